"""A request as the scheduler holds it (Job), and what it sends back (Delta, Done, Failed events).

The HTTP layer makes a Job and hands it to the Scheduler; the scheduler thread fills its runtime fields while it
runs and reports through its sink. `job_stats` is what a finished job reports: usage, timings and kvcmas fields.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..plan import Append, Plan
from ..sampling import SamplingParams, TokenLogprob
from ..token_stream import TokenStream
from .backend import MethodBackend, PlainPrefilled, Prefilled, Segment
from .sessions import Namespace, Session, SessionKey


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
    # (engine id, scale) of the LoRA adapter it runs with (None: the base model); `model` names it
    adapter: tuple[int, float] | None = None
    model: str | None = None  # the model id its reply reports (an adapter's name); None: the server's
    t_arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    cached: int = 0  # prompt rows the prefix cache serves (Scheduler.prompt_rows), as of its version cached_version
    cached_version: int = -1
    # runtime (scheduler thread only)
    backend: MethodBackend | None = None
    session: Session | None = None
    prefilled: Prefilled | None = None
    stream: TokenStream | None = None  # its tokens (made on admission)
    pending_token: int = -1
    remaining: int = 0  # prompt rows still to compute (an estimate): the shortest prefill goes first
    prefilling: bool = False  # its prefill plan is in flight (from its start to its end)
    ending: bool = False  # finished or failed while its session's prefill was in flight; completed when that ends
    t_admit: float = 0.0  # got a slot and its KV reservation
    t_prefill: float = 0.0  # its prefill started
    engine_ms: float = 0.0  # time in the forward passes of its prompt's chunks (they carry decode rows too)
    plan_ms: float = 0.0  # time in its prefill plan between appends (the method's own work: forks, corrections)
    interleaved_ms: float = 0.0  # time other jobs' work ran during its prefill, outside its own passes and plan
    chunks_run: int = 0  # prompt chunks its prefill ran (Scheduler._prefill_step)
    plan: Plan[Prefilled] | None = None  # its prefill in flight (MethodBackend.prefill_plan)
    append: Append | None = None  # the plan's current append
    appended: int = 0  # rows of it computed
    index: int = 0  # choice index (forks of an n > 1 job)
    children: list[Job] = field(default_factory=list)  # its forks (n > 1)

    @property
    def space(self) -> Namespace | None:
        """Its namespace: its session's, or its plain prompt's (None: a job made outside the server)."""
        return self.session_key.namespace if self.session_key is not None else self.namespace

    @property
    def tenant(self) -> str | None:
        """The tenant whose request this is (None: unknown, a job made outside the server)."""
        ns = self.space
        return ns.tenant if ns is not None else None

    @property
    def generated(self) -> list[int]:
        """The tokens it generated so far (an end-of-generation token excluded)."""
        return self.stream.tokens if self.stream is not None else []

    def claims(self, prompt_rows: int) -> list[int]:
        """Rows it may still add, per sequence it will hold (KVBudget.reservations_bytes prices them): its own
        (the tokens left of its reservation, and prompt_rows, its prompt less what the prefix cache serves, until
        prefilled) and, until prefilled, each other choice's (n > 1)."""
        before = self.prefilled is None
        own = max(0, self.reserve - len(self.generated)) + (prompt_rows if before else 0)
        return [own] + ([self.reserve] * (self.n - 1) if before else [])

    def fork_choice(self, index: int, prefilled: Prefilled) -> Job:
        """Choice `index` of this n > 1 job, whose prompt was just prefilled: it continues a fork of the prompt's
        sequence (no prompt row is computed again) with its own sampler (seed + index when seeded) and constraint.
        It ends like any job but registers no reply with the sharing session (choice 0 does)."""
        assert self.stream is not None
        params = SamplingParams(**vars(self.params))
        if params.seed is not None:
            params.seed += index
        fork = Job(
            id=self.id,
            ids=self.ids,
            max_tokens=self.max_tokens,
            reserve=self.reserve,
            params=params,
            stops=self.stops,
            sink=self.sink,
            deadline=self.deadline,
            n_prompt=self.n_prompt,
            logprobs=self.logprobs,
            t_arrival=self.t_arrival,
            index=index,
            namespace=self.space,
            adapter=self.adapter,
            model=self.model,
        )
        fork.stream = self.stream.fork(params)
        fork.constraint = fork.stream.constraint
        fork.t_admit, fork.t_prefill, fork.engine_ms = self.t_admit, self.t_prefill, self.engine_ms
        stats = dict(prefilled.stats, computed_tokens=0)
        fork.prefilled = PlainPrefilled(prefilled.seq.fork(), prefilled.logits, stats)
        return fork

    def __post_init__(self) -> None:
        if not self.n_prompt:
            self.n_prompt = len(self.ids)
        if not self.reserve:
            self.reserve = self.max_tokens


def job_stats(job: Job, t_end: float) -> dict[str, Any]:
    """What a job that ended at t_end (time.perf_counter()) reports: usage, timings (ms) and kvcmas fields."""
    assert job.prefilled is not None and job.stream is not None
    s = job.prefilled.stats
    t_first = job.stream.t_first
    n_prompt = int(s.get("prompt_tokens", job.n_prompt))
    reused = int(s.get("reused_tokens", 0))
    n_gen = len(job.stream.tokens)
    prompt_ms = (t_first - job.t_prefill) * 1000.0  # the prefill's wall time, interleaved work included
    predicted_ms = (t_end - t_first) * 1000.0
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
        "ttft_ms": (t_first - job.t_arrival) * 1000.0,
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
