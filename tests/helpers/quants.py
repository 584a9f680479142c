"""Weights of every GGUF type with gguf-py's dequantization as the reference, and the error measure of products."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from helpers.native import testing

FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
BLOCK32_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
K_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
# the types of llama.cpp's smaller files (cpp/backend/cpu/quants-lowbit.cpp); gguf-py cannot quantize them
LOWBIT_TYPES = [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS]
RANDOM_BLOCK_TYPES = K_TYPES + LOWBIT_TYPES
ALL_TYPES = FLOAT_TYPES + BLOCK32_TYPES + K_TYPES + LOWBIT_TYPES
MIN_TYPES = (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K)  # a per-block min: w = d·q + m


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


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Activations as the engine quantizes them, per row and block of 32: d = max|x| / 127, q = round(x · (1/d)) in
    f32, ties to even; then the residual x - d·q (rounded once) as qr = round(resid · (256/d)), saturated to ±127.
    Returns (x̂ = d·q + (d/256)·qr in float64 [n_tok, n_in], the step s = d / 256 per block [n_tok, n_in / 32])."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    resid = (xb.astype(np.float64) - d[..., None].astype(np.float64) * q).astype(np.float32)  # exact, rounded once
    qr = np.clip(np.rint(resid * (inv * np.float32(256))[..., None]), -127, 127)
    step = d.astype(np.float64) / 256
    xq = (256 * q + qr) * step[..., None]
    return xq.reshape(x.shape), step


def quantize_q8_one_pass(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first pass of quantize_q8 alone (llama.cpp's Q8_0 rounding, activations="q8-fast"'s K-quant prefill):
    (x̂ = d·q in float64 [n_tok, n_in], d per block [n_tok, n_in / 32]); |x - x̂| <= d / 2."""
    xb = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None])
    return (q * d[..., None].astype(np.float64)).reshape(x.shape), d.astype(np.float64)


def min_part(raw: bytes, qtype: QT, n_out: int, n_in: int) -> np.ndarray:
    """The per-block min term of every weight (m for Q4_1/Q5_1, -dmin·m_j for Q4_K/Q5_K, 0 otherwise): the weights
    dequantized with their scale d set to zero."""
    if qtype not in MIN_TYPES:
        return np.zeros((n_out, n_in))
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]).copy()
    blocks[:, 0:2] = 0  # d (f16 +0); the min (Q4_1/Q5_1 m, K-quant dmin) follows it
    return gguf.quants.dequantize(blocks, qtype).astype(np.float64).reshape(n_out, n_in)


def activations(rng: np.random.Generator, n_tok: int, n_in: int) -> np.ndarray:
    """Normal activations with an outlier channel (as hidden states have: it makes its block's steps coarse) and one
    all-zero block (scale 0)."""
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 5] = np.where(np.arange(n_tok) % 2 == 0, 50.0, -50.0)
    x[0, -32:] = 0.0
    return x


def assert_one_pass_product(one: np.ndarray, qtype: QT, raw: bytes, w: np.ndarray, x: np.ndarray) -> None:
    """one = numpy's dequantize(w)·x̂ for x̂ = d·q (one pass) to f32 rounding, within |Δy| <= Σ_blocks (d/2)·Σ|w - m|
    of the exact product, and not q8's two passes (whose error is 256 times smaller)."""
    n_out, n_in = w.shape
    mins = min_part(raw, qtype, n_out, n_in)
    xq, d = quantize_q8_one_pass(x)
    ref = xq @ (w - mins).T + x.astype(np.float64) @ mins.T
    magnitude = np.abs(xq) @ np.abs(w - mins).T + np.abs(x) @ np.abs(mins).T
    assert max_scaled_err(one, ref, magnitude) < 1e-5
    exact, exact_magnitude = exact_product(x, w)
    bound = (d / 2) @ np.abs(w - mins).reshape(n_out, -1, 32).sum(axis=-1).T
    assert (np.abs(one - exact) <= bound * (1 + 1e-6) + 1e-5 * exact_magnitude).all()
    two = testing.matmul(int(qtype), raw, n_in, n_out, x, 1, "q8")
    assert np.abs(one - exact).mean() > 10 * np.abs(two - exact).mean()


def write_k_quant_cases(folder: Path, rng: np.random.Generator, n_out: int, n_tok: int) -> list[tuple[int, str, int]]:
    """Q4_K, Q5_K and Q6_K weights of n_out rows at 1,536 and 8,960 columns written to folder/{type}-{n_in}.bin and
    n_tok activation rows per width to folder/x-{n_in}.npy, for a child process (another instruction set) to
    multiply: returns the cases as (type, type name, n_in)."""
    cases = []
    for qtype in K_TYPES:
        for n_in in (1536, 8960):
            raw, _ = make_weight(qtype, n_out, n_in, rng)
            (folder / f"{qtype.name}-{n_in}.bin").write_bytes(raw)
            np.save(folder / f"x-{n_in}.npy", activations(np.random.default_rng(n_in), n_tok, n_in))
            cases.append((int(qtype), qtype.name, n_in))
    return cases
