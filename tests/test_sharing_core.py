"""KVCMAS corrections built and applied in the core, on SmolLM2: the ridge estimator's factors computed in C++
(`Model.ridge_correction`) against the numpy reference path, and a materialized (copied) corrected span
(`Model.materialize_last`) against the fused one, with the runner's per-shape choice between them."""

from __future__ import annotations

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp._native import core
from kvcmas_cpp.sharing import MethodConfig, RidgeEstimator, WorkflowRunner, gsm8k_workflow, load_gsm8k
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing.evaluate import question_ids
from kvcmas_cpp.sharing.span import Span
from kvcmas_cpp.sharing.training_read import canonical as _canonical
from kvcmas_cpp.sharing.workflow import QUESTION

GEN = 4


@pytest.fixture(scope="module")
def model(exact_sharing_model: kc.Model) -> kc.Model:
    return exact_sharing_model


@pytest.fixture(scope="module")
def workflow():
    return gsm8k_workflow(4)


@pytest.fixture(scope="module")
def ridge(model, workflow) -> RidgeEstimator:
    """The default estimator fitted on exact runs of 3 training questions (every edge of the workflow)."""
    estimator = RidgeEstimator(rank=8)
    trainer = WorkflowRunner(model, workflow, MethodConfig("nonshared", head=4), estimator)
    for i, q in enumerate(load_gsm8k(40, 3)):
        trainer.run(question_ids(model, q), f"train-{i}", max_new_tokens=GEN, ridge_training=True).close()
    trainer.close()
    estimator.fit()
    return estimator


def _rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _assert_factors_equal(corr: est.Correction | None, ref: est.Correction | None, n_layer: int) -> None:
    """A correction built in the core against numpy factors (padded like the runner pads them): per layer, every
    factor within 1e-5 relative (fp32), and the same uncorrected layers."""
    assert corr is not None and corr.in_core and ref is not None and not ref.in_core
    got, want = corr.factors(n_layer), ref.factors(n_layer)
    for il in range(n_layer):
        layer = want[il]
        if layer is None:
            assert got[il] is None, il
            continue
        for g, r in zip(got[il], est.pad_rank(layer), strict=True):
            assert g.shape == r.shape
            assert _rel(g, r) < 1e-5, (il, _rel(g, r))


def test_core_ridge_factors_equal_the_numpy_path(model, workflow, ridge) -> None:
    """Hop 1 reads the question stored by agent 0 (another position, frame0 != its own), hop 2 reads agent 1's
    corrected view of it (chained: the previous correction in front); the core builds the same factors as
    RidgeEstimator.correct + the stored-frame rotation + concatenation in numpy."""
    runner = WorkflowRunner(model, workflow, MethodConfig("kvcmas", head=4), ridge)
    q = question_ids(model, load_gsm8k(12, 1)[0])
    src = runner.prefixes[0].fork()
    p0 = len(src)
    src.append(q, logits="none")
    h, n = 4, len(q) - 4
    bucket = Span(QUESTION, q).with_rows(src.share(p0 + h, n), None, p0 + h, src, p0 + h)
    c1 = runner._core_ridge(runner.edge_of(QUESTION, 1), bucket, n)
    ref1 = runner._correction_numpy(1, QUESTION, bucket, 0, n, "m", None)
    assert isinstance(c1, est.Correction) and c1.rank == 9 and c1.rows == n
    kc1 = c1.core
    assert isinstance(kc1, core.KvCorrection)
    _assert_factors_equal(c1, ref1, model.n_layer)
    # the map is what the numpy estimator computes from the canonical base (layer 0 uncorrected, offset column 1)
    a1 = core.correction_layer(kc1, 5)[0]
    np.testing.assert_array_equal(a1[:, -1], np.ones(n, np.float32))
    assert core.correction_layer(kc1, 0) is None

    # hop 1 reads the span at its own position with that correction; hop 2 starts from hop 1's view
    reader = runner.prefixes[1].fork()
    reader.append(q[:h], logits="none")
    pos1 = len(reader)
    assert pos1 != p0
    reader.append_shared(bucket.shared, kc1)
    chained = bucket.with_rows(bucket.shared, c1, bucket.frame0, reader, pos1)
    c2 = runner._core_ridge(runner.edge_of(QUESTION, 2), chained, n)
    in_numpy = est.Correction(c1.factors(model.n_layer))  # the same chain, folded by the numpy path
    ref2 = runner._correction_numpy(
        2, QUESTION, bucket.with_rows(bucket.shared, in_numpy, p0 + h, reader, pos1), 0, n, "m", None
    )
    assert isinstance(c2, est.Correction) and c2.rank == 18 and ref2 is not None
    _assert_factors_equal(c2, ref2, model.n_layer)
    kc2 = c2.core
    # the chained view is the stored rows plus both hops' deltas: reading it back agrees with the factors' sum
    reader2 = runner.prefixes[2].fork()
    reader2.append(q[:h], logits="none")
    pos2 = len(reader2)
    reader2.append_shared(bucket.shared, kc2)
    k2, v2 = _canonical(model, reader2, pos2, n)
    k0, v0 = _canonical(model, src, p0 + h, n)
    dk, dv = est.materialize(ref2.factors(model.n_layer), model.n_layer, n, model.n_head_kv * model.head_dim)
    rot = np.stack([model.rope_rotate(np.ascontiguousarray(dk[il]), -(p0 + h)) for il in range(model.n_layer)])
    assert _rel(k2, k0 + rot) < 1e-5 and _rel(v2, v0 + dv) < 1e-5
    with pytest.raises(core.KvcmasError, match="outside sequence"):
        model.ridge_correction(ridge.core_maps(runner.edge_of(QUESTION, 1)), src, p0, len(src), p0, None)
    for s in (src, reader, reader2):
        s.close()
    runner.close()


def _run(model, workflow, cfg: MethodConfig, estimator, q, exact=None):
    before = model.kv_bytes_in_use
    runner = WorkflowRunner(model, workflow, cfg, estimator)
    forced = [h.generated for h in exact.hops] if exact is not None else None
    res = runner.run(question_ids(model, q), "m", max_new_tokens=GEN, forced=forced, exact=exact)
    # bytes accounting: every allocated byte is the template caches' or some hop's
    assert runner.template_kv_bytes + sum(h.kv_bytes for h in res.hops) == model.kv_bytes_in_use - before
    return runner, res


def test_core_numpy_fused_and_materialized_give_the_same_logits(model, workflow, ridge) -> None:
    q = load_gsm8k(13, 1)[0]
    r0, exact = _run(model, workflow, MethodConfig("nonshared"), None, q)
    runs = {}
    for key, cfg in {
        "core": MethodConfig("kvcmas", head=4, apply="fused"),
        "numpy": MethodConfig("kvcmas", head=4, apply="fused", ridge_path="numpy"),
        "copy": MethodConfig("kvcmas", head=4, apply="materialize"),
    }.items():
        runs[key] = _run(model, workflow, cfg, ridge, q, exact)
    hops = {k: r[1].hops for k, r in runs.items()}
    for a in range(1, 4):
        ref = hops["numpy"][a].first_logits
        for key in ("core", "copy"):
            got = hops[key][a].first_logits
            assert np.max(np.abs(got - ref)) < 1e-3 * np.max(np.abs(ref)), (key, a)
            assert hops[key][a].kl == pytest.approx(hops["numpy"][a].kl, rel=1e-2, abs=1e-6)
            np.testing.assert_allclose(hops[key][a].v_err, hops["numpy"][a].v_err, rtol=1e-3, atol=1e-6)
        assert hops["core"][a].corr_rank == hops["numpy"][a].corr_rank > 0
        assert hops["core"][a].mode == hops["copy"][a].mode == "reuse"
        # fused: the engine holds the factors; materialized: it holds copied rows and no factors
        assert hops["core"][a].corr_bytes == hops["core"][a].corr_factor_bytes > 0
        assert hops["core"][a].materialized_tokens == 0
        assert hops["copy"][a].corr_bytes == hops["copy"][a].corr_factor_bytes == 0
        assert hops["copy"][a].materialized_tokens >= runs["copy"][1].span_pos[a][QUESTION][1] - 4
    # the question span's copy costs whole rows: far more KV than the fused factors (rank 9) take
    copy_kv = sum(h.kv_bytes for h in hops["copy"][1:])
    fused_kv = sum(h.kv_bytes + h.corr_bytes for h in hops["core"][1:])
    assert copy_kv > fused_kv
    for runner, res in runs.values():
        res.close()
        runner.close()
    exact.close()
    r0.close()


def test_auto_apply_is_fused_at_kvcmas_rank_and_a_copy_at_full_rank(model, workflow, ridge) -> None:
    q = load_gsm8k(14, 1)[0]
    r0, exact = _run(model, workflow, MethodConfig("nonshared"), None, q)
    # kvcmas' default: the question span (rank 9, ~100 rows) stays fused
    runner, res = _run(model, workflow, MethodConfig("kvcmas", head=4), ridge, q, exact)
    kd, n_layer = model.n_head_kv * model.head_dim, model.n_layer
    for a in range(1, 4):
        n_q = res.span_pos[a][QUESTION][1] - 4
        rank = res.hops[a].corr_rank
        factor_bytes = (n_layer - 1) * 2 * (n_q * rank + rank * kd) * 4
        assert factor_bytes < runner._copy_bytes(n_q) == n_q * n_layer * 2 * kd * 4
        assert res.hops[a].materialized_tokens < n_q  # at most the short relayed spans were copied
        assert res.hops[a].corr_bytes >= factor_bytes
    res.close()
    runner.close()
    # the exact delta at full rank: the factors would take more than the rows, so every corrected span is copied;
    # the copy holds the exact KV
    runner, res = _run(model, workflow, MethodConfig("oracle", rank=256), None, q, exact)
    for a, h in enumerate(res.hops[1:], start=1):
        assert h.mode == "reuse" and h.corr_rank > 0
        assert h.materialized_tokens >= res.span_pos[a][QUESTION][1]
        assert max(h.k_err) < 1e-4 and max(h.v_err) < 1e-4
        assert h.kl < 1e-6 and h.top1
    res.close()
    runner.close()
    exact.close()
    r0.close()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_materialized_segment_reads_like_the_fused_one(default_model_path, kv_type) -> None:
    m = kc.Model(default_model_path, n_threads=2, n_ctx=512, kv_budget=64 << 20, kv_type=kv_type, activations="f32")
    ids = m.tokenize("Shared context: the quick brown fox jumps over the lazy dog, twice over.", add_special=False)
    src = m.new_sequence()
    src.append(ids, logits="none")
    n, kd = len(ids) - 2, m.n_head_kv * m.head_dim
    rng = np.random.default_rng(0)
    corr = core.KvCorrection(n, 5, kd, m.n_layer)
    for il in range(1, m.n_layer):
        f = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((n, 5), (5, kd), (n, 5), (5, kd))]
        corr.set_layer(il, *f)
    fused, copied = (m.new_sequence() for _ in range(2))
    for s in (fused, copied):
        s.append(m.tokenize("Reader", add_special=False), logits="none")
        s.append_shared(src.share(2, n), corr)
    before = m.kv_bytes_in_use
    assert m.materialize_last(copied) == n
    seg = m.sequence_segments(copied.id)
    assert seg[-1]["corr_bytes"] == 0 and not seg[-1]["shared"] and seg[-1]["shift"] == 0
    block = 32 * m.n_layer * 2 * kd * (2 if kv_type == "f16" else 4)
    assert (m.kv_bytes_in_use - before) % block == 0  # whole blocks, counted by the pool
    k1, v1 = fused.kv()
    k2, v2 = copied.kv()
    tol = 1e-6 if kv_type == "f32" else 2e-3  # f16 rounds the corrected rows once
    assert _rel(k2, k1) < tol and _rel(v2, v1) < tol
    l1, l2 = fused.append([ids[0]]), copied.append([ids[0]])
    assert np.max(np.abs(l2 - l1)) < (1e-3 if kv_type == "f32" else 5e-2) * np.max(np.abs(l1))
    empty = m.new_sequence()
    with pytest.raises(core.KvcmasError, match="holds no rows"):
        m.materialize_last(empty)
    for s in (src, fused, copied, empty):
        s.close()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_core_ridge_on_a_corrected_view_matches_the_formula(default_model_path, kv_type) -> None:
    """Random maps (rank 6, some layers without a map) applied to a reader's view that carries its own correction,
    read at another position than the span's stored frame: A = [(x - mu_x)·proj, 1] on the canonical view (numpy,
    from seq.kv), B_k = [vt; mu_y] rotated by frame0, the view's correction in front; f16 rows too."""
    m = kc.Model(default_model_path, n_threads=2, n_ctx=512, kv_budget=64 << 20, kv_type=kv_type, activations="f32")
    kd, n_layer, r = m.n_head_kv * m.head_dim, m.n_layer, 6
    rng = np.random.default_rng(1)
    src = m.new_sequence()
    src.append(m.tokenize("Context: " + "numbers and words, " * 12, add_special=False), logits="none")
    frame0, n = 3, len(src) - 5
    prev = core.KvCorrection(n, 2, kd, n_layer)
    for il in range(2, n_layer):
        prev.set_layer(il, *(rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((n, 2), (2, kd)) * 2))
    view = m.new_sequence()
    view.append(m.tokenize("A reader's own words first", add_special=False), logits="none")
    pos = len(view)
    view.append_shared(src.share(frame0, n), prev)
    maps = core.RidgeMaps(n_layer, kd, r)
    params: dict[int, list[np.ndarray]] = {}
    for il in range(1, n_layer, 2):  # even layers (and 0) have no map
        params[il] = [rng.standard_normal(s).astype(np.float32) for s in ((kd,), (kd, r), (r, kd), (kd,)) * 2]
        maps.set_layer(il, *params[il])
    got = est.Correction(kv=m.ridge_correction(maps, view, pos, n, frame0, prev)).factors(n_layer)
    base_k, base_v = _canonical(m, view, pos, n)
    prev_f = est.Correction(kv=prev).factors(n_layer)
    for il in range(n_layer):
        if il not in params and prev_f[il] is None:
            assert got[il] is None
            continue
        ref: list[tuple[np.ndarray, ...]] = [prev_f[il]] if prev_f[il] is not None else []
        if il in params:
            mu_k, proj_k, vt_k, muy_k, mu_v, proj_v, vt_v, muy_v = params[il]
            ones = np.ones((n, 1), np.float32)
            bk = m.rope_rotate(np.concatenate([vt_k, muy_k[None]]), frame0)
            ref.append(
                (
                    np.concatenate([(base_k[il] - mu_k) @ proj_k, ones], 1),
                    bk,
                    np.concatenate([(base_v[il] - mu_v) @ proj_v, ones], 1),
                    np.concatenate([vt_v, muy_v[None]]),
                )
            )
        want = est.pad_rank(est.concat([[f] for f in ref])[0])
        width = got[il][0].shape[1]
        for g, w, is_a in zip(got[il], want, (True, False, True, False), strict=True):
            pad = width - w.shape[1 if is_a else 0]
            w = np.pad(w, ((0, 0), (0, pad)) if is_a else ((0, pad), (0, 0)))
            assert _rel(g, w) < 1e-5, (il, _rel(g, w))
    for s in (src, view):
        s.close()
