"""Continuous batching with chunked prefill on one engine thread: the scheduler queues, ranks and admits.

The HTTP layer submits Jobs (jobs.py); one scheduler thread owns every engine call. Each turn it drops cancelled
and timed-out jobs, admits waiting jobs while a slot (--parallel) and KV memory (--kv-budget, kvcmas_cpp.kv_budget)
allow, picks the admitted job whose prefill takes the turn's step (shortest first: a later agent that reuses most
of its prompt is not stuck behind another workflow's long first prompt; waiting ages a job so a long one is not
starved), and gives every generating job one token per forward pass, so jobs join and leave the batch between
steps. Results go back through each job's sink, a thread-safe callback (the app forwards them to asyncio).

The parts it drives, each entered once per step in one direction: the batch runner (batch_runner.py) runs the
prefill plans and the forward passes (a prompt chunk with every generating job's pending token, or a decode-only
pass); each job's TokenStream (kvcmas_cpp.token_stream) turns its logits into a token, text and whether it ends;
the session store (sessions.py) holds the sharing sessions; the training reads (training_reads.py) run as the
lowest-priority work. A short prompt that arrives during a long prefill takes the next turns and its first token
comes first; no prefill runs inside another's step.

A job of a sharing session waits while another job's prefill of that session is in flight, and work that would
touch that session in the middle of it (registering a finished reply, failing a job, evicting its spans, a
training read of it) waits until that prefill ends. Sessions that share an estimator do interleave: each holds the
estimator's (re-entrant) lock on this thread while suspended between appends, so every estimator call sees a whole
state. A cancelled or timed-out prefill closes its plan, which frees the rows it computed.

KV admission is conservative: a job reserves blocks for its prompt plus max_tokens, less the prompt rows the prefix
cache serves it (re-read whenever the cache changes, so an eviction puts them back in the reservation); memory in
use is read from the engine, so rows a job reuses from shared spans cost nothing extra. When a job does not fit,
stored spans of the least recently used sharing sessions are evicted first, then the job waits; the queue holds at
most max_queue jobs and further submissions get QueueFull (HTTP 429 with Retry-After). When the server goes idle,
freed heap and free KV blocks go back to the system.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from .. import agents
from .._native import KvcmasError
from ..kv_budget import KVBudget
from ..model import Model
from ..prefix_cache import PrefixCache
from ..token_stream import TokenStream
from .admission import Admission
from .batch_runner import BatchRunner, PrefillEnd
from .job_output import JobOutput
from .jobs import Delta, Done, Event, Failed, Job, QueueFull
from .metrics import Metrics
from .sessions import IDLE_TTL_S, MAX_TENANT_SESSIONS, Namespace, SessionKey, SessionStore
from .training_reads import TrainingReads

__all__ = ["Delta", "Done", "Event", "Failed", "Job", "Namespace", "QueueFull", "Scheduler", "SessionKey"]

log = logging.getLogger("kvcmas.server")

# Prompt rows per prefill chunk (--prefill-chunk): a short prompt waits at most about one chunk of another's prefill.
# 128 rows keep the matrix products efficient (the weights are read once per chunk) while a chunk of SmolLM2-135M
# takes a few hundred ms on two cores.
PREFILL_CHUNK = 128
# Shortest first would starve a long prompt while shorter ones keep coming (an overloaded server: nonshared later
# hops are longer than the first hops that keep arriving). Waiting ages a job: it ranks as if it had this many rows
# fewer left per second since it arrived, so after a few seconds it goes before fresh prompts. A shorter prompt still
# runs between the chunks of a long one that is running (that compares the rows actually left).
PREFILL_AGING_ROWS_PER_S = 128
# What the estimators of all namespaces may hold together (--calibration-memory): the statistics of edges still
# calibrating (~17 MB an edge for SmolLM2-135M, whatever the span; dropped once the edge is fitted) and fitted maps.
CALIBRATION_BYTES = 512 << 20
EXPIRY_CHECK_S = 1.0  # how often a busy scheduler looks for idle state to age out
# A request that names no max_tokens may generate up to the context, but reserves KV for this many new tokens at
# first; the reservation doubles as the generation reaches it, while the budget allows (then the request ends with
# finish_reason "length"). Reserving the whole context up front ran such requests one at a time.
GENERATION_RESERVE = 256


def prefill_rank(job: Job, now: float) -> tuple[float, float]:
    """Prefill order, lowest first: the rows left, less PREFILL_AGING_ROWS_PER_S for every second waited; then
    arrival."""
    return (job.remaining - PREFILL_AGING_ROWS_PER_S * (now - job.t_arrival), job.t_arrival)


class Scheduler:
    """Owns the model's compute. Thread-safe API: submit, cancel, drop_workflow, stop, snapshot properties."""

    def __init__(
        self,
        model: Model,
        method: str,
        parallel: int,
        kv_budget: int,
        max_queue: int,
        metrics: Metrics,
        prefill_chunk: int = PREFILL_CHUNK,
        vision: Any = None,
        calibration_bytes: int | None = CALIBRATION_BYTES,
        cold: str = "reuse",
        calibration_dir: str | os.PathLike[str] | bool = True,
        idle_ttl: float | None = IDLE_TTL_S,
        max_tenant_sessions: int = MAX_TENANT_SESSIONS,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.method = method
        self.parallel = parallel
        self.budget = KVBudget(model, kv_budget)
        self.max_queue = max_queue
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.calibration_bytes = calibration_bytes
        self.sessions = SessionStore(
            model, vision, calibration_bytes, cold, calibration_dir, idle_ttl, max_tenant_sessions
        )
        self.runner = BatchRunner(model, metrics, prefill_chunk)
        self.reads = TrainingReads(metrics, prefill_chunk)
        self.prefix_cache = PrefixCache.of(model)
        self.admission = Admission(self.budget, self.prefix_cache, self.sessions, self.reads, metrics)
        self._active: list[Job] = []
        self.output = JobOutput(self._active, self.sessions, self.admission, self.reads, metrics)
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._last_expiry = time.monotonic()
        self._stopping = False
        self.stored_bytes = 0  # snapshot of the sessions' stored span bytes (updated each turn)
        self.estimator_bytes = 0  # snapshot of what the shared estimators hold (after prefills and finishes)
        self._estimators_touched = False  # a prefill or a finish ran since the snapshot: they feed the estimators
        # snapshot of agents.estimator_edges: (method, estimator name) -> edges by calibration state
        self.estimator_edges: dict[tuple[str, str], dict[str, int]] = {}
        self.peak_kv_bytes = 0
        self.trimmed_bytes = 0  # KV memory handed back to the system when idle, in all
        self._mixed = False  # this turn ran a prompt chunk with the decode tokens (no decode-only step then)
        self._thread = threading.Thread(target=self._run, name="kvcmas-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ public API
    kv_budget = property(lambda self: self.budget.budget, doc="KV bytes the jobs and stored spans may take")
    n_active = property(lambda self: len(self._active))
    n_queued = property(lambda self: len(self._pending))
    n_sessions = property(lambda self: len(self.sessions))
    n_namespaces = property(lambda self: self.sessions.n_namespaces, doc="see SessionStore.n_namespaces")
    n_training_reads = property(lambda self: len(self.reads), doc="training reads waiting (or part-way through)")
    expired = property(lambda self: self.sessions.expired, doc="idle state that went, by kind")
    alive = property(lambda self: self._thread.is_alive(), doc="whether the scheduler thread runs")

    def max_tokens_fitting(self, n_prompt: int) -> int:
        """The most tokens a job with this prompt may generate within the KV budget alone (may be <= 0)."""
        return self.budget.max_tokens_fitting(n_prompt)

    def submit(self, job: Job) -> None:
        """Queues a job. Raises QueueFull when max_queue jobs are already waiting."""
        with self._cond:
            if self._stopping:
                raise QueueFull(5)
            if len(self._pending) >= self.max_queue:
                waves = (len(self._pending) + len(self._active)) / max(1, self.parallel)
                raise QueueFull(max(1, math.ceil(self.output.service_s * waves)))
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stops a job (client gone); its KV is freed on the scheduler's next turn."""
        with self._cond:
            job.cancelled = True
            for child in job.children:
                child.cancelled = True
            self._cond.notify()

    def drop_workflow(self, tenant: str, workflow: str) -> bool:
        """Closes the tenant's sharing sessions of this workflow (all methods and cache salts), freeing their stored
        spans, once none of its jobs holds them any more. False when the tenant has no such workflow."""
        known = self.sessions.drop_workflow(tenant, workflow)
        if known:
            with self._cond:
                self._cond.notify()
        return known

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ----------------------------------------------------------------------------------------- the loop
    def _run(self) -> None:
        busy = False
        while True:
            with self._cond:
                idle = not self._has_work()
            if idle and busy:  # outside the lock: submissions do not wait for it
                busy = False
                self._release_free_memory()
            if idle and self._expire():
                self._release_free_memory()
            with self._cond:
                while not self._stopping and not self._has_work():
                    if not self._cond.wait(self.sessions.next_expiry()):
                        break  # idle state to age out
                if self._stopping:
                    break
                if not self._has_work():
                    continue
            busy = True
            try:
                self._turn()
            except Exception:  # a bug must not kill the engine thread; fail what is running and go on
                log.exception("scheduler turn failed")
                for job in list(self._active):
                    self.output.fail(job, 500, "internal error in the scheduler")
        for job in list(self._active):
            self.output.fail(job, 503, "the server is shutting down", "server_shutting_down")
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.sink(Failed(503, "the server is shutting down", "server_shutting_down"))
        self.reads.drop_all()
        self.sessions.close_all()

    def _has_work(self) -> bool:
        """Jobs to run or admit, workflows to drop, or training reads to run (under _cond)."""
        return bool(self._active or self._pending or self.reads) or self.sessions.has_drops

    def _release_free_memory(self) -> None:
        """Idle: gives freed heap pages and free KV blocks back to the system (RSS would stay at the load's peak)."""
        self.trimmed_bytes += self.runner.release_free_memory()

    def _expire(self) -> bool:
        """Ages out idle sessions and namespaces (SessionStore.expire); returns whether anything went."""
        self._last_expiry = time.monotonic()
        gone = self.sessions.expire({j.space for j in self._active})
        if gone:  # the snapshots /metrics reads (a busy turn takes them again)
            self.stored_bytes = self.sessions.stored_bytes
            self.estimator_bytes = agents.estimator_bytes(self.model)
        return gone

    def _turn(self) -> None:
        if time.monotonic() - self._last_expiry > EXPIRY_CHECK_S:
            self._expire()
        self._drop_cancelled()
        self._drop_expired()
        self.sessions.drop_workflows()
        self._admit()
        self._mixed = False
        job = self._next_prefill()
        if job is not None:
            self._prefill_step(job)
        busy = job is not None or bool(self._generating())  # a read step between two decode steps stalls a stream
        if self.reads.due(busy):
            idle = not self._active  # nothing running will free memory for it
            if self.reads.step(self.budget, self.admission.outstanding_bytes(self._active), self._session_busy, idle):
                self._estimators_touched = True
        if self._generating() and not self._mixed:
            self._decode_step()
        elif not self._active and self._pending:
            self._refuse_unfitting_head()
        self.stored_bytes = self.sessions.stored_bytes
        if self._estimators_touched or self.output.estimators_touched:
            self._estimators_touched = self.output.estimators_touched = False
            self.estimator_bytes = agents.estimator_bytes(self.model)
            if self.calibration_bytes is not None and self.estimator_bytes > self.calibration_bytes:
                self._bound_estimators(self.calibration_bytes)  # one bound for all namespaces: clients add them
            self.estimator_edges = agents.estimator_edges(self.model)  # read by /v1/kvcmas/summary (server.ui)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.budget.in_use)

    def _bound_estimators(self, max_bytes: int) -> None:
        """Brings the shared estimators of every namespace within --calibration-memory."""
        freed = self.sessions.bound_estimators(max_bytes)
        if freed:
            log.info("estimators: %d bytes of learned state and statistics dropped (--calibration-memory)", freed)
        self.estimator_bytes -= freed  # the snapshot just taken, less what went (this thread alone changes them)

    def _refuse_unfitting_head(self) -> None:
        """Nothing runs. A prefill that ended at its first token freed its memory in this very turn: admission tries
        the head against what is free now, and only a head that still does not fit (nothing will ever free memory
        for it) is refused."""
        self._admit()
        with self._cond:
            head = self._pending[0] if self._pending and not self._active else None
            if head is not None and not self.admission.fits(head, self._active):
                self._pending.popleft()
            else:
                head = None
        if head is not None:
            choices = f" ({head.n} choices)" if head.n > 1 else ""
            head.sink(
                Failed(
                    400,
                    f"the request needs {self.admission.needed_bytes(head)} bytes of KV memory{choices} but only "
                    f"{self.budget.free} of the budget ({self.budget.budget}) are free",
                    "context_length_exceeded",
                )
            )

    def _session_busy(self, session_id: int) -> bool:
        return session_id in self.sessions.busy

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [j for j in self._pending if j.cancelled]
            for j in gone:
                self._pending.remove(j)
        if gone:
            self.metrics.bump("cancelled", len(gone))
        for j in [j for j in self._active if j.cancelled and not j.ending]:
            self.output.release(j)
            self.metrics.bump("cancelled")
            log.info("%s cancelled after %d tokens", j.id, len(j.generated))

    def _drop_expired(self) -> None:
        """Ends jobs past their deadline (--request-timeout), waiting or running; running ones free their KV."""
        now = time.perf_counter()
        with self._cond:
            late = [j for j in self._pending if j.deadline is not None and now > j.deadline and not j.cancelled]
            for j in late:
                self._pending.remove(j)
        late += [
            j for j in self._active if j.deadline is not None and now > j.deadline and not j.cancelled and not j.ending
        ]
        for j in late:
            log.warning("%s timed out after %d tokens", j.id, len(j.generated))
            self.metrics.bump("timed_out")
            self.output.fail(j, 408, f"the request timed out after {now - j.t_arrival:.1f} s", "request_timeout")

    # ------------------------------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Gives waiting jobs a slot while their KV reservation fits, evicting stored spans for it."""
        while len(self._active) < self.parallel:
            with self._cond:
                if not self._pending:
                    return
                job = self._pending[0]
            while not self.admission.fits(job, self._active):
                if not self.admission.evict_one():
                    return
            with self._cond:
                self._pending.popleft()
            if job.cancelled:
                self.metrics.bump("cancelled")
                continue
            self._bind(job)

    def _bind(self, job: Job) -> None:
        """An admitted job: its token stream, its backend (the sharing session for chat) and how much it computes."""
        job.t_admit = time.perf_counter()
        try:
            ids, tok = list(job.ids), self.model.tokenizer
            job.stream = TokenStream(tok, job.params, job.stops, job.max_tokens, ids, job.constraint, job.logprobs)
            if job.session_key is not None and job.messages is not None:
                session = self.sessions.open(job.session_key)
                session.active += 1  # until _release: the session stays open while the job holds its KV
                job.session = session
                job.backend = session.backend
                job.remaining = job.n_prompt - session.backend.reusable_tokens(job.messages)
            else:
                job.backend = self.runner.plain
                job.remaining = job.n_prompt
        except ValueError as e:  # sampling parameters, or messages the session cannot read
            self.output.fail(job, 400, str(e), "invalid_request_error")
            return
        except Exception as e:  # a bug in making its session must cost this job, never leave it unanswered
            log.exception("%s: binding failed", job.id)
            self.output.fail(job, 500, f"internal error: {type(e).__name__}: {e}", "internal_error")
            return
        self._active.append(job)

    # -------------------------------------------------------------------------------------------- prefill
    def _next_prefill(self) -> Job | None:
        """The admitted job whose prefill takes this turn's step (prefill_rank): one in flight, or one to start that
        is not of a session with a prefill in flight."""
        busy = self.sessions.busy
        ready = [
            j
            for j in self._active
            if j.prefilled is None
            and not j.cancelled
            and not j.ending
            and (j.plan is not None or (not j.prefilling and (j.session is None or id(j.session) not in busy)))
        ]
        now = time.perf_counter()
        return min(ready, key=lambda j: prefill_rank(j, now), default=None)

    def _prefill_step(self, job: Job) -> None:
        """One step of job's prefill: its plan is started if it has none, then the next chunk of its current append
        runs in one forward pass with the decode tokens, whose jobs take their next token. When the append is done
        the plan goes on to its next append, or the prefill ends (its first token). A chunk the engine refuses is
        thrown into the plan."""
        if job.plan is None:
            self._estimators_touched = True
            if job.session is not None:
                self.sessions.busy[id(job.session)] = job
            end = self.runner.start(job)
            if end is not None:
                self._prefill_ended(job, end)
            if job.plan is None:  # it ended already
                return
        running = self._generating()
        try:
            result = self.runner.run_chunk(job, running)
        except Exception as e:
            self._advance(job, None, e)
            return
        if running:
            self._mixed = True  # the generating jobs have their step in this turn
            if result.decode_rows is None:
                self._decode_step()
            else:
                for j, row in zip(running, result.decode_rows, strict=True):
                    self.output.next_token(j, row)
        if result.last:
            self._advance(job, result.logits, None)

    def _advance(self, job: Job, sent: np.ndarray | None, error: Exception | None) -> None:
        end = self.runner.advance(job, sent, error)
        if end is not None:
            self._prefill_ended(job, end)

    def _prefill_ended(self, job: Job, end: PrefillEnd) -> None:
        """A plan returned or failed: the job samples its first token (and its forks' for n > 1), or fails;
        completions deferred for its session run now."""
        self.output.end_prefill(job)
        error = end.error
        if isinstance(error, KvcmasError):
            log.warning("%s: prefill refused by the engine: %s", job.id, error)
            self.output.fail(job, 503, f"the engine could not take the request now: {error}", "server_busy")
        elif isinstance(error, ValueError):  # e.g. a chat template that rejects the messages
            self.output.fail(job, 400, str(error), "invalid_request_error")
        elif error is not None:  # a bug in a backend must cost this job only
            log.error("%s: prefill failed", job.id, exc_info=error)
            self.output.fail(
                job, 500, f"internal error during prefill: {type(error).__name__}: {error}", "internal_error"
            )
        prefilled = end.prefilled
        if prefilled is not None:
            job.prefilled = prefilled
            job.remaining = 0
            if not job.cancelled:  # a cancelled job is released on the next turn
                forks = [job.fork_choice(i, prefilled) for i in range(1, job.n)]
                with self._cond:
                    for fork in forks:
                        fork.cancelled = job.cancelled
                        job.children.append(fork)
                self._active.extend(forks)
                for choice in [job, *forks]:  # first tokens come before the postponed work
                    self.output.next_token(choice, prefilled.logits)
        self.output.run_deferred()

    # --------------------------------------------------------------------------------------------- decoding
    def _generating(self) -> list[Job]:
        return [j for j in self._active if j.prefilled is not None and not j.cancelled and not j.ending]

    def _decode_step(self) -> None:
        running = self._generating()
        if not running:
            return
        try:
            rows = self.runner.decode(running)
        except KvcmasError as e:
            # Reservations make this rare (budget shared with stored spans): evict, or give up the newest job.
            if not self.admission.evict_one():
                victim = max(running, key=lambda j: j.t_admit)
                log.warning("%s: decode refused by the engine (%s); failing the newest job", victim.id, e)
                self.output.fail(victim, 503, f"out of KV memory: {e}", "server_busy")
            return
        for job, logits in zip(running, rows, strict=True):
            self.output.next_token(job, logits)
