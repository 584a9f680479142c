"""The architecture registry: one class per Hugging Face architecture, mapping its config and tensors to GGUF.

A class declares the GGUF architecture name, writes the hyper-parameter keys, and lists the GGUF tensors it will
write: for each, the source tensor, the expected shape, and a transform applied to the float32 data. Nothing is
loaded while planning, so a checkpoint is validated (names and shapes) before any output exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from . import constants as C
from .errors import ConvertError
from .source import CheckpointTensors

Transform = Callable[[np.ndarray], np.ndarray]


@dataclass
class TensorPlan:
    """One GGUF tensor to write: its name, its source (a HF tensor, or None for a computed one) and final shape.

    ``shape`` is in numpy order ([rows, cols] for a matrix whose rows are output features); GGUF lists it reversed.
    """

    name: str
    source: str | None
    shape: tuple[int, ...]
    transform: Transform | None = None
    compute: Callable[[], np.ndarray] | None = None


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:  # absent, or null as transformers writes unset optional values
        value = default
    if value is None:
        raise ConvertError(f"{where}: config.json has no '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConvertError(f"{where}: config.json '{key}' = {value!r} must be a positive integer")
    return value


def permute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Reorders the rows of a Q or K projection from Hugging Face's rotate-half RoPE layout to GGML's pairwise one.

    HF keeps the two halves of each head's rotated dimensions apart (dims i and i + d/2 rotate together); GGML's
    "normal" RoPE rotates adjacent pairs (2i, 2i + 1). Per head, row r of the first half goes to 2r and row r of the
    second half to 2r + 1. Works for biases (1-D) too.
    """
    rows = weights.shape[0]
    if rows % n_head != 0 or (rows // n_head) % 2 != 0:
        raise ConvertError(f"cannot permute {rows} rows into {n_head} heads of even size")
    head_dim = rows // n_head
    rest = weights.shape[1:]
    return weights.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(weights.shape)


def llama3_rope_factors(rope: dict[str, Any], base: float, head_dim: int, where: str) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 RoPE scaling (the published formula), written as rope_freqs.weight."""
    try:
        factor = float(rope["factor"])
        low = float(rope.get("low_freq_factor", 1.0))
        high = float(rope.get("high_freq_factor", 4.0))
        old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    except (KeyError, TypeError, ValueError) as e:
        raise ConvertError(f"{where}: llama3 rope scaling needs a numeric 'factor' ({e})") from e
    if not (factor > 0 and high > low > 0 and old_ctx > 0):
        raise ConvertError(f"{where}: llama3 rope scaling parameters out of range: {rope}")
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    factors = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, factors))
    return factors.astype(np.float32)


class ModelClass:
    """Base of the registry entries. Subclasses set ``hf_architecture`` and ``gguf_architecture``."""

    hf_architecture: ClassVar[str] = ""
    gguf_architecture: ClassVar[str] = ""
    permute_qk: ClassVar[bool] = False  # HF rotate-half RoPE -> GGML pairwise RoPE
    qkv_bias: ClassVar[bool] = False  # q/k/v projections carry biases

    def __init__(self, config: dict[str, Any], where: str) -> None:
        self.config = config
        self.where = where
        c = config
        self.n_vocab = _int(c, "vocab_size", where)
        self.n_embd = _int(c, "hidden_size", where)
        self.n_layer = _int(c, "num_hidden_layers", where)
        self.n_ff = _int(c, "intermediate_size", where)
        self.n_head = _int(c, "num_attention_heads", where)
        self.n_head_kv = _int(c, "num_key_value_heads", where, self.n_head)
        self.head_dim = _int(c, "head_dim", where, self.n_embd // self.n_head)
        self.explicit_head_dim = c.get("head_dim") is not None
        self.n_ctx = _int(c, "max_position_embeddings", where, 4096)
        self.rms_eps = float(c.get("rms_norm_eps", 1e-6))
        self.tied = bool(c.get("tie_word_embeddings", False))
        if self.n_head % self.n_head_kv != 0:
            raise ConvertError(
                f"{where}: num_attention_heads {self.n_head} is not a multiple of num_key_value_heads {self.n_head_kv}"
            )
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConvertError(f"{where}: hidden_act {act!r} is not supported (kvcmas runs SiLU-gated MLPs)")
        # transformers 5 writes rope_parameters; older versions rope_theta + rope_scaling.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConvertError(f"{where}: config.json rope parameters must be an object, got {rope!r}")
        self.rope = rope
        self.rope_base = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ConvertError(f"{where}: rope type {self.rope_type!r} is not supported (default, linear, llama3)")
        if float(c.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConvertError(f"{where}: partial_rotary_factor is not supported")

    def sliding_window(self) -> tuple[int, list[bool]] | None:
        """(window, windowed per layer) when attention slides on some layer, else None.

        config.json's ``layer_types`` ("sliding_attention" / "full_attention") decides per layer when present;
        otherwise ``default_window_layers`` does (every layer for Mistral).
        """
        c, where = self.config, self.where
        if c.get("sliding_window") is None or not self.window_enabled():
            return None
        window = _int(c, "sliding_window", where)
        types = c.get("layer_types")
        if types is None:
            layers = self.default_window_layers()
        else:
            if not isinstance(types, list) or len(types) != self.n_layer:
                raise ConvertError(f"{where}: config.json 'layer_types' must list one type per layer ({self.n_layer})")
            unknown = sorted({str(t) for t in types} - {"sliding_attention", "full_attention"})
            if unknown:
                raise ConvertError(f"{where}: config.json 'layer_types' has unsupported {', '.join(unknown)}")
            layers = [t == "sliding_attention" for t in types]
        return (window, layers) if any(layers) else None

    def window_enabled(self) -> bool:
        """Whether config.json's ``sliding_window`` applies (as in transformers' class for the architecture)."""
        return False

    def default_window_layers(self) -> list[bool]:
        """Windowed layers when config.json has no ``layer_types``."""
        return [True] * self.n_layer

    def write_params(self, writer: Any) -> None:
        """Writes the ``<arch>.*`` keys through a ``gguf.GGUFWriter``."""
        a = self.gguf_architecture + "."
        writer.add_uint32(a + C.ARCH_KEY_CONTEXT_LENGTH, self.n_ctx)
        writer.add_uint32(a + C.ARCH_KEY_EMBEDDING_LENGTH, self.n_embd)
        writer.add_uint32(a + C.ARCH_KEY_BLOCK_COUNT, self.n_layer)
        writer.add_uint32(a + C.ARCH_KEY_FEED_FORWARD_LENGTH, self.n_ff)
        writer.add_uint32(a + C.ARCH_KEY_HEAD_COUNT, self.n_head)
        writer.add_uint32(a + C.ARCH_KEY_HEAD_COUNT_KV, self.n_head_kv)
        writer.add_float32(a + C.ARCH_KEY_RMS_EPS, self.rms_eps)
        writer.add_float32(a + C.ARCH_KEY_ROPE_FREQ_BASE, self.rope_base)
        writer.add_uint32(a + C.ARCH_KEY_ROPE_DIMENSION_COUNT, self.head_dim)
        writer.add_uint32(a + C.ARCH_KEY_VOCAB_SIZE, self.n_vocab)
        # llama.cpp's converter writes the head size whenever config.json gives one (even hidden / heads).
        if self.explicit_head_dim or self.head_dim != self.n_embd // self.n_head:
            writer.add_uint32(a + C.ARCH_KEY_KEY_LENGTH, self.head_dim)
            writer.add_uint32(a + C.ARCH_KEY_VALUE_LENGTH, self.head_dim)
        sliding = self.sliding_window()
        if sliding is not None:  # the keys llama.cpp's converter writes (gguf-py add_sliding_window[_pattern])
            window, layers = sliding
            writer.add_uint32(a + C.ARCH_KEY_SLIDING_WINDOW, window)
            if not all(layers):
                writer.add_array(a + C.ARCH_KEY_SLIDING_WINDOW_PATTERN, layers)
        if self.rope_type == "linear":
            writer.add_string(a + C.ARCH_KEY_ROPE_SCALING_TYPE, "linear")
            writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_FACTOR, float(self.rope["factor"]))

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        """The GGUF tensors in write order; raises on missing / unexpected tensors and shape mismatches."""
        E, F, V = self.n_embd, self.n_ff, self.n_vocab
        qd, kd = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        plans: list[TensorPlan] = []

        def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], transform: Transform | None = None) -> None:
            plans.append(TensorPlan(gguf_name, hf_name, shape, transform))

        add(C.TENSOR_TOKEN_EMBD, "model.embed_tokens.weight", (V, E))
        if self.rope_type == "llama3":
            factors = llama3_rope_factors(self.rope, self.rope_base, self.head_dim, self.where)
            plans.append(TensorPlan(C.TENSOR_ROPE_FREQS, None, factors.shape, compute=lambda: factors))
        permute_q = (lambda w: permute_rotary(w, self.n_head)) if self.permute_qk else None
        permute_k = (lambda w: permute_rotary(w, self.n_head_kv)) if self.permute_qk else None
        for il in range(self.n_layer):
            hf = f"model.layers.{il}."

            def blk(suffix: str, il: int = il) -> str:
                return C.block_tensor(il, suffix)

            add(blk(C.BLK_ATTN_NORM), hf + "input_layernorm.weight", (E,))
            add(blk(C.BLK_ATTN_Q), hf + "self_attn.q_proj.weight", (qd, E), permute_q)
            add(blk(C.BLK_ATTN_K), hf + "self_attn.k_proj.weight", (kd, E), permute_k)
            add(blk(C.BLK_ATTN_V), hf + "self_attn.v_proj.weight", (kd, E))
            if self.qkv_bias:
                add(blk(C.BLK_ATTN_Q_BIAS), hf + "self_attn.q_proj.bias", (qd,), permute_q)
                add(blk(C.BLK_ATTN_K_BIAS), hf + "self_attn.k_proj.bias", (kd,), permute_k)
                add(blk(C.BLK_ATTN_V_BIAS), hf + "self_attn.v_proj.bias", (kd,))
            add(blk(C.BLK_ATTN_OUTPUT), hf + "self_attn.o_proj.weight", (E, qd))
            add(blk(C.BLK_FFN_NORM), hf + "post_attention_layernorm.weight", (E,))
            add(blk(C.BLK_FFN_GATE), hf + "mlp.gate_proj.weight", (F, E))
            add(blk(C.BLK_FFN_UP), hf + "mlp.up_proj.weight", (F, E))
            add(blk(C.BLK_FFN_DOWN), hf + "mlp.down_proj.weight", (E, F))
        add(C.TENSOR_OUTPUT_NORM, "model.norm.weight", (E,))
        # A tied checkpoint may still store lm_head.weight (a copy); it is then expected but not written.
        if not self.tied:
            add(C.TENSOR_OUTPUT, "lm_head.weight", (V, E))
        self._check(tensors, plans)
        return plans

    def ignored_tensors(self) -> set[str]:
        """Source tensors that may be present and are not written (buffers, tied copies)."""
        extra = {f"model.layers.{il}.self_attn.rotary_emb.inv_freq" for il in range(self.n_layer)}
        if self.tied:
            extra.add("lm_head.weight")
        return extra

    def _check(self, tensors: CheckpointTensors, plans: list[TensorPlan]) -> None:
        used = set()
        for p in plans:
            if p.source is None:
                continue
            used.add(p.source)
            if p.source not in tensors:
                raise ConvertError(
                    f"{self.where}: tensor {p.source!r} (for GGUF {p.name!r}) is missing from the checkpoint"
                )
            shape = tensors.shape(p.source)
            if shape != p.shape:
                raise ConvertError(
                    f"{tensors.refs[p.source].path}: tensor {p.source!r} has shape {list(shape)}, "
                    f"config.json implies {list(p.shape)}"
                )
        unexpected = sorted(set(tensors) - used - self.ignored_tensors())
        if unexpected:
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise ConvertError(
                f"{tensors.refs[unexpected[0]].path}: unexpected tensor(s) for "
                f"{self.hf_architecture}: {', '.join(map(repr, unexpected[:5]))}{more}"
            )


MODEL_CLASSES: dict[str, type[ModelClass]] = {}


def register(cls: type[ModelClass]) -> type[ModelClass]:
    """Class decorator: adds an architecture to the registry under its Hugging Face name."""
    MODEL_CLASSES[cls.hf_architecture] = cls
    return cls


@register
class LlamaModel(ModelClass):
    """``LlamaForCausalLM``: llama.cpp's "llama" architecture; Q/K rows permuted to pairwise RoPE."""

    hf_architecture = "LlamaForCausalLM"
    gguf_architecture = C.ARCH_LLAMA
    permute_qk = True

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ConvertError(f"{where}: config.json '{key}' = true is not supported by kvcmas")


@register
class MistralModel(LlamaModel):
    """``MistralForCausalLM``: the same tensors as Llama; llama.cpp runs it as "llama".

    Its ``sliding_window`` (every layer) is written as ``llama.attention.sliding_window``, which kvcmas applies.
    """

    hf_architecture = "MistralForCausalLM"

    def window_enabled(self) -> bool:
        return True


@register
class Qwen2Model(ModelClass):
    """``Qwen2ForCausalLM``: llama.cpp's "qwen2" architecture (NeoX RoPE, so no permutation; q/k/v biases)."""

    hf_architecture = "Qwen2ForCausalLM"
    gguf_architecture = C.ARCH_QWEN2
    qkv_bias = True

    def window_enabled(self) -> bool:
        return bool(self.config.get("use_sliding_window"))

    def default_window_layers(self) -> list[bool]:
        # transformers' Qwen2: with use_sliding_window, layers from max_window_layers on slide
        first = self.config.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConvertError(f"{self.where}: config.json 'max_window_layers' = {first!r} must be an integer >= 0")
        return [il >= first for il in range(self.n_layer)]


def model_class_for(config: dict[str, Any], where: str) -> ModelClass:
    """The registry entry for config.json's ``architectures``; a clear error for an unknown one."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConvertError(f"{where}: config.json has no 'architectures' list")
    for arch in archs:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch](config, where)
    raise ConvertError(
        f"{where}: unsupported architecture {', '.join(map(str, archs))}; supported: {', '.join(sorted(MODEL_CLASSES))}"
    )
