"""The estimators' numerics (kvcmas_cpp.sharing.estimators) against numpy references; no model needed."""

from __future__ import annotations

import numpy as np

from kvcmas_cpp.sharing import estimators as est

L, N, KD = 3, 20, 48


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_rsvd_recovers_low_rank_and_nearly_optimal_truncation() -> None:
    rng = _rng(0)
    low = (rng.standard_normal((60, 5)) @ rng.standard_normal((5, 40))).astype(np.float32)
    q, vt = est.rsvd(low, 8, rng)
    assert q.shape == (60, 5) or q.shape == (60, 8)
    np.testing.assert_allclose(q @ vt, low, atol=1e-3 * np.abs(low).max())
    # a full-rank matrix: rank-10 randomized error within 5% of the optimal (exact SVD) error
    m = rng.standard_normal((60, 40)).astype(np.float32) * np.linspace(3, 0.1, 40, dtype=np.float32)
    q, vt = est.rsvd(m, 10, rng)
    us, vt2 = est.truncated(m, 10)
    err, best = np.linalg.norm(m - q @ vt), np.linalg.norm(m - us @ vt2)
    assert best <= err <= 1.05 * best


def test_ridge_map_recovers_a_low_rank_linear_map_with_offset() -> None:
    rng = _rng(1)
    w = (rng.standard_normal((KD, 3)) @ rng.standard_normal((3, KD)) * 0.1).astype(np.float32)
    c = rng.standard_normal(KD).astype(np.float32)
    x = rng.standard_normal((500, KD)).astype(np.float32)
    y = x @ w + c
    fit = est.fit_ridge_map(x, y, rank=8, alpha=1e-6)
    x_new = rng.standard_normal((7, KD)).astype(np.float32)
    a, b = fit.factors(x_new)
    assert a.shape == (7, 9) and b.shape == (9, KD)  # rank 8 + the offset column
    np.testing.assert_allclose(a @ b, x_new @ w + c, atol=1e-3)


def _corr(seed: int, rank: int) -> est.Factors:
    rng = _rng(seed)
    return [None] + [
        tuple(rng.standard_normal(s).astype(np.float32) for s in ((N, rank), (rank, KD)) * 2) for _ in range(L - 1)
    ]


def test_concatenated_factors_add_the_corrections() -> None:
    c1, c2 = _corr(2, 4), _corr(3, 6)
    both = est.concat([c1, c2])
    assert both[0] is None and est.correction_rank(both) == 10
    d1, d2, d12 = (est.materialize(c, L, N, KD) for c in (c1, c2, both))
    np.testing.assert_allclose(d12[0], d1[0] + d2[0], atol=1e-4)
    np.testing.assert_allclose(d12[1], d1[1] + d2[1], atol=1e-4)
    # a dense delta as factors reproduces it exactly and never exceeds the kernel's rank limit
    delta = _rng(4).standard_normal((L, 300, KD)).astype(np.float32)
    dense = est.dense_to_correction(delta, delta)
    assert est.correction_rank(dense) <= est.MAX_KERNEL_RANK
    np.testing.assert_allclose(est.materialize(dense, L, 300, KD)[0][1:], delta[1:], atol=1e-5)


def _ctx(seed: int, reader: int = 1, message: str = "m", ph: str = "agent_0_current", n: int = N) -> est.EdgeContext:
    rng = _rng(seed)
    base_k, base_v = (rng.standard_normal((L, n, KD)).astype(np.float32) for _ in range(2))
    return est.EdgeContext(ph, reader, message, base_k, base_v, base_k + 0.5, base_v - 0.25)


def test_oracle_full_rank_is_the_exact_delta() -> None:
    ctx = _ctx(5)
    dk, dv = est.materialize(est.OracleEstimator(rank=KD).correction(ctx), L, N, KD)
    np.testing.assert_allclose(dk[1:], (ctx.exact_k - ctx.base_k)[1:], atol=1e-4)
    np.testing.assert_allclose(dv[1:], (ctx.exact_v - ctx.base_v)[1:], atol=1e-4)
    assert not dk[0].any()  # layer 0 is never corrected


def test_anchor_gate_weights_and_lfu_eviction() -> None:
    pool = est.AnchorEstimator(rank=None, base_rank=None, max_anchors=2, window=2, gamma=0.5)
    span_v = _ctx(6).base_v
    assert pool.gate("agent_0_current", "m0", span_v)  # empty pool: novel
    assert pool.needs_dense(1, ["agent_0_current"], "m0")
    for i in range(3):
        assert pool.record(_ctx(10 + i, message=f"m{i}"), is_question=False)
    assert not pool.needs_dense(1, ["agent_0_current"], "m0")  # its anchor now holds reader 1's delta
    # a candidate equal to anchor m1's base: the gate is confident and counts m1 (or all, top-p quirk)
    cand = _ctx(11)
    assert not pool.gate("agent_0_current", "new", cand.base_v)
    # one anchor weight ~1: the corrected delta is (nearly) m1's delta
    dk, _ = est.materialize(
        pool.correction(est.EdgeContext("agent_0_current", 1, "new", cand.base_k, cand.base_v)), L, N, KD
    )
    np.testing.assert_allclose(dk[1:], np.full_like(dk[1:], 0.5), atol=1e-3)
    # the pool holds max + 1 = 3 entries; the next insertion evicts the least used of the 2 oldest (m0)
    assert list(pool.pools["agent_0_current"]) == ["m0", "m1", "m2"]
    pool.record(_ctx(20, message="m3"), is_question=False)
    assert list(pool.pools["agent_0_current"]) == ["m1", "m2", "m3"]
    assert pool.state_bytes() == 3 * (2 * L * N * KD * 4 + 2 * L * N * KD * 4)
