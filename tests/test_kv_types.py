"""KV cache stored as f16 (`kv_type="f16"`): rows are rounded to the nearest half on write and attention reads them
back exactly, so an f16 cache behaves like an f32 cache holding f16-rounded rows; forks, shared spans and low-rank
corrections work as they do over f32 rows."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.attention import CASES, make_runs, reference
from helpers.native import require_testing, testing
from kvcmas_cpp._native import core

F16_EPS = 2.0**-11  # unit roundoff of IEEE half


def _f16_bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint16)


def _rounded(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _as_f16_runs(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The runs with K/V as f16 bits, and the same runs with K/V as f32 holding the f16-rounded values."""
    halves, rounded = [], []
    for r in runs:
        halves.append(dict(r, k=_f16_bits(r["k"]), v=_f16_bits(r["v"])))
        rounded.append(dict(r, k=_rounded(r["k"]), v=_rounded(r["v"])))
    return halves, rounded


# ------------------------------------------------------------------------------------------------ the kernel


@pytest.mark.parametrize("case", CASES)
def test_f16_kernel_equals_f32_kernel_on_rounded_rows(case) -> None:
    """Reading halves is exact: the f16 kernel gives bit for bit what the f32 kernel gives on the rounded values,
    and both match the materializing float64 reference (shifts and corrections included)."""
    n_head, n_head_kv, hd, n_rot, neox, lengths, shifts, ranks = case
    rng = np.random.default_rng(sum(lengths) * 31 + hd)
    halves, rounded = _as_f16_runs(make_runs(rng, lengths, shifts, ranks, n_head_kv, hd))
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    total = sum(lengths)
    for n_visible in (1, total // 2 + 1, total):
        got = testing.attend_test(q, halves, n_head_kv, n_rot, neox, 10000.0, n_visible, "f16")
        same = testing.attend_test(q, rounded, n_head_kv, n_rot, neox, 10000.0, n_visible)
        np.testing.assert_array_equal(got, same)
        ref = reference(q, rounded, n_head_kv, n_rot, neox, 10000.0, n_visible)
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5


def test_f16_kernel_portable_path_agrees() -> None:
    """KVCMAS_FORCE_SCALAR=1 (no F16C) reads halves the same way."""
    require_testing()  # the child process loads it
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests');"
        "from helpers.attention import make_runs, reference;"
        "from kvcmas_cpp._native import core, testing_module; testing = testing_module();"
        "rng=np.random.default_rng(3); runs=make_runs(rng,[32,20],[0,9],[0,8],3,64);"
        "h=[dict(r,k=r['k'].astype(np.float16).view(np.uint16),v=r['v'].astype(np.float16).view(np.uint16))"
        " for r in runs];"
        "f=[dict(r,k=r['k'].astype(np.float16).astype(np.float32),v=r['v'].astype(np.float16).astype(np.float32))"
        " for r in runs];"
        "q=rng.standard_normal((9,64)).astype(np.float32);"
        "got=testing.attend_test(q,h,3,64,False,10000.0,52,'f16'); ref=reference(q,f,3,64,False,10000.0,52);"
        "assert not core.cpu_features()['avx2_fma_f16c'];"
        "print(np.abs(got-ref).max()/np.abs(ref).max())"
    )
    env = dict(os.environ, KVCMAS_FORCE_SCALAR="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout.strip()) <= 1e-5


def test_f16_kernel_rejects_f32_rows() -> None:
    q = np.zeros((4, 64), np.float32)
    run = {"k": np.zeros((3, 128), np.float32), "v": np.zeros((3, 128), np.float32)}
    with pytest.raises(core.KvcmasError, match="uint16"):
        testing.attend_test(q, [run], 2, 64, False, 10000.0, 3, "f16")
    with pytest.raises(core.KvcmasError, match="kv_type"):
        testing.attend_test(q, [run], 2, 64, False, 10000.0, 3, "bf16")


# ------------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def models(reference_models) -> dict[str, kc.Model]:
    # F32 weights: the only difference between the two models is how KV is stored.
    path = reference_models["F32"]
    return {kv: kc.Model(path, n_threads=2, n_ctx=512, kv_type=kv) for kv in ("f32", "f16")}


def _ids(model: kc.Model, seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, model.n_vocab, size=n)]


def test_layer0_rows_are_the_f32_rows_rounded_to_half(models) -> None:
    """Layer 0's K and V are computed from the same inputs, so the f16 cache holds exactly their f16 roundings."""
    ids = _ids(models["f32"], 1, 40)
    with models["f32"].new_sequence() as a, models["f16"].new_sequence() as b:
        a.append(ids, logits="none")
        b.append(ids, logits="none")
        ka, va = a.kv(0, len(ids))
        kb, vb = b.kv(0, len(ids))
    assert kb.dtype == np.float32 and kb.shape == ka.shape
    np.testing.assert_array_equal(kb[0], _rounded(ka[0]))
    np.testing.assert_array_equal(vb[0], _rounded(va[0]))
    assert not np.array_equal(kb[0], ka[0])  # the rows really are stored as halves
    # Later layers drift only by the propagated rounding.
    for x, y in ((ka, kb), (va, vb)):
        assert np.abs(y - x).max() <= 20 * F16_EPS * np.abs(x).max()


def test_f16_logits_match_f32_within_rounding(models) -> None:
    ids = _ids(models["f32"], 2, 96)
    exact = models["f32"].logits(ids)
    half = models["f16"].logits(ids)
    bound = 16 * F16_EPS * np.abs(exact).max()  # relative error of a few half roundings, on the logits' scale
    diff = np.abs(half - exact).max()
    assert 0 < diff <= bound, (diff, bound)
    top2 = np.sort(exact, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * bound  # positions whose winner cannot flip within the bound
    assert clear.sum() >= len(ids) // 2
    np.testing.assert_array_equal(half.argmax(1)[clear], exact.argmax(1)[clear])


def test_kv_bytes_halve(models) -> None:
    assert models["f16"].kv_budget * 2 == models["f32"].kv_budget
    used = {}
    for kv, model in models.items():
        base = model.kv_bytes_in_use
        with model.new_sequence() as s:
            s.append(_ids(model, 3, 70), logits="none")
            used[kv] = model.kv_bytes_in_use - base
        assert model.kv_bytes_in_use == base
    assert used["f32"] > 0 and used["f16"] * 2 == used["f32"]
    assert models["f16"].kv_type == "f16" and models["f32"].kv_type == "f32"


def _fresh(model: kc.Model, *chunks: list[int]) -> np.ndarray:
    """Logits of the last chunk of a fresh sequence fed chunk by chunk (the same batch shapes as the forked run)."""
    with model.new_sequence() as seq:
        for chunk in chunks:
            out = seq.append(chunk, logits="all")
    return out


def test_f16_fork_and_truncate_match_recompute(models) -> None:
    model = models["f16"]
    p, a_tail, b_tail = _ids(model, 4, 33), _ids(model, 5, 7), _ids(model, 6, 9)
    with model.new_sequence() as a:
        a.append(p, logits="none")
        used = model.kv_bytes_in_use
        with a.fork() as b:
            assert model.kv_bytes_in_use == used  # a fork copies nothing
            got_a = a.append(a_tail, logits="all")
            got_b = b.append(b_tail, logits="all")
            b.truncate(len(p) + 3)
            got_b2 = b.append(a_tail, logits="all")
    np.testing.assert_array_equal(got_a, _fresh(model, p, a_tail))
    np.testing.assert_array_equal(got_b, _fresh(model, p, b_tail))
    # b's rows past the truncation were computed in one batch with the dropped ones: recompute the same way.
    with model.new_sequence() as c:
        c.append(p, logits="none")
        c.append(b_tail, logits="none")
        c.truncate(len(p) + 3)
        np.testing.assert_array_equal(got_b2, c.append(a_tail, logits="all"))


def test_f16_batched_decode_equals_one_by_one(models) -> None:
    """Several sequences decoded in one batch give what each gives alone (to f32 rounding of the matmul paths)."""
    model = models["f16"]
    prompts = [_ids(model, 10 + i, 12 + 5 * i) for i in range(3)]
    nxt = [_ids(model, 20 + i, 1)[0] for i in range(3)]
    seqs = [model.new_sequence() for _ in prompts]
    try:
        for s, p in zip(seqs, prompts, strict=True):
            s.append(p, logits="none")
        batched = model.decode_batch([(s, [t]) for s, t in zip(seqs, nxt, strict=True)])
    finally:
        for s in seqs:
            s.close()
    for got, p, t in zip(batched, prompts, nxt, strict=True):
        with model.new_sequence() as alone:
            alone.append(p, logits="none")
            single = alone.append([t], logits="last")
        assert int(np.argmax(got)) == int(np.argmax(single))
        assert float(np.max(np.abs(got - single))) <= 1e-3 * float(np.std(single))


def test_f16_same_position_sharing_is_bit_identical(models) -> None:
    model = models["f16"]
    prefix, span, tail = _ids(model, 31, 20), _ids(model, 32, 37), _ids(model, 33, 6)
    with model.new_sequence() as first:
        first.append(prefix + span, logits="none")
        shared = first.share(len(prefix), len(span))
        exact = first.append(tail, logits="all")
        with model.new_sequence() as second:
            second.append(prefix, logits="none")
            used = model.kv_bytes_in_use
            second.append_shared(shared)
            assert model.kv_bytes_in_use == used  # stored once
            np.testing.assert_array_equal(second.append(tail, logits="all"), exact)


def test_f16_repositioned_span_reads_rerotated_halves(models) -> None:
    model = models["f16"]
    a_prefix, b_prefix, span = _ids(model, 34, 25), _ids(model, 35, 9), _ids(model, 36, 30)
    with model.new_sequence() as a, model.new_sequence() as b:
        a.append(a_prefix + span, logits="none")
        b.append(b_prefix, logits="none")
        b.append_shared(a.share(len(a_prefix), len(span)))
        ka, va = a.kv(len(a_prefix), len(span))
        kb, vb = b.kv(len(b_prefix), len(span))
        shift = len(b_prefix) - len(a_prefix)
        for il in range(model.n_layer):
            np.testing.assert_allclose(kb[il], model.rope_rotate(ka[il], shift), rtol=0, atol=1e-4)
        np.testing.assert_array_equal(vb, va)
        np.testing.assert_array_equal(_rounded(va), va)  # halves, handed out as f32


def _delta_correction(model, reader, exact_seq, pos, n, rank):
    """Full-rank f32 factors turning the reader's shared (f16) rows into the exact sequence's (f16) rows, in the
    span's frame."""
    k_base, v_base = reader.kv(pos, n)
    k_exact, v_exact = exact_seq.kv(pos, n)
    shift = [s for s in model.sequence_segments(reader.id) if s["pos"] == pos][0]["shift"]
    kd = k_base.shape[2]
    corr = core.KvCorrection(n, rank, kd, model.n_layer)
    for il in range(model.n_layer):
        factors = []
        for delta in (k_exact[il] - k_base[il], v_exact[il] - v_base[il]):
            u, s, vt = np.linalg.svd(delta.astype(np.float64), full_matrices=False)
            r = min(rank, len(s))
            a = np.zeros((n, rank), np.float32)
            b = np.zeros((rank, kd), np.float32)
            a[:, :r] = (u[:, :r] * s[:r]).astype(np.float32)
            b[:r] = vt[:r].astype(np.float32)
            factors.append((a, b))
        (ak, bk), (av, bv) = factors
        corr.set_layer(il, ak, model.rope_rotate(bk, -shift), av, bv)
    return corr


def test_f16_correction_applies_on_top_of_half_rows(models) -> None:
    """Corrections stay f32 factors added in the kernel to the stored halves: a full-rank correction of a shared
    f16 span reproduces the dense f16 sequence's KV and logits."""
    model = models["f16"]
    a_prefix, b_prefix, span, tail = _ids(model, 37, 18), _ids(model, 38, 11), _ids(model, 39, 24), _ids(model, 40, 3)
    with model.new_sequence() as a, model.new_sequence() as dense:
        a.append(a_prefix + span, logits="none")
        dense.append(b_prefix + span, logits="none")
        exact_logits = dense.append(tail, logits="all")
        shared = a.share(len(a_prefix), len(span))
        with model.new_sequence() as probe:
            probe.append(b_prefix, logits="none")
            probe.append_shared(shared)
            corr = _delta_correction(model, probe, dense, len(b_prefix), len(span), rank=len(span))
            rotate_only = probe.append(tail, logits="all")
        with model.new_sequence() as b:
            b.append(b_prefix, logits="none")
            b.append_shared(shared, corr)
            kb, vb = b.kv(len(b_prefix), len(span))
            ke, ve = dense.kv(len(b_prefix), len(span))
            assert np.abs(kb - ke).max() <= 1e-3 * np.abs(ke).max()
            assert np.abs(vb - ve).max() <= 1e-3 * np.abs(ve).max()
            assert not np.array_equal(_rounded(kb), kb)  # corrected rows are no longer halves: factors are f32
            got = b.append(tail, logits="all")
    err_corrected = np.abs(got - exact_logits).max()
    err_rotate_only = np.abs(rotate_only - exact_logits).max()
    assert err_corrected <= 2e-3, err_corrected
    assert err_rotate_only > 20 * err_corrected


def test_bad_kv_type_is_a_clear_error(reference_models) -> None:
    path = str(reference_models["F32"])
    with pytest.raises(ValueError, match="kv_type"):
        kc.Model(path, kv_type="bf16")  # type: ignore[arg-type]
    with pytest.raises(core.KvcmasError, match="kv_type"):
        core.Model(path, 1, 64, 0, "q8_0")
