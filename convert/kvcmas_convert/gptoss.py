"""``GptOssForCausalLM``: llama.cpp's "gpt-oss", the tensors named and laid out as llama.cpp's converter writes them.

Attention: q/k/v/o with biases and ``attn_sinks`` (a logit per query head), NeoX RoPE (no permutation) with YaRN
(``truncate: false``, which the engine applies to this architecture), sliding-window layers alternating with full
ones (even layers slide). Feed-forward: a router with a bias and experts whose fused, interleaved ``gate_up_proj``
([expert, hidden, 2·ff], gate in the even columns, up in the odd ones) is split into ``ffn_gate_exps`` and
``ffn_up_exps`` [expert, ff, hidden] with their biases, and ``down_proj`` transposed into ``ffn_down_exps``. The
pre-FFN norm is llama.cpp's ``post_attention_norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import constants as C
from .errors import ConvertError
from .models import ModelClass, TensorPlan, _int, register
from .source import CheckpointTensors

# OpenAI's MXFP4 release stores each expert matrix as *_blocks [expert, out, in / 32, 16] (byte i of a block: element
# 2i in the low nibble, 2i + 1 in the high one) and *_scales [expert, out, in / 32] (E8M0, bias 127), values from:
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
SWIGLU_ALPHA = 1.702  # llama.cpp and the engine apply gpt-oss's clamped SwiGLU with these constants
SWIGLU_LIMIT = 7.0


def unpack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 matrices [expert, out, in] of OpenAI's packed MXFP4 (codes and exponents as stored, any dtype)."""
    codes = blocks.astype(np.uint8)
    values = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.float32)
    values[..., 0::2] = FP4_VALUES[codes & 0x0F]
    values[..., 1::2] = FP4_VALUES[codes >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*codes.shape[:-2], -1)


@register
class GptOssModel(ModelClass):
    """``GptOssForCausalLM``: llama.cpp's "gpt-oss" (attention sinks, alternating sliding layers, biased MoE)."""

    hf_architecture = "GptOssForCausalLM"
    hf_model_type = "gpt_oss"
    gguf_architecture = C.ARCH_GPT_OSS
    qkv_bias = True
    rope_types = ("default", "yarn")
    yarn_truncate = False

    def __init__(self, config: dict[str, Any], where: str) -> None:
        super().__init__(config, where)
        c = config
        self.n_expert = _int(c, "num_local_experts", where)
        self.n_expert_used = _int(c, "num_experts_per_tok", where)
        self.n_ff_exp = self.n_ff
        if self.n_expert_used > self.n_expert:
            raise ConvertError(f"{where}: num_experts_per_tok {self.n_expert_used} > num_local_experts {self.n_expert}")
        for key, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
            if float(c.get(key, value)) != value:
                raise ConvertError(f"{where}: {key} {c[key]} differs from the {value} llama.cpp and kvcmas apply")
        if c.get("attention_bias") is False:
            raise ConvertError(f"{where}: attention_bias = false is not supported for gpt-oss")
        sliding = self.sliding_window()
        alternating = [il % 2 == 0 for il in range(self.n_layer)]
        if sliding is not None and sliding[1] != alternating:
            raise ConvertError(
                f"{where}: layer_types {c.get('layer_types')} is not the alternating pattern llama.cpp reads "
                "(sliding on even layers)"
            )

    def window_enabled(self) -> bool:
        return True

    def default_window_layers(self) -> list[bool]:
        return [il % 2 == 0 for il in range(self.n_layer)]

    def write_extra(self, writer: Any, a: str) -> None:
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_COUNT, self.n_expert)
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_USED_COUNT, self.n_expert_used)
        writer.add_uint32(a + C.ARCH_KEY_EXPERT_FEED_FORWARD_LENGTH, self.n_ff_exp)

    def plan(self, tensors: CheckpointTensors) -> list[TensorPlan]:
        self._tensors = tensors  # the experts are split and transposed when written
        return super().plan(tensors)

    def plan_attention(self, il: int, add: Callable[..., None]) -> None:
        super().plan_attention(il, add)
        hf = f"model.layers.{il}.self_attn."
        add(C.block_tensor(il, C.BLK_ATTN_OUTPUT_BIAS), hf + "o_proj.bias", (self.n_embd,))
        add(C.block_tensor(il, C.BLK_ATTN_SINKS), hf + "sinks", (self.n_head,))

    def _computed(self, name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> None:
        self._plans_out.append(TensorPlan(name, None, shape, compute=make))

    def plan_ffn(self, il: int, add: Callable[..., None]) -> None:
        E, F, X = self.n_embd, self.n_ff_exp, self.n_expert
        hf = f"model.layers.{il}.mlp."
        add(C.block_tensor(il, C.BLK_ATTN_POST_NORM), f"model.layers.{il}.post_attention_layernorm.weight", (E,))
        add(C.block_tensor(il, C.BLK_FFN_GATE_INP), hf + "router.weight", (X, E))
        add(C.block_tensor(il, C.BLK_FFN_GATE_INP_BIAS), hf + "router.bias", (X,))
        gate_up_bias = self.checked_source(self._tensors, hf + "experts.gate_up_proj_bias", (X, 2 * F))
        down_bias = self.checked_source(self._tensors, hf + "experts.down_proj_bias", (X, E))
        load = self._tensors.load
        packed = hf + "experts.gate_up_proj_blocks" in self._tensors  # OpenAI's MXFP4 release
        if packed:  # already [X, out, in]
            gate_up = self._packed(hf + "experts.gate_up_proj", (X, 2 * F, E))
            down = self._packed(hf + "experts.down_proj", (X, E, F))
        else:  # as transformers holds them: [X, in, out]
            gate_up = self.checked_source(self._tensors, hf + "experts.gate_up_proj", (X, E, 2 * F))
            down = self.checked_source(self._tensors, hf + "experts.down_proj", (X, F, E))

        def out_major(src: str) -> np.ndarray:  # the expert matrices [X, out, in]
            if packed:
                return unpack_mxfp4(load(src + "_blocks"), load(src + "_scales"))
            return load(src).transpose(0, 2, 1)

        def matrices(src: str, out_rows: slice) -> Callable[[], np.ndarray]:
            return lambda: np.ascontiguousarray(out_major(src)[:, out_rows])

        def rows(src: str, cols: slice) -> Callable[[], np.ndarray]:
            return lambda: np.ascontiguousarray(load(src)[:, cols])

        every = slice(None)
        self._computed(C.block_tensor(il, C.BLK_FFN_GATE_EXPS), (X, F, E), matrices(gate_up, slice(0, None, 2)))
        self._computed(C.block_tensor(il, C.BLK_FFN_UP_EXPS), (X, F, E), matrices(gate_up, slice(1, None, 2)))
        self._computed(C.block_tensor(il, C.BLK_FFN_DOWN_EXPS), (X, E, F), matrices(down, every))
        self._computed(C.block_tensor(il, C.BLK_FFN_GATE_EXPS_BIAS), (X, F), rows(gate_up_bias, slice(0, None, 2)))
        self._computed(C.block_tensor(il, C.BLK_FFN_UP_EXPS_BIAS), (X, F), rows(gate_up_bias, slice(1, None, 2)))
        self._computed(C.block_tensor(il, C.BLK_FFN_DOWN_EXPS_BIAS), (X, E), rows(down_bias, every))

    def _packed(self, name: str, shape: tuple[int, int, int]) -> str:
        """name, after checking its *_blocks and *_scales hold the matrices [expert, out, in] of this shape."""
        x, out, n_in = shape
        if n_in % 32 != 0:
            raise ConvertError(f"{self.where}: {name}_blocks: rows of {n_in} are not whole MXFP4 blocks of 32")
        self.checked_source(self._tensors, name + "_blocks", (x, out, n_in // 32, 16))
        self.checked_source(self._tensors, name + "_scales", (x, out, n_in // 32))
        return name

    def ignored_tensors(self) -> set[str]:
        names: tuple[str, ...] = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        names += tuple(f"{p}_{part}" for p in ("gate_up_proj", "down_proj") for part in ("blocks", "scales"))
        return super().ignored_tensors() | {
            f"model.layers.{il}.mlp.experts.{n}" for il in range(self.n_layer) for n in names
        }
