"""CPU kernels: dequantization against gguf-py, matmul against numpy, the portable path against the AVX2 one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kvcmas_cpp import KvcmasError
from kvcmas_cpp._native import core

FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
BLOCK32_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
K_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
ALL_TYPES = FLOAT_TYPES + BLOCK32_TYPES + K_TYPES


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
    if qtype == QT.Q6_K:
        raw[:, -2:] = scales  # d is the last field
    else:
        raw[:, 0:2] = scales
        if qtype in (QT.Q4_1, QT.Q5_1, QT.Q4_K, QT.Q5_K):
            raw[:, 2:4] = mins  # m / dmin
    return raw


def make_weight(qtype: QT, n_out: int, n_in: int, rng: np.random.Generator) -> tuple[bytes, np.ndarray]:
    """Weight bytes of the given type and their f32 dequantization by gguf-py, shape (n_out, n_in)."""
    if qtype in K_TYPES:
        raw = random_blocks(qtype, n_out * n_in // block_size(qtype), rng).reshape(n_out, -1)
    else:
        values = rng.standard_normal((n_out, n_in)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(n_out, n_in)
    return raw.tobytes(), ref


# ---- dequantization ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK32_TYPES + K_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_match_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 64, rng)
    ours = core.dequantize(int(qtype), raw.tobytes(), 64 * block_size(qtype))
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))  # bit-exact, sign of zero included


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_quantized_data_matches_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    raw, ref = make_weight(qtype, 3, 512, rng)
    ours = core.dequantize(int(qtype), raw, 3 * 512)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_dequantize_every_half_bit_pattern(qtype: QT) -> None:
    bits = np.arange(65536, dtype=np.uint16)
    ours = core.dequantize(int(qtype), bits.tobytes(), 65536)
    if qtype == QT.F16:
        ref = bits.view(np.float16).astype(np.float32)
    else:
        ref = gguf.quants.dequantize(bits.view(np.uint8), qtype).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(ours, ref)  # NaN positions must agree too


def test_dequantize_zero_elements() -> None:
    assert core.dequantize(int(QT.Q4_K), b"", 0).shape == (0,)


# ---- matmul -----------------------------------------------------------------------------------------------------


def shapes_for(qtype: QT) -> list[tuple[int, int]]:
    """(n_in, n_out) pairs: several block multiples, odd row counts; odd widths for the float types."""
    if qtype in K_TYPES:
        return [(256, 7), (768, 97), (512, 1)]
    if qtype in BLOCK32_TYPES:
        return [(32, 7), (96, 97), (576, 1), (288, 20)]
    return [(5, 7), (37, 97), (576, 1), (301, 19)]


def emulate_act_q8(x: np.ndarray, block: int) -> np.ndarray:
    """Activations as the decode path quantizes them: per block d = amax/127, q = round-half-even(x / d)."""
    xb = x.reshape(x.shape[0], -1, block)
    d = (np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return (q * d).reshape(x.shape)


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("n_tok", [1, 2, 5, 11, 17, 64, 129])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_numpy(qtype: QT, n_tok: int) -> None:
    rng = np.random.default_rng(1000 * int(qtype) + n_tok)
    for n_in, n_out in shapes_for(qtype):
        raw, w = make_weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        exact = x.astype(np.float64) @ w.T.astype(np.float64)

        ref = core.matmul_reference(int(qtype), raw, n_in, n_out, x)
        assert ref.shape == (n_tok, n_out) and ref.dtype == np.float32
        assert rel_err(ref, exact) < 1e-6

        for n_threads in (1, 2):
            y = core.matmul(int(qtype), raw, n_in, n_out, x, n_threads)
            assert y.shape == (n_tok, n_out) and y.dtype == np.float32
            err = rel_err(y, exact)
            if qtype in FLOAT_TYPES:
                assert err < 1e-5, (n_in, n_out, n_threads, err)
            else:
                # Either the f32 path, or the 8-bit activation path (then exact against the emulated activations).
                act_block = 256 if qtype in K_TYPES else 32
                emulated = emulate_act_q8(x, act_block).astype(np.float64) @ w.T.astype(np.float64)
                # 8-bit activations: error relative to Σ|w||x| (a single dot product may cancel to near zero).
                magnitude = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
                assert rel_err(y, exact) * np.linalg.norm(exact) / np.linalg.norm(magnitude) < 1e-2, (n_in, n_out)
                assert min(err, rel_err(y, emulated)) < 1e-5, (n_in, n_out, n_threads, err)


def test_matmul_threads_agree_on_a_larger_product() -> None:
    rng = np.random.default_rng(7)
    raw, _ = make_weight(QT.Q4_1, 300, 576, rng)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    one = core.matmul(int(QT.Q4_1), raw, 576, 300, x, 1)
    for n_threads in (2, 3, 5):
        np.testing.assert_array_equal(core.matmul(int(QT.Q4_1), raw, 576, 300, x, n_threads), one)


def test_matmul_zero_tokens_and_rows() -> None:
    raw, _ = make_weight(QT.Q8_0, 4, 64, np.random.default_rng(3))
    assert core.matmul(int(QT.Q8_0), raw, 64, 4, np.zeros((0, 64), np.float32)).shape == (0, 4)
    assert core.matmul(int(QT.Q8_0), b"", 64, 0, np.ones((3, 64), np.float32)).shape == (3, 0)


# ---- thread pool ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_threads", [1, 2, 4])
def test_thread_pool_runs_every_index_once_per_job(n_threads: int) -> None:
    assert core.thread_pool_check(n_threads, 2000) == [2000] * n_threads


@pytest.mark.parametrize("fail_ith", [0, 1, 3])
def test_thread_pool_rethrows_errors_of_any_thread(fail_ith: int) -> None:
    with pytest.raises(KvcmasError, match=f"failed in thread {fail_ith}"):
        core.thread_pool_check(4, 50, fail_ith)


# ---- bad input --------------------------------------------------------------------------------------------------


def test_bad_sizes_raise() -> None:
    raw, _ = make_weight(QT.Q4_0, 4, 64, np.random.default_rng(5))
    x = np.ones((2, 64), np.float32)
    with pytest.raises(KvcmasError, match="bytes"):
        core.matmul(int(QT.Q4_0), raw[:-1], 64, 4, x)
    with pytest.raises(KvcmasError, match="bytes"):
        core.matmul(int(QT.Q4_0), raw, 64, 5, x)
    with pytest.raises(KvcmasError, match="columns"):
        core.matmul(int(QT.Q4_0), raw, 64, 4, np.ones((2, 32), np.float32))
    with pytest.raises(KvcmasError, match="block"):
        core.matmul(int(QT.Q4_0), raw, 48, 4, np.ones((2, 48), np.float32))
    with pytest.raises(KvcmasError, match="n_threads"):
        core.matmul(int(QT.Q4_0), raw, 64, 4, x, 0)
    with pytest.raises(KvcmasError, match="bytes"):
        core.matmul_reference(int(QT.Q4_0), raw + b"\0", 64, 4, x)
    with pytest.raises(KvcmasError, match="bytes"):
        core.dequantize(int(QT.Q4_K), bytes(143), 256)
    with pytest.raises(KvcmasError, match="block"):
        core.dequantize(int(QT.Q8_0), bytes(34), 31)
    for bad_type in (int(QT.Q2_K), int(QT.Q8_K), 99):
        with pytest.raises(KvcmasError, match="not a supported weight type"):
            core.dequantize(bad_type, bytes(84), 256)


# ---- portable path against the SIMD path ---------------------------------------------------------------------------

_SCALAR_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from kvcmas_cpp._native import core
    cases = json.loads(sys.stdin.read())
    out = {"features": core.cpu_features(), "results": []}
    for case in cases:
        raw = bytes.fromhex(case["raw"])
        x = np.array(case["x"], dtype=np.float32)
        y = core.matmul(case["type"], raw, case["n_in"], case["n_out"], x, 2)
        d = core.dequantize(case["type"], raw, case["n_in"] * case["n_out"])
        out["results"].append({"y": y.tolist(), "d": d.view(np.uint32).tolist()})
    print(json.dumps(out))
    """
)


def test_scalar_path_agrees_with_default_path() -> None:
    rng = np.random.default_rng(11)
    cases = []
    for qtype in ALL_TYPES:
        n_in = 512 if qtype in K_TYPES else (96 if qtype in BLOCK32_TYPES else 45)
        for n_tok in (1, 3, 13, 60):
            raw, _ = make_weight(qtype, 9, n_in, rng)
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            cases.append({"type": int(qtype), "raw": raw.hex(), "n_in": n_in, "n_out": 9, "x": x.tolist()})
    env = dict(os.environ, KVCMAS_FORCE_SCALAR="1")
    proc = subprocess.run(
        [sys.executable, "-c", _SCALAR_SCRIPT],
        input=json.dumps(cases),
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    scalar = json.loads(proc.stdout)
    assert scalar["features"]["avx2_fma_f16c"] is False
    for case, res in zip(cases, scalar["results"], strict=True):
        raw = bytes.fromhex(case["raw"])
        x = np.array(case["x"], dtype=np.float32)
        y = core.matmul(case["type"], raw, case["n_in"], case["n_out"], x, 2)
        d = core.dequantize(case["type"], raw, case["n_in"] * case["n_out"])
        np.testing.assert_array_equal(np.array(res["d"], dtype=np.uint32), d.view(np.uint32))
        y_scalar = np.array(res["y"], dtype=np.float32)
        assert rel_err(y_scalar, y) < 1e-5, (case["type"], x.shape)
