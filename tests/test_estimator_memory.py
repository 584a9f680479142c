"""The ridge estimator's memory stays bounded however many edges a long-running server meets: training reads of
edges that never reach their calibration count are dropped least recently added first, and fitted edges beyond
max_edges least recently used first."""

from __future__ import annotations

import numpy as np

from kvcmas_cpp.sharing.estimators import EdgeContext, RidgeEstimator

N_LAYER, N_ROWS, KD = 3, 16, 8


# a rank-1 linear map of the base: the delta the fit has to find for K
_MAP_K = np.outer(np.linspace(-1, 1, KD), np.linspace(0.5, 1, KD)).astype(np.float32)


def _read(rng: np.random.Generator, ph: str, reader: int) -> EdgeContext:
    base_k, base_v = (rng.standard_normal((N_LAYER, N_ROWS, KD)).astype(np.float32) for _ in range(2))
    return EdgeContext(ph, reader, "", base_k, base_v, exact_k=base_k + base_k @ _MAP_K, exact_v=base_v - 0.25)


READ_BYTES = 4 * N_LAYER * N_ROWS * KD * 4  # base_k, base_v, delta_k, delta_v in float32


def test_pending_reads_are_bounded_and_the_stalest_edge_goes_first() -> None:
    rng = np.random.default_rng(0)
    est = RidgeEstimator(rank=2, max_pending_bytes=5 * READ_BYTES)
    for k in range(4):  # four edges, one read each
        est.add_example(_read(rng, f"condition_{k}_current", 1))
    est.add_example(_read(rng, "condition_0_current", 1))  # edge 0 is now the most recently added to
    assert est.pending_bytes() == 5 * READ_BYTES
    est.add_example(_read(rng, "condition_4_current", 1))  # over the limit: edge 1 (stalest) loses its read
    assert est.pending_bytes() <= 5 * READ_BYTES
    assert est.examples(("condition_1_current", 1)) == 0
    assert est.examples(("condition_0_current", 1)) == 2 and est.examples(("condition_4_current", 1)) == 1
    for _ in range(20):  # a long stream of one-off edges never grows past the limit
        est.add_example(_read(rng, f"condition_{rng.integers(1 << 30)}_current", 2))
        assert est.pending_bytes() <= 5 * READ_BYTES


def test_one_edge_over_the_limit_keeps_its_newest_reads_and_still_fits() -> None:
    rng = np.random.default_rng(1)
    est = RidgeEstimator(rank=2, alpha=1e-4, max_pending_bytes=2 * READ_BYTES)
    reads = [_read(rng, "user_question", 1) for _ in range(3)]
    for r in reads:
        est.add_example(r)
    assert est.examples(("user_question", 1)) == 2
    kept = est._rows[("user_question", 1)]
    assert kept[0][0] is reads[1].base_k and kept[1][0] is reads[2].base_k
    est.fit()
    assert est.pending_bytes() == 0 and ("user_question", 1) in est.maps
    probe = _read(rng, "user_question", 1)
    corr = est.correct(probe)
    assert corr is not None and corr[0] is None
    ak, bk, av, bv = corr[1]  # type: ignore[misc]
    # the map found the linear delta: A·B ≈ exact - base
    np.testing.assert_allclose(ak @ bk, probe.exact_k[1] - probe.base_k[1], atol=1e-2)  # type: ignore[index]
    np.testing.assert_allclose(av @ bv, probe.exact_v[1] - probe.base_v[1], atol=1e-3)  # type: ignore[index]


def test_fitted_edges_beyond_max_edges_drop_the_least_recently_used() -> None:
    rng = np.random.default_rng(2)
    est = RidgeEstimator(rank=2, max_edges=3)
    for k in range(3):
        est.add_example(_read(rng, f"condition_{k}_current", 1))
        est.fit()
    assert est.correct(_read(rng, "condition_0_current", 1)) is not None  # edge 0 used: edge 1 is now the stalest
    est.add_example(_read(rng, "condition_3_current", 1))
    est.fit()
    assert set(est.maps) == {("condition_0_current", 1), ("condition_2_current", 1), ("condition_3_current", 1)}
    assert est.correct(_read(rng, "condition_1_current", 1)) is None  # it calibrates again when met again
    assert est.state_bytes() > 0
