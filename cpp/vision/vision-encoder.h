// Vision encoder of LLaVA-style models: a ViT (CLIP or SigLIP variant) and an optional two-layer MLP projector,
// read from an mmproj GGUF file (llama.cpp's "clip" layout; names in vision/vision-names.h).
//
// Forward pass for one image of S x S pixels with patches of P pixels (G = S / P patches a side, N = G² patches):
//   patches [N, 3·P·P] · patch_embdᵀ (+ bias)   -> [N, E]      (the stride-P convolution as one matmul)
//   class token row first when v.class_embd exists -> T = N + 1 rows, else T = N
//   + position embeddings [T, E]; LayerNorm v.pre_ln when present (CLIP)
//   block_count blocks: x += attn(LN1(x)) (all-to-all, no mask); x += down(act(up(LN2(x))))
//   LayerNorm v.post_ln when present; the class token row dropped for select strategy "default"
//   projector when mm.0 exists: mm.2(act(mm.0(x)))               -> [n_tokens, n_embd_out]
//   or Gemma 3's (projector type "gemma3"): k x k average pooling of the G x G patch grid (k: the scale factor),
//   RMSNorm mm.soft_emb_norm, · mm.input_projection                 -> [(G / k)², n_embd_out]
// The converter stores only the blocks whose output feeds the projector (LLaVA's vision_feature_layer), so the
// last stored block's output is the feature layer.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/activation.h"
#include "backend/backend.h"
#include "gguf/gguf-file.h"
#include "vision/tower-weights.h"

namespace kvcmas::vision {

using kvcmas::Activation;
using kvcmas::parse_activation;

struct VisionParams {
    int64_t    image_size       = 0;  // S: the square input the tower expects
    int64_t    patch_size       = 0;  // P
    int64_t    n_embd           = 0;  // E: ViT width
    int64_t    n_ff             = 0;  // ViT MLP width
    int64_t    n_layer          = 0;  // blocks stored and run
    int64_t    n_head           = 0;
    float      eps              = 1e-5f;  // LayerNorm epsilon
    Activation act              = Activation::QuickGelu;
    bool       class_token      = false;  // v.class_embd present (CLIP)
    bool       keep_class_token = false;  // select strategy "full"
    bool       pre_ln           = false;
    bool       post_ln          = false;
    bool       projector        = false;  // mm.0 / mm.2 present, or Gemma 3's projector
    bool       gemma3_projector = false;  // projector type "gemma3": pooling, RMSNorm, projection
    int64_t    pool_kernel      = 1;      // gemma3: average pooling side (clip.vision.projector.scale_factor)
    int64_t    n_embd_proj      = 0;      // projector hidden width (mm.0 rows)
    Activation projector_act    = Activation::GeluErf;
    // Preprocessing (applied by the caller, recorded here so the file is self-contained).
    std::vector<float> image_mean, image_std;         // per channel
    std::string        resize_mode    = "square";     // "shortest_edge" (resize, then centre crop) | "square"
    std::string        resample       = "bicubic";    // the resize filter: "bicubic" | "bilinear" (Gemma 3)
    int64_t            resize_size    = 0;            // shortest edge before the crop ("shortest_edge" mode)
    double             rescale_factor = 1.0 / 255.0;  // 8-bit values times this before normalising
    std::string        model_type     = "clip";       // "clip" | "siglip" (informational)

    int64_t n_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
    int64_t n_positions() const { return n_patches() + (class_token ? 1 : 0); }
    // Rows of encode()'s output.
    int64_t n_output_tokens() const {
        if (gemma3_projector) {
            const int64_t side = image_size / patch_size / pool_kernel;
            return side * side;
        }
        return n_patches() + (class_token && keep_class_token ? 1 : 0);
    }
};

class VisionEncoder {
  public:
    // Loads and validates an mmproj file: every key's range and every tensor's presence, shape and type, and
    // uploads the weights to a backend made by name (backend::make_backend: "cpu", "cuda", "cuda:N") that runs
    // every op of the tower. Throws kvcmas::Error naming the file and the problem, or the backend that this build
    // does not know or cannot run. n_threads <= 0: all cores (at most 64; the CPU backend's threads).
    VisionEncoder(const std::string & path, int n_threads, const std::string & backend_name = "cpu");
    ~VisionEncoder();
    VisionEncoder(const VisionEncoder &)             = delete;
    VisionEncoder & operator=(const VisionEncoder &) = delete;

    const VisionParams &   params() const { return p_; }
    const gguf::GgufFile & file() const { return *file_; }
    int                    n_threads() const { return be_->n_threads(); }
    std::string            backend_name() const { return be_->name(); }
    // Width of encode()'s rows: the projector's output (the text model's n_embd), or E without a projector.
    int64_t n_output_embd() const;

    // Encodes one preprocessed image: pixels [3][image_size][image_size] f32, channel-major (the layout of a
    // Hugging Face processor's pixel_values). Returns [n_output_tokens()][n_output_embd()] row-major. Thread-safe
    // (calls are serialised on the encoder's backend).
    std::vector<float> encode(const float * pixels, int64_t channels, int64_t height, int64_t width);
    // Encodes n_images preprocessed images at once: pixels [n_images][3][image_size][image_size] f32 (AnyRes's
    // base view and tiles). Returns [n_images·n_output_tokens()][n_output_embd()], image after image: the same
    // values as n_images encode() calls (every row's products and sums are computed as there), from one pass that
    // runs each linear layer over all images' rows (up to kMaxBatch images per pass, bounding the scratch memory).
    std::vector<float>       encode_batch(const float * pixels, int64_t n_images, int64_t channels, int64_t height,
                                          int64_t width);
    static constexpr int64_t kMaxBatch = 8;

  private:
    struct Layer {
        backend::Buffer ln1_w, ln1_b, ln2_w, ln2_b;
        backend::Weight wq, wk, wv, wo, w_up, w_down;  // [E, E] x4, [E, F], [F, E] as (n_in, n_out)
        backend::Buffer bq, bk, bv, bo, b_up, b_down;  // empty when the file has no bias
    };

    void load_params();
    void load_weights();
    // y [n_tok, w.n_out] = x · wᵀ + b (b may be empty), backend addresses.
    void linear(const backend::Weight & w, const backend::Buffer & b, const float * x, float * y, int64_t n_tok);
    // Attention within each of n_img images of T rows: xn, out [n_img·T, E].
    void attention(const Layer & L, const float * xn, float * out, int64_t T, int64_t n_img);
    // The tower (and projector) on n_img validated images, the mutex held.
    std::vector<float> encode_locked(const float * pixels, int64_t n_img);
    void               load_gemma3_projector();

    std::unique_ptr<gguf::GgufFile>   file_;
    VisionParams                      p_;
    std::unique_ptr<backend::Backend> be_;  // before every buffer: they go first
    backend::Weight                   patch_w_{};
    int64_t                           patch_cols_ = 0;  // patch_w_.n_in: 3·P·P, padded with zeros for a device
    std::vector<float>                patch_w_host_;    // the padded copy a device backend uploads
    std::vector<float>                class_embd_;      // host: uploaded in front of the patch rows
    backend::Buffer                   patch_b_, pos_embd_, pre_ln_w_, pre_ln_b_, post_ln_w_, post_ln_b_;
    std::vector<Layer>                layers_;
    backend::Weight                   mm0_{}, mm2_{};
    backend::Buffer                   mm0_b_, mm2_b_;
    backend::Buffer                   soft_emb_norm_;  // gemma3: [E], (1 + w) as stored
    std::vector<float>                input_proj_t_;   // gemma3: the projection transposed to [n_embd_out][E]
    backend::Weight                   input_proj_{};   // input_proj_t_ in backend memory
    QkvRows                           qkv_;            // attention's [n_img·T, E] x3
    std::mutex                        mutex_;          // one encode at a time (the backend and buffers are shared)
};

}  // namespace kvcmas::vision
