"""The attention kernel against a materializing numpy reference: per-run RoPE re-positioning equals re-rotating the
keys, and low-rank corrections applied inside the kernel equal attention over K + A_k·B_k and V + A_v·B_v."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from helpers.attention import CASES, make_runs, reference
from helpers.native import require_testing, testing
from kvcmas_cpp._native import core


@pytest.mark.parametrize("case", CASES)
def test_fused_correction_equals_materializing_reference(case) -> None:
    n_head, n_head_kv, hd, n_rot, neox, lengths, shifts, ranks = case
    rng = np.random.default_rng(hash(str(case)) % 2**32)
    runs = make_runs(rng, lengths, shifts, ranks, n_head_kv, hd)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    total = sum(lengths)
    for n_visible in (1, total // 2 + 1, total):
        got = testing.attend_test(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible)
        ref = reference(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (case, n_visible, err)


def test_runs_sharing_one_segments_factors() -> None:
    """Consecutive runs of one corrected segment share B: (Σ p·A_v)·B_v is summed over the segment."""
    rng = np.random.default_rng(5)
    runs = make_runs(rng, [32, 32, 11], [7, 7, 7], [8, 8, 8], 3, 64, shared_factors=True)
    q = rng.standard_normal((9, 64)).astype(np.float32)
    got = testing.attend_test(q, runs, 3, 64, False, 10000.0, 75)
    ref = reference(q, runs, 3, 64, False, 10000.0, 75)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5


def test_rank_zero_and_zero_factors_change_nothing() -> None:
    rng = np.random.default_rng(6)
    plain = make_runs(rng, [20, 12], [0, 4], [0, 0], 2, 64)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    base = testing.attend_test(q, plain, 2, 64, False, 10000.0, 32)
    zero = [dict(r) for r in plain]
    zero[1].update(
        a_k=np.zeros((12, 4), np.float32),
        a_v=np.zeros((12, 4), np.float32),
        b_k=rng.standard_normal((4, 128)).astype(np.float32),
        b_v=rng.standard_normal((4, 128)).astype(np.float32),
    )
    np.testing.assert_allclose(testing.attend_test(q, zero, 2, 64, False, 10000.0, 32), base, rtol=0, atol=1e-6)


def test_split_into_runs_does_not_change_the_result() -> None:
    """The same keys split at other places give bit-identical outputs (forks and shared spans rely on it)."""
    rng = np.random.default_rng(7)
    whole = make_runs(rng, [45], [0], [0], 3, 64)[0]
    q = rng.standard_normal((9, 64)).astype(np.float32)
    one = testing.attend_test(q, [whole], 3, 64, False, 10000.0, 45)
    parts = [
        {"k": whole["k"][a:b].copy(), "v": whole["v"][a:b].copy(), "shift": 0} for a, b in ((0, 13), (13, 32), (32, 45))
    ]
    np.testing.assert_array_equal(testing.attend_test(q, parts, 3, 64, False, 10000.0, 45), one)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_sliding_window_attends_only_the_last_rows(case, kv_type) -> None:
    """window > 0: only the last `window` visible rows count, wherever runs, shifts and corrections begin and end
    (windows starting inside a run, at a run boundary, inside a corrected segment, or covering everything)."""
    n_head, n_head_kv, hd, n_rot, neox, lengths, shifts, ranks = case
    rng = np.random.default_rng(hash(str(case)) % 2**32 + 1)
    runs = make_runs(rng, lengths, shifts, ranks, n_head_kv, hd, shared_factors=True)
    if kv_type == "f16":  # the kernel reads halves; the reference gets the same rounded values
        runs = [dict(r, k=r["k"].astype(np.float16), v=r["v"].astype(np.float16)) for r in runs]
        bits = [dict(r, k=r["k"].view(np.uint16), v=r["v"].view(np.uint16)) for r in runs]
    else:
        bits = runs
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    total = sum(lengths)
    for n_visible in (1, total // 2 + 1, total):
        for window in (1, 5, lengths[0], lengths[0] + 1, n_visible - 1, n_visible, total + 7):
            if window <= 0:
                continue
            got = testing.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, n_visible, kv_type, window)
            ref = reference(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible, window)
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= 1e-5, (case, kv_type, n_visible, window, err)
    full = testing.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, total, kv_type)
    np.testing.assert_array_equal(
        testing.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, total, kv_type, total), full
    )


def test_rows_before_the_window_are_never_read() -> None:
    """Rows before the window may hold anything (NaN keys, values and correction rows here): they are not read."""
    rng = np.random.default_rng(9)
    runs = make_runs(rng, [30, 20], [0, 6], [4, 4], 2, 64, shared_factors=True)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    for window, poisoned_rows in ((20, 30), (25, 25)):
        poisoned = [dict(r) for r in runs]  # B_k, B_v stay shared: the runs remain one corrected segment
        for key in ("k", "v", "a_k", "a_v"):
            poisoned[0][key] = runs[0][key].copy()
            poisoned[0][key][:poisoned_rows] = np.nan
        got = testing.attend_test(q, poisoned, 2, 64, False, 1e4, 50, "f32", window)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, testing.attend_test(q, runs, 2, 64, False, 1e4, 50, "f32", window))


def test_portable_path_agrees() -> None:
    """KVCMAS_FORCE_SCALAR=1 (no AVX2) computes the same attention, with a sliding window too."""
    require_testing()  # the child process loads it
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests');"
        "from helpers.attention import make_runs, reference;"
        "from kvcmas_cpp._native import core, testing_module; testing = testing_module();"
        "rng=np.random.default_rng(3); runs=make_runs(rng,[32,20],[0,9],[0,8],3,64);"
        "q=rng.standard_normal((9,64)).astype(np.float32);"
        "got=testing.attend_test(q,runs,3,64,False,10000.0,52); ref=reference(q,runs,3,64,False,10000.0,52);"
        "gw=testing.attend_test(q,runs,3,64,False,10000.0,52,'f32',27); rw=reference(q,runs,3,64,False,10000.0,52,27);"
        "assert not core.cpu_features()['avx2_fma_f16c'];"
        "print(max(np.abs(got-ref).max()/np.abs(ref).max(), np.abs(gw-rw).max()/np.abs(rw).max()))"
    )
    import os

    env = dict(os.environ, KVCMAS_FORCE_SCALAR="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout.strip()) <= 1e-5


def test_bad_shapes_raise() -> None:
    q = np.zeros((4, 64), np.float32)
    run = {"k": np.zeros((3, 128), np.float32), "v": np.zeros((3, 128), np.float32)}
    with pytest.raises(core.KvcmasError, match="n_visible"):
        testing.attend_test(q, [run], 2, 64, False, 10000.0, 4)
    with pytest.raises(core.KvcmasError, match=r"k and v must be"):
        testing.attend_test(q, [run], 4, 64, False, 10000.0, 1)
    bad = dict(
        run,
        a_k=np.zeros((3, 2), np.float32),
        a_v=np.zeros((3, 2), np.float32),
        b_k=np.zeros((3, 128), np.float32),
        b_v=np.zeros((2, 128), np.float32),
    )
    with pytest.raises(core.KvcmasError, match="factors"):
        testing.attend_test(q, [bad], 2, 64, False, 10000.0, 1)
