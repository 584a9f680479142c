"""Spans of KV stored once and read by several sequences at their own positions, with per-sequence low-rank
corrections applied inside attention (the engine side of KVCMAS)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp._native import core


@pytest.fixture(scope="module")
def model(reference_models) -> kc.Model:
    # F32 weights: exactness checks are not blurred by quantization.
    return kc.Model(reference_models["F32"], n_threads=2, n_ctx=512)


def _ids(model: kc.Model, seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, model.n_vocab, size=n)]


def test_same_position_sharing_is_bit_identical(model: kc.Model) -> None:
    """An agent that reads a span at the position it was computed at gets exactly what computing it gives."""
    prefix, span, tail = _ids(model, 1, 20), _ids(model, 2, 37), _ids(model, 3, 6)
    with model.new_sequence() as first:
        first.append(prefix, logits="none")
        first.append(span, logits="none")
        shared = first.share(len(prefix), len(span))
        exact = first.append(tail, logits="all")
        with model.new_sequence() as second:
            second.append(prefix, logits="none")
            used = model.kv_bytes_in_use
            second.append_shared(shared)
            assert model.kv_bytes_in_use == used  # stored once
            np.testing.assert_array_equal(second.append(tail, logits="all"), exact)


def test_a_slice_of_a_span_reads_the_same_stored_rows(model: kc.Model) -> None:
    """SharedKV.slice(first, n) is rows [first, first + n) of the span, by reference: appended at another position
    they read as the span's rows re-positioned (equal to sharing those rows of the source directly), no rows are
    allocated for them, and a slice of a slice composes."""
    prefix, span, other = _ids(model, 4, 11), _ids(model, 5, 40), _ids(model, 6, 7)
    with model.new_sequence() as src:
        src.append(prefix + span, logits="none")
        whole = src.share(len(prefix), len(span))
        direct = src.share(len(prefix) + 9, 20)
        part = whole.slice(5, 30).slice(4, 20)  # rows [9, 29) of the span
        assert len(part) == 20 and part.tokens == tuple(span[9:29])
        assert part.handle.frame0 == direct.handle.frame0 == len(prefix) + 9
        with model.new_sequence() as a, model.new_sequence() as b:
            a.append(other, logits="none")
            b.append(other, logits="none")
            used = model.kv_bytes_in_use
            a.append_shared(part)
            b.append_shared(direct)
            assert model.kv_bytes_in_use == used  # by reference
            ka, va = a.kv(len(other), 20)
            kb, vb = b.kv(len(other), 20)
            np.testing.assert_array_equal(ka, kb)
            np.testing.assert_array_equal(va, vb)
        assert whole.slice(0, len(span)) is whole
        for first, n in ((-1, 5), (0, 0), (35, 6), (40, 1)):
            with pytest.raises(ValueError, match="outside the span"):
                whole.slice(first, n)
        with pytest.raises(ValueError, match="outside the span"):
            whole.handle.slice(35, 6)  # the core's own check


def test_repositioned_span_keys_equal_rerotated_keys(model: kc.Model) -> None:
    """RoPE re-positioning inside attention equals rotating the stored keys to the new positions."""
    a_prefix, b_prefix, span = _ids(model, 4, 25), _ids(model, 5, 9), _ids(model, 6, 30)
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
        seg = model.sequence_segments(b.id)
        assert [s["shift"] for s in seg] == [0, shift] and seg[1]["shared"]


def _exact_delta_correction(model, reader, exact_seq, pos, n, rank):
    """Correction that turns the reader's shared rows into the exact rows, truncated to `rank` (per layer SVD),
    expressed in the span's frame (rotated back by the segment's shift). Layer 0 stays uncorrected when asked."""
    k_base, v_base = reader.kv(pos, n)
    k_exact, v_exact = exact_seq.kv(pos, n)
    shift = [s for s in model.sequence_segments(reader.id) if s["pos"] == pos][0]["shift"]
    kd = k_base.shape[2]
    corr = core.KvCorrection(n, rank, kd, model.n_layer)
    for il in range(model.n_layer):
        factors = []
        for delta in (k_exact[il] - k_base[il], v_exact[il] - v_base[il]):
            u, s, vt = np.linalg.svd(delta.astype(np.float64), full_matrices=False)
            a = np.zeros((n, rank), np.float32)
            b = np.zeros((rank, kd), np.float32)
            r = min(rank, len(s))
            a[:, :r] = (u[:, :r] * s[:r]).astype(np.float32)
            b[:r] = vt[:r].astype(np.float32)
            factors.append((a, b))
        (ak, bk), (av, bv) = factors
        bk = model.rope_rotate(bk, -shift)  # keys' delta into the span's frame
        corr.set_layer(il, ak, bk, av, bv)
    return corr


def test_full_rank_correction_reproduces_exact_kv_and_logits(model: kc.Model) -> None:
    """With full rank the corrected KV equals the exact KV, and the next logits equal dense prefill's."""
    a_prefix, b_prefix, span, tail = _ids(model, 7, 18), _ids(model, 8, 11), _ids(model, 9, 24), _ids(model, 10, 3)
    with model.new_sequence() as a, model.new_sequence() as dense:
        a.append(a_prefix + span, logits="none")
        dense.append(b_prefix + span, logits="none")
        exact_logits = dense.append(tail, logits="all")
        shared = a.share(len(a_prefix), len(span))
        with model.new_sequence() as probe:  # uncorrected reader, to measure the delta
            probe.append(b_prefix, logits="none")
            probe.append_shared(shared)
            corr = _exact_delta_correction(model, probe, dense, len(b_prefix), len(span), rank=len(span))
            rotate_only = probe.append(tail, logits="all")
        with model.new_sequence() as b:
            b.append(b_prefix, logits="none")
            b.append_shared(shared, corr)
            kb, vb = b.kv(len(b_prefix), len(span))
            ke, ve = dense.kv(len(b_prefix), len(span))
            assert np.abs(kb - ke).max() <= 1e-3 * np.abs(ke).max()
            assert np.abs(vb - ve).max() <= 1e-3 * np.abs(ve).max()
            got = b.append(tail, logits="all")
    err_corrected = np.abs(got - exact_logits).max()
    err_rotate_only = np.abs(rotate_only - exact_logits).max()
    assert err_corrected <= 2e-3, err_corrected
    assert err_rotate_only > 20 * err_corrected  # the correction did the work
    with pytest.raises(core.KvcmasError, match="in use"):
        corr.set_layer(1, *(np.zeros((24, 24), np.float32), np.zeros((24, 192), np.float32)) * 2)


def test_low_rank_correction_memory_is_factor_sized(model: kc.Model) -> None:
    n, rank, kd = 40, 8, model.n_head_kv * 64
    corr = core.KvCorrection(n, rank, kd, model.n_layer)
    zeros_a, zeros_b = np.zeros((n, rank), np.float32), np.zeros((rank, kd), np.float32)
    for il in range(1, model.n_layer):  # layer 0 is never corrected
        corr.set_layer(il, zeros_a, zeros_b, zeros_a, zeros_b)
    assert corr.bytes == (model.n_layer - 1) * 2 * (n * rank + rank * kd) * 4
    with model.new_sequence() as a, model.new_sequence() as b:
        a.append(_ids(model, 11, n), logits="none")
        b.append(_ids(model, 12, 5), logits="none")
        b.append_shared(a.share(0, n), corr)
        assert model.sequence_segments(b.id)[1]["corr_bytes"] == corr.bytes


def test_pieces_of_a_span_read_one_correction_at_their_offsets(model: kc.Model) -> None:
    """The reused pieces between recomputed rows read one correction at row offsets (corr_row0): the pieces read,
    fused and copied, what appending each piece with its own slice of the factors reads (the slices a numpy
    reference builds), the sequence's logits equal the whole span's, and the factors are counted once."""
    n, rank, kd = 40, 4, model.n_head_kv * 64
    rng = np.random.default_rng(21)
    corr = core.KvCorrection(n, rank, kd, model.n_layer)
    layers = []
    for il in range(1, model.n_layer):
        f = [rng.normal(0, 0.05, shape).astype(np.float32) for shape in ((n, rank), (rank, kd)) * 2]
        corr.set_layer(il, *f)
        layers.append((il, f))
    cuts = [(0, 7), (7, 23), (23, 40)]
    prefix, span, other, tail = _ids(model, 31, 9), _ids(model, 32, n), _ids(model, 33, 13), _ids(model, 34, 5)
    with model.new_sequence() as src:
        src.append(prefix + span, logits="none")
        whole = src.share(len(prefix), n)
        with model.new_sequence() as a, model.new_sequence() as b, model.new_sequence() as c:
            for s in (a, b, c):
                s.append(other, logits="none")
            a.append_shared(whole, corr)
            for start, end in cuts:
                b.append_shared(whole.slice(start, end - start), corr, corr_row0=start)
                piece = core.KvCorrection(end - start, rank, kd, model.n_layer)
                for il, (ak, bk, av, bv) in layers:
                    piece.set_layer(il, ak[start:end].copy(), bk, av[start:end].copy(), bv)
                c.append_shared(whole.slice(start, end - start), piece)
            kb, vb = b.kv(len(other), n)
            kc_, vc = c.kv(len(other), n)
            np.testing.assert_array_equal(kb, kc_)
            np.testing.assert_array_equal(vb, vc)
            assert sum(seg["corr_bytes"] for seg in model.sequence_segments(b.id)) == corr.bytes
            np.testing.assert_array_equal(b.append(tail, logits="all"), a.append(tail, logits="all"))
        with model.new_sequence() as d:
            d.append(other, logits="none")
            d.append_shared(whole.slice(7, 16), corr, corr_row0=7)
            fused = d.kv(len(other), 16)
            model.materialize_last(d)  # the copy reads the same offset
            copied = d.kv(len(other), 16)
            np.testing.assert_allclose(copied[0], fused[0], rtol=0, atol=1e-5)
            np.testing.assert_allclose(copied[1], fused[1], rtol=0, atol=1e-5)
            for row0, part, match in ((30, whole.slice(0, 16), "covers 40 rows"), (-1, whole.slice(0, 4), "covers")):
                with pytest.raises(core.KvcmasError, match=match):
                    d.append_shared(part, corr, corr_row0=row0)
            with pytest.raises(core.KvcmasError, match="without a correction"):
                d.append_shared(whole.slice(0, 4), None, corr_row0=3)
            assert len(d) == len(other) + 16


def test_rows_computed_between_shared_pieces_fill_the_sequences_own_span(model: kc.Model) -> None:
    """Fine-grained recompute computes a few rows between shared pieces, many times per prompt. Those rows go on in
    the sequence's own span (one block per 32 rows, not one block per run of rows), with keys rotated at their own
    positions (shift 0: as in a fresh span), so a reader that recomputes every other 3 rows of a span at the span's
    own positions reads what computing the span gives; truncation gives the unused rows back."""
    prefix, span, tail = _ids(model, 41, 8), _ids(model, 42, 60), _ids(model, 43, 4)
    with model.new_sequence() as probe:
        before = model.kv_bytes_in_use
        probe.append(prefix[:1], logits="none")
        block_bytes = model.kv_bytes_in_use - before
    with model.new_sequence() as src:
        src.append(prefix + span, logits="none")
        whole = src.share(len(prefix), len(span))
        exact = src.append(tail, logits="all")
        with model.new_sequence() as b:
            before = model.kv_bytes_in_use
            b.append(prefix, logits="none")
            own = len(prefix)
            for start in range(0, len(span), 6):
                b.append_shared(whole.slice(start, 3))
                b.append(span[start + 3 : start + 6], logits="none")
                own += 3
            assert model.kv_bytes_in_use - before == -(-own // 32) * block_bytes  # 38 own rows: two blocks, not 11
            segs = model.sequence_segments(b.id)
            assert all(s["shift"] == 0 for s in segs) and sum(not s["shared"] for s in segs) == 11
            np.testing.assert_allclose(b.append(tail, logits="all"), exact, rtol=0, atol=1e-3)
            b.truncate(len(prefix) + 3)  # the prefix and the first shared piece
            assert model.kv_bytes_in_use - before == block_bytes
            b.append(span[3:6], logits="none")
            assert model.kv_bytes_in_use - before == block_bytes
            assert model.sequence_segments(b.id)[-1]["shift"] == 0


def test_bad_sharing_requests_raise(model: kc.Model) -> None:
    with model.new_sequence() as a, model.new_sequence() as b:
        a.append(_ids(model, 13, 10), logits="none")
        with pytest.raises(ValueError, match="outside"):
            a.share(5, 10)
        wrong = core.KvCorrection(10, 4, 100, model.n_layer)
        with pytest.raises(core.KvcmasError, match="row width"):
            b.append_shared(a.share(0, 10), wrong)
        short = core.KvCorrection(3, 4, model.n_head_kv * 64, model.n_layer)
        with pytest.raises(core.KvcmasError, match="covers 3 rows"):
            b.append_shared(a.share(0, 10), short)
        with pytest.raises(core.KvcmasError, match="must be"):
            short.set_layer(
                0,
                np.zeros((2, 4), np.float32),
                np.zeros((4, 192), np.float32),
                np.zeros((3, 4), np.float32),
                np.zeros((4, 192), np.float32),
            )
        assert len(b) == 0 and model.sequence_rows(b.id) == 0


def test_reserved_rows_between_spans_compute_in_one_pass_like_appends_in_turn(model: kc.Model) -> None:
    """Rows reserved before shared spans, then computed in one append, equal appending them in turn around the spans
    (bit for bit: runs of >= 17 rows take the same kernels either way), with a correction on a span, in one pass."""
    src_ids, a, b, c = _ids(model, 20, 60), _ids(model, 21, 20), _ids(model, 22, 24), _ids(model, 23, 18)
    with model.new_sequence() as src, model.new_sequence() as turns, model.new_sequence() as one:
        src.append(src_ids, logits="none")
        span = src.share(10, 40)
        corr = core.KvCorrection(20, 2, model.n_head_kv * 64, model.n_layer)
        rng = np.random.default_rng(5)
        for il in range(1, model.n_layer):
            f = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((20, 2), (2, 192), (20, 2), (2, 192))]
            corr.set_layer(il, *f)
        turns.append(a, "none")
        turns.append_shared(span)
        turns.append(b, "none")
        turns.append_shared(span.slice(0, 20), corr)
        want = turns.append(c, "all")
        one.reserve(a)
        one.append_shared(span)
        one.reserve(b)
        one.append_shared(span.slice(0, 20), corr)
        assert one.reserved == len(a) + len(b) == model.sequence_reserved(one.id)
        assert len(one) == len(turns) - len(c) and one.tokens == turns.tokens[: len(one)]
        calls = []
        real = model._decode
        model._decode = lambda *args: calls.append(1) or real(*args)  # type: ignore[method-assign]
        try:
            got = one.append(a + b + c, "all")
        finally:
            del model._decode
        assert len(calls) == 1 and one.reserved == 0 and one.tokens == turns.tokens
        np.testing.assert_array_equal(got[-len(c) :], want)
        for x, y in zip(one.kv(), turns.kv(), strict=True):
            np.testing.assert_array_equal(x, y)
        assert [s["n"] for s in model.sequence_segments(one.id)] == [20, 40, 24, 20, 18]


def test_reserved_rows_are_refused_to_readers_until_computed(model: kc.Model) -> None:
    """Until computed, reserved rows cannot be forked, shared or read; the next append must pass their ids; a
    refused append keeps them reserved; truncation drops them; a reservation past n_ctx changes nothing."""
    a, b = _ids(model, 24, 12), _ids(model, 25, 20)
    with model.new_sequence() as src, model.new_sequence() as seq:
        src.append(b, logits="none")
        seq.append(a[:4], logits="none")
        seq.reserve(a[4:])
        seq.append_shared(src.share(0, 20))
        for refused in (seq.fork, lambda: seq.share(4, 2), lambda: seq.kv(0, 6)):
            with pytest.raises(core.KvcmasError, match="reserved"):
                refused()
        assert seq.share(0, 4) is not None and seq.kv(4 + 8, 20)[0].shape[1] == 20  # computed rows stay readable
        with pytest.raises(ValueError, match="reserved for ids"):
            seq.append(a[:8], "none")
        with pytest.raises(core.KvcmasError, match="out of range"):
            model.forward(np.full(8, seq.id, np.int32), np.full(8, -5, np.int32), np.zeros(8, np.uint8))
        assert seq.reserved == 8 and model.sequence_reserved(seq.id) == 8 and len(seq) == 32
        with pytest.raises(core.KvcmasError, match="context overflow"):
            seq.reserve([1] * model.n_ctx)
        assert len(seq) == model.sequence_rows(seq.id) == 32
        seq.append(a[4:10], "none")  # fills 6 of the 8 rows
        assert seq.reserved == 2
        seq.truncate(9)  # drops the last reserved rows and the span
        assert seq.reserved == 0 and model.sequence_reserved(seq.id) == 0 and len(seq) == 9
        seq.fork().close()
