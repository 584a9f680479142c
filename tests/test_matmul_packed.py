"""The packed-panel GEMM of float weights (cpp/backend/cpu/matmul-packed-avx512.cpp: 14-token x 32-row micro tiles,
k blocks of 256, units of up to 512 tokens x 256 rows) against numpy's float64 product, on shapes that are not
multiples of any of its blocks; the same bits at every thread count and token count; and the AVX2 path
(KVCMAS_NO_AVX512=1) on the same products."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from helpers.native import require_testing, testing
from helpers.quants import exact_product, make_weight, max_scaled_err
from kvcmas_cpp._native import core

FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
# (n_tok, n_in, n_out): tails of the 14-token tile, the 16-row half panel, the 32-row panel, the 16-wide transpose,
# the 256 k block and the units; one tall product (several token units) and one wide (several row units).
ODD_SHAPES = [(12, 7, 5), (13, 17, 33), (29, 83, 47), (41, 300, 71), (15, 513, 129), (531, 259, 40), (45, 64, 600)]
TOL = 1e-5  # of Σ|w||x|: f32 products and sums


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_packed_gemm_matches_numpy_on_odd_shapes(qtype: QT) -> None:
    rng = np.random.default_rng(3000 + int(qtype))
    for n_tok, n_in, n_out in ODD_SHAPES:
        raw, w = make_weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        exact, magnitude = exact_product(x, w)
        one = testing.matmul(int(qtype), raw, n_in, n_out, x, 1)
        assert max_scaled_err(one, exact, magnitude) <= TOL, (n_tok, n_in, n_out)
        for n_threads in (2, 3):
            np.testing.assert_array_equal(testing.matmul(int(qtype), raw, n_in, n_out, x, n_threads), one)


def test_packed_gemm_rows_do_not_depend_on_token_count() -> None:
    rng = np.random.default_rng(31)
    raw, _ = make_weight(QT.F16, 70, 300, rng)
    x = rng.standard_normal((600, 300)).astype(np.float32)
    full = testing.matmul(int(QT.F16), raw, 300, 70, x, 2)
    for n_tok in (12, 14, 15, 43, 599):
        np.testing.assert_array_equal(testing.matmul(int(QT.F16), raw, 300, 70, x[-n_tok:], 2), full[-n_tok:])


_AVX2_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvcmas_cpp._native import core, testing_module
    testing = testing_module()
    cases = np.load(sys.argv[1])
    out = {"avx512": np.array(core.cpu_features()["avx512"])}
    for i in range(len(cases.files) // 3):
        qtype, n_in, n_out = (int(v) for v in cases[f"meta_{i}"])
        out[f"y_{i}"] = testing.matmul(qtype, cases[f"raw_{i}"].tobytes(), n_in, n_out, cases[f"x_{i}"], 2)
    np.savez(sys.argv[2], **out)
    """
)


def test_avx2_path_matches_numpy_on_the_same_shapes(tmp_path: Path) -> None:
    """The fallback the dispatch takes without AVX-512 stays within the same bound."""
    require_testing()
    if not core.cpu_features()["avx2_fma_f16c"]:
        pytest.skip("this CPU has no AVX2/FMA/F16C: the AVX2 path cannot run")
    rng = np.random.default_rng(32)
    cases: dict[str, np.ndarray] = {}
    refs = []
    for i, (qtype, (n_tok, n_in, n_out)) in enumerate((q, s) for q in FLOAT_TYPES for s in ODD_SHAPES[:5]):
        raw, w = make_weight(qtype, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        cases[f"raw_{i}"] = np.frombuffer(raw, np.uint8)
        cases[f"x_{i}"] = x
        cases[f"meta_{i}"] = np.array([qtype, n_in, n_out])
        refs.append(exact_product(x, w))
    np.savez(tmp_path / "cases.npz", **cases)
    env = dict(os.environ, KVCMAS_NO_AVX512="1")
    script = [sys.executable, "-c", _AVX2_SCRIPT, str(tmp_path / "cases.npz"), str(tmp_path / "out.npz")]
    subprocess.run(script, env=env, check=True)
    out = np.load(tmp_path / "out.npz")
    assert not bool(out["avx512"])
    for i, (exact, magnitude) in enumerate(refs):
        assert max_scaled_err(out[f"y_{i}"], exact, magnitude) <= TOL, i
