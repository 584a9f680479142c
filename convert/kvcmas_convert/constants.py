"""Names shared with the C++ engine: GGUF metadata keys, tensor names, and the ``kvcmas.*`` settings.

This is the Python side's single place for them; ``cpp/engine/gguf-names.h`` is the C++ side's, and
``tests/test_convert.py`` checks that both (and the names ``cpp/engine/model.cpp`` reads) agree. The standard names
are llama.cpp's (``gguf-py``'s ``Keys`` and ``MODEL_TENSOR`` names), so llama.cpp loads the files as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# --- general.* -----------------------------------------------------------------------------------------------------
KEY_ARCHITECTURE: Final = "general.architecture"
KEY_NAME: Final = "general.name"
KEY_FILE_TYPE: Final = "general.file_type"
KEY_QUANTIZATION_VERSION: Final = "general.quantization_version"

# --- adapter files (llama.cpp's LoRA GGUF, convert_lora_to_gguf.py) ---------------------------------------------------
# general.type "adapter", adapter.type "lora", adapter.lora.alpha; per target tensor "<base tensor name>" +
# ".lora_a" (A [rank, n_in], GGUF [n_in, rank]) and ".lora_b" (B [n_out, rank], GGUF [rank, n_out]).
KEY_TYPE: Final = "general.type"
KEY_ADAPTER_TYPE: Final = "adapter.type"
KEY_ADAPTER_LORA_ALPHA: Final = "adapter.lora.alpha"
TYPE_ADAPTER: Final = "adapter"
ADAPTER_TYPE_LORA: Final = "lora"
LORA_SUFFIX_A: Final = ".lora_a"
LORA_SUFFIX_B: Final = ".lora_b"

# --- {arch}.* hyper-parameters: the suffix after "<arch>." ----------------------------------------------------------
# The engine builds these as arch + "." + suffix.
ARCH_KEY_CONTEXT_LENGTH: Final = "context_length"
ARCH_KEY_EMBEDDING_LENGTH: Final = "embedding_length"
ARCH_KEY_BLOCK_COUNT: Final = "block_count"
ARCH_KEY_FEED_FORWARD_LENGTH: Final = "feed_forward_length"
ARCH_KEY_HEAD_COUNT: Final = "attention.head_count"
ARCH_KEY_HEAD_COUNT_KV: Final = "attention.head_count_kv"
ARCH_KEY_KEY_LENGTH: Final = "attention.key_length"
ARCH_KEY_VALUE_LENGTH: Final = "attention.value_length"
ARCH_KEY_RMS_EPS: Final = "attention.layer_norm_rms_epsilon"
ARCH_KEY_SLIDING_WINDOW: Final = "attention.sliding_window"  # uint32: a query at p sees keys in (p - window, p]
ARCH_KEY_SLIDING_WINDOW_PATTERN: Final = "attention.sliding_window_pattern"  # bool per layer: windowed (absent: all)
ARCH_KEY_ROPE_DIMENSION_COUNT: Final = "rope.dimension_count"
ARCH_KEY_ROPE_FREQ_BASE: Final = "rope.freq_base"
ARCH_KEY_ROPE_FREQ_BASE_SWA: Final = "rope.freq_base_swa"  # sliding-window layers' base (gemma3)
ARCH_KEY_ROPE_DIMENSION_SECTIONS: Final = "rope.dimension_sections"  # M-RoPE (qwen2vl): pairs per t / h / w, 0
ARCH_KEY_ROPE_SCALING_TYPE: Final = "rope.scaling.type"
ARCH_KEY_ROPE_SCALING_FACTOR: Final = "rope.scaling.factor"
ARCH_KEY_ROPE_SCALING_ORIG_CTX: Final = "rope.scaling.original_context_length"
ARCH_KEY_ROPE_SCALING_ATTN_FACTOR: Final = "rope.scaling.attn_factor"  # yarn / longrope: q and k scale
ARCH_KEY_ROPE_SCALING_YARN_BETA_FAST: Final = "rope.scaling.yarn_beta_fast"
ARCH_KEY_ROPE_SCALING_YARN_BETA_SLOW: Final = "rope.scaling.yarn_beta_slow"
ARCH_KEY_FINAL_LOGIT_SOFTCAPPING: Final = "final_logit_softcapping"
ARCH_KEY_EXPERT_COUNT: Final = "expert_count"
ARCH_KEY_EXPERT_USED_COUNT: Final = "expert_used_count"
ARCH_KEY_EXPERT_FEED_FORWARD_LENGTH: Final = "expert_feed_forward_length"
ARCH_KEY_VOCAB_SIZE: Final = "vocab_size"

ARCH_KEYS: Final = (
    ARCH_KEY_CONTEXT_LENGTH, ARCH_KEY_EMBEDDING_LENGTH, ARCH_KEY_BLOCK_COUNT, ARCH_KEY_FEED_FORWARD_LENGTH,
    ARCH_KEY_HEAD_COUNT, ARCH_KEY_HEAD_COUNT_KV, ARCH_KEY_KEY_LENGTH, ARCH_KEY_VALUE_LENGTH, ARCH_KEY_RMS_EPS,
    ARCH_KEY_SLIDING_WINDOW, ARCH_KEY_SLIDING_WINDOW_PATTERN,
    ARCH_KEY_ROPE_DIMENSION_COUNT, ARCH_KEY_ROPE_FREQ_BASE, ARCH_KEY_ROPE_FREQ_BASE_SWA, ARCH_KEY_ROPE_SCALING_TYPE,
    ARCH_KEY_ROPE_DIMENSION_SECTIONS,
    ARCH_KEY_ROPE_SCALING_FACTOR, ARCH_KEY_ROPE_SCALING_ORIG_CTX, ARCH_KEY_ROPE_SCALING_ATTN_FACTOR,
    ARCH_KEY_ROPE_SCALING_YARN_BETA_FAST, ARCH_KEY_ROPE_SCALING_YARN_BETA_SLOW, ARCH_KEY_FINAL_LOGIT_SOFTCAPPING,
    ARCH_KEY_EXPERT_COUNT, ARCH_KEY_EXPERT_USED_COUNT, ARCH_KEY_EXPERT_FEED_FORWARD_LENGTH, ARCH_KEY_VOCAB_SIZE,
)  # fmt: skip

# Architectures the engine runs (general.architecture values): one file each in cpp/engine/arch/, listed by its
# registry.cpp; tests/test_convert.py checks that this list, gguf-names.h and the registry agree.
ARCH_LLAMA: Final = "llama"
ARCH_QWEN2: Final = "qwen2"
ARCH_QWEN3: Final = "qwen3"
ARCH_QWEN3_MOE: Final = "qwen3moe"
ARCH_GEMMA3: Final = "gemma3"
ARCH_OLMO2: Final = "olmo2"
ARCH_SMOLLM3: Final = "smollm3"
ARCH_PHI3: Final = "phi3"
ARCH_QWEN2_VL: Final = "qwen2vl"
ARCH_GPT_OSS: Final = "gpt-oss"
ENGINE_ARCHITECTURES: Final = (
    ARCH_LLAMA,
    ARCH_QWEN2,
    ARCH_QWEN3,
    ARCH_QWEN3_MOE,
    ARCH_GEMMA3,
    ARCH_OLMO2,
    ARCH_SMOLLM3,
    ARCH_PHI3,
    ARCH_QWEN2_VL,
    ARCH_GPT_OSS,
)

# --- tokenizer.* ----------------------------------------------------------------------------------------------------
KEY_TOKENIZER_MODEL: Final = "tokenizer.ggml.model"
KEY_TOKENIZER_PRE: Final = "tokenizer.ggml.pre"
KEY_TOKENS: Final = "tokenizer.ggml.tokens"
KEY_TOKEN_TYPE: Final = "tokenizer.ggml.token_type"
KEY_SCORES: Final = "tokenizer.ggml.scores"
KEY_MERGES: Final = "tokenizer.ggml.merges"
KEY_BOS_ID: Final = "tokenizer.ggml.bos_token_id"
KEY_EOS_ID: Final = "tokenizer.ggml.eos_token_id"
KEY_UNK_ID: Final = "tokenizer.ggml.unknown_token_id"
KEY_PAD_ID: Final = "tokenizer.ggml.padding_token_id"
KEY_EOT_ID: Final = "tokenizer.ggml.eot_token_id"
KEY_ADD_BOS: Final = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS: Final = "tokenizer.ggml.add_eos_token"
KEY_ADD_SPACE_PREFIX: Final = "tokenizer.ggml.add_space_prefix"
KEY_CHAT_TEMPLATE: Final = "tokenizer.chat_template"

TOKENIZER_MODEL_BPE: Final = "gpt2"  # byte-level BPE
TOKENIZER_MODEL_SPM: Final = "llama"  # SentencePiece


class TokenType:
    """``tokenizer.ggml.token_type`` values (llama.cpp's token types)."""

    NORMAL: Final = 1
    UNKNOWN: Final = 2
    CONTROL: Final = 3
    USER_DEFINED: Final = 4
    UNUSED: Final = 5
    BYTE: Final = 6


# --- tensor names ---------------------------------------------------------------------------------------------------
TENSOR_TOKEN_EMBD: Final = "token_embd.weight"
TENSOR_OUTPUT_NORM: Final = "output_norm.weight"
TENSOR_OUTPUT: Final = "output.weight"  # absent when the output matrix is tied to token_embd
TENSOR_ROPE_FREQS: Final = "rope_freqs.weight"  # llama3-style rope scaling: per-frequency divisors
TENSOR_ROPE_FACTORS_LONG: Final = "rope_factors_long.weight"  # LongRoPE divisors past the original context
TENSOR_ROPE_FACTORS_SHORT: Final = "rope_factors_short.weight"  # LongRoPE divisors within it
BLOCK_PREFIX: Final = "blk."  # per-layer tensors are "blk.<i>.<suffix>"
BLK_ATTN_NORM: Final = "attn_norm.weight"
BLK_ATTN_Q: Final = "attn_q.weight"
BLK_ATTN_K: Final = "attn_k.weight"
BLK_ATTN_V: Final = "attn_v.weight"
BLK_ATTN_OUTPUT: Final = "attn_output.weight"
BLK_ATTN_Q_BIAS: Final = "attn_q.bias"
BLK_ATTN_K_BIAS: Final = "attn_k.bias"
BLK_ATTN_V_BIAS: Final = "attn_v.bias"
BLK_ATTN_QKV: Final = "attn_qkv.weight"  # fused Q, K, V rows (phi3)
BLK_ATTN_Q_NORM: Final = "attn_q_norm.weight"
BLK_ATTN_K_NORM: Final = "attn_k_norm.weight"
BLK_ATTN_POST_NORM: Final = "post_attention_norm.weight"
BLK_FFN_NORM: Final = "ffn_norm.weight"
BLK_FFN_GATE: Final = "ffn_gate.weight"
BLK_FFN_UP: Final = "ffn_up.weight"
BLK_FFN_DOWN: Final = "ffn_down.weight"
BLK_FFN_POST_NORM: Final = "post_ffw_norm.weight"
BLK_FFN_GATE_INP: Final = "ffn_gate_inp.weight"  # MoE router
BLK_FFN_GATE_EXPS: Final = "ffn_gate_exps.weight"
BLK_FFN_UP_EXPS: Final = "ffn_up_exps.weight"
BLK_FFN_DOWN_EXPS: Final = "ffn_down_exps.weight"
BLK_ATTN_OUTPUT_BIAS: Final = "attn_output.bias"  # gpt-oss
BLK_ATTN_SINKS: Final = "attn_sinks.weight"  # gpt-oss: a sink logit per query head
BLK_FFN_GATE_INP_BIAS: Final = "ffn_gate_inp.bias"
BLK_FFN_GATE_EXPS_BIAS: Final = "ffn_gate_exps.bias"
BLK_FFN_UP_EXPS_BIAS: Final = "ffn_up_exps.bias"
BLK_FFN_DOWN_EXPS_BIAS: Final = "ffn_down_exps.bias"

GLOBAL_TENSORS: Final = (
    TENSOR_TOKEN_EMBD, TENSOR_OUTPUT_NORM, TENSOR_OUTPUT, TENSOR_ROPE_FREQS, TENSOR_ROPE_FACTORS_LONG,
    TENSOR_ROPE_FACTORS_SHORT,
)  # fmt: skip
BLOCK_TENSORS: Final = (
    BLK_ATTN_NORM, BLK_ATTN_Q, BLK_ATTN_K, BLK_ATTN_V, BLK_ATTN_OUTPUT, BLK_ATTN_Q_BIAS, BLK_ATTN_K_BIAS,
    BLK_ATTN_V_BIAS, BLK_ATTN_QKV, BLK_ATTN_Q_NORM, BLK_ATTN_K_NORM, BLK_ATTN_POST_NORM, BLK_FFN_NORM, BLK_FFN_GATE,
    BLK_FFN_UP, BLK_FFN_DOWN, BLK_FFN_POST_NORM, BLK_FFN_GATE_INP, BLK_FFN_GATE_EXPS, BLK_FFN_UP_EXPS,
    BLK_FFN_DOWN_EXPS, BLK_ATTN_OUTPUT_BIAS, BLK_ATTN_SINKS, BLK_FFN_GATE_INP_BIAS, BLK_FFN_GATE_EXPS_BIAS,
    BLK_FFN_UP_EXPS_BIAS, BLK_FFN_DOWN_EXPS_BIAS,
)  # fmt: skip


def block_tensor(layer: int, suffix: str) -> str:
    """The GGUF name of a per-layer tensor, e.g. ``block_tensor(3, BLK_ATTN_Q) == "blk.3.attn_q.weight"``."""
    return f"{BLOCK_PREFIX}{layer}.{suffix}"


# --- kvcmas.* : settings of the shared-context KV correction -------------------------------------------------------
KVCMAS_PREFIX: Final = "kvcmas."


@dataclass(frozen=True)
class KvcmasSetting:
    """One ``kvcmas.*`` key: its GGUF value type ("uint32", "float32" or "bool"), default, and meaning."""

    key: str
    type: str
    default: int | float | bool
    help: str
    minimum: float | None = None
    maximum: float | None = None


# Defaults: the paper/runner column of the KVCMAS method notes, section 4 (kept outside this repository; the γ
# default is the config default 0.3; the runner tunes it per benchmark). Rank 0 means "no low-rank truncation" (raw
# deltas), as in the reference code.
KVCMAS_SETTINGS: Final[tuple[KvcmasSetting, ...]] = (
    KvcmasSetting("kvcmas.version", "uint32", 1, "version of this key set", 1, 1),
    KvcmasSetting("kvcmas.rank_k", "uint32", 32, "rank of the K (key) correction of a placeholder span", 0, 1 << 16),
    KvcmasSetting("kvcmas.rank_v", "uint32", 32, "rank of the V (value) correction of a placeholder span", 0, 1 << 16),
    KvcmasSetting("kvcmas.rank_base_k", "uint32", 32, "rank of the stored anchor base K (0 = full)", 0, 1 << 16),
    KvcmasSetting("kvcmas.rank_base_v", "uint32", 32, "rank of the stored anchor base V (0 = full)", 0, 1 << 16),
    KvcmasSetting("kvcmas.first_layer", "uint32", 1, "first corrected layer (layer 0 is never corrected)", 0, 1 << 16),
    KvcmasSetting("kvcmas.anchor_pool_size", "uint32", 10, "anchors kept per placeholder id", 1, 1 << 20),
    KvcmasSetting("kvcmas.anchor_window", "uint32", 5, "oldest anchors considered for LFU eviction", 1, 1 << 20),
    KvcmasSetting("kvcmas.hot_anchors", "uint32", 10, "top-k anchors mixed per segment and layer", 1, 1 << 20),
    KvcmasSetting("kvcmas.gate_threshold", "float32", 0.3, "entropy gate γ, a fraction of log2(#anchors); ≤ 0: dense",
                  -1e9, 1e9),
    KvcmasSetting("kvcmas.gate_top_p", "float32", 0.9, "nucleus of anchors activated by a confident match", 0.0, 1.0),
    KvcmasSetting("kvcmas.chain", "bool", True, "chain corrections along agents (true) or relative to the source"),
)  # fmt: skip

KVCMAS_SETTINGS_BY_KEY: Final = {s.key: s for s in KVCMAS_SETTINGS}
