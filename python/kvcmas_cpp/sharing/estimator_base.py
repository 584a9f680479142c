"""The estimator protocol: what the runner (sharing.runner.WorkflowRunner) asks an estimator of the KV delta a reader
needs on a shared span, and what sessions and the estimator pool ask of what it learned. Capabilities are members
(flags and methods with do-nothing defaults), so no caller checks classes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .factors import Factors

Edge = tuple[str, int | str]  # (span key, reader key) an estimator learns per


@dataclass
class EdgeContext:
    """What an estimator sees for one (span, reader) read. exact_* are set only on dense hops (anchor recording) and
    for the oracle."""

    ph: str
    reader: int | str
    message: str
    base_k: np.ndarray
    base_v: np.ndarray
    exact_k: np.ndarray | None = None
    exact_v: np.ndarray | None = None


class Estimator:
    """The estimator protocol the runner (sharing.runner.WorkflowRunner) drives, and its base: no correction
    (fullshared, nonshared). An estimator says what it needs through these members; the runner checks no classes.

    - name; needs_exact: correction() needs the exact rows (the oracle: evaluation only); reads_base: correction()
      reads the base view (else the runner skips reading it back).
    - content_edges: it learns per content edge (the span's role, the reader's identity: runner.edge_of); False: per
      (placeholder, agent index), as the reference code's anchor pools.
    - decide(reader, placeholders, message): a reason to compute a reader's spans densely ('gate'), or None.
    - gates_outputs / observe_output(ph, message, span_v): a freshly produced span's values; returns whether it is
      novel (the anchor pools' gate; None: the estimator gates nothing).
    - observes_dense / observe(ctx, is_question): a dense hop's exact rows next to the base it would have read (the
      anchor pools record them).
    - calibrating(edge): the edge is still learning (online ridge): its readers share cold (MethodConfig.cold) and
      get a training read (learns_from_reads: the LearnsFromReads methods, RidgeEstimator's).
    - core_path / core_maps(edge): the correction is computed in the core from these maps (None: the numpy path).
    - correction(ctx): the delta factors for one read, or None.
    - persists: its fitted maps are saved to and loaded from a calibration directory (sharing.persist; the ridge's).
    - calibration_counts(): (edges fitted, edges calibrating, reads gathered for those), or None for an estimator
      that learns nothing per edge; drop_stalest_map / stalest_pending / drop_pending: what a memory bound frees
      (sharing.pool.EstimatorPool.bound)."""

    name = "fullshared"
    needs_exact = False
    reads_base = False  # correction() never looks at the base view: callers may skip reading it back
    content_edges = False
    gates_outputs = False
    observes_dense = False
    learns_from_reads = False
    core_path = False
    persists = False

    def decide(self, reader: int | str, phs: list[str], message: str) -> str | None:
        """A reason to compute this reader's spans densely instead of sharing them, or None."""
        return None

    def observe_output(self, ph: str, message: str, span_v: np.ndarray) -> bool | None:
        """A produced span's values [n_layer, n, kd]: whether it is novel; None when the estimator gates nothing."""
        return None

    def observe(self, ctx: EdgeContext, is_question: bool) -> None:
        """A dense hop's exact rows (ctx.exact_*) next to its base (called where observes_dense)."""

    def calibrating(self, edge: Edge) -> bool:
        """The edge is still learning (no correction for it yet; its readers get training reads)."""
        return False

    def core_maps(self, edge: Edge) -> Any:
        """Maps the core computes the edge's correction from (where core_path), or None."""
        return None

    def correction(self, ctx: EdgeContext) -> Factors | None:
        return None

    def state_bytes(self) -> int:
        """Persistent estimator state (maps, anchor pools) in bytes."""
        return 0

    def pending_bytes(self) -> int:
        """Bytes held by training reads not yet turned into state (online calibration)."""
        return 0

    def calibration_counts(self) -> tuple[int, int, int] | None:
        """(edges with a fitted map, edges gathering reads, reads those hold); None: nothing is learned per edge."""
        return None

    def drop_stalest_map(self) -> int:
        """Drops the least recently used fitted edge (it calibrates again when read); the bytes freed (0: none)."""
        return 0

    def stalest_pending(self) -> tuple[int, Edge] | None:
        """(when rows last came in, edge) of the calibrating edge that went longest without rows; None when none."""
        return None

    def drop_pending(self, edge: Edge) -> int:
        """Drops a calibrating edge's statistics (its reads start over); the bytes freed."""
        return 0


class LearnsFromReads(Protocol):
    """What an estimator with learns_from_reads offers the runner's training reads (RidgeEstimator)."""

    def calibrating(self, edge: Edge) -> bool: ...

    def add_rows(
        self, edge: Edge, base_k: np.ndarray, base_v: np.ndarray, exact_k: np.ndarray, exact_v: np.ndarray
    ) -> None: ...

    def end_read(self, edge: Edge, rows: int | None = None) -> None: ...

    def examples(self, edge: Edge) -> int: ...

    def fit(self, edges: list[Edge] | None = None) -> list[Edge]: ...
