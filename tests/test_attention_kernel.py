"""The attention kernel against a materializing numpy reference: per-run RoPE re-positioning equals re-rotating the
keys, and low-rank corrections applied inside the kernel equal attention over K + A_k·B_k and V + A_v·B_v."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvcmas_cpp._native import core


def rotate(x: np.ndarray, pos: float, head_dim: int, n_rot: int, neox: bool, base: float) -> np.ndarray:
    """RoPE of every head of rows x [n, n_heads * head_dim] by position pos, in float64."""
    n, width = x.shape
    h = x.astype(np.float64).reshape(n, width // head_dim, head_dim).copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    c, s = np.cos(pos * inv), np.sin(pos * inv)
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    a, b = h[..., i0].copy(), h[..., i1].copy()
    h[..., i0] = a * c - b * s
    h[..., i1] = a * s + b * c
    return h.reshape(n, width)


def reference(q, runs, n_head_kv, n_rot, neox, base, n_visible, window=0):
    """Materializes every run's keys at their sequence positions (rotated by +shift, corrected) and attends to the
    first n_visible rows (only the last `window` of them when window > 0)."""
    n_head, hd = q.shape
    keys, values = [], []
    for r in runs:
        k = r["k"].astype(np.float64)
        v = r["v"].astype(np.float64)
        if "a_k" in r:
            k = k + r["a_k"].astype(np.float64) @ r["b_k"].astype(np.float64)
            v = v + r["a_v"].astype(np.float64) @ r["b_v"].astype(np.float64)
        keys.append(rotate(k, r.get("shift", 0), hd, n_rot, neox, base))
        values.append(v)
    first = max(0, n_visible - window) if window > 0 else 0
    K = np.concatenate(keys)[first:n_visible]
    V = np.concatenate(values)[first:n_visible]
    group = n_head // n_head_kv
    out = np.zeros((n_head, hd))
    for h in range(n_head):
        g = h // group
        s = K[:, g * hd : (g + 1) * hd] @ q[h].astype(np.float64) / np.sqrt(hd)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = p @ V[:, g * hd : (g + 1) * hd]
    return out


def make_runs(rng, lengths, shifts, ranks, n_head_kv, hd, shared_factors=False):
    kd = n_head_kv * hd
    runs = []
    shared = {}
    for n, shift, rank in zip(lengths, shifts, ranks, strict=True):
        r = {
            "k": rng.standard_normal((n, kd)).astype(np.float32),
            "v": rng.standard_normal((n, kd)).astype(np.float32),
            "shift": int(shift),
        }
        if rank > 0:
            if not (shared_factors and rank in shared):
                shared[rank] = (
                    (rng.standard_normal((rank, kd)) * 0.3).astype(np.float32),
                    (rng.standard_normal((rank, kd)) * 0.3).astype(np.float32),
                )
            r["a_k"] = rng.standard_normal((n, rank)).astype(np.float32)
            r["a_v"] = rng.standard_normal((n, rank)).astype(np.float32)
            r["b_k"], r["b_v"] = shared[rank]
        runs.append(r)
    return runs


CASES = [
    # (n_head, n_head_kv, head_dim, n_rot, neox, lengths, shifts, ranks)
    (4, 4, 64, 64, False, [32, 17], [0, 0], [0, 0]),  # MHA, no correction
    (9, 3, 64, 64, False, [32, 32, 5], [0, 40, 40], [0, 8, 8]),  # SmolLM2 GQA, a corrected shifted segment
    (8, 2, 64, 64, True, [7, 30, 3], [0, -12, 100], [0, 32, 1]),  # neox, negative shift, ranks 32 and 1
    (8, 1, 128, 128, False, [40, 9], [3, 0], [16, 0]),  # MQA, head 128
    (6, 2, 32, 16, True, [13, 13, 13], [5, 6, 7], [2, 2, 2]),  # partial rotary, three segments
    (4, 2, 24, 24, False, [10, 11], [0, 9], [0, 3]),  # head size not a multiple of 8: portable path
]


@pytest.mark.parametrize("case", CASES)
def test_fused_correction_equals_materializing_reference(case) -> None:
    n_head, n_head_kv, hd, n_rot, neox, lengths, shifts, ranks = case
    rng = np.random.default_rng(hash(str(case)) % 2**32)
    runs = make_runs(rng, lengths, shifts, ranks, n_head_kv, hd)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    total = sum(lengths)
    for n_visible in (1, total // 2 + 1, total):
        got = core.attend_test(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible)
        ref = reference(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (case, n_visible, err)


def test_runs_sharing_one_segments_factors() -> None:
    """Consecutive runs of one corrected segment share B: (Σ p·A_v)·B_v is summed over the segment."""
    rng = np.random.default_rng(5)
    runs = make_runs(rng, [32, 32, 11], [7, 7, 7], [8, 8, 8], 3, 64, shared_factors=True)
    q = rng.standard_normal((9, 64)).astype(np.float32)
    got = core.attend_test(q, runs, 3, 64, False, 10000.0, 75)
    ref = reference(q, runs, 3, 64, False, 10000.0, 75)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5


def test_rank_zero_and_zero_factors_change_nothing() -> None:
    rng = np.random.default_rng(6)
    plain = make_runs(rng, [20, 12], [0, 4], [0, 0], 2, 64)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    base = core.attend_test(q, plain, 2, 64, False, 10000.0, 32)
    zero = [dict(r) for r in plain]
    zero[1].update(
        a_k=np.zeros((12, 4), np.float32),
        a_v=np.zeros((12, 4), np.float32),
        b_k=rng.standard_normal((4, 128)).astype(np.float32),
        b_v=rng.standard_normal((4, 128)).astype(np.float32),
    )
    np.testing.assert_allclose(core.attend_test(q, zero, 2, 64, False, 10000.0, 32), base, rtol=0, atol=1e-6)


def test_split_into_runs_does_not_change_the_result() -> None:
    """The same keys split at other places give bit-identical outputs (forks and shared spans rely on it)."""
    rng = np.random.default_rng(7)
    whole = make_runs(rng, [45], [0], [0], 3, 64)[0]
    q = rng.standard_normal((9, 64)).astype(np.float32)
    one = core.attend_test(q, [whole], 3, 64, False, 10000.0, 45)
    parts = [
        {"k": whole["k"][a:b].copy(), "v": whole["v"][a:b].copy(), "shift": 0} for a, b in ((0, 13), (13, 32), (32, 45))
    ]
    np.testing.assert_array_equal(core.attend_test(q, parts, 3, 64, False, 10000.0, 45), one)


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
            got = core.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, n_visible, kv_type, window)
            ref = reference(q, runs, n_head_kv, n_rot, neox, 10000.0, n_visible, window)
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= 1e-5, (case, kv_type, n_visible, window, err)
    full = core.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, total, kv_type)
    np.testing.assert_array_equal(
        core.attend_test(q, bits, n_head_kv, n_rot, neox, 10000.0, total, kv_type, total), full
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
        got = core.attend_test(q, poisoned, 2, 64, False, 1e4, 50, "f32", window)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, core.attend_test(q, runs, 2, 64, False, 1e4, 50, "f32", window))


def test_portable_path_agrees() -> None:
    """KVCMAS_FORCE_SCALAR=1 (no AVX2) computes the same attention, with a sliding window too."""
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests');"
        "from test_attention_kernel import make_runs, reference; from kvcmas_cpp._native import core;"
        "rng=np.random.default_rng(3); runs=make_runs(rng,[32,20],[0,9],[0,8],3,64);"
        "q=rng.standard_normal((9,64)).astype(np.float32);"
        "got=core.attend_test(q,runs,3,64,False,10000.0,52); ref=reference(q,runs,3,64,False,10000.0,52);"
        "gw=core.attend_test(q,runs,3,64,False,10000.0,52,'f32',27); rw=reference(q,runs,3,64,False,10000.0,52,27);"
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
        core.attend_test(q, [run], 2, 64, False, 10000.0, 4)
    with pytest.raises(core.KvcmasError, match=r"k and v must be"):
        core.attend_test(q, [run], 4, 64, False, 10000.0, 1)
    bad = dict(
        run,
        a_k=np.zeros((3, 2), np.float32),
        a_v=np.zeros((3, 2), np.float32),
        b_k=np.zeros((3, 128), np.float32),
        b_v=np.zeros((2, 128), np.float32),
    )
    with pytest.raises(core.KvcmasError, match="factors"):
        core.attend_test(q, [bad], 2, 64, False, 10000.0, 1)
