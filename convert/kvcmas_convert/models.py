"""The architecture registry: one class per Hugging Face architecture, mapping its config and tensors to GGUF.

A class declares the GGUF architecture name, writes the hyper-parameter keys, and lists the GGUF tensors it will
write: for each, the source tensor, the expected shape, and a transform applied to the float32 data. Nothing is
loaded while planning, so a checkpoint is validated (names and shapes) before any output exists.
"""

from __future__ import annotations

import functools
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
    hf_model_type: ClassVar[str] = ""  # config.json's model_type (a multimodal checkpoint's text_config names it)
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
        act = c.get(self.activation_key, "silu")
        if act not in self.activations:
            raise ConvertError(
                f"{where}: {self.activation_key} {act!r} is not supported for {self.hf_architecture} "
                f"({', '.join(self.activations)})"
            )
        # transformers 5 writes rope_parameters; older versions rope_theta + rope_scaling.
        rope = self.global_rope_parameters()
        if not isinstance(rope, dict):
            raise ConvertError(f"{where}: config.json rope parameters must be an object, got {rope!r}")
        self.rope = rope
        self.rope_base = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        self.rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if self.rope_type not in self.rope_types:
            raise ConvertError(
                f"{where}: rope type {self.rope_type!r} is not supported for {self.hf_architecture} "
                f"({', '.join(self.rope_types)})"
            )
        partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
        partial = 1.0 if partial is None else float(partial)
        if partial != 1.0 and not self.partial_rotary:
            raise ConvertError(f"{where}: partial_rotary_factor is not supported for {self.hf_architecture}")
        self.n_rot = int(self.head_dim * partial)
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2 != 0:
            raise ConvertError(f"{where}: partial_rotary_factor {partial} gives an odd or empty rotary size")

    # Which config.json key names the MLP's activation, and the values the engine runs for this architecture.
    activation_key: ClassVar[str] = "hidden_act"
    activations: ClassVar[tuple[str, ...]] = ("silu", "swish")
    rope_types: ClassVar[tuple[str, ...]] = ("default", "linear", "llama3", "yarn")
    partial_rotary: ClassVar[bool] = False
    yarn_truncate: ClassVar[bool] = True  # the engine rounds YaRN's ramp to whole dims (gpt-oss does not)

    def global_rope_parameters(self) -> Any:
        """The RoPE parameters of the global (full-attention) layers."""
        c = self.config
        return c.get("rope_parameters") or c.get("rope_scaling") or {}

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
        writer.add_uint32(a + C.ARCH_KEY_ROPE_DIMENSION_COUNT, self.n_rot)
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
        if self.rope_type == "yarn":
            self._write_yarn(writer, a)
        self.write_extra(writer, a)

    def _write_yarn(self, writer: Any, a: str) -> None:
        """YaRN as llama.cpp's converter writes it, plus the parameters transformers reads when they differ from
        its defaults (beta_fast 32, beta_slow 1, attention factor 0.1 ln(factor) + 1)."""
        rope, where = self.rope, self.where
        orig = rope.get("original_max_position_embeddings") or self.config.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if orig is None:
            raise ConvertError(f"{where}: yarn rope scaling needs 'original_max_position_embeddings'")
        if factor is None:
            factor = self.n_ctx / float(orig)
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ConvertError(f"{where}: yarn with mscale / mscale_all_dim is not supported")
        if bool(rope.get("truncate", True)) != self.yarn_truncate:
            raise ConvertError(
                f"{where}: yarn truncate={rope.get('truncate', True)} is not supported for {self.hf_architecture}"
            )
        writer.add_string(a + C.ARCH_KEY_ROPE_SCALING_TYPE, "yarn")
        writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_FACTOR, float(factor))
        writer.add_uint32(a + C.ARCH_KEY_ROPE_SCALING_ORIG_CTX, int(orig))
        if rope.get("beta_fast"):
            writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_YARN_BETA_FAST, float(rope["beta_fast"]))
        if rope.get("beta_slow"):
            writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_YARN_BETA_SLOW, float(rope["beta_slow"]))
        if rope.get("attention_factor") is not None:
            writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_ATTN_FACTOR, float(rope["attention_factor"]))

    def write_extra(self, writer: Any, a: str) -> None:
        """The architecture's own keys (none by default)."""

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        """The GGUF tensors in write order; raises on missing / unexpected tensors and shape mismatches."""
        E, V = self.n_embd, self.n_vocab
        plans: list[TensorPlan] = []
        self._plans_out = plans  # plan_attention / plan_ffn may append computed tensors

        def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], transform: Transform | None = None) -> None:
            plans.append(TensorPlan(gguf_name, hf_name, shape, transform))

        add(C.TENSOR_TOKEN_EMBD, "model.embed_tokens.weight", (V, E))
        if self.rope_type == "llama3":
            factors = llama3_rope_factors(self.rope, self.rope_base, self.head_dim, self.where)
            plans.append(TensorPlan(C.TENSOR_ROPE_FREQS, None, factors.shape, compute=lambda: factors))
        for il in range(self.n_layer):
            self.plan_attention(il, add)
            self.plan_ffn(il, add)
        add(C.TENSOR_OUTPUT_NORM, "model.norm.weight", (E,), self.norm_transform())
        # A tied checkpoint may still store lm_head.weight (a copy); it is then expected but not written.
        if not self.tied:
            add(C.TENSOR_OUTPUT, "lm_head.weight", (V, E))
        self._check(tensors, plans)
        return plans

    def norm_transform(self) -> Transform | None:
        """How norm weights are stored in GGUF (None: as they are; gemma: 1 + w, what its RMSNorm multiplies by)."""
        return None

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        """The attention tensors of layer il: norm, Q/K/V (+ biases), output; llama's names."""
        E, qd, kd = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        hf = f"model.layers.{il}."
        permute_q = (lambda w: permute_rotary(w, self.n_head)) if self.permute_qk else None
        permute_k = (lambda w: permute_rotary(w, self.n_head_kv)) if self.permute_qk else None
        add(C.block_tensor(il, C.BLK_ATTN_NORM), hf + "input_layernorm.weight", (E,), self.norm_transform())
        add(C.block_tensor(il, C.BLK_ATTN_Q), hf + "self_attn.q_proj.weight", (qd, E), permute_q)
        add(C.block_tensor(il, C.BLK_ATTN_K), hf + "self_attn.k_proj.weight", (kd, E), permute_k)
        add(C.block_tensor(il, C.BLK_ATTN_V), hf + "self_attn.v_proj.weight", (kd, E))
        if self.qkv_bias:
            add(C.block_tensor(il, C.BLK_ATTN_Q_BIAS), hf + "self_attn.q_proj.bias", (qd,), permute_q)
            add(C.block_tensor(il, C.BLK_ATTN_K_BIAS), hf + "self_attn.k_proj.bias", (kd,), permute_k)
            add(C.block_tensor(il, C.BLK_ATTN_V_BIAS), hf + "self_attn.v_proj.bias", (kd,))
        add(C.block_tensor(il, C.BLK_ATTN_OUTPUT), hf + "self_attn.o_proj.weight", (E, qd))

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        """The feed-forward tensors of layer il: norm, gate, up, down; llama's names."""
        E, F = self.n_embd, self.n_ff
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_FFN_NORM), hf + "post_attention_layernorm.weight", (E,), self.norm_transform())
        add(C.block_tensor(il, C.BLK_FFN_GATE), hf + "mlp.gate_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_UP), hf + "mlp.up_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_DOWN), hf + "mlp.down_proj.weight", (E, F))

    def checked_source(self, tensors: CheckpointTensors, name: str, shape: tuple[int, ...]) -> str:
        """``name`` itself, after checking that the checkpoint holds it with this shape (for computed tensors)."""
        tensors.require(name, shape, self.where)
        return name

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
    hf_model_type = "llama"
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
    hf_model_type = "mistral"

    def window_enabled(self) -> bool:
        return True


@register
class Qwen2Model(ModelClass):
    """``Qwen2ForCausalLM``: llama.cpp's "qwen2" architecture (NeoX RoPE, so no permutation; q/k/v biases)."""

    hf_architecture = "Qwen2ForCausalLM"
    hf_model_type = "qwen2"
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


class _TextTensors:
    """The text model's tensors of a vision-language checkpoint under causal-LM names: ``model.language_model.*``
    (transformers 5) as ``model.*``; the vision tower's (``model.visual.*``, ``visual.*``) left out."""

    def __init__(self, tensors: CheckpointTensors) -> None:
        self.source: dict[str, str] = {}
        for name in tensors:
            if name.startswith(("model.visual.", "visual.")):
                continue
            new = "model." + name[len("model.language_model.") :] if name.startswith("model.language_model.") else name
            self.source[new] = name
        self.refs = {new: tensors.refs[old] for new, old in self.source.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.refs

    def __iter__(self) -> Any:
        return iter(self.refs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape


@register
class Qwen2VLModel(Qwen2Model):
    """The text half of ``Qwen2_5_VLForConditionalGeneration``: llama.cpp's "qwen2vl", the qwen2 layer with M-RoPE
    (``rope.dimension_sections``: the rotated pairs of the temporal, height and width positions, then 0)."""

    hf_architecture = "Qwen2_5_VLForConditionalGeneration"
    hf_model_type = ""  # only whole checkpoints: its text_config alone is not a causal LM of its own
    gguf_architecture = C.ARCH_QWEN2_VL
    rope_types = ("default", "mrope")

    def __init__(self, config: dict[str, Any], where: str) -> None:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConvertError(f"{where}: a {self.hf_architecture} config needs a 'text_config' object")
        merged = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        merged.update(text)
        super().__init__(merged, where)
        sections = self.rope.get("mrope_section")
        half = self.n_rot // 2
        if (
            not isinstance(sections, list)
            or len(sections) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sections)
            or sum(sections) != half
        ):
            raise ConvertError(
                f"{where}: rope parameters 'mrope_section' = {sections!r} must be 3 integers summing to {half} "
                "(half the rotated head size)"
            )
        self.sections = [*sections, 0]

    def write_extra(self, writer: Any, a: str) -> None:
        writer.add_array(a + C.ARCH_KEY_ROPE_DIMENSION_SECTIONS, self.sections)

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        view = _TextTensors(tensors)
        plans = super().plan(view)  # type: ignore[arg-type]
        for p in plans:
            if p.source is not None:
                p.source = view.source[p.source]
        return plans


@register
class Qwen3Model(Qwen2Model):
    """``Qwen3ForCausalLM``: llama.cpp's "qwen3" (NeoX RoPE, no q/k/v biases, per-head RMSNorm of Q and K)."""

    hf_architecture = "Qwen3ForCausalLM"
    hf_model_type = "qwen3"
    gguf_architecture = C.ARCH_QWEN3
    qkv_bias = False

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        if config.get("attention_bias"):
            raise ConvertError(f"{where}: config.json 'attention_bias' = true is not supported for Qwen3")

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        super().plan_attention(il, add)
        hf = f"model.layers.{il}.self_attn."
        add(C.block_tensor(il, C.BLK_ATTN_Q_NORM), hf + "q_norm.weight", (self.head_dim,))
        add(C.block_tensor(il, C.BLK_ATTN_K_NORM), hf + "k_norm.weight", (self.head_dim,))


@register
class Qwen3MoeModel(Qwen3Model):
    """``Qwen3MoeForCausalLM``: llama.cpp's "qwen3moe": Qwen3 attention and top-k routed experts in every layer,
    the experts stacked into ffn_{gate,up,down}_exps [n_expert, rows, cols] as llama.cpp writes them."""

    hf_architecture = "Qwen3MoeForCausalLM"
    hf_model_type = "qwen3_moe"
    gguf_architecture = C.ARCH_QWEN3_MOE

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        c = config
        # transformers 5 writes num_local_experts; released checkpoints num_experts
        self.n_expert = _int(c, "num_experts" if c.get("num_experts") is not None else "num_local_experts", where)
        self.n_expert_used = _int(c, "num_experts_per_tok", where)
        self.n_ff_exp = _int(c, "moe_intermediate_size", where)
        if self.n_expert_used > self.n_expert:
            raise ConvertError(f"{where}: num_experts_per_tok {self.n_expert_used} > num_experts {self.n_expert}")
        # llama.cpp's qwen3moe always renormalizes the chosen experts' weights and routes every layer
        if not c.get("norm_topk_prob", False):
            raise ConvertError(f"{where}: norm_topk_prob = false is not supported (llama.cpp and kvcmas renormalize)")
        if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
            raise ConvertError(f"{where}: dense layers (mlp_only_layers / decoder_sparse_step) are not supported")

    def write_extra(self, writer: Any, a: str) -> None:
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_COUNT, self.n_expert)
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_USED_COUNT, self.n_expert_used)
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_FEED_FORWARD_LENGTH, self.n_ff_exp)

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        self._tensors = tensors  # the stacked experts are read when written
        return super().plan(tensors)

    def _experts(self, il: int, proj: str) -> list[str]:
        return [f"model.layers.{il}.mlp.experts.{e}.{proj}.weight" for e in range(self.n_expert)]

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        E, F, X = self.n_embd, self.n_ff_exp, self.n_expert
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_FFN_NORM), hf + "post_attention_layernorm.weight", (E,))
        add(C.block_tensor(il, C.BLK_FFN_GATE_INP), hf + "mlp.gate.weight", (X, E))
        for name, proj, shape in (
            (C.BLK_FFN_GATE_EXPS, "gate_proj", (F, E)),
            (C.BLK_FFN_UP_EXPS, "up_proj", (F, E)),
            (C.BLK_FFN_DOWN_EXPS, "down_proj", (E, F)),
        ):
            sources = [self.checked_source(self._tensors, src, shape) for src in self._experts(il, proj)]

            def stack(sources: list[str] = sources) -> np.ndarray:
                return np.stack([self._tensors.load(s) for s in sources])

            self._plans_out.append(TensorPlan(C.block_tensor(il, name), None, (X, *shape), compute=stack))

    def ignored_tensors(self) -> set[str]:
        return super().ignored_tensors() | {
            t for il in range(self.n_layer) for p in ("gate_proj", "up_proj", "down_proj") for t in self._experts(il, p)
        }


@register
class Olmo2Model(ModelClass):
    """``Olmo2ForCausalLM``: llama.cpp's "olmo2": no pre-norms, RMSNorm after attention and after the MLP, Q/K
    RMSNorm over the whole projection, NeoX RoPE."""

    hf_architecture = "Olmo2ForCausalLM"
    hf_model_type = "olmo2"
    gguf_architecture = C.ARCH_OLMO2

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        if config.get("attention_bias"):
            raise ConvertError(f"{where}: config.json 'attention_bias' = true is not supported for OLMo 2")

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        E, qd, kd = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_ATTN_Q), hf + "self_attn.q_proj.weight", (qd, E))
        add(C.block_tensor(il, C.BLK_ATTN_K), hf + "self_attn.k_proj.weight", (kd, E))
        add(C.block_tensor(il, C.BLK_ATTN_V), hf + "self_attn.v_proj.weight", (kd, E))
        add(C.block_tensor(il, C.BLK_ATTN_Q_NORM), hf + "self_attn.q_norm.weight", (qd,))
        add(C.block_tensor(il, C.BLK_ATTN_K_NORM), hf + "self_attn.k_norm.weight", (kd,))
        add(C.block_tensor(il, C.BLK_ATTN_OUTPUT), hf + "self_attn.o_proj.weight", (E, qd))
        add(C.block_tensor(il, C.BLK_ATTN_POST_NORM), hf + "post_attention_layernorm.weight", (E,))

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        E, F = self.n_embd, self.n_ff
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_FFN_GATE), hf + "mlp.gate_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_UP), hf + "mlp.up_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_DOWN), hf + "mlp.down_proj.weight", (E, F))
        add(C.block_tensor(il, C.BLK_FFN_POST_NORM), hf + "post_feedforward_layernorm.weight", (E,))


@register
class SmolLM3Model(LlamaModel):
    """``SmolLM3ForCausalLM``: llama.cpp's "smollm3": the llama layer with RoPE off on every 4th layer.

    llama.cpp's files carry no per-layer key for this (its loader applies the interval 4), so a checkpoint with
    another ``no_rope_layers`` pattern is refused rather than written as a file that reads differently."""

    hf_architecture = "SmolLM3ForCausalLM"
    hf_model_type = "smollm3"
    gguf_architecture = C.ARCH_SMOLLM3

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        expected = [int((il + 1) % 4 != 0) for il in range(self.n_layer)]
        got = config.get("no_rope_layers", expected)
        if [int(x) for x in got] != expected:
            raise ConvertError(
                f"{where}: no_rope_layers {got} is not the every-4th-layer pattern llama.cpp and kvcmas read "
                f"({expected})"
            )

    def window_enabled(self) -> bool:
        return bool(self.config.get("use_sliding_window"))


@register
class Gemma3Model(ModelClass):
    """``Gemma3ForCausalLM`` (text): llama.cpp's "gemma3": sliding / global layers (``layer_types``) with their
    own RoPE bases, per-head Q/K RMSNorm, norms before and after attention and MLP, GeGLU (tanh GELU), embeddings
    scaled by sqrt(hidden) in the engine, norms stored as 1 + w (as llama.cpp's converter writes them)."""

    hf_architecture = "Gemma3ForCausalLM"
    hf_model_type = "gemma3_text"
    gguf_architecture = C.ARCH_GEMMA3
    activation_key = "hidden_activation"
    activations = ("gelu_pytorch_tanh",)

    def norm_transform(self) -> Transform | None:
        return _plus_one

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        c = config
        self.tied = bool(c.get("tie_word_embeddings", True))
        scalar = c.get("query_pre_attn_scalar", self.head_dim)
        llama_cpp_scalar = self.n_embd // self.n_head if self.n_layer == 62 else self.head_dim
        if scalar != llama_cpp_scalar:
            raise ConvertError(
                f"{where}: query_pre_attn_scalar {scalar} differs from the scale llama.cpp and kvcmas apply "
                f"({llama_cpp_scalar})"
            )
        if c.get("attn_logit_softcapping") is not None:
            raise ConvertError(f"{where}: attn_logit_softcapping is not supported")
        local = self._layer_rope("sliding_attention")
        self.rope_base_swa = float(local.get("rope_theta", c.get("rope_local_base_freq", 10000.0)))
        if str(local.get("rope_type", "default")) != "default":
            raise ConvertError(f"{where}: sliding layers' rope type {local.get('rope_type')!r} is not supported")

    def _layer_rope(self, layer_type: str) -> dict[str, Any]:
        rope = self.config.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get(layer_type), dict):  # transformers 5: per layer type
            return dict(rope[layer_type])
        return {}

    def global_rope_parameters(self) -> Any:
        per_type = self._layer_rope("full_attention")
        if per_type:
            return per_type
        c = self.config
        out = dict(c.get("rope_scaling") or {})
        if c.get("rope_theta") is not None:
            out.setdefault("rope_theta", c["rope_theta"])
        return out

    def window_enabled(self) -> bool:
        return True

    def default_window_layers(self) -> list[bool]:
        period = int(self.config.get("sliding_window_pattern", 6))
        return [(il + 1) % period != 0 for il in range(self.n_layer)]

    def write_extra(self, writer: Any, a: str) -> None:
        writer.add_float32(a + C.ARCH_KEY_ROPE_FREQ_BASE_SWA, self.rope_base_swa)
        cap = self.config.get("final_logit_softcapping")
        if cap is not None:
            writer.add_float32(a + C.ARCH_KEY_FINAL_LOGIT_SOFTCAPPING, float(cap))

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        super().plan_attention(il, add)
        hf = f"model.layers.{il}."
        norm = self.norm_transform()
        add(C.block_tensor(il, C.BLK_ATTN_Q_NORM), hf + "self_attn.q_norm.weight", (self.head_dim,), norm)
        add(C.block_tensor(il, C.BLK_ATTN_K_NORM), hf + "self_attn.k_norm.weight", (self.head_dim,), norm)
        add(C.block_tensor(il, C.BLK_ATTN_POST_NORM), hf + "post_attention_layernorm.weight", (self.n_embd,), norm)

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        E, F = self.n_embd, self.n_ff
        hf = f"model.layers.{il}."
        norm = self.norm_transform()
        add(C.block_tensor(il, C.BLK_FFN_NORM), hf + "pre_feedforward_layernorm.weight", (E,), norm)
        add(C.block_tensor(il, C.BLK_FFN_GATE), hf + "mlp.gate_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_UP), hf + "mlp.up_proj.weight", (F, E))
        add(C.block_tensor(il, C.BLK_FFN_DOWN), hf + "mlp.down_proj.weight", (E, F))
        add(C.block_tensor(il, C.BLK_FFN_POST_NORM), hf + "post_feedforward_layernorm.weight", (E,), norm)


@register
class Phi3Model(ModelClass):
    """``Phi3ForCausalLM`` (Phi-3, Phi-3.5, Phi-4-mini): llama.cpp's "phi3": fused qkv_proj and gate_up_proj kept
    fused (attn_qkv, ffn_up), NeoX RoPE over the first partial_rotary_factor of each head, LongRoPE factors."""

    hf_architecture = "Phi3ForCausalLM"
    hf_model_type = "phi3"
    gguf_architecture = C.ARCH_PHI3
    rope_types = ("default", "longrope")
    partial_rotary = True

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        self.orig_ctx = _int(config, "original_max_position_embeddings", where, self.n_ctx)
        if self.rope_type == "longrope":
            for key in ("long_factor", "short_factor"):
                f = self.rope.get(key)
                if not isinstance(f, list) or len(f) != self.n_rot // 2:
                    raise ConvertError(f"{where}: longrope '{key}' must list {self.n_rot // 2} numbers")

    def window_enabled(self) -> bool:
        return True

    def write_extra(self, writer: Any, a: str) -> None:
        if self.rope_type != "longrope":
            return
        orig = int(self.rope.get("original_max_position_embeddings") or self.orig_ctx)
        factor = self.rope.get("factor") or self.n_ctx / orig
        attn = self.rope.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(orig))
        writer.add_uint32(a + C.ARCH_KEY_ROPE_SCALING_ORIG_CTX, orig)
        writer.add_float32(a + C.ARCH_KEY_ROPE_SCALING_ATTN_FACTOR, float(attn))

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        plans = super().plan(tensors)
        if self.rope_type == "longrope":
            for name, key in (
                (C.TENSOR_ROPE_FACTORS_LONG, "long_factor"),
                (C.TENSOR_ROPE_FACTORS_SHORT, "short_factor"),
            ):
                factors = np.asarray(self.rope[key], dtype=np.float32)
                plans.insert(1, TensorPlan(name, None, factors.shape, compute=functools.partial(np.array, factors)))
        return plans

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        E, qd, kd = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_ATTN_NORM), hf + "input_layernorm.weight", (E,))
        add(C.block_tensor(il, C.BLK_ATTN_QKV), hf + "self_attn.qkv_proj.weight", (qd + 2 * kd, E))
        add(C.block_tensor(il, C.BLK_ATTN_OUTPUT), hf + "self_attn.o_proj.weight", (E, qd))

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        E, F = self.n_embd, self.n_ff
        hf = f"model.layers.{il}."
        add(C.block_tensor(il, C.BLK_FFN_NORM), hf + "post_attention_layernorm.weight", (E,))
        add(C.block_tensor(il, C.BLK_FFN_UP), hf + "mlp.gate_up_proj.weight", (2 * F, E))
        add(C.block_tensor(il, C.BLK_FFN_DOWN), hf + "mlp.down_proj.weight", (E, F))


def text_architecture_for(model_type: str) -> str | None:
    """The registered Hugging Face architecture of a config.json model_type, or None."""
    return next((c.hf_architecture for c in MODEL_CLASSES.values() if c.hf_model_type == model_type), None)


def _plus_one(w: np.ndarray) -> np.ndarray:
    return w + 1.0


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
