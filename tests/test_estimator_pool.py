"""EstimatorPool: the estimators agent sessions share. A pool handed to sessions (a server's) is theirs alone: sessions
of one workflow in it share one estimator and lock, sessions of the model's default pool or of another pool do not;
what it holds is counted, bounded and forgotten per pool; a pool serves the model it was made for only."""

from __future__ import annotations

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession, estimator_edges
from kvcmas_cpp.sharing.estimators import EdgeContext, RidgeEstimator
from kvcmas_cpp.sharing.pool import EstimatorPool


@pytest.fixture(scope="module")
def model(default_model_path: str) -> kc.Model:
    return kc.Model(default_model_path, n_threads=1)


def _session(model: kc.Model, workflow: str, pool: EstimatorPool | None = None) -> AgentSession:
    return AgentSession(model, "kvcmas", workflow=workflow, calibration_dir=False, pool=pool)


def _teach(e: RidgeEstimator, edge: str, rows: int = 8, n_layer: int = 3, kd: int = 4) -> None:
    """One training read of random rows into an edge's statistics (no fit)."""
    rng = np.random.default_rng(len(edge))
    base_k, base_v = (rng.standard_normal((n_layer, rows, kd)).astype(np.float32) for _ in range(2))
    e.add_example(EdgeContext(edge, "reader", "", base_k, base_v, base_k + 1.0, base_v - 1.0))


def test_sessions_of_a_pool_share_its_estimator_and_no_other(model: kc.Model) -> None:
    pool = EstimatorPool(model)
    with _session(model, "pool-w", pool) as a, _session(model, "pool-w", pool) as b:
        assert a.pool is pool and a._runner.estimator is b._runner.estimator
        assert a._estimator_lock is b._estimator_lock
        assert (a._runner.estimator, a._estimator_lock) == pool.get("kvcmas", "pool-w")
        with _session(model, "pool-w") as c, _session(model, "pool-v", pool) as d:
            assert c.pool is EstimatorPool.of(model) and c._runner.estimator is not a._runner.estimator
            assert d._runner.estimator is not a._runner.estimator
        assert a.fork()._runner.estimator is a._runner.estimator  # a fork stays in its pool


def test_a_pool_counts_bounds_and_forgets_its_own_estimators(model: kc.Model) -> None:
    pool = EstimatorPool(model)
    e, _ = pool.get("kvcmas", "pool-count")
    assert isinstance(e, RidgeEstimator) and pool.bytes() == 0
    _teach(e, "span-a")
    _teach(e, "span-b")
    assert pool.bytes() == e.pending_bytes() > 0
    assert pool.edges()[("kvcmas", "pool-count")] == {
        "fitted": 0,
        "calibrating": 2,
        "reads": 2,
        "bytes": e.pending_bytes(),
    }
    assert ("kvcmas", "pool-count") not in estimator_edges(model)  # the model's default pool is another
    one_edge = e.pending_bytes() // 2
    # a live, busy workflow keeps its estimator; its stalest calibrating edge goes first
    assert pool.bound(one_edge, live=["pool-count"], busy=["pool-count"]) == one_edge
    assert e.pending_edges() == [("span-b", "reader")]
    assert pool.forget("pool-count") == one_edge and pool.bytes() == 0
    assert pool.get("kvcmas", "pool-count")[0] is not e  # a later session starts fresh


def test_a_pool_of_another_model_is_refused(model: kc.Model, default_model_path: str) -> None:
    other = kc.Model(default_model_path, n_threads=1)
    with pytest.raises(ValueError, match="another model"):
        AgentSession(model, "kvcmas", calibration_dir=False, pool=EstimatorPool(other))
