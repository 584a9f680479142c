"""Continuous batching with chunked prefill on one engine thread.

The HTTP layer submits Jobs; one scheduler thread owns every engine call. Each turn it drops cancelled jobs, admits
waiting jobs while a slot (--parallel) and KV memory (--kv-budget) allow, prefills the admitted job with the fewest
prompt rows left to compute (shortest first: a later agent that reuses most of its prompt is not stuck behind
another workflow's long first prompt), and gives every job that is generating one token per forward pass, so jobs
join and leave the batch between steps. Results go back through each job's sink, a thread-safe callback (the app
forwards them to asyncio).

Prefill plans, one chunk per turn: every prefill is a plan (kvcmas_cpp.plan; Backend.prefill_plan: a generator that
yields the appends computing its rows, plain prompts and the sharing methods' hops alike) that the scheduler holds in
flight. Each turn the in-flight or startable prefill first in prefill_rank order (shortest remaining first, with
aging) runs the next chunk of its current append, --prefill-chunk rows (plan.chunk_bounds: the same rows and
logits as one piece, each row attends to the rows before it), in ONE forward pass together with the pending token of
every generating job (the step's token budget: one chunk plus one row per generating job; the weights are read once
for all of them). A short prompt that arrives during a long prefill takes the next turns and its first token comes
first; no prefill runs inside another's step. A turn without a prompt chunk runs a decode-only step
(Model.decode_batch). A chunk the engine refuses is thrown into its plan, where a direct append would have raised.
A job of a sharing session waits while another job's prefill of that session is in flight, and work that would
touch that session in the middle of it (registering a finished reply, failing a job, evicting its spans, a
training read of it) waits until that prefill ends. Sessions that share an estimator do interleave: each holds the
estimator's (re-entrant) lock on this thread while suspended between appends, so every estimator call sees a whole
state. A cancelled or timed-out prefill closes its plan, which frees the rows it computed. A decode row computed in
a batch with a chunk may differ from the same row computed alone in the last bits (the engine picks its kernels by
batch size).

Training reads (kvcmas calibrating an edge under cold reuse: the span's exact rows in the reader's context, folded
into the estimator's statistics) are scheduled by a finished reply and run after its Done, as the lowest-priority
work: one step (a prefill chunk of rows, or one batch of statistics) in a turn with no prefill to run, between the
decode steps of the generating jobs, and under a steady stream of prefills one step at least every READ_STARVE_S.
A reply never waits for one. They own forks of the rows they read, so a session closed meanwhile loses nothing;
under memory pressure, past MAX_TRAINING_READS and at shutdown pending ones are dropped (counted in
kvcmas_training_reads_total{outcome="dropped"}).

KV admission is conservative: a job reserves blocks for its prompt plus max_tokens, less the prompt rows the prefix
cache serves it (re-read whenever the cache changes, so an eviction puts them back in the reservation); memory in
use is read from the engine, so rows a job reuses from shared spans cost nothing extra. When a job does not fit,
stored spans of the least recently used sharing sessions are evicted first, then the job waits; the queue holds at
most max_queue jobs and further submissions get QueueFull (HTTP 429 with Retry-After). When the server goes idle,
freed heap and free KV blocks go back to the system.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np

from .. import agents
from .._native import KvcmasError
from ..constrained import ConstraintDeadEnd
from ..model import PROMPT_CHUNK, KVSequence, Model
from ..plan import MIN_CHUNK_ROWS, Append, ChunkExecutor, Plan, chunk_bounds
from ..prefix_cache import PrefixCache
from ..sampling import Sampler, SamplingParams, StopMatcher, TokenLogprob, token_logprobs
from ..sharing.runner import TrainingRead
from ..tokenizer import StreamDecoder
from .backend import Backend, PlainBackend, PlainPrefilled, Prefilled, Segment, make_backend
from .metrics import Metrics

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
MAX_SESSIONS = 256  # sharing sessions kept; idle least recently used ones are closed beyond this
# Idle state ages out (--idle-ttl): a sharing session unused this long is closed (its stored spans freed), and a
# namespace (tenant and cache_salt) with no session and no request this long forgets its estimator and its prefix
# cache entries (maps saved in --calibration-dir load again on its next request). Clients rarely end workflows.
IDLE_TTL_S = 600.0
# Sharing sessions one tenant may hold (--max-sessions-per-tenant): beyond it the tenant's least recently used idle
# one is closed, so one tenant's workflows and cache_salts cannot crowd out the others' up to MAX_SESSIONS.
MAX_TENANT_SESSIONS = 64
EXPIRY_CHECK_S = 1.0  # how often a busy scheduler looks for idle state to age out
# A session keeps every message it has seen (its shared context only grows), so a long-lived one (the default
# session of unmodified clients) is replaced by a fresh one after this many requests, when idle. What kvcmas
# learned lives in the model-wide estimator and survives.
MAX_SESSION_REQUESTS = 512
# A request that names no max_tokens may generate up to the context, but reserves KV for this many new tokens at
# first; the reservation doubles as the generation reaches it, while the budget allows (then the request ends with
# finish_reason "length"). Reserving the whole context up front ran such requests one at a time.
GENERATION_RESERVE = 256
# Training reads waiting to run; past this the oldest is dropped (each holds forks of the rows it reads).
MAX_TRAINING_READS = 64
# Training reads step when nothing else runs; while requests prefill or generate, the oldest read still gets one step
# at least this often (seconds), so calibration ends however busy the server is and a stream stalls at most once a
# second; a step is one prefill chunk of rows or one batch of statistics.
READ_STARVE_S = 1.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS, Windows)."""
    try:
        import ctypes

        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _return_free_heap() -> None:
    """Gives memory freed by the finished requests back to the system when the server goes idle (glibc keeps freed
    heap pages of its arenas otherwise, so RSS would stay at the load's peak)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class Delta:
    """Newly generated text (never part of a stop string) of choice `index`; logprobs: its tokens' (when asked)."""

    text: str
    token: int | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Done:
    """The job finished; stats has usage, timings and kvcmas fields."""

    finish_reason: Literal["stop", "length"]
    stats: dict[str, Any]
    index: int = 0  # the choice (n > 1)


@dataclass
class Failed:
    """The job could not run. status is the HTTP status to report."""

    status: int
    message: str
    code: str = "server_error"


Event = Delta | Done | Failed


class Namespace(NamedTuple):
    """Who may share with whom: requests share spans, prefix caches and what the estimator learns only within one
    namespace. tenant: the API key's tenant; salt: the request's cache_salt ('' when none)."""

    tenant: str
    salt: str = ""

    def estimator_name(self) -> str:
        """The name the namespace's sessions share their estimator under (AgentSession's workflow)."""
        return "ns-" + hashlib.sha256(f"{self.tenant}\x00{self.salt}".encode()).hexdigest()[:24]

    def cache_namespace(self) -> str:
        """The namespace's entries in the model's prefix cache: owned by its tenant (PrefixCache.owners), so one
        tenant's prompts never evict another's, whatever cache_salts it sends."""
        tenant = hashlib.sha256(self.tenant.encode()).hexdigest()[:16]
        return f"tenant-{tenant}/{self.estimator_name()}"


class SessionKey(NamedTuple):
    """A sharing session: one workflow of one namespace under one method."""

    namespace: Namespace
    workflow: str
    method: str


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the request queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


@dataclass(eq=False)
class Job:
    """One generation request. The fields above `# runtime` are set by the submitter."""

    id: str
    ids: list[int]  # the prompt's token ids (rendered chat template for chat requests)
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    sink: Callable[[Event], None]
    deadline: float | None = None  # time.perf_counter() by which the job must be done; then it fails with 408
    reserve: int = 0  # new tokens whose KV is reserved (grows up to max_tokens); max_tokens when 0
    # chat requests: what a sharing session prefills (contents: strings, or lists of strings and image embeddings)
    messages: list[dict[str, Any]] | None = None
    agent: str | None = None
    session_key: SessionKey | None = None  # chat: its sharing session; None: plain prompt (completions)
    namespace: Namespace | None = None  # plain prompt: whose prefix cache entries it may read (None: none)
    recompute: float = 0.0  # chat: the share of its shared rows the agent recomputes (MethodConfig.recompute)
    segments: list[Segment] | None = None  # the rendered prompt as text ids and image embeddings; [ids] when None
    n_prompt: int = 0  # prompt positions (text tokens and image embeddings); len(ids) when 0
    n: int = 1  # choices: n - 1 more continue forks of this job's prompt sequence (computed once)
    logprobs: int | None = None  # None: none; else report each token's logprob and this many alternatives
    constraint: Any = None  # constrained decoding (kvcmas_cpp.constrained.Constraint): the tokens allowed next
    t_arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    cached: int = 0  # prompt rows the prefix cache serves (Scheduler._prompt_rows), as of its version cached_version
    cached_version: int = -1
    # runtime (scheduler thread only)
    backend: Backend | None = None
    session: _Session | None = None
    prefilled: Prefilled | None = None
    sampler: Sampler | None = None
    decoder: StreamDecoder | None = None
    matcher: StopMatcher | None = None
    history: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    received: str = ""  # the text the client got (stop strings cut)
    pending_token: int = -1
    remaining: int = 0  # prompt rows still to compute (an estimate): the shortest prefill goes first
    prefilling: bool = False  # its prefill plan is in flight (from its start to its end)
    ending: bool = False  # finished or failed while its session's prefill was in flight; completed when that ends
    t_admit: float = 0.0  # got a slot and its KV reservation
    t_prefill: float = 0.0  # its prefill started
    t_first: float = 0.0
    engine_ms: float = 0.0  # time in the forward passes of its prompt's chunks (they carry decode rows too)
    plan_ms: float = 0.0  # time in its prefill plan between appends (the method's own work: forks, corrections)
    interleaved_ms: float = 0.0  # time other jobs' work ran during its prefill, outside its own passes and plan
    chunks_run: int = 0  # prompt chunks its prefill ran (_prefill_step)
    plan: Plan[Prefilled] | None = None  # its prefill in flight (Backend.prefill_plan)
    append: Append | None = None  # the plan's current append
    appended: int = 0  # rows of it computed
    index: int = 0  # choice index (forks of an n > 1 job)
    children: list[Job] = field(default_factory=list)  # its forks (n > 1)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # tokens whose text is not sent yet

    @property
    def tenant(self) -> str | None:
        """The tenant whose request this is (None: unknown, a job made outside the server)."""
        ns = self.session_key.namespace if self.session_key is not None else self.namespace
        return ns.tenant if ns is not None else None

    def __post_init__(self) -> None:
        if not self.n_prompt:
            self.n_prompt = len(self.ids)
        if not self.reserve:
            self.reserve = self.max_tokens


def prefill_rank(job: Job, now: float) -> tuple[float, float]:
    """Prefill order, lowest first: the rows left, less PREFILL_AGING_ROWS_PER_S for every second waited; then
    arrival."""
    return (job.remaining - PREFILL_AGING_ROWS_PER_S * (now - job.t_arrival), job.t_arrival)


@dataclass
class _Session:
    backend: Backend
    active: int = 0
    requests: int = 0
    last_used: float = field(default_factory=time.monotonic)


class Scheduler:
    """Owns the model's compute. Thread-safe API: submit, cancel, stop, snapshot properties."""

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
        self.kv_budget = kv_budget
        self.max_queue = max_queue
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.vision = vision  # sessions get the vision encoder: image embeddings in their messages
        self.calibration_bytes = calibration_bytes
        self.cold, self.calibration_dir = cold, calibration_dir  # kvcmas sessions (AgentSession)
        self.block_rows, self.block_bytes = model.kv_block_rows, model.kv_block_bytes  # the engine's KV blocks
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._sessions: OrderedDict[SessionKey, _Session] = OrderedDict()  # least recently used first
        self.idle_ttl, self.max_tenant_sessions = idle_ttl, max_tenant_sessions
        self._namespaces: dict[Namespace, float] = {}  # namespace -> when a request of it last ended (monotonic)
        self._last_expiry = time.monotonic()
        # idle state that went: sessions and namespaces past --idle-ttl, sessions beyond a cap (capped)
        self.expired: dict[str, int] = {"session": 0, "namespace": 0, "capped": 0}
        self._plain = PlainBackend(model)
        self.prefix_cache = PrefixCache.of(model)  # agents' template prefixes and plain prompts, per namespace
        self._stopping = False
        self._drops: set[tuple[str, str]] = set()  # (tenant, workflow) whose sessions are to be closed
        self._workflows: dict[tuple[str, str], int] = {}  # (tenant, workflow) -> open sessions (under _cond)
        self._service_s = 1.0  # moving average of a job's time in the engine, for Retry-After
        self.stored_bytes = 0  # snapshot of the sessions' stored span bytes (updated each turn)
        self.estimator_bytes = 0  # snapshot of what the shared estimators hold (after prefills and finishes)
        self._estimators_touched = False  # a prefill or a finish ran since the snapshot: they feed the estimators
        # snapshot of agents.estimator_edges: (method, estimator name) -> edges by calibration state
        self.estimator_edges: dict[tuple[str, str], dict[str, int]] = {}
        self.peak_kv_bytes = 0
        self.trimmed_bytes = 0  # KV memory handed back to the system when idle, in all
        self._mixed = False  # this turn ran a prompt chunk with the decode tokens (no decode-only step then)
        self._busy: dict[int, Job] = {}  # id() of a session -> its job whose prefill plan is in flight
        # completions postponed until their session's prefill plan ends: (id() of the session, the completion)
        self._deferred: list[tuple[int, Callable[[], None]]] = []
        # training reads to run after their replies, oldest first, with the id() of the session they read
        self._reads: deque[tuple[TrainingRead, int]] = deque()
        self._last_read_step = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvcmas-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ public API
    @property
    def n_active(self) -> int:
        return len(self._active)

    @property
    def n_queued(self) -> int:
        return len(self._pending)

    @property
    def n_sessions(self) -> int:
        return len(self._sessions)

    @property
    def n_namespaces(self) -> int:
        """Namespaces whose requests ended within --idle-ttl, or that hold a session."""
        return len(set(self._namespaces) | {k.namespace for k in list(self._sessions)})

    @property
    def n_training_reads(self) -> int:
        """Training reads waiting to run (or part-way through)."""
        return len(self._reads)

    def reservation_bytes(self, n_tokens: int) -> int:
        """KV bytes reserved for a job that may hold n_tokens rows (one spare block for a partly filled first one)."""
        return (math.ceil(n_tokens / self.block_rows) + 1) * self.block_bytes

    def max_tokens_fitting(self, n_prompt: int) -> int:
        """The most tokens a job with this prompt may generate within the KV budget alone (may be <= 0)."""
        blocks = self.kv_budget // self.block_bytes - 1
        return blocks * self.block_rows - n_prompt

    def submit(self, job: Job) -> None:
        """Queues a job. Raises QueueFull when max_queue jobs are already waiting."""
        with self._cond:
            if self._stopping:
                raise QueueFull(5)
            if len(self._pending) >= self.max_queue:
                waves = (len(self._pending) + len(self._active)) / max(1, self.parallel)
                raise QueueFull(max(1, math.ceil(self._service_s * waves)))
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
        with self._cond:
            known = self._workflows.get((tenant, workflow), 0) > 0
            if known:
                self._drops.add((tenant, workflow))
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
                    if not self._cond.wait(self._next_expiry()):
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
                    self._fail(job, 500, "internal error in the scheduler")
        for job in list(self._active):
            self._fail(job, 503, "the server is shutting down", "server_shutting_down")
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.sink(Failed(503, "the server is shutting down", "server_shutting_down"))
        if self._reads:
            log.info("shutting down: %d training reads not run are dropped", len(self._reads))
        while self._reads:
            self._drop_read()
        for s in self._sessions.values():
            s.backend.close()

    def _has_work(self) -> bool:
        """Jobs to run or admit, workflows to drop, or training reads to run (under _cond)."""
        return bool(self._active or self._pending or self._drops or self._reads)

    def _release_free_memory(self) -> None:
        """Idle: gives freed heap pages and free KV blocks back to the system (RSS would stay at the load's peak)."""
        _return_free_heap()
        released = self.model.kv_trim()
        self.trimmed_bytes += released
        if released:
            log.debug("idle: %d bytes of free KV blocks released", released)

    def _next_expiry(self) -> float | None:
        """Seconds until the next idle session or namespace ages out (at least 0.05), None when none will."""
        if self.idle_ttl is None:
            return None
        times = [s.last_used for s in self._sessions.values() if s.active == 0] + list(self._namespaces.values())
        return max(0.05, min(times) + self.idle_ttl - time.monotonic()) if times else None

    def _expire(self) -> bool:
        """Closes sessions idle for --idle-ttl and forgets namespaces with no session and no request for as long
        (their estimators and prefix cache entries). Returns whether anything went."""
        now = self._last_expiry = time.monotonic()
        if self.idle_ttl is None:
            return False
        cutoff = now - self.idle_ttl
        gone = False
        for key, s in list(self._sessions.items()):
            if s.active == 0 and s.last_used < cutoff and id(s) not in self._busy:
                self._close_session(key)
                self.expired["session"] += 1
                gone = True
        in_use: set[Namespace | None] = {k.namespace for k in self._sessions}
        in_use |= {j.session_key.namespace if j.session_key is not None else j.namespace for j in self._active}
        for ns, last in list(self._namespaces.items()):
            if last < cutoff and ns not in in_use:
                del self._namespaces[ns]
                agents.forget_estimators(self.model, ns.estimator_name())
                self.prefix_cache.forget(ns.cache_namespace())
                self.expired["namespace"] += 1
                gone = True
        if gone:  # the snapshots /metrics reads (a busy turn takes them again)
            self.stored_bytes = sum(s.backend.stored_bytes for s in self._sessions.values())
            self.estimator_bytes = agents.estimator_bytes(self.model)
        return gone

    def _turn(self) -> None:
        if time.monotonic() - self._last_expiry > EXPIRY_CHECK_S:
            self._expire()
        self._drop_cancelled()
        self._drop_expired()
        self._drop_workflows()
        self._admit(evict=True)
        self._mixed = False
        job = self._next_prefill()
        if job is not None:
            self._prefill_step(job)
        busy = job is not None or bool(self._generating())  # a read step between two decode steps stalls a stream
        if self._reads and (not busy or time.monotonic() - self._last_read_step > READ_STARVE_S):
            self._read_step()
        if self._generating() and not self._mixed:
            self._decode_step()
        elif not self._active and self._pending:
            # Nothing runs. A prefill that ended at its first token freed its memory in this very turn: admission
            # tries the head against what is free now, and only a head that still does not fit (nothing will ever
            # free memory for it) is refused.
            self._admit(evict=True)
            with self._cond:
                head = self._pending[0] if self._pending and not self._active else None
                if head is not None and not self._fits(head):
                    self._pending.popleft()
                else:
                    head = None
            if head is not None:
                choices = f" ({head.n} choices)" if head.n > 1 else ""
                free = self.kv_budget - self.model.kv_bytes_in_use
                head.sink(
                    Failed(
                        400,
                        f"the request needs {self._needed_bytes(head)} bytes of KV memory{choices} but only {free} "
                        f"of the budget ({self.kv_budget}) are free",
                        "context_length_exceeded",
                    )
                )
        self.stored_bytes = sum(s.backend.stored_bytes for s in self._sessions.values())
        if self._estimators_touched:
            self._estimators_touched = False
            self.estimator_bytes = agents.estimator_bytes(self.model)
            if self.calibration_bytes is not None and self.estimator_bytes > self.calibration_bytes:
                self._bound_estimators(self.calibration_bytes)  # one bound for all namespaces: clients add them
            self.estimator_edges = agents.estimator_edges(self.model)  # read by /v1/kvcmas/summary (server.ui)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.model.kv_bytes_in_use)

    def _bound_estimators(self, max_bytes: int) -> None:
        """Brings the shared estimators of every namespace within --calibration-memory (agents.bound_estimators)."""
        live = {key.namespace.estimator_name() for key in self._sessions}
        busy = {key.namespace.estimator_name() for key, s in self._sessions.items() if id(s) in self._busy}
        freed = agents.bound_estimators(self.model, max_bytes, live, busy)
        if freed:
            log.info("estimators: %d bytes of learned state and statistics dropped (--calibration-memory)", freed)
        self.estimator_bytes -= freed  # the snapshot just taken, less what went (this thread alone changes them)

    def _read_step(self) -> None:
        """One step of the oldest training read, when its rows fit beside what the admitted jobs may still take and
        its session has no prefill in flight (the read's end changes that session's spans)."""
        read, session_id = self._reads[0]
        if session_id in self._busy:
            return
        self._last_read_step = time.monotonic()
        rows = min(read.chunk, read.rows)
        if self.model.kv_bytes_in_use + self._outstanding_bytes() + self.reservation_bytes(rows) > self.kv_budget:
            if not self._active:  # nothing running will free memory for it
                log.info("a training read does not fit the KV budget: dropped")
                self._drop_read()
            return
        self._estimators_touched = True
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

    def _drop_read(self) -> None:
        """Drops the oldest training read (frees the rows it holds)."""
        self._reads.popleft()[0].close()
        self.metrics.count_training_read("dropped", 0)

    def _drop_cancelled(self) -> None:
        with self._cond:
            gone = [j for j in self._pending if j.cancelled]
            for j in gone:
                self._pending.remove(j)
        if gone:
            self.metrics.bump("cancelled", len(gone))
        for j in [j for j in self._active if j.cancelled and not j.ending]:
            self._release(j)
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
            self._fail(j, 408, f"the request timed out after {now - j.t_arrival:.1f} s", "request_timeout")

    def _drop_workflows(self) -> None:
        with self._cond:
            drops = set(self._drops)
        done: set[tuple[str, str]] = set()
        for tenant, workflow in drops:
            keys = [k for k in self._sessions if k.namespace.tenant == tenant and k.workflow == workflow]
            for key in keys:
                if self._sessions[key].active == 0:
                    self._close_session(key)
            if all(k not in self._sessions for k in keys):
                done.add((tenant, workflow))
        if done:
            with self._cond:
                self._drops -= done

    # ------------------------------------------------------------------------------------------ admission
    def _outstanding_bytes(self) -> int:
        """KV the admitted jobs may still allocate: their remaining tokens, and their prompts until prefilled."""
        return sum(
            self.reservation_bytes(
                max(0, j.reserve - len(j.generated)) + (self._prompt_rows(j) if j.prefilled is None else 0)
            )
            + (self.reservation_bytes(j.reserve) * (j.n - 1) if j.prefilled is None else 0)  # its forks (n > 1)
            for j in self._active
        )

    def _prompt_rows(self, job: Job) -> int:
        """The prompt rows a job will compute: its prompt less the rows the prefix cache serves it now (its
        namespace's longest match; text prompts only). Memoized per cache version."""
        cache = self.prefix_cache
        if job.cached_version != cache.version:
            job.cached_version = cache.version
            ns = job.session_key.namespace if job.session_key is not None else job.namespace
            text = job.segments is None or all(isinstance(g, list) for g in job.segments)
            job.cached = cache.cached_rows(ns.cache_namespace(), job.ids) if ns is not None and text else 0
        return job.n_prompt - job.cached

    def _needed_bytes(self, job: Job) -> int:
        """KV a job reserves to be admitted: its prompt and tokens, and each other choice's tokens (n > 1)."""
        first = self.reservation_bytes(self._prompt_rows(job) + job.reserve)
        return first + (job.n - 1) * self.reservation_bytes(job.reserve)

    def _fits(self, job: Job) -> bool:
        return self.model.kv_bytes_in_use + self._outstanding_bytes() + self._needed_bytes(job) <= self.kv_budget

    def _grow_reservation(self, job: Job) -> bool:
        """A job whose generation reached its reservation: doubles it (up to max_tokens) if the budget allows,
        evicting stored spans for it. False when it cannot grow."""
        new = min(job.max_tokens, 2 * job.reserve)
        while True:
            extra = self.reservation_bytes(new - len(job.generated))
            if self.model.kv_bytes_in_use + self._outstanding_bytes() + extra <= self.kv_budget:
                job.reserve = new
                return True
            if not self._evict_one():
                return False

    def _evict_one(self) -> bool:
        """Evicts one stored span, from the least recently used session that has any; when none has, the least
        recently used prefix cache entry (a prefill in progress holds its own fork of its prefix); when none is left,
        closes the least recently used idle session (which drops whatever else it holds). Sessions in the middle of
        a prefill are left alone."""
        for s in self._sessions.values():
            if id(s) not in self._busy and s.backend.evict_lru():
                self.metrics.bump("evictions")
                return True
        if self.prefix_cache.evict_lru():  # counted by the cache (kvcmas_evictions_total reads its count)
            return True
        if self._reads:  # it holds forks of rows the sessions let go of
            self._drop_read()
            return True
        for key, s in self._sessions.items():
            if s.active == 0 and s.backend.stored_bytes > 0:
                self._close_session(key)
                self.metrics.bump("evictions")
                return True
        return False

    def _close_session(self, key: SessionKey) -> None:
        self._sessions.pop(key).backend.close()
        with self._cond:
            wf = (key.namespace.tenant, key.workflow)
            self._workflows[wf] -= 1
            if not self._workflows[wf]:
                del self._workflows[wf]

    def _admit(self, evict: bool) -> None:
        """Gives waiting jobs a slot while their KV reservation fits (evicting stored spans for it if `evict`)."""
        while len(self._active) < self.parallel:
            with self._cond:
                if not self._pending:
                    return
                job = self._pending[0]
            while not self._fits(job):
                if not evict or not self._evict_one():
                    return
            with self._cond:
                self._pending.popleft()
            if job.cancelled:
                self.metrics.bump("cancelled")
                continue
            self._bind(job)

    def _session(self, key: SessionKey) -> _Session:
        s = self._sessions.get(key)
        if s is not None and s.requests >= MAX_SESSION_REQUESTS and s.active == 0:
            self._close_session(key)
            s = None
        if s is None:
            backend = make_backend(
                self.model,
                key.method,
                self.vision,
                self.calibration_bytes,
                key.namespace.estimator_name(),
                self.cold,
                self.calibration_dir,
                key.namespace.cache_namespace(),
            )
            s = _Session(backend)
            self._sessions[key] = s
            with self._cond:
                wf = (key.namespace.tenant, key.workflow)
                self._workflows[wf] = self._workflows.get(wf, 0) + 1
            self._close_idle_beyond(MAX_SESSIONS, key, None)
            self._close_idle_beyond(self.max_tenant_sessions, key, key.namespace.tenant)
        self._sessions.move_to_end(key)
        s.last_used = time.monotonic()
        s.requests += 1
        return s

    def _close_idle_beyond(self, limit: int, keep: SessionKey, tenant: str | None) -> None:
        """Closes the least recently used idle sessions (of one tenant, or of all) beyond `limit`, never `keep`."""
        while sum(tenant is None or k.namespace.tenant == tenant for k in self._sessions) > limit:
            mine = (k for k, v in self._sessions.items() if v.active == 0 and k != keep)
            idle = next((k for k in mine if tenant is None or k.namespace.tenant == tenant), None)
            if idle is None:
                return
            self._close_session(idle)
            self.expired["capped"] += 1

    def _bind(self, job: Job) -> None:
        """An admitted job: its sampler, its backend (the sharing session for chat) and how much it will compute."""
        job.t_admit = time.perf_counter()
        try:
            job.sampler = Sampler(job.params)
            if job.session_key is not None and job.messages is not None:
                session = self._session(job.session_key)
                session.active += 1  # until _release: the session stays open while the job holds its KV
                job.session = session
                job.backend = session.backend
                job.remaining = job.n_prompt - session.backend.reusable_tokens(job.messages)
            else:
                job.backend = self._plain
                job.remaining = job.n_prompt
        except ValueError as e:  # sampling parameters, or messages the session cannot read
            self._fail(job, 400, str(e), "invalid_request_error")
            return
        except Exception as e:  # a bug in making its session must cost this job, never leave it unanswered
            log.exception("%s: binding failed", job.id)
            self._fail(job, 500, f"internal error: {type(e).__name__}: {e}", "internal_error")
            return
        job.decoder = StreamDecoder(self.model.tokenizer)
        job.matcher = StopMatcher(job.stops)
        job.history = list(job.ids)
        self._active.append(job)

    # -------------------------------------------------------------------------------------------- prefill
    def _next_prefill(self) -> Job | None:
        """The admitted job whose prefill takes this turn's step (prefill_rank): one in flight, or one to start that
        is not of a session with a prefill in flight."""
        ready = [
            j
            for j in self._active
            if j.prefilled is None
            and not j.cancelled
            and not j.ending
            and (j.plan is not None or (not j.prefilling and (j.session is None or id(j.session) not in self._busy)))
        ]
        now = time.perf_counter()
        return min(ready, key=lambda j: prefill_rank(j, now), default=None)

    def _prefill_step(self, job: Job) -> None:
        """One step of job's prefill: its plan is started if it has none, then the next chunk of its current append
        runs in one forward pass with the decode tokens (_pass). When the append is done the plan goes on to its next
        append, or the prefill ends (its first token). A chunk the engine refuses is thrown into the plan."""
        if job.plan is None:
            self._start_plan(job)
            if job.plan is None:  # it ended already
                return
        step = job.append
        assert step is not None
        first, end = chunk_bounds(len(step.rows) - job.appended, self.prefill_chunk)[0]
        first, end = first + job.appended, end + job.appended
        last = end == len(step.rows)
        try:
            want = step.logits if last else "none"
            if step.image_pos is None:
                out = self._pass(job, step.seq, step.rows[first:end], want)
            else:  # an M-RoPE image's rows, with their places in it
                out = self._pass(job, step.seq, step.rows[first:end], want, step.image_pos[first:end])
        except Exception as e:
            self._advance_plan(job, None, e)
            return
        job.appended = end
        job.remaining = max(0, job.remaining - (end - first))
        job.chunks_run += 1
        if last:
            self._advance_plan(job, out, None)

    def _start_plan(self, job: Job) -> None:
        """Makes the job's prefill plan (its backend's) and runs it up to its first append."""
        self._estimators_touched = True
        assert job.backend is not None
        job.prefilling = True
        job.t_prefill = time.perf_counter()
        if job.session is not None:
            self._busy[id(job.session)] = job
        segments: list[Segment] = job.segments if job.segments is not None else [job.ids]
        if job.session is not None and job.messages is not None:
            job.plan = job.backend.prefill_plan(job.messages, segments, job.agent, job.recompute)
        else:
            ns = job.namespace.cache_namespace() if job.namespace is not None else None
            job.plan = self._plain.prefill_plan([], segments, None, namespace=ns)
        self._advance_plan(job, None, None)

    def _advance_plan(self, job: Job, sent: np.ndarray | None, error: Exception | None) -> None:
        """Resumes job's plan with its last append's logits (or that append's error, thrown in) up to its next
        append; ends the prefill when the plan returns or raises."""
        assert job.plan is not None
        t0 = time.perf_counter()
        prefilled: Prefilled | None = None
        try:
            job.append = job.plan.throw(error) if error is not None else job.plan.send(sent)
            job.appended = 0
            job.plan_ms += (time.perf_counter() - t0) * 1000.0
            return
        except StopIteration as done:
            prefilled = done.value
        except Exception as e:  # the plan's own error, or the append's it did not handle
            error = e
        job.plan_ms += (time.perf_counter() - t0) * 1000.0
        job.plan = job.append = None
        self._prefill_ended(job, prefilled, error)

    def _prefill_ended(self, job: Job, prefilled: Prefilled | None, error: Exception | None) -> None:
        """A plan returned (prefilled) or failed (error): the job samples its first token (and its forks' for
        n > 1), or fails; completions deferred for its session run now."""
        self._end_prefill(job)
        job.interleaved_ms = max(0.0, (time.perf_counter() - job.t_prefill) * 1000.0 - job.engine_ms - job.plan_ms)
        if isinstance(error, KvcmasError):
            log.warning("%s: prefill refused by the engine: %s", job.id, error)
            self._fail(job, 503, f"the engine could not take the request now: {error}", "server_busy")
        elif isinstance(error, ValueError):  # e.g. a chat template that rejects the messages
            self._fail(job, 400, str(error), "invalid_request_error")
        elif error is not None:  # a bug in a backend must cost this job only
            log.error("%s: prefill failed", job.id, exc_info=error)
            self._fail(job, 500, f"internal error during prefill: {type(error).__name__}: {error}", "internal_error")
        if prefilled is not None:
            job.prefilled = prefilled
            job.remaining = 0
            if not job.cancelled:  # a cancelled job is released on the next turn
                forks = self._fork_choices(job, prefilled) if job.n > 1 else []
                for choice in [job, *forks]:  # first tokens come before the postponed work
                    self._sample_and_accept(choice, prefilled.logits)
        self._run_deferred()

    def _end_prefill(self, job: Job) -> None:
        job.prefilling = False
        if job.session is not None and self._busy.get(id(job.session)) is job:
            del self._busy[id(job.session)]

    def _fork_choices(self, job: Job, prefilled: Prefilled) -> list[Job]:
        """n > 1: choices 1..n-1 continue forks of the job's prompt sequence (no prompt row is computed again), each
        with its own sampler (seed + index when seeded) and constraint; they end like any job but register no reply
        with the sharing session (choice 0 does)."""
        forks: list[Job] = []
        for i in range(1, job.n):
            params = SamplingParams(**vars(job.params))
            if params.seed is not None:
                params.seed += i
            fork = Job(
                id=job.id,
                ids=job.ids,
                max_tokens=job.max_tokens,
                reserve=job.reserve,
                params=params,
                stops=job.stops,
                sink=job.sink,
                deadline=job.deadline,
                n_prompt=job.n_prompt,
                logprobs=job.logprobs,
                constraint=job.constraint.fork() if job.constraint is not None else None,
                t_arrival=job.t_arrival,
                index=i,
                namespace=job.session_key.namespace if job.session_key is not None else job.namespace,
            )
            fork.sampler = Sampler(params)
            fork.decoder = StreamDecoder(self.model.tokenizer)
            fork.matcher = StopMatcher(job.stops)
            fork.history = list(job.history)
            fork.t_admit, fork.t_prefill, fork.engine_ms = job.t_admit, job.t_prefill, job.engine_ms
            stats = dict(prefilled.stats, computed_tokens=0)
            fork.prefilled = PlainPrefilled(prefilled.seq.fork(), prefilled.logits, stats)
            with self._cond:
                fork.cancelled = job.cancelled
                job.children.append(fork)
            self._active.append(fork)
            forks.append(fork)
        return forks

    def _pass(
        self,
        job: Job,
        seq: KVSequence,
        chunk: list[int] | np.ndarray,
        logits: Literal["last", "none"],
        image_pos: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """One forward pass: a chunk of job's prompt with the pending token of every generating job, whose next
        tokens are sampled from their rows; returns the chunk's logits. Image embeddings, a chunk shorter than
        MIN_CHUNK_ROWS, a batch over PROMPT_CHUNK rows (the engine call's scratch bound) and a batch the engine
        refuses run the chunk alone (its error is raised) and then a decode step."""
        running = self._generating()
        t_pass = time.perf_counter()
        # A chunk shorter than MIN_CHUNK_ROWS runs alone: alone the engine computes it with its decode kernels, in a
        # bigger batch with its prefill kernels, and its rows (which the prefix cache may keep) must not depend on
        # what else is running.
        fits = MIN_CHUNK_ROWS <= len(chunk) <= PROMPT_CHUNK - len(running)
        mixed = bool(running) and not isinstance(chunk, np.ndarray) and fits
        out: np.ndarray | None = None
        if mixed:
            ids = [int(t) for t in chunk]
            n = len(ids)
            want = np.zeros(n + len(running), dtype=np.uint8)
            if logits == "last":
                want[n - 1] = 1
            want[n:] = 1  # each decode row
            seqs = [seq.id] * n + [j.prefilled.seq.id for j in running if j.prefilled is not None]
            filled = seq.check_fill(ids)
            try:
                deltas = [seq._delta_at(p) for p in seq._next_positions(filled, n)] + [
                    j.prefilled.seq.rope_delta for j in running if j.prefilled is not None
                ]  # M-RoPE: text after images goes on from their positions
                tokens = ids + [j.pending_token for j in running]
                if any(deltas):
                    rows = self.model._decode(seqs, tokens, want, deltas)
                else:
                    rows = self.model._decode(seqs, tokens, want)
            except KvcmasError as e:
                log.info("a mixed step was refused by the engine (%s): the chunk and the decode step run apart", e)
                mixed = False
        if mixed:
            seq.record(ids, filled)
            for j in running:
                assert j.prefilled is not None
                j.prefilled.seq.tokens.append(j.pending_token)
            k = int(want[:n].sum())
            out = rows[k - 1] if logits == "last" else None
            self.metrics.count_pass("mixed")
            self._mixed = True
            job.engine_ms += (time.perf_counter() - t_pass) * 1000.0
            for j, row in zip(running, rows[k:], strict=True):
                self._sample_and_accept(j, row)
        else:
            out = ChunkExecutor().append(seq, chunk, logits, image_pos)
            self.metrics.count_pass("prefill")
            job.engine_ms += (time.perf_counter() - t_pass) * 1000.0
            if running:
                self._decode_step()
                self._mixed = True  # the generating jobs had their step in this turn
        return out

    def _later(self, job: Job, action: Callable[[], None]) -> bool:
        """Postpones a job's completion while another job's prefill plan of its session is in flight (completing
        registers a reply, or fails, which would touch that session in the middle of its prefill) until that plan
        ends; returns True then. The job takes no more decode steps meanwhile."""
        owner = self._busy.get(id(job.session)) if job.session is not None else None
        if owner is None or owner is job:
            return False
        job.ending = True
        self._deferred.append((id(job.session), action))
        return True

    def _run_deferred(self) -> None:
        """Runs the postponed completions whose session has no prefill in flight any more."""
        while any(sid not in self._busy for sid, _ in self._deferred):
            ready = [a for sid, a in self._deferred if sid not in self._busy]
            self._deferred = [(sid, a) for sid, a in self._deferred if sid in self._busy]
            for action in ready:
                action()

    def _sample_and_accept(self, job: Job, logits: Any) -> None:
        assert job.sampler is not None
        try:
            allowed = job.constraint.allowed() if job.constraint is not None else None
            token = job.sampler.sample(logits, job.history, allowed)
            if job.logprobs is not None and token not in self.model.tokenizer.eog_ids:
                job.pending_logprobs.append(token_logprobs(logits, token, job.logprobs))
            if job.constraint is not None:
                job.constraint.accept(token)
        except ConstraintDeadEnd as e:  # the request's schema has no value: its fault, not the server's
            self._fail(job, 400, f"the output's grammar (response_format or forced tool call): {e}", "invalid_schema")
            return
        except ValueError as e:  # NaN logits and the like: this job cannot go on, the others can
            log.error("%s: sampling failed: %s", job.id, e)
            self._fail(job, 500, f"sampling failed: {e}", "internal_error")
            return
        if not job.t_first:
            job.t_first = time.perf_counter()  # the first token exists from here
        self._accept(job, token)

    # --------------------------------------------------------------------------------------------- decoding
    def _generating(self) -> list[Job]:
        return [j for j in self._active if j.prefilled is not None and not j.cancelled and not j.ending]

    def _decode_step(self) -> None:
        running = self._generating()
        if not running:
            return
        steps = [(j.prefilled.seq, [j.pending_token]) for j in running if j.prefilled is not None]
        try:
            rows = self.model.decode_batch(steps)
            self.metrics.count_pass("decode")
        except KvcmasError as e:
            # Reservations make this rare (budget shared with stored spans): evict, or give up the newest job.
            if not self._evict_one():
                victim = max(running, key=lambda j: j.t_admit)
                log.warning("%s: decode refused by the engine (%s); failing the newest job", victim.id, e)
                self._fail(victim, 503, f"out of KV memory: {e}", "server_busy")
            return
        for job, logits in zip(running, rows, strict=True):
            self._sample_and_accept(job, logits)

    def _accept(self, job: Job, token: int) -> None:
        """Handles one sampled token: end of generation, stop strings, max_tokens, or keep going."""
        assert job.decoder is not None and job.matcher is not None
        if token in self.model.tokenizer.eog_ids:
            self._finish(job, "stop")
            return
        job.generated.append(token)
        job.history.append(token)
        text, hit = job.matcher.feed(job.decoder.feed(token))
        if text:
            job.received += text
            job.sink(Delta(text, token, job.index, self._take_logprobs(job)))
        if hit or (job.constraint is not None and job.constraint.finished):
            self._finish(job, "stop")
        elif len(job.generated) >= job.max_tokens:
            self._finish(job, "length")
        elif len(job.generated) >= job.reserve and not self._grow_reservation(job):
            log.info("%s: KV budget exhausted after %d tokens: ends with 'length'", job.id, len(job.generated))
            self._finish(job, "length")
        else:
            job.pending_token = token

    def _finish(self, job: Job, reason: Literal["stop", "length"]) -> None:
        if self._later(job, lambda: self._finish(job, reason)):
            return
        assert job.decoder is not None and job.matcher is not None and job.prefilled is not None
        t_end = time.perf_counter()
        if not job.matcher.stopped:
            tail = job.matcher.flush(job.decoder.flush())
            if tail or job.pending_logprobs:
                job.received += tail
                job.sink(Delta(tail, None, job.index, self._take_logprobs(job)))
        p = job.prefilled
        self._estimators_touched = True
        try:
            if job.backend is not None:
                for read in job.backend.finish(p, list(job.generated), job.received):
                    read.chunk = self.prefill_chunk  # run after the Done below, between other work (_read_step)
                    self._reads.append((read, id(job.session)))
                while len(self._reads) > MAX_TRAINING_READS:
                    self._drop_read()
        except Exception:
            log.exception("%s: registering the reply failed", job.id)
        stats = self._stats(job, t_end)
        self._release(job)
        self._service_s = 0.8 * self._service_s + 0.2 * (t_end - job.t_admit)
        tenant = job.tenant
        if job.index == 0:
            self.metrics.count_generation(
                stats["prompt_tokens"],
                stats["reused_tokens"],
                stats["completion_tokens"],
                stats["ttft_ms"] / 1000.0,
                tenant,
            )
            self.metrics.count_sharing(
                stats["prefix_cached_tokens"], stats["span_tokens"], stats["dense_reason"], tenant
            )
        else:  # a fork: its prompt was counted with choice 0
            self.metrics.count_generation(0, 0, stats["completion_tokens"], None, tenant)
        job.sink(Done(reason, stats, job.index))

    @staticmethod
    def _take_logprobs(job: Job) -> list[TokenLogprob] | None:
        if job.logprobs is None:
            return None
        taken, job.pending_logprobs = job.pending_logprobs, []
        return taken

    def _stats(self, job: Job, t_end: float) -> dict[str, Any]:
        assert job.prefilled is not None
        s = job.prefilled.stats
        n_prompt = int(s.get("prompt_tokens", job.n_prompt))
        reused = int(s.get("reused_tokens", 0))
        n_gen = len(job.generated)
        prompt_ms = (job.t_first - job.t_prefill) * 1000.0  # the prefill's wall time, interleaved work included
        predicted_ms = (t_end - job.t_first) * 1000.0
        computed = int(s.get("computed_tokens", n_prompt - reused))
        own_ms = prompt_ms - job.interleaved_ms
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_gen,
            "reused_tokens": reused,
            "computed_tokens": computed,
            "recomputed_tokens": int(s.get("recomputed_tokens", 0) or 0),
            "method": s.get("method", "nonshared"),
            "mode": s.get("mode"),
            "gate": s.get("gate"),
            "queue_ms": (job.t_admit - job.t_arrival) * 1000.0,
            "wait_ms": (job.t_prefill - job.t_admit) * 1000.0,
            "prompt_ms": prompt_ms,
            "engine_ms": job.engine_ms,
            "interleaved_ms": job.interleaved_ms,
            "session_ms": max(0.0, own_ms - job.engine_ms),
            "prompt_per_second": computed / (own_ms / 1000.0) if own_ms > 0 else 0.0,
            "ttft_ms": (job.t_first - job.t_arrival) * 1000.0,
            "predicted_ms": predicted_ms,
            "predicted_per_second": (n_gen - 1) / (predicted_ms / 1000.0) if n_gen > 1 and predicted_ms > 0 else 0.0,
            "kv_bytes": int(s.get("kv_bytes", 0) or 0),
            "corr_bytes": int(s.get("corr_bytes", 0) or 0),
            "prefix_cached_tokens": int(s.get("prefix_cached_tokens", 0)),
            "span_tokens": int(s.get("span_tokens", 0)),
            # rows of the training read this call scheduled: computed after the reply (a dropped read never does)
            "calibration_tokens_scheduled": int(s.get("calibration_tokens_scheduled", 0)),
            "dense_reason": s.get("dense_reason"),
            "reads": list(s.get("reads", [])),  # the prompt's shared spans by author (ResponseStats.reads)
        }

    def _release(self, job: Job) -> None:
        plan, job.plan, job.append = job.plan, None, None
        if plan is not None:  # its prefill in flight: closing the plan frees what it holds
            try:
                plan.close()
            except Exception:
                log.exception("%s: closing its prefill plan failed", job.id)
            self._end_prefill(job)
        if job in self._active:
            self._active.remove(job)
        if job.prefilled is not None:
            job.prefilled.close()
            job.prefilled = None
        if job.session is not None:
            job.session.active -= 1
            job.session.last_used = time.monotonic()
            job.session = None
        ns = job.session_key.namespace if job.session_key is not None else job.namespace
        if ns is not None:
            self._namespaces[ns] = time.monotonic()
        if plan is not None:
            self._run_deferred()  # its session's postponed completions

    def _fail(self, job: Job, status: int, message: str, code: str = "server_error") -> None:
        if self._later(job, lambda: self._fail(job, status, message, code)):
            return
        self._release(job)
        job.sink(Failed(status, message, code))
