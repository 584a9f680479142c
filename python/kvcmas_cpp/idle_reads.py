"""Training reads off the agents' path: a worker per model runs them while no agent call is in flight.

kvcmas calibrating an edge under cold reuse schedules a training read after the reply
(sharing.training_read.TrainingRead: the span's exact rows in the reader's context, folded into the edge's
statistics, then the fit). An AgentSession with training_reads="idle" (the default) queues its reads here. The
worker steps the oldest read only once no call of any session on the model has been in flight for IDLE_S seconds,
and checks again with the read's locks held before each step, so a call never runs a read and waits at most for one
step that began before it (a step is READ_STEP_ROWS rows of prefill, one batch of statistics, or one edge's fit).
What is left when a session resets or closes runs then. A server runs its sessions' reads itself
(server.scheduler), between its own work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator

from .model import Model
from .sharing.training_read import TrainingRead

log = logging.getLogger("kvcmas.idle_reads")

# The engine counts as idle once no call has been in flight for this long: a program calling one agent after another
# never sees a read step between its calls.
IDLE_S = 0.05
# Rows of a read's prefill per step: about what a call arriving mid-step may wait for (~0.1 s on SmolLM2-135M, 2
# threads).
READ_STEP_ROWS = 128


class IdleReads:
    """The training reads of a model's sessions, run by one daemon thread when no call is in flight."""

    _of: weakref.WeakKeyDictionary[Model, IdleReads] = weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[TrainingRead] = deque()
        self._calls = 0  # agent calls in flight on the model
        self._last_call = 0.0  # time.monotonic() when the last one ended
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, model: Model) -> IdleReads:
        with cls._of_lock:
            reads = cls._of.get(model)
            if reads is None:
                reads = cls._of[model] = cls()
            return reads

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Marks an agent call in flight while the block runs (see begin / end)."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self) -> None:
        """An agent call starts: no read step starts until it ends."""
        with self._cond:
            self._calls += 1

    def end(self) -> None:
        """The call begun with begin() ended."""
        with self._cond:
            self._calls -= 1
            self._last_call = time.monotonic()
            self._cond.notify_all()

    def idle(self) -> bool:
        """No call in flight, and none ended within IDLE_S seconds."""
        with self._cond:
            return self._calls == 0 and time.monotonic() - self._last_call >= IDLE_S

    def submit(self, read: TrainingRead) -> None:
        """Queues a read (its lock and on_done set by its session); the worker runs it when the model is idle."""
        read.chunk = min(read.chunk, READ_STEP_ROWS)
        with self._cond:
            self._queue.append(read)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvcmas-idle-reads", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def withdraw(self, reads: list[TrainingRead]) -> None:
        """Takes reads out of the queue (handed to a caller that runs them itself); a step already begun ends."""
        with self._cond:
            gone = {id(r) for r in reads}
            self._queue = deque(r for r in self._queue if id(r) not in gone)
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Reads queued and not run to their end (a session may run them meanwhile: those leave at their turn)."""
        with self._cond:
            return sum(1 for r in self._queue if not (r.done or r.dropped))

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every queued read has run (or was dropped); False if timeout seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(not (r.done or r.dropped) for r in self._queue):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
            return True

    def _next(self) -> TrainingRead:
        """The oldest read still to run, once the model is idle (under no lock on return)."""
        with self._cond:
            while True:
                while self._queue and (self._queue[0].done or self._queue[0].dropped):
                    self._queue.popleft()
                    self._cond.notify_all()
                if not self._queue:
                    self._cond.wait()
                    continue
                wait = IDLE_S - (time.monotonic() - self._last_call)
                if self._calls:
                    self._cond.wait()
                elif wait > 0:
                    self._cond.wait(wait)
                else:
                    return self._queue[0]

    def _run(self) -> None:
        while True:
            read = self._next()
            try:
                read.step(when=self.idle)
            except Exception:  # a failed read is dropped (step closed it); the worker goes on
                log.exception("a training read failed: dropped")
            del read  # holds its session while the worker waits otherwise
            with self._cond:
                self._cond.notify_all()
