"""Training reads waiting in the server: kvcmas calibrating an edge under cold reuse (the span's exact rows in the
reader's context, folded into the estimator's statistics), scheduled by a finished reply and run after its Done.

They are the lowest-priority work: the scheduler runs one step (a prefill chunk of rows, or one batch of
statistics) in a turn with nothing else to run, between the decode steps of the generating jobs, and under a
steady stream of prefills one step at least every READ_STARVE_S, so calibration ends however busy the server is
and a stream stalls at most once a second. A reply never waits for one. Each owns forks of the rows it reads (a
session closed meanwhile loses nothing); under memory pressure, past MAX_TRAINING_READS and at shutdown pending ones
are dropped (counted in kvcmas_training_reads_total{outcome="dropped"}).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from ..kv_budget import KVBudget
from ..sharing.runner import TrainingRead
from .metrics import Metrics

log = logging.getLogger("kvcmas.server")

# Training reads waiting to run; past this the oldest is dropped (each holds forks of the rows it reads).
MAX_TRAINING_READS = 64
# While requests prefill or generate, the oldest read still gets one step at least this often (seconds).
READ_STARVE_S = 1.0


class TrainingReads:
    """The server's pending training reads, oldest first (scheduler thread only)."""

    def __init__(self, metrics: Metrics, chunk: int) -> None:
        self.metrics = metrics
        self.chunk = chunk  # rows per step of a read's exact rows (--prefill-chunk)
        self._reads: deque[tuple[TrainingRead, int]] = deque()  # with the id() of the session each reads
        self._last_step = time.monotonic()

    def __len__(self) -> int:
        return len(self._reads)

    def add(self, reads: list[TrainingRead], session_id: int) -> None:
        """Reads a reply scheduled, to run after it; the oldest go beyond MAX_TRAINING_READS."""
        for read in reads:
            read.chunk = self.chunk
            self._reads.append((read, session_id))
        while len(self._reads) > MAX_TRAINING_READS:
            self.drop()

    def due(self, busy: bool) -> bool:
        """Whether a step runs this turn: when nothing else runs (`busy`: a prefill step or generating jobs), or
        when the oldest read has waited READ_STARVE_S."""
        return bool(self._reads) and (not busy or time.monotonic() - self._last_step > READ_STARVE_S)

    def step(self, budget: KVBudget, outstanding: int, session_busy: Callable[[int], bool], idle: bool) -> bool:
        """One step of the oldest read, when its rows fit beside `outstanding` (what the admitted jobs may still
        take) and its session has no prefill in flight (the read's end changes that session's spans). A read that
        does not fit while nothing runs (`idle`: nothing will free memory for it) is dropped. Returns whether the
        estimators may have changed."""
        read, session_id = self._reads[0]
        if session_busy(session_id):
            return False
        self._last_step = time.monotonic()
        rows = min(read.chunk, read.rows)
        if not budget.fits(outstanding, budget.reservation_bytes(rows)):
            if idle:
                log.info("a training read does not fit the KV budget: dropped")
                self.drop()
            return False
        try:
            more = read.step()
        except Exception:
            log.exception("a training read failed: dropped")
            more = False
        if not more:
            self._reads.popleft()
            if read.done:
                self.metrics.count_training_read("done", read.rows)
            else:
                read.close()
                self.metrics.count_training_read("dropped", 0)
        return True

    def drop(self) -> bool:
        """Drops the oldest read (frees the rows it holds); False when there is none."""
        if not self._reads:
            return False
        self._reads.popleft()[0].close()
        self.metrics.count_training_read("dropped", 0)
        return True

    def drop_all(self) -> None:
        if self._reads:
            log.info("shutting down: %d training reads not run are dropped", len(self._reads))
        while self.drop():
            pass
