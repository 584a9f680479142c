"""Weights of every GGUF type with gguf-py's dequantization as the reference, and the error measure of products."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
BLOCK32_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
K_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
# the types of llama.cpp's smaller files (cpp/backend/cpu/quants-lowbit.cpp); gguf-py cannot quantize them
LOWBIT_TYPES = [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS]
RANDOM_BLOCK_TYPES = K_TYPES + LOWBIT_TYPES
ALL_TYPES = FLOAT_TYPES + BLOCK32_TYPES + K_TYPES + LOWBIT_TYPES


def block_size(qtype: QT) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def f16_bytes(values: np.ndarray) -> np.ndarray:
    """f16 bit patterns of `values` as a (n, 2) uint8 array."""
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for n_blocks blocks of a block type, every quant bit random, f16 scales small and finite."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = f16_bytes(rng.uniform(-0.02, 0.02, n_blocks))
    mins = f16_bytes(rng.uniform(-0.02, 0.02, n_blocks))
    if qtype in (QT.Q6_K, QT.Q3_K):
        raw[:, -2:] = scales  # d is the last field
    elif qtype == QT.Q2_K:
        raw[:, -4:-2], raw[:, -2:] = scales, mins  # d, dmin last
    else:
        raw[:, 0:2] = scales
        if qtype in (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K):
            raw[:, 2:4] = mins  # m / dmin
    return raw


def make_weight(qtype: QT, n_out: int, n_in: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    """Weight bytes of the given type and their f32 dequantization by gguf-py, shape (n_out, n_in)."""
    if qtype in RANDOM_BLOCK_TYPES:
        raw = random_blocks(qtype, n_out * n_in // block_size(qtype), rng).reshape(n_out, -1)
    else:
        values = rng.standard_normal((n_out, n_in)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(n_out, n_in)
    return raw.tobytes(), ref


def exact_product(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x · wᵀ in float64, |x| · |w|ᵀ in float64): the reference and the per-element error scale."""
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    return exact, magnitude


def max_scaled_err(y: np.ndarray, exact: np.ndarray, magnitude: np.ndarray) -> float:
    """Largest |y - exact| relative to the element's Σ|w||x| (1e-30 floor for all-zero rows)."""
    return float(np.max(np.abs(y.astype(np.float64) - exact) / np.maximum(magnitude, 1e-30), initial=0.0))
