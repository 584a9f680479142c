"""CPU kernels: dequantization against gguf-py, matmul (every type, path, token and thread count, portable and AVX2)
against numpy's float64 product of the dequantized weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from helpers.native import require_testing, testing
from helpers.quants import (
    ALL_TYPES,
    BLOCK32_TYPES,
    RANDOM_BLOCK_TYPES,
    block_size,
    exact_product,
    make_weight,
    max_scaled_err,
    random_blocks,
)
from kvcmas_cpp import KvcmasError
from kvcmas_cpp._native import core

# ---- dequantization ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK32_TYPES + RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_random_blocks_match_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 64, rng)
    ours = testing.dequantize(int(qtype), raw.tobytes(), 64 * block_size(qtype))
    ref = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))  # bit-exact, sign of zero included


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_quantized_data_matches_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    raw, ref = make_weight(qtype, 3, 512, rng)
    ours = testing.dequantize(int(qtype), raw, 3 * 512)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_dequantize_every_half_bit_pattern(qtype: QT) -> None:
    bits = np.arange(65536, dtype=np.uint16)
    ours = testing.dequantize(int(qtype), bits.tobytes(), 65536)
    if qtype == QT.F16:
        ref = bits.view(np.float16).astype(np.float32)
    else:
        ref = gguf.quants.dequantize(bits.view(np.uint8), qtype).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(ours, ref)  # NaN positions must agree too


def test_dequantize_zero_elements() -> None:
    assert testing.dequantize(int(QT.Q4_K), b"", 0).shape == (0,)


# ---- matmul -----------------------------------------------------------------------------------------------------


def shapes_for(qtype: QT) -> list[tuple[int, int]]:
    """(n_in, n_out) pairs: several block multiples, odd row counts; odd widths for the float types."""
    if block_size(qtype) == 256:
        return [(256, 7), (768, 97), (512, 1)]
    if block_size(qtype) == 32:
        return [(32, 7), (96, 97), (576, 1), (288, 20)]
    return [(5, 7), (37, 97), (576, 1), (301, 19)]


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


# Every path computes dequantize(w) · x with f32 products and sums: error bound per output element relative to
# Σ|w||x| (a single dot product may cancel to near zero). f32 rounding over these widths stays below ~1e-6; an
# 8-bit activation path would be off by ~1e-2.
MATMUL_TOL = 1e-5

N_TOKS = [1, 2, 3, 4, 5, 7, 11, 12, 16, 17, 64, 129]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_numpy(qtype: QT) -> None:
    rng = np.random.default_rng(1000 * int(qtype))
    for n_in, n_out in shapes_for(qtype):
        raw, w = make_weight(qtype, n_out, n_in, rng)
        x_all = rng.standard_normal((max(N_TOKS), n_in)).astype(np.float32)
        exact_all, magnitude_all = exact_product(x_all, w)
        for n_tok in N_TOKS:
            x, exact, magnitude = x_all[:n_tok], exact_all[:n_tok], magnitude_all[:n_tok]
            ref = testing.matmul_reference(int(qtype), raw, n_in, n_out, x)
            assert ref.shape == (n_tok, n_out) and ref.dtype == np.float32
            assert max_scaled_err(ref, exact, magnitude) < 1e-6
            for n_threads in (1, 2):
                y = testing.matmul(int(qtype), raw, n_in, n_out, x, n_threads)
                assert y.shape == (n_tok, n_out) and y.dtype == np.float32
                err = max_scaled_err(y, exact, magnitude)
                assert err < MATMUL_TOL, (n_in, n_out, n_tok, n_threads, err)


# Row 0 of x alone (decode path) and inside calls of every size (decode with 1-4 tokens per pass, prefill).
ROW_CONSISTENCY_N_TOKS = [1, 2, 5, 17, 64, 129]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_row_result_does_not_depend_on_token_count(qtype: QT) -> None:
    rng = np.random.default_rng(2000 + int(qtype))
    n_in = 768 if block_size(qtype) == 256 else 576
    raw, w = make_weight(qtype, 50, n_in, rng)
    x = rng.standard_normal((max(ROW_CONSISTENCY_N_TOKS), n_in)).astype(np.float32)
    _, magnitude = exact_product(x[:1], w)
    alone = testing.matmul(int(qtype), raw, n_in, 50, x[:1], 1)[0]
    for n_tok in ROW_CONSISTENCY_N_TOKS[1:]:
        for n_threads in (1, 2):
            row0 = testing.matmul(int(qtype), raw, n_in, 50, x[:n_tok], n_threads)[0]
            delta = np.abs(row0.astype(np.float64) - alone) / magnitude[0]
            assert delta.max() <= MATMUL_TOL, (n_tok, n_threads, delta.max())


def test_matmul_threads_agree_on_a_larger_product() -> None:
    rng = np.random.default_rng(7)
    raw, _ = make_weight(QT.Q4_1, 300, 576, rng)
    x = rng.standard_normal((40, 576)).astype(np.float32)
    one = testing.matmul(int(QT.Q4_1), raw, 576, 300, x, 1)
    for n_threads in (2, 3, 5):
        np.testing.assert_array_equal(testing.matmul(int(QT.Q4_1), raw, 576, 300, x, n_threads), one)


@pytest.mark.parametrize("activations", ["f32", "q8"])
def test_decode_rows_split_over_threads_give_the_one_thread_result(activations: str) -> None:
    # Decode-sized products hand rows to the threads in shrinking portions (multiples of 16, the last one short):
    # every split must give exactly the one-thread rows.
    rng = np.random.default_rng(11)
    raw, _ = make_weight(QT.Q5_0, 1000, 256, rng)
    for n_tok in (1, 3):
        x = rng.standard_normal((n_tok, 256)).astype(np.float32)
        one = testing.matmul(int(QT.Q5_0), raw, 256, 1000, x, 1, activations)
        for n_threads in (2, 3, 5):
            np.testing.assert_array_equal(testing.matmul(int(QT.Q5_0), raw, 256, 1000, x, n_threads, activations), one)


def test_matmul_zero_tokens_and_rows() -> None:
    raw, _ = make_weight(QT.Q8_0, 4, 64, np.random.default_rng(3))
    assert testing.matmul(int(QT.Q8_0), raw, 64, 4, np.zeros((0, 64), np.float32)).shape == (0, 4)
    assert testing.matmul(int(QT.Q8_0), b"", 64, 0, np.ones((3, 64), np.float32)).shape == (3, 0)


# ---- thread pool ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_threads", [1, 2, 4])
def test_thread_pool_runs_every_index_once_per_job(n_threads: int) -> None:
    assert testing.thread_pool_check(n_threads, 2000) == [2000] * n_threads


@pytest.mark.parametrize("fail_ith", [0, 1, 3])
def test_thread_pool_rethrows_errors_of_any_thread(fail_ith: int) -> None:
    with pytest.raises(KvcmasError, match=f"failed in thread {fail_ith}"):
        testing.thread_pool_check(4, 50, fail_ith)


# ---- bad input --------------------------------------------------------------------------------------------------


def test_bad_sizes_raise() -> None:
    raw, _ = make_weight(QT.Q4_0, 4, 64, np.random.default_rng(5))
    x = np.ones((2, 64), np.float32)
    with pytest.raises(KvcmasError, match="bytes"):
        testing.matmul(int(QT.Q4_0), raw[:-1], 64, 4, x)
    with pytest.raises(KvcmasError, match="bytes"):
        testing.matmul(int(QT.Q4_0), raw, 64, 5, x)
    with pytest.raises(KvcmasError, match="columns"):
        testing.matmul(int(QT.Q4_0), raw, 64, 4, np.ones((2, 32), np.float32))
    with pytest.raises(KvcmasError, match="block"):
        testing.matmul(int(QT.Q4_0), raw, 48, 4, np.ones((2, 48), np.float32))
    with pytest.raises(KvcmasError, match="n_threads"):
        testing.matmul(int(QT.Q4_0), raw, 64, 4, x, 0)
    with pytest.raises(KvcmasError, match="bytes"):
        testing.matmul_reference(int(QT.Q4_0), raw + b"\0", 64, 4, x)
    with pytest.raises(KvcmasError, match="bytes"):
        testing.dequantize(int(QT.Q4_K), bytes(143), 256)
    with pytest.raises(KvcmasError, match="block"):
        testing.dequantize(int(QT.Q8_0), bytes(34), 31)
    for bad_type in (int(QT.IQ2_XXS), int(QT.Q8_K), 99):
        with pytest.raises(KvcmasError, match="not a supported weight type"):
            testing.dequantize(bad_type, bytes(84), 256)


# ---- portable path against the SIMD path ---------------------------------------------------------------------------

# The child process gets the cases as an .npz (raw_<i>, x_<i>, meta_<i> = [type, n_in, n_out]) and writes back
# y_<i>_<n_tok>_<threads> for every token count in SCALAR_N_TOKS plus the dequantized weights d_<i>.
_SCALAR_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvcmas_cpp._native import core, testing_module
    testing = testing_module()
    cases = np.load(sys.argv[1])
    n_toks = [int(v) for v in sys.argv[3].split(",")]
    features = core.cpu_features()
    out = {"avx2": np.array(features["avx2_fma_f16c"]), "avx512": np.array(features["avx512"])}
    for i in range(len(cases.files) // 3):
        qtype, n_in, n_out = (int(v) for v in cases[f"meta_{i}"])
        raw, x = cases[f"raw_{i}"].tobytes(), cases[f"x_{i}"]
        out[f"d_{i}"] = testing.dequantize(qtype, raw, n_in * n_out)
        for n_tok in n_toks:
            for n_threads in (1, 2):
                out[f"y_{i}_{n_tok}_{n_threads}"] = testing.matmul(qtype, raw, n_in, n_out, x[:n_tok], n_threads)
    np.savez(sys.argv[2], **out)
    """
)

SCALAR_N_TOKS = [1, 2, 3, 4, 5, 13, 17, 60, 129]


def test_scalar_path_matches_numpy_and_default_path(tmp_path: Path) -> None:
    """KVCMAS_FORCE_SCALAR=1 (portable kernels): same accuracy bound, same row results at every token count."""
    require_testing()  # the child process loads it
    rng = np.random.default_rng(11)
    cases: dict[str, np.ndarray] = {}
    weights = []
    for i, qtype in enumerate(ALL_TYPES):
        n_in = {256: 512, 32: 96}.get(block_size(qtype), 45)
        raw, w = make_weight(qtype, 9, n_in, rng)
        x = rng.standard_normal((max(SCALAR_N_TOKS), n_in)).astype(np.float32)
        cases[f"raw_{i}"] = np.frombuffer(raw, dtype=np.uint8)
        cases[f"x_{i}"] = x
        cases[f"meta_{i}"] = np.array([int(qtype), n_in, 9])
        weights.append((qtype, raw, w, x))
    np.savez(tmp_path / "cases.npz", **cases)
    env = dict(os.environ, KVCMAS_FORCE_SCALAR="1")
    subprocess.run(
        [
            sys.executable,
            "-c",
            _SCALAR_SCRIPT,
            str(tmp_path / "cases.npz"),
            str(tmp_path / "out.npz"),
            ",".join(map(str, SCALAR_N_TOKS)),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    scalar = np.load(tmp_path / "out.npz")
    assert not bool(scalar["avx2"])
    for i, (qtype, raw, w, x) in enumerate(weights):
        n_in = x.shape[1]
        np.testing.assert_array_equal(scalar[f"d_{i}"].view(np.uint32), w.reshape(-1).view(np.uint32))
        exact, magnitude = exact_product(x, w)
        alone = scalar[f"y_{i}_1_1"][0]
        for n_tok in SCALAR_N_TOKS:
            default = testing.matmul(int(qtype), raw, n_in, 9, x[:n_tok], 2)
            for n_threads in (1, 2):
                y = scalar[f"y_{i}_{n_tok}_{n_threads}"]
                assert y.shape == (n_tok, 9)
                err = max_scaled_err(y, exact[:n_tok], magnitude[:n_tok])
                assert err < MATMUL_TOL, (qtype.name, n_tok, n_threads, err)
                assert max_scaled_err(y, default.astype(np.float64), magnitude[:n_tok]) < 2 * MATMUL_TOL
                assert np.max(np.abs(y[0] - alone.astype(np.float64)) / magnitude[0]) <= MATMUL_TOL


# ---- AVX-512 prefill GEMM against the AVX2 one ---------------------------------------------------------------------

# Prefill token counts around the AVX-512 kernel's 12-token micro tiles and 96-token blocks.
AVX512_N_TOKS = [13, 24, 25, 97, 130]


def test_avx512_gemm_matches_numpy_and_avx2_path(tmp_path: Path) -> None:
    """The prefill GEMM with AVX-512 (default here) and with KVCMAS_NO_AVX512=1 (the AVX2 kernel) over row counts
    around its 32-row micro tiles (1, 17, 47, 100) and widths with tails past its 128-wide k blocks: both within the
    f32 bound of numpy's float64 product, and of each other."""
    require_testing()  # the child process loads it
    if not core.cpu_features().get("avx512"):
        pytest.skip("this CPU (or KVCMAS_NO_AVX512) has no AVX-512")
    rng = np.random.default_rng(18)
    shapes = [(QT.F32, 5, 17), (QT.F32, 301, 47), (QT.F32, 130, 1), (QT.F32, 259, 100), (QT.F16, 37, 33)]
    shapes += [(QT.Q4_0, 96, 100), (QT.Q4_K, 512, 47), (QT.Q6_K, 256, 17)]
    cases: dict[str, np.ndarray] = {}
    weights = []
    for i, (qtype, n_in, n_out) in enumerate(shapes):
        raw, w = make_weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((max(AVX512_N_TOKS), n_in)).astype(np.float32)
        cases[f"raw_{i}"] = np.frombuffer(raw, dtype=np.uint8)
        cases[f"x_{i}"] = x
        cases[f"meta_{i}"] = np.array([int(qtype), n_in, n_out])
        weights.append((qtype, w, x))
    np.savez(tmp_path / "cases.npz", **cases)
    outs = {}
    for flag in ("0", "1"):
        subprocess.run(
            [
                sys.executable,
                "-c",
                _SCALAR_SCRIPT,
                str(tmp_path / "cases.npz"),
                str(tmp_path / f"out{flag}.npz"),
                ",".join(map(str, AVX512_N_TOKS)),
            ],
            env=dict(os.environ, KVCMAS_NO_AVX512=flag),
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        outs[flag] = np.load(tmp_path / f"out{flag}.npz")
    avx512, avx2 = outs["0"], outs["1"]
    assert bool(avx512["avx512"]) and not bool(avx2["avx512"]) and bool(avx2["avx2"])
    for i, (qtype, w, x) in enumerate(weights):
        exact, magnitude = exact_product(x, w)
        for n_tok in AVX512_N_TOKS:
            for n_threads in (1, 2):
                key = f"y_{i}_{n_tok}_{n_threads}"
                case = (qtype.name, w.shape, n_tok, n_threads)
                assert avx512[key].shape == (n_tok, w.shape[0]), case
                assert max_scaled_err(avx512[key], exact[:n_tok], magnitude[:n_tok]) < MATMUL_TOL, case
                assert max_scaled_err(avx2[key], exact[:n_tok], magnitude[:n_tok]) < MATMUL_TOL, case
                diff = max_scaled_err(avx512[key], avx2[key].astype(np.float64), magnitude[:n_tok])
                assert diff < 2 * MATMUL_TOL, case
