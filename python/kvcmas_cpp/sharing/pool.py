"""EstimatorPool: the estimators agent sessions share on one model, one per (method, workflow name), so what kvcmas
learns from one session's reads carries to the next of the same workflow; with their locks, their calibration
directories (loaded once each) and a memory bound.

A server makes its own pool and hands it to every session it opens (AgentSession(..., pool=...)); sessions opened
without one share the model's default pool (EstimatorPool.of(model)).

The estimator locks are re-entrant: a server's scheduler thread holds several sessions' prefill plans in flight,
each suspended between its appends with its estimator's lock held, and sessions of one workflow kind share one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Collection

from ..model import Model
from . import methods as registry
from .estimator_base import Estimator
from .persist import CalibrationStore


class EstimatorPool:
    """The shared estimators of one model, keyed by (method, workflow), least recently used first."""

    _default: weakref.WeakKeyDictionary[Model, EstimatorPool] = weakref.WeakKeyDictionary()
    _default_lock = threading.Lock()

    def __init__(self, model: Model) -> None:
        self._model = weakref.ref(model)  # a model's default pool lives in a table keyed by the model
        self._lock = threading.Lock()
        self._estimators: dict[tuple[str, str], tuple[Estimator, threading.RLock]] = {}
        self._loaded: dict[tuple[str, str], set[str]] = {}  # per estimator: the calibration directories it loaded

    def serves(self, model: Model) -> bool:
        """The pool is this model's (its estimators are fitted on it)."""
        return self._model() is model

    @classmethod
    def of(cls, model: Model) -> EstimatorPool:
        """The model's default pool (sessions given no pool share it)."""
        with cls._default_lock:
            pool = cls._default.get(model)
            if pool is None:
                pool = cls._default[model] = cls(model)
            return pool

    def get(
        self, method: str, workflow: str, store: CalibrationStore | None = None
    ) -> tuple[Estimator, threading.RLock]:
        """The estimator sessions of one workflow kind share (made on first use), with the lock that serialises its
        use. store: a calibration directory whose maps it loads (once per directory, where the estimator persists)."""
        with self._lock:
            key = (method, workflow)
            if key in self._estimators:  # most recently used last (bound() drops the least recently used first)
                self._estimators[key] = self._estimators.pop(key)
            else:
                model = self._model()
                if model is None:
                    raise ValueError("EstimatorPool: its model is gone")
                config = registry.method(method, session=True).config(for_session=True)
                self._estimators[key] = (registry.make_estimator(model, config, workflow), threading.RLock())
            estimator, lock = self._estimators[key]
            loaded = self._loaded.setdefault(key, set())
            if store is not None and estimator.persists and str(store.dir) not in loaded:
                loaded.add(str(store.dir))
                with lock:
                    store.load_into(estimator)  # type: ignore[arg-type]  # persists: a RidgeEstimator's maps
            return estimator, lock

    def _items(self) -> list[tuple[tuple[str, str], Estimator]]:
        with self._lock:
            return [(key, e) for key, (e, _) in self._estimators.items()]

    def bytes(self) -> int:
        """Memory the estimators hold: learned state plus training reads still pending. Call it where no session is
        using them (a server's engine thread)."""
        return sum(e.state_bytes() + e.pending_bytes() for _, e in self._items())

    def edges(self) -> dict[tuple[str, str], dict[str, int]]:
        """Per estimator ((method, workflow)): its edges by calibration state, {"fitted": edges with a learned map,
        "calibrating": edges gathering training reads, "reads": those reads, "bytes": state + pending}. Estimators
        that learn nothing per edge report only bytes. Call it where no session is using them."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        for key, e in self._items():
            row = {"fitted": 0, "calibrating": 0, "reads": 0, "bytes": e.state_bytes() + e.pending_bytes()}
            counts = e.calibration_counts()
            if counts is not None:
                row["fitted"], row["calibrating"], row["reads"] = counts
            out[key] = row
        return out

    def bound(self, max_bytes: int, live: Collection[str], busy: Collection[str]) -> int:
        """Brings what the estimators hold (bytes()) within max_bytes, for a server whose clients choose how many
        workflows (namespaces) there are. In order: the estimators of workflows no session in `live` names, least
        recently used first (a later session starts a fresh one, which loads the calibration directory again); the
        fitted maps of estimators no workflow in `busy` (a prefill in flight) uses, least recently used estimators
        and edges first (those edges calibrate again, with one read); then the statistics of the calibrating edges
        that went longest without rows (reads in progress: their edges start over). Returns the bytes freed. Call
        it where no session is using the estimators (a server's engine thread)."""
        freed = 0
        with self._lock:
            total = sum(e.state_bytes() + e.pending_bytes() for e, _ in self._estimators.values())
            for key in [k for k in self._estimators if k[1] not in live]:
                if total - freed <= max_bytes:
                    return freed
                freed += self._drop(key)
            kept = [(wf, e) for (_, wf), (e, _) in self._estimators.items()]
        for wf, e in kept:
            while wf not in busy and total - freed > max_bytes and (got := e.drop_stalest_map()):
                freed += got
        while total - freed > max_bytes:
            pending = [(s, e) for _, e in kept if (s := e.stalest_pending()) is not None]
            if not pending:
                break
            (_, edge), e = min(pending, key=lambda p: p[0][0])
            freed += e.drop_pending(edge)
        return freed

    def forget(self, workflow: str) -> int:
        """Drops the estimators of a workflow name (every method's), for a server whose idle namespaces age out; a
        later session of it starts fresh (loading the calibration directory again). Returns the bytes they held."""
        with self._lock:
            return sum(self._drop(key) for key in [k for k in self._estimators if k[1] == workflow])

    def _drop(self, key: tuple[str, str]) -> int:
        """Drops one estimator (under the pool's lock); the bytes it held."""
        e, _ = self._estimators.pop(key)
        self._loaded.pop(key, None)
        return e.state_bytes() + e.pending_bytes()


# The model's default EstimatorPool, as functions (what a server without a pool of its own calls).
def estimator_bytes(model: Model) -> int:
    """EstimatorPool.of(model).bytes()."""
    return EstimatorPool.of(model).bytes()


def estimator_edges(model: Model) -> dict[tuple[str, str], dict[str, int]]:
    """EstimatorPool.of(model).edges()."""
    return EstimatorPool.of(model).edges()


def bound_estimators(model: Model, max_bytes: int, live: Collection[str], busy: Collection[str]) -> int:
    """EstimatorPool.of(model).bound(max_bytes, live, busy)."""
    return EstimatorPool.of(model).bound(max_bytes, live, busy)


def forget_estimators(model: Model, workflow: str) -> int:
    """EstimatorPool.of(model).forget(workflow)."""
    return EstimatorPool.of(model).forget(workflow)


def shared_estimator(
    model: Model, method: str, workflow: str, store: CalibrationStore | None = None
) -> tuple[Estimator, threading.RLock]:
    """EstimatorPool.of(model).get(method, workflow, store): the estimator sessions of one workflow kind share on a
    model, with the lock that serialises its use."""
    return EstimatorPool.of(model).get(method, workflow, store)
