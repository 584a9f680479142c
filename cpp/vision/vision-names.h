// GGUF keys and tensor names of an mmproj (vision projector) file: the C++ side's one place for them.
// The clip.* keys and v.* / mm.* tensor names are llama.cpp's (its multimodal "clip" files), so the tensors and
// hyper-parameters of a file written by either tool mean the same thing; kvcmas.vision.* keys carry what
// llama.cpp's files leave implicit (exact activations, which token rows feed the projector, preprocessing).
// convert/kvcmas_convert/vision.py writes the same names.
#pragma once

namespace kvcmas::vision_names {

inline constexpr char kArchClip[] = "clip";

// llama.cpp keys
inline constexpr char kKeyArchitecture[]     = "general.architecture";
inline constexpr char kKeyHasVisionEncoder[] = "clip.has_vision_encoder";
inline constexpr char kKeyProjectorType[]    = "clip.projector_type";  // "mlp" (LLaVA) | "gemma3"
inline constexpr char kKeyUseGelu[]          = "clip.use_gelu";        // without kvcmas.vision.hidden_act
inline constexpr char kKeyUseSilu[]          = "clip.use_silu";
inline constexpr char kKeyImageSize[]        = "clip.vision.image_size";
inline constexpr char kKeyPatchSize[]        = "clip.vision.patch_size";
inline constexpr char kKeyEmbeddingLength[]  = "clip.vision.embedding_length";
inline constexpr char kKeyFeedForward[]      = "clip.vision.feed_forward_length";
inline constexpr char kKeyBlockCount[]       = "clip.vision.block_count";
inline constexpr char kKeyHeadCount[]        = "clip.vision.attention.head_count";
inline constexpr char kKeyLayerNormEps[]     = "clip.vision.attention.layer_norm_epsilon";
inline constexpr char kKeyProjectionDim[]    = "clip.vision.projection_dim";
inline constexpr char kKeyImageMean[]        = "clip.vision.image_mean";
inline constexpr char kKeyImageStd[]         = "clip.vision.image_std";
inline constexpr char kKeyProjScaleFactor[]  = "clip.vision.projector.scale_factor";  // gemma3: pooling side (4)

// kvcmas keys
inline constexpr char kKeyHiddenAct[]      = "kvcmas.vision.hidden_act";       // Hugging Face name of the ViT MLP act
inline constexpr char kKeyProjectorAct[]   = "kvcmas.vision.projector_act";    // of the projector (default "gelu")
inline constexpr char kKeySelectStrategy[] = "kvcmas.vision.select_strategy";  // "default" drops the class token
inline constexpr char kKeyFeatureLayer[]   = "kvcmas.vision.feature_layer";    // informational (HF index)
inline constexpr char kKeyModelType[]      = "kvcmas.vision.model_type";       // "clip" | "siglip"
inline constexpr char kKeyResizeMode[]     = "kvcmas.vision.resize_mode";      // "shortest_edge" | "square"
inline constexpr char kKeyResizeSize[]     = "kvcmas.vision.resize_size";      // shortest edge before the crop
inline constexpr char kKeyRescaleFactor[]  = "kvcmas.vision.rescale_factor";   // pixel scale before normalising
inline constexpr char kKeyResample[]       = "kvcmas.vision.resample";         // "bicubic" (default) | "bilinear"

// tensors ("v.blk.<i>." + block suffix + ".weight" / ".bias")
inline constexpr char kTensorPatchEmbd[] = "v.patch_embd";  // .weight [P, P, 3, E] (ggml order), optional .bias
inline constexpr char kTensorClassEmbd[] = "v.class_embd";  // [E]; absent for SigLIP
inline constexpr char kTensorPosEmbd[]   = "v.position_embd";
inline constexpr char kTensorPreLn[]     = "v.pre_ln";
inline constexpr char kTensorPostLn[]    = "v.post_ln";
inline constexpr char kBlockPrefix[]     = "v.blk.";
inline constexpr char kBlkAttnQ[]        = "attn_q";
inline constexpr char kBlkAttnK[]        = "attn_k";
inline constexpr char kBlkAttnV[]        = "attn_v";
inline constexpr char kBlkAttnOut[]      = "attn_out";
inline constexpr char kBlkLn1[]          = "ln1";
inline constexpr char kBlkLn2[]          = "ln2";
inline constexpr char kBlkFfnUp[]        = "ffn_up";
inline constexpr char kBlkFfnDown[]      = "ffn_down";
inline constexpr char kTensorMm0[]       = "mm.0";  // projector linear_1
inline constexpr char kTensorMm2[]       = "mm.2";  // projector linear_2 (index 1 is the activation)
// Gemma 3's projector: average pooling, RMSNorm (weight stored as 1 + w), a bias-free projection stored as
// Hugging Face's mm_input_projection_weight [E, n_embd_out] (GGUF ne [n_embd_out, E]).
inline constexpr char kTensorMmSoftEmbNorm[] = "mm.soft_emb_norm.weight";
inline constexpr char kTensorMmInputProj[]   = "mm.input_projection.weight";
inline constexpr char kProjectorMlp[]        = "mlp";
inline constexpr char kProjectorGemma3[]     = "gemma3";

// Qwen2.5-VL (clip.projector_type "qwen2.5vl_merger"; llama.cpp's keys and names)
inline constexpr char kProjectorQwen25Vl[]    = "qwen2.5vl_merger";
inline constexpr char kKeyWindowAttnPattern[] = "clip.vision.n_wa_pattern";      // every n-th block attends fully
inline constexpr char kKeyFullAttnLayers[]    = "clip.vision.wa_layer_indexes";  // the blocks that attend fully
inline constexpr char kKeyWindowSize[]        = "clip.vision.window_size";       // pixels a side of a window
inline constexpr char kKeySpatialMergeSize[]  = "clip.vision.spatial_merge_size";
inline constexpr char kKeyImageMinPixels[]    = "clip.vision.image_min_pixels";
inline constexpr char kKeyImageMaxPixels[]    = "clip.vision.image_max_pixels";
inline constexpr char kKeyTemporalPatchSize[] = "kvcmas.vision.temporal_patch_size";  // the Conv3d's depth (2)
inline constexpr char kKeyRopeTheta[]         = "kvcmas.vision.rope_theta";           // the ViT's 2D RoPE base
inline constexpr char kTensorPatchEmbd1[]     = "v.patch_embd.weight.1";              // the second temporal kernel
inline constexpr char kBlkFfnGate[]           = "ffn_gate";

}  // namespace kvcmas::vision_names
