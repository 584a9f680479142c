"""The training reads of an agent session (kvcmas calibrating its edges under cold reuse): when they run (its
training_reads policy), what they cost, and what their exact rows continue once done. AgentSession's part that
deals with them (a mixin: the session's state and locks are its own)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Literal

from .idle_reads import IdleReads
from .model import KVSequence
from .sharing.persist import CalibrationStore
from .sharing.state import RequestState
from .sharing.training_read import TrainingRead

# When an AgentSession runs the training reads its calls schedule (kvcmas calibrating under cold reuse):
# idle: a worker runs them while no call is in flight on the model (idle_reads), the rest at reset()/close();
# eager: the next call runs them before its prompt (its ttft_ms counts them), and reset()/close();
# manual: only run_training_reads(), take_training_reads() (a server's scheduler) and reset()/close().
TrainingReadPolicy = Literal["idle", "eager", "manual"]
TRAINING_READ_POLICIES = ("idle", "eager", "manual")


class SessionTrainingReads:
    """The training-read half of AgentSession (see the module docstring)."""

    training_reads: TrainingReadPolicy
    _lock: threading.RLock
    _estimator_lock: threading.RLock
    _idle: IdleReads
    _store: CalibrationStore | None
    _state: RequestState
    _seqs: list[KVSequence]
    _owned_rows: dict[int, int]
    _reads: list[TrainingRead]
    _reads_out: list[TrainingRead]
    _read_ms_done: float

    def _collect(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _read_lock(self) -> Iterator[None]:
        with self._lock, self._estimator_lock:
            yield

    def _read_done(self, read: TrainingRead) -> None:
        """A training read ran to its end (under _read_lock): its fits are saved, its exact rows join the session's
        sequences when a chain reads on them."""
        self._read_ms_done += read.ms
        if read.fitted and self._store is not None and read.estimator.persists:
            self._store.save(read.estimator, read.fitted)  # type: ignore[arg-type]  # persists: a RidgeEstimator
        if read.st is self._state:
            for s in self._state.owned:  # a cold-reuse hop's exact rows the chain reads on
                self._seqs.append(s)
                self._owned_rows[id(s)] = read.rows
            self._state.owned.clear()
            self._collect()
        for queue in (self._reads, self._reads_out):
            if read in queue:
                queue.remove(read)
        self._idle.withdraw([read])  # the worker's queue holds it no longer (nor the session's state through it)

    @property
    def pending_training_reads(self) -> int:
        """Training reads scheduled by finished calls and not yet run (those taken by take_training_reads
        included)."""
        with self._lock:
            return len(self._reads) + len(self._reads_out)

    @property
    def training_read_ms_total(self) -> float:
        """Milliseconds the training reads this session's calls scheduled have taken so far, wherever they ran (an
        idle worker, a call's path under 'eager', reset()/close(), run_training_reads(); a taken read's steps
        included): engine work a workflow costs besides its calls."""
        with self._lock:
            return self._read_ms_done + sum(r.ms for r in self._reads + self._reads_out)

    def wait_training_reads(self, timeout: float | None = None) -> bool:
        """Waits (without running them here) until the model's idle worker has run this session's pending reads;
        False if `timeout` seconds passed first. Under 'eager' or 'manual' nothing runs them meanwhile: False at
        once while some are pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                reads = list(self._reads)
            if not reads:
                return True
            if self.training_reads != "idle":
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._idle.wait(min(left, 1.0) if left is not None else 1.0)

    def run_training_reads(self) -> int:
        """Runs the pending training reads (kvcmas calibrating its edges) now, on this thread; returns how many ran.
        By default (training_reads='idle') a worker runs them while no call is in flight, and reset()/close() run what
        is left; call this where the program would rather pay for them now."""
        with self._lock:
            reads, n = list(self._reads), 0
            for read in reads:
                if not read.done:
                    read.run()
                    n += 1
            return n

    def _run_pending_reads(self) -> float:
        """Under 'eager', run_training_reads() before a prompt; the milliseconds it took (counted in that call's
        ttft_ms)."""
        if not self._reads or self.training_reads != "eager":
            return 0.0
        start = time.perf_counter()
        self.run_training_reads()
        return (time.perf_counter() - start) * 1000.0

    def take_training_reads(self) -> list[TrainingRead]:
        """Hands the pending training reads to the caller (a server's scheduler), which runs them step by step
        (TrainingRead.step) when it has nothing better to do, or drops them (close()). They stay valid after the
        session closes; the session then no longer continues its chains from them."""
        with self._lock:
            taken, self._reads = self._reads, []
            self._reads_out += taken
            self._idle.withdraw(taken)
            return taken
