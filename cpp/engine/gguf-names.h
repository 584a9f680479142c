// GGUF metadata keys and tensor names the engine reads: the C++ side's one place for them.
// The Python converter (convert/kvcmas_convert/constants.py) defines the same names; tests/test_convert.py checks
// that both lists agree and that cpp/engine/model.cpp reads only names listed here. The values are llama.cpp's
// standard names, so files written by either tool load in the other.
#pragma once

namespace kvcmas::gguf_names {

// general.* keys
inline constexpr char kKeyArchitecture[] = "general.architecture";
inline constexpr char kKeyName[] = "general.name";
inline constexpr char kKeyFileType[] = "general.file_type";
inline constexpr char kKeyQuantizationVersion[] = "general.quantization_version";

// adapter files (llama.cpp's LoRA GGUF): general.type "adapter", adapter.type "lora", the alpha of alpha / rank;
// tensors <base tensor name> + kLoraSuffixA / kLoraSuffixB ("blk.0.attn_q.weight.lora_a")
inline constexpr char kKeyType[] = "general.type";
inline constexpr char kKeyAdapterType[] = "adapter.type";
inline constexpr char kKeyAdapterLoraAlpha[] = "adapter.lora.alpha";
inline constexpr char kTypeAdapter[] = "adapter";
inline constexpr char kAdapterTypeLora[] = "lora";
inline constexpr char kLoraSuffixA[] = ".lora_a";
inline constexpr char kLoraSuffixB[] = ".lora_b";

// "<arch>." + suffix: hyper-parameter keys (the suffix after the architecture name)
inline constexpr char kArchKeyContextLength[] = "context_length";
inline constexpr char kArchKeyEmbeddingLength[] = "embedding_length";
inline constexpr char kArchKeyBlockCount[] = "block_count";
inline constexpr char kArchKeyFeedForwardLength[] = "feed_forward_length";
inline constexpr char kArchKeyHeadCount[] = "attention.head_count";
inline constexpr char kArchKeyHeadCountKv[] = "attention.head_count_kv";
inline constexpr char kArchKeyKeyLength[] = "attention.key_length";
inline constexpr char kArchKeyValueLength[] = "attention.value_length";
inline constexpr char kArchKeyRmsEps[] = "attention.layer_norm_rms_epsilon";
inline constexpr char kArchKeySlidingWindow[] = "attention.sliding_window";
inline constexpr char kArchKeySlidingWindowPattern[] = "attention.sliding_window_pattern";
inline constexpr char kArchKeyRopeDimensionCount[] = "rope.dimension_count";
inline constexpr char kArchKeyRopeFreqBase[] = "rope.freq_base";
inline constexpr char kArchKeyRopeFreqBaseSwa[] = "rope.freq_base_swa";
inline constexpr char kArchKeyRopeDimensionSections[] = "rope.dimension_sections";
inline constexpr char kArchKeyRopeScalingType[] = "rope.scaling.type";
inline constexpr char kArchKeyRopeScalingFactor[] = "rope.scaling.factor";
inline constexpr char kArchKeyRopeScalingOrigCtx[] = "rope.scaling.original_context_length";
inline constexpr char kArchKeyRopeScalingAttnFactor[] = "rope.scaling.attn_factor";
inline constexpr char kArchKeyRopeScalingYarnBetaFast[] = "rope.scaling.yarn_beta_fast";
inline constexpr char kArchKeyRopeScalingYarnBetaSlow[] = "rope.scaling.yarn_beta_slow";
inline constexpr char kArchKeyFinalLogitSoftcapping[] = "final_logit_softcapping";
inline constexpr char kArchKeyExpertCount[] = "expert_count";
inline constexpr char kArchKeyExpertUsedCount[] = "expert_used_count";
inline constexpr char kArchKeyExpertFeedForwardLength[] = "expert_feed_forward_length";
inline constexpr char kArchKeyVocabSize[] = "vocab_size";

// general.architecture values the engine runs: one per file of engine/arch (registry.cpp lists them)
inline constexpr char kArchLlama[] = "llama";
inline constexpr char kArchQwen2[] = "qwen2";
inline constexpr char kArchQwen3[] = "qwen3";
inline constexpr char kArchQwen3Moe[] = "qwen3moe";
inline constexpr char kArchGemma3[] = "gemma3";
inline constexpr char kArchOlmo2[] = "olmo2";
inline constexpr char kArchSmollm3[] = "smollm3";
inline constexpr char kArchPhi3[] = "phi3";
inline constexpr char kArchQwen2Vl[] = "qwen2vl";
inline constexpr char kArchGptOss[] = "gpt-oss";

// tokenizer.* keys
inline constexpr char kKeyTokenizerModel[] = "tokenizer.ggml.model";
inline constexpr char kKeyTokenizerPre[] = "tokenizer.ggml.pre";
inline constexpr char kKeyTokens[] = "tokenizer.ggml.tokens";
inline constexpr char kKeyTokenType[] = "tokenizer.ggml.token_type";
inline constexpr char kKeyScores[] = "tokenizer.ggml.scores";
inline constexpr char kKeyMerges[] = "tokenizer.ggml.merges";
inline constexpr char kKeyBosId[] = "tokenizer.ggml.bos_token_id";
inline constexpr char kKeyEosId[] = "tokenizer.ggml.eos_token_id";
inline constexpr char kKeyUnkId[] = "tokenizer.ggml.unknown_token_id";
inline constexpr char kKeyPadId[] = "tokenizer.ggml.padding_token_id";
inline constexpr char kKeyEotId[] = "tokenizer.ggml.eot_token_id";
inline constexpr char kKeyAddBos[] = "tokenizer.ggml.add_bos_token";
inline constexpr char kKeyAddEos[] = "tokenizer.ggml.add_eos_token";
inline constexpr char kKeyAddSpacePrefix[] = "tokenizer.ggml.add_space_prefix";
inline constexpr char kKeyChatTemplate[] = "tokenizer.chat_template";

// global tensors
inline constexpr char kTensorTokenEmbd[] = "token_embd.weight";
inline constexpr char kTensorOutputNorm[] = "output_norm.weight";
inline constexpr char kTensorOutput[] = "output.weight";
inline constexpr char kTensorRopeFreqs[] = "rope_freqs.weight";
inline constexpr char kTensorRopeFactorsLong[] = "rope_factors_long.weight";
inline constexpr char kTensorRopeFactorsShort[] = "rope_factors_short.weight";

// per-layer tensors: kBlockPrefix + std::to_string(il) + "." + suffix
inline constexpr char kBlockPrefix[] = "blk.";
inline constexpr char kBlkAttnNorm[] = "attn_norm.weight";
inline constexpr char kBlkAttnQ[] = "attn_q.weight";
inline constexpr char kBlkAttnK[] = "attn_k.weight";
inline constexpr char kBlkAttnV[] = "attn_v.weight";
inline constexpr char kBlkAttnOutput[] = "attn_output.weight";
inline constexpr char kBlkAttnQBias[] = "attn_q.bias";
inline constexpr char kBlkAttnKBias[] = "attn_k.bias";
inline constexpr char kBlkAttnVBias[] = "attn_v.bias";
inline constexpr char kBlkAttnQkv[] = "attn_qkv.weight";
inline constexpr char kBlkAttnQNorm[] = "attn_q_norm.weight";
inline constexpr char kBlkAttnKNorm[] = "attn_k_norm.weight";
inline constexpr char kBlkAttnPostNorm[] = "post_attention_norm.weight";
inline constexpr char kBlkFfnNorm[] = "ffn_norm.weight";
inline constexpr char kBlkFfnGate[] = "ffn_gate.weight";
inline constexpr char kBlkFfnUp[] = "ffn_up.weight";
inline constexpr char kBlkFfnDown[] = "ffn_down.weight";
inline constexpr char kBlkFfnPostNorm[] = "post_ffw_norm.weight";
inline constexpr char kBlkFfnGateInp[] = "ffn_gate_inp.weight";
inline constexpr char kBlkFfnGateExps[] = "ffn_gate_exps.weight";
inline constexpr char kBlkFfnUpExps[] = "ffn_up_exps.weight";
inline constexpr char kBlkFfnDownExps[] = "ffn_down_exps.weight";
inline constexpr char kBlkAttnOutputBias[] = "attn_output.bias";
inline constexpr char kBlkAttnSinks[] = "attn_sinks.weight";
inline constexpr char kBlkFfnGateInpBias[] = "ffn_gate_inp.bias";
inline constexpr char kBlkFfnGateExpsBias[] = "ffn_gate_exps.bias";
inline constexpr char kBlkFfnUpExpsBias[] = "ffn_up_exps.bias";
inline constexpr char kBlkFfnDownExpsBias[] = "ffn_down_exps.bias";

// kvcmas.* settings of the KV correction (types and defaults: constants.py KVCMAS_SETTINGS)
inline constexpr char kKvcmasPrefix[] = "kvcmas.";
inline constexpr char kKvcmasVersion[] = "kvcmas.version";
inline constexpr char kKvcmasRankK[] = "kvcmas.rank_k";
inline constexpr char kKvcmasRankV[] = "kvcmas.rank_v";
inline constexpr char kKvcmasRankBaseK[] = "kvcmas.rank_base_k";
inline constexpr char kKvcmasRankBaseV[] = "kvcmas.rank_base_v";
inline constexpr char kKvcmasFirstLayer[] = "kvcmas.first_layer";
inline constexpr char kKvcmasAnchorPoolSize[] = "kvcmas.anchor_pool_size";
inline constexpr char kKvcmasAnchorWindow[] = "kvcmas.anchor_window";
inline constexpr char kKvcmasHotAnchors[] = "kvcmas.hot_anchors";
inline constexpr char kKvcmasGateThreshold[] = "kvcmas.gate_threshold";
inline constexpr char kKvcmasGateTopP[] = "kvcmas.gate_top_p";
inline constexpr char kKvcmasChain[] = "kvcmas.chain";

}  // namespace kvcmas::gguf_names
