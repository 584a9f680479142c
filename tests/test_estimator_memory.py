"""The ridge estimator learns from sufficient statistics: its memory per edge is fixed (however long the spans and
however many reads), the fit equals the batch fit of the same reads (numpy reference), statistics of edges that never
reach their calibration count are dropped stalest first, and fitted edges beyond max_edges least recently used
first."""

from __future__ import annotations

import numpy as np

from kvcmas_cpp.sharing.estimators import EdgeContext, RidgeEstimator, RowMoments

N_LAYER, N_ROWS, KD = 3, 16, 8


# a rank-1 linear map of the base: the delta the fit has to find for K
_MAP_K = np.outer(np.linspace(-1, 1, KD), np.linspace(0.5, 1, KD)).astype(np.float32)


def _read(rng: np.random.Generator, ph: str, reader: int | str, rows: int = N_ROWS) -> EdgeContext:
    base_k, base_v = (rng.standard_normal((N_LAYER, rows, KD)).astype(np.float32) + 3.0 for _ in range(2))
    return EdgeContext(ph, reader, "", base_k, base_v, exact_k=base_k + base_k @ _MAP_K, exact_v=base_v - 0.25)


EDGE_BYTES = RowMoments(2 * (N_LAYER - 1), KD).nbytes  # K and V maps of layers >= 1


def _batch_ridge(x: np.ndarray, y: np.ndarray, rank: int, alpha: float) -> tuple[np.ndarray, ...]:
    """The reference: reduced-rank ridge on all rows at once in float64 (mu_x, W V, V^T, mu_y)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    mu_x, mu_y = x.mean(0), y.mean(0)
    xc, yc = x - mu_x, y - mu_y
    g = xc.T @ xc
    lam = alpha * np.trace(g) / g.shape[0]
    w = np.linalg.solve(g + lam * np.eye(len(g)), xc.T @ yc)
    evals, evecs = np.linalg.eigh(w.T @ g @ w)
    vt = evecs[:, np.argsort(evals)[::-1][:rank]].T
    return mu_x, w @ vt.T, vt, mu_y


def test_the_fit_from_statistics_equals_the_batch_fit_of_the_same_reads() -> None:
    rng = np.random.default_rng(3)
    est = RidgeEstimator(rank=3, alpha=0.1)
    reads = [_read(rng, "span", "reader", rows) for rows in (40, 7, 129, 1)]  # uneven reads, one of a single row
    for r in reads[:2]:
        est.add_example(r)
    for r in reads[2:]:  # a read may come in pieces of rows
        for a in range(0, r.base_k.shape[1], 50):
            sl = slice(a, a + 50)
            est.add_rows(("span", "reader"), r.base_k[:, sl], r.base_v[:, sl], r.exact_k[:, sl], r.exact_v[:, sl])  # type: ignore[index]
        est.end_read(("span", "reader"))
    assert est.examples(("span", "reader")) == 4
    assert est.pending_bytes() == EDGE_BYTES  # the same memory whatever the rows
    est.fit()
    maps = est.maps[("span", "reader")]
    probe = rng.standard_normal((11, KD)) + 3.0
    for il in range(1, N_LAYER):
        for kind, (base, exact) in enumerate((("base_k", "exact_k"), ("base_v", "exact_v"))):
            x = np.concatenate([getattr(r, base)[il] for r in reads])
            y = np.concatenate([getattr(r, exact)[il] - getattr(r, base)[il] for r in reads])
            mu_x, proj, vt, mu_y = _batch_ridge(x, y, 3, 0.1)
            want = (probe - mu_x) @ proj @ vt + mu_y  # the predicted delta (factors are defined up to a rotation)
            a, b = maps[il][kind].factors(probe.astype(np.float32))  # type: ignore[index]
            np.testing.assert_allclose(a @ b, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_memory_per_edge_does_not_grow_with_span_length_or_reads() -> None:
    rng = np.random.default_rng(4)
    est = RidgeEstimator(rank=2)
    for rows in (16, 400, 3000):
        est.add_example(_read(rng, "long", 1, rows))
        assert est.pending_bytes() == EDGE_BYTES


def test_pending_statistics_are_bounded_and_the_stalest_edge_goes_first() -> None:
    rng = np.random.default_rng(0)
    est = RidgeEstimator(rank=2, max_pending_bytes=4 * EDGE_BYTES)
    for k in range(4):  # four edges, one read each
        est.add_example(_read(rng, f"span_{k}", 1))
    est.add_example(_read(rng, "span_0", 1))  # edge 0 is now the most recently added to
    assert est.pending_bytes() == 4 * EDGE_BYTES
    est.add_example(_read(rng, "span_4", 1))  # over the limit: edge 1 (stalest) loses its statistics
    assert est.pending_bytes() <= 4 * EDGE_BYTES
    assert est.examples(("span_1", 1)) == 0
    assert est.examples(("span_0", 1)) == 2 and est.examples(("span_4", 1)) == 1
    for _ in range(20):  # a long stream of one-off edges never grows past the limit
        est.add_example(_read(rng, f"span_{rng.integers(1 << 30)}", 2))
        assert est.pending_bytes() <= 4 * EDGE_BYTES


def test_an_edge_over_the_limit_alone_still_calibrates() -> None:
    rng = np.random.default_rng(1)
    est = RidgeEstimator(rank=2, alpha=1e-4, max_pending_bytes=EDGE_BYTES // 2)
    for _ in range(3):
        est.add_example(_read(rng, "user_question", 1))
    assert est.examples(("user_question", 1)) == 3
    assert est.fit() == [("user_question", 1)]
    assert est.pending_bytes() == 0 and ("user_question", 1) in est.maps
    probe = _read(rng, "user_question", 1)
    corr = est.correction(probe)
    assert corr is not None and corr[0] is None
    ak, bk, av, bv = corr[1]  # type: ignore[misc]
    # the map found the linear delta: A·B ≈ exact - base
    np.testing.assert_allclose(ak @ bk, probe.exact_k[1] - probe.base_k[1], atol=1e-2)  # type: ignore[index]
    np.testing.assert_allclose(av @ bv, probe.exact_v[1] - probe.base_v[1], atol=1e-3)  # type: ignore[index]


def test_fitted_edges_beyond_max_edges_drop_the_least_recently_used() -> None:
    rng = np.random.default_rng(2)
    est = RidgeEstimator(rank=2, max_edges=3)
    for k in range(3):
        est.add_example(_read(rng, f"span_{k}", 1))
        est.fit()
    assert est.correction(_read(rng, "span_0", 1)) is not None  # edge 0 used: edge 1 is now the stalest
    est.add_example(_read(rng, "span_3", 1))
    est.fit()
    assert set(est.maps) == {("span_0", 1), ("span_2", 1), ("span_3", 1)}
    assert est.correction(_read(rng, "span_1", 1)) is None  # it calibrates again when met again
    assert est.state_bytes() > 0
