"""Agent sessions: agents declared by role read a growing shared context; kvcmas shares and corrects their KV.

```python
team = AgentSession(model, method="kvcmas")       # nonshared | fullshared | kvcmas | kvcomm
solver = team.agent("Math Solver", system="You are ...")
critic = team.agent("Critic", system="...")
team.share("Question: ...")                        # shared context
a = solver.respond(max_tokens=256)                 # sees the shared context and earlier replies
b = critic.respond(max_tokens=256)                 # reads a's reply as a shared span
```

Every shared item (the context given to `share`, and each reply) is a span: the first agent that reads it computes it
exactly and stores its rows once; later agents append those rows by reference with the method's low-rank correction
(the method layer is `sharing.runner.WorkflowRunner`, the same engine as the benchmarks). An agent's prompt is its
chat: system = role prompt, user = the shared items, each after a label line, or the agent's own template with
placeholders ({user_question}, {agent_<i>_current}, {condition_<k>_current}, {context} for every item).

Lower level (the server's): `prefill(messages)` takes OpenAI-style messages, identifies the agent by its system
prompt, keys every message content by its token ids (image embeddings in a content count by their rows), and reuses
spans already computed in the session: whole, found by text inside a bigger message, or any run of at least
MIN_PIECE_TOKENS of a message's tokens equal to part of a stored span (read from that span's rows). `prefill_plan`
is the same call as a plan (kvcmas_cpp.plan): a server's scheduler holds several in flight and runs their appends in
chunks, each in one forward pass with other requests' decode tokens.

Thread safety: a session serialises its own calls with a lock; sessions run concurrently on one model (compute
releases the GIL; the engine serialises compute), each with its own shared context.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

import numpy as np

from .idle_reads import IdleReads
from .model import CompletionChunk, KVSequence, Model, token_ids
from .plan import ChunkExecutor, Plan, run_plan
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, TokenLogprob, chat_logprobs, max_tokens_count, stop_strings
from .sharing import estimators as est
from .sharing import methods as registry
from .sharing.methods import CALIBRATION_READS, MethodConfig  # noqa: F401 (kc.agents.*: public)
from .sharing.persist import CalibrationStore, default_calibration_dir
from .sharing.runner import HopReport, RequestState, TrainingRead, WorkflowRunner
from .sharing.span import Span, chains
from .sharing.workflow import PLACEHOLDER_RE, QUESTION, Template, Workflow, template_from_messages
from .tools import TOOLS_KEY, attached_tools

# Inside a bigger message, a paragraph becomes its own span, and a span the session holds is found again, only from
# this many tokens on: shorter runs cost more in exact head and tail rows than reusing them saves.
MIN_PIECE_TOKENS = 16
# Stored spans are indexed by their aligned token blocks of this size: a common run of MIN_PIECE_TOKENS tokens, at
# any offset, holds a whole aligned block (2 * RUN_BLOCK - 1 <= MIN_PIECE_TOKENS), which is then extended both ways.
RUN_BLOCK = MIN_PIECE_TOKENS // 2
_PARAGRAPH_RE = re.compile(r"\S(?:.*?\S)?(?=\s*\n\s*\n|\s*$)", re.DOTALL)  # text between blank lines, stripped


# The estimator locks are re-entrant: a server's scheduler thread holds several sessions' prefill plans in flight,
# each suspended between its appends with its estimator's lock held, and sessions of one workflow kind share one.
_estimators: weakref.WeakKeyDictionary[Model, dict[tuple[str, str], tuple[est.Estimator, threading.RLock]]] = (
    weakref.WeakKeyDictionary()
)
# the calibration directories each shared estimator has loaded (model -> (method, workflow) -> resolved roots)
_loaded_dirs: weakref.WeakKeyDictionary[Model, dict[tuple[str, str], set[str]]] = weakref.WeakKeyDictionary()
_estimators_lock = threading.Lock()


def estimator_bytes(model: Model) -> int:
    """Memory the shared estimators of a model hold: learned state plus training reads still pending. Call it where
    no session is using them (a server's engine thread)."""
    with _estimators_lock:
        items = list(_estimators.get(model, {}).values())
    return sum(e.state_bytes() + e.pending_bytes() for e, _ in items)


def estimator_edges(model: Model) -> dict[tuple[str, str], dict[str, int]]:
    """Per shared estimator of a model ((method, workflow) as shared_estimator names it): its edges by calibration
    state, {"fitted": edges with a learned map, "calibrating": edges gathering training reads, "reads": those reads,
    "bytes": state + pending}. Estimators that learn nothing per edge report only bytes. Call it where no session is
    using them (a server's engine thread)."""
    with _estimators_lock:
        items = list(_estimators.get(model, {}).items())
    out: dict[tuple[str, str], dict[str, int]] = {}
    for key, (e, _) in items:
        row = {"fitted": 0, "calibrating": 0, "reads": 0, "bytes": e.state_bytes() + e.pending_bytes()}
        if isinstance(e, est.RidgeEstimator):
            pending = [edge for edge in e.pending_edges() if edge not in e.maps]
            row["fitted"], row["calibrating"] = len(e.maps), len(pending)
            row["reads"] = sum(e.examples(edge) for edge in pending)
        out[key] = row
    return out


def bound_estimators(model: Model, max_bytes: int, live: Collection[str], busy: Collection[str]) -> int:
    """Brings what the shared estimators of a model hold (estimator_bytes) within max_bytes, for a server whose
    clients choose how many workflows (namespaces) there are. In order: the estimators of workflows no session in
    `live` names, least recently used first (a later session starts a fresh one, which loads the calibration
    directory again); the fitted maps of estimators no workflow in `busy` (a prefill in flight) uses, least recently
    used estimators and edges first (those edges calibrate again, with one read); then the statistics of the
    calibrating edges that went longest without rows (reads in progress: their edges start over). Returns the bytes
    freed. Call it where no session is using the estimators (a server's engine thread)."""
    freed = 0
    with _estimators_lock:
        per_model = _estimators.get(model, {})
        total = sum(e.state_bytes() + e.pending_bytes() for e, _ in per_model.values())
        for key in [k for k in per_model if k[1] not in live]:
            if total - freed <= max_bytes:
                return freed
            e, _ = per_model.pop(key)
            _loaded_dirs.get(model, {}).pop(key, None)
            freed += e.state_bytes() + e.pending_bytes()
        # least recently used first (shared_estimator moves an estimator to the end when a session takes it)
        ridges = [(wf, e) for (_, wf), (e, _) in per_model.items() if isinstance(e, est.RidgeEstimator)]
    for wf, e in ridges:
        while wf not in busy and e.maps and total - freed > max_bytes:
            freed += e.drop_stalest_map()
    while total - freed > max_bytes:
        pending = [(s, e) for _, e in ridges if (s := e.stalest_pending()) is not None]
        if not pending:
            break
        (_, edge), e = min(pending, key=lambda p: p[0][0])
        freed += e.drop_pending(edge)
    return freed


def forget_estimators(model: Model, workflow: str) -> int:
    """Drops the shared estimators of a workflow name (every method's), for a server whose idle namespaces age out;
    a later session of it starts fresh (loading the calibration directory again). Returns the bytes they held."""
    with _estimators_lock:
        per_model = _estimators.get(model, {})
        freed = 0
        for key in [k for k in per_model if k[1] == workflow]:
            e, _ = per_model.pop(key)
            _loaded_dirs.get(model, {}).pop(key, None)
            freed += e.state_bytes() + e.pending_bytes()
        return freed


def shared_estimator(
    model: Model, method: str, workflow: str, store: CalibrationStore | None = None
) -> tuple[est.Estimator, threading.RLock]:
    """The estimator sessions of one workflow kind share on a model (what kvcmas learns carries across sessions),
    with the lock that serialises its use. store: a calibration directory whose maps it loads (once per directory)."""
    with _estimators_lock:
        per_model = _estimators.setdefault(model, {})
        key = (method, workflow)
        if key in per_model:  # most recently used last (bound_estimators drops the least recently used first)
            per_model[key] = per_model.pop(key)
        else:
            config = registry.method(method, session=True).config(for_session=True)
            per_model[key] = (registry.make_estimator(model, config, workflow), threading.RLock())
        estimator, lock = per_model[key]
        loaded = _loaded_dirs.setdefault(model, {}).setdefault(key, set())
        if store is not None and isinstance(estimator, est.RidgeEstimator) and str(store.dir) not in loaded:
            loaded.add(str(store.dir))
            with lock:
                store.load_into(estimator)
        return estimator, lock


# When an AgentSession runs the training reads its calls schedule (kvcmas calibrating under cold reuse):
# idle: a worker runs them while no call is in flight on the model (idle_reads), the rest at reset()/close();
# eager: the next call runs them before its prompt (its ttft_ms counts them), and reset()/close();
# manual: only run_training_reads(), take_training_reads() (a server's scheduler) and reset()/close().
TrainingReadPolicy = Literal["idle", "eager", "manual"]
TRAINING_READ_POLICIES = ("idle", "eager", "manual")

_WORD_IN_BRACES = re.compile(r"\{(\w+)\}")
CONTEXT_PLACEHOLDER = "{context}"  # in a template: every shared item


def _check_template(name: str, template: object) -> None:
    """A session agent's template must read the shared context, and a {word} in it must be a placeholder: a typo
    ({contex}) or a template without any would otherwise leave the agent blind to what it is meant to read."""
    if not isinstance(template, str):
        raise ValueError(f"agent {name!r}: template must be a string, got {type(template).__name__}")
    words = _WORD_IN_BRACES.findall(template)
    unknown = [w for w in words if not (f"{{{w}}}" == CONTEXT_PLACEHOLDER or PLACEHOLDER_RE.fullmatch(f"{{{w}}}"))]
    if unknown:
        raise ValueError(
            f"agent {name!r}: the template's {{{unknown[0]}}} is not a placeholder ({{context}}, {{user_question}}, "
            "{agent_<i>_current}, {agent_<i>_history}, {condition_<k>_current}); a template has no escape for a "
            "literal {word}"
        )
    if not words:
        raise ValueError(
            f"agent {name!r}: the template reads nothing shared (no {{context}} or other placeholder), so the agent "
            "would never see the shared context"
        )


def agent_identity(system: str, template: str | None = None) -> str:
    """A reader's key in the estimator: a hash of its role prompt (and template), not its arrival order."""
    return "agent:" + hashlib.sha256(f"{system}\0{template or ''}".encode()).hexdigest()[:16]


@dataclass
class ResponseStats:
    """What one agent call cost and reused. Times in milliseconds; bytes of KV rows this call computed and holds
    (prompt rows it forwarded + generated rows) and of its low-rank corrections."""

    agent: str
    method: str
    mode: str  # source | dense | reuse | fallback
    gate: str  # the method's decision for this call
    ttft_ms: float
    prompt_tokens: int
    computed_tokens: int
    reused_tokens: int  # prefix_cached_tokens + span_tokens: rows served from earlier work
    generated_tokens: int = 0
    generation_ms: float = 0.0
    kv_bytes: int = 0
    corr_bytes: int = 0
    corr_rank: int = 0
    recomputed_tokens: int = 0  # shared-span tokens recomputed in this agent's context (counted in computed_tokens)
    prefix_cached_tokens: int = 0  # rows of the agent's prompt prefix computed by an earlier call (exact)
    span_tokens: int = 0  # rows of shared spans other calls computed, read by reference (corrected by the method)
    dense_reason: str | None = None  # why this later call computed its shared spans: calibrating | gate | no match
    # rows of the training read this call scheduled (cold reuse while calibrating): computed after the reply, off its
    # path (an idle worker, close(), run_training_reads(); a server runs them when it has nothing else to do)
    calibration_tokens_scheduled: int = 0
    # of ttft_ms, the time this call spent first running training reads earlier calls left pending: only under
    # training_reads="eager" (AgentSession.training_read_ms_total counts them wherever they ran); 0 on a server
    training_read_ms: float = 0.0
    # the shared spans this call's prompt holds, by author: [{"from": agent name or None (shared context), "tokens",
    # "spans"}] in prompt order (whether they were read or computed: mode says)
    reads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / (self.generation_ms / 1000.0) if steps > 0 and self.generation_ms > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        return d


@dataclass
class Response:
    agent: str
    text: str
    ids: list[int]
    finish_reason: Literal["stop", "length", "tool_calls"]
    stats: ResponseStats
    first_logits: np.ndarray | None = field(default=None, repr=False)  # next-token logits after the prompt
    logprobs: list[dict[str, Any]] | None = None  # logprobs=True: OpenAI's chat logprobs entries, per token
    tool_calls: list[dict[str, Any]] | None = None  # tools=: the OpenAI tool_call objects the reply holds


@dataclass
class ResponseChunk:
    """A streamed piece of a reply; the last one has finish_reason and the whole Response set."""

    text: str
    token: int | None
    finish_reason: Literal["stop", "length"] | None = None
    response: Response | None = None


def _find_run(ids: list[int], piece: list[int], start: int = 0) -> int:
    """Where `piece` first occurs in `ids` as a contiguous run at or after `start`; -1 if nowhere."""
    if not piece:
        return -1
    hay, needle = np.asarray(ids, dtype=np.int64).tobytes(), np.asarray(piece, dtype=np.int64).tobytes()
    at = hay.find(needle, start * 8)
    while at >= 0 and at % 8:
        at = hay.find(needle, at + 1)
    return at // 8 if at >= 0 else -1


@dataclass(frozen=True)
class _Run:
    """A run of a message's ids (starting at `at`) equal to the ids of a stored span from `offset` on: read from that
    span's stored rows (AgentSession._add_run)."""

    span: str
    offset: int
    ids: tuple[int, ...]
    at: int


@dataclass
class Prefilled:
    """A prompt in the engine: `seq` ends with the generation prompt, `logits` are the next-token logits."""

    session: AgentSession
    agent: int
    seq: KVSequence
    logits: np.ndarray
    hop: HopReport
    pos_map: dict[str, tuple[int, int]]
    corrs: dict[str, est.Correction]
    reply_ph: str
    prefix_rows: int = 0  # rows of the agent's template prefix (before the first span)
    prefix_cached: int = 0  # of them, rows an earlier call computed (served by the model's PrefixCache)
    prefix: KVSequence | None = None  # the template prefix the hop forked (its own fork of the cache's rows)
    training_read_ms: float = 0.0  # spent before the prompt on earlier calls' pending training reads
    in_flight: bool = False  # counted as a call in flight (IdleReads.begin) until finished or closed
    runs: list[str] = field(default_factory=list)  # placeholders of sub-runs of stored spans this prompt reads
    finished: bool = False
    released: bool = False

    @property
    def stats(self) -> dict[str, Any]:
        return self.session._stats(self).as_dict()

    def close(self) -> None:
        """Releases the sequence; its rows stay while a stored span of the session reads them."""
        self.session._release(self)

    def __enter__(self) -> Prefilled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Agent:
    """A role in a session. Create with AgentSession.agent()."""

    def __init__(self, session: AgentSession, index: int, name: str, system: str, template: str | None) -> None:
        self.session, self.index, self.name, self.system, self.template = session, index, name, system, template

    @overload
    def respond(
        self,
        max_tokens: int = ...,
        *,
        stream: Literal[False] = ...,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        min_p: float = ...,
        repeat_penalty: float = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool = ...,
        response_format: Mapping[str, Any] | None = ...,
        logprobs: bool = ...,
        top_logprobs: int | None = ...,
    ) -> Response: ...

    @overload
    def respond(
        self,
        max_tokens: int = ...,
        *,
        stream: Literal[True],
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        min_p: float = ...,
        repeat_penalty: float = ...,
        seed: int | None = ...,
        stop: str | Sequence[str] | None = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        parallel_tool_calls: bool = ...,
        response_format: Mapping[str, Any] | None = ...,
        logprobs: bool = ...,
        top_logprobs: int | None = ...,
    ) -> Iterator[ResponseChunk]: ...

    def respond(
        self,
        max_tokens: int = 256,
        *,
        stream: bool = False,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        logprobs: bool = False,
        top_logprobs: int | None = None,
    ) -> Response | Iterator[ResponseChunk]:
        """The agent's reply to the shared context so far (greedy by default). The reply joins the shared context
        as a span later agents read. stream=True returns an iterator of ResponseChunk.

        OpenAI's output options as Model.chat and the server take them (kvcmas_cpp.constrained.output_constraint):
        tools / tool_choice / parallel_tool_calls (calls in Response.tool_calls; "required" and a named function
        are enforced by constrained decoding; list the tools in the agent's system prompt, e.g. with
        kvcmas_cpp.tools.tools_system_text), response_format (json_object / json_schema), logprobs and top_logprobs
        (Response.logprobs). The reply's text, calls included, is what later agents read."""
        from .constrained import output_constraint
        from .tools import parse_tool_calls, tool_format_of

        params = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed
        )
        params.validate()
        max_tokens_count(max_tokens, 1)
        stops = stop_strings(stop)
        model = self.session.model
        fmt = tool_format_of(model.tokenizer.chat_template)
        constraint, names = (None, None)
        if tools or response_format:
            constraint, names = output_constraint(
                model.tokenizer, model.n_vocab, tools, tool_choice, response_format, parallel_tool_calls, fmt
            )
        top = (top_logprobs or 0) if logprobs else None
        chunks = self.session._respond(self, max_tokens, params, stops, constraint, top)
        if stream:
            return chunks
        last: Response | None = None
        for c in chunks:
            last = c.response or last
        assert last is not None
        if names is not None:
            _, calls = parse_tool_calls(last.text, names, fmt)
            if calls:
                last.tool_calls = calls
                last.finish_reason = "tool_calls" if last.finish_reason == "stop" else last.finish_reason
        return last

    async def arespond(self, max_tokens: int = 256, **kwargs: Any) -> Response:
        """respond() for asyncio: runs in a worker thread (compute releases the GIL), so other sessions' calls and
        the event loop go on meanwhile."""
        kwargs.pop("stream", None)
        return await asyncio.to_thread(lambda: self.respond(max_tokens, **kwargs))

    def __repr__(self) -> str:
        return f"Agent({self.name!r}, index={self.index})"


class AgentSession:
    """One multi-agent workflow instance over a shared context, under one sharing method."""

    def __init__(
        self,
        model: Model,
        method: str = "kvcmas",
        *,
        workflow: str = "default",
        estimator: est.Estimator | None = None,
        config: MethodConfig | None = None,
        vision: Any = None,
        recompute: float | None = None,
        cold: Literal["reuse", "dense"] | None = None,
        calibration_dir: str | os.PathLike[str] | bool = True,
        cache_namespace: str = "",
        training_reads: TrainingReadPolicy = "idle",
    ) -> None:
        """method: nonshared (every agent computes the shared items and replies it reads; only its template prefix
        comes from the model's exact prefix cache), fullshared (spans shared without correction), kvcmas (spans
        shared with learned low-rank corrections: the ridge map, fitted online from the first dense reads of each
        edge unless `estimator` is given already fitted), kvcomm (full-rank anchor deltas). workflow: sessions with
        the same name share what the estimator learns. vision: a kvcmas_cpp.vision.VisionEncoder for images in the
        shared context (its output width must be n_embd).
        recompute: the share of its shared rows a later agent recomputes in its own context (MethodConfig.recompute,
        sharing/recompute.py): 0 = pure reuse (default), 1 = what nonshared computes; prefill() may override it.
        cold (kvcmas, online calibration): what a reader does before its edge has a fitted map: 'reuse' (default:
        shares the span like fullshared with an exact head and tail, and computes the exact rows after its reply as
        the training read) or 'dense' (computes the span; overrides config.cold when given). calibration_dir
        (kvcmas): where fitted maps are kept across processes, keyed by model, workflow and edge: True (default)
        for $XDG_CACHE_HOME/kvcmas (sharing.persist.default_calibration_dir), a path, or False for none; maps found
        there are loaded when the workflow's estimator is first used, and each fit is written there. An
        `estimator` given here persists only with an explicit path. cache_namespace: an agent's template prefix
        (system prompt and the chat template's text before the first span) comes from the model's exact prefix
        cache (kvcmas_cpp.prefix_cache.PrefixCache), shared by every session on the model with the same
        cache_namespace (the server gives each tenant and cache_salt its own): computed once, not once per
        session. training_reads (kvcmas, cold reuse): when the training reads its calls schedule run: 'idle'
        (default: in a worker while no call is in flight on the model, never on a call's path; what is left at
        reset()/close()), 'eager' (at the start of the next call, which waits for them) or 'manual'
        (run_training_reads(), take_training_reads(), reset()/close())."""
        if training_reads not in TRAINING_READ_POLICIES:
            raise ValueError(
                f"training_reads must be one of {', '.join(TRAINING_READ_POLICIES)}, got {training_reads!r}"
            )
        self.training_reads: TrainingReadPolicy = training_reads
        self._idle = IdleReads.of(model)
        self._read_ms_done = 0.0  # training_read_ms_total of the reads that ran to their end
        entry = registry.method(method, session=True)
        self.model, self.method, self.workflow, self.vision = model, method, workflow, vision
        if vision is not None:
            vision.check_text_model(model.n_embd)
        if config is None:
            config = entry.config(for_session=True)
        if cold is not None:
            if cold not in ("reuse", "dense"):
                raise ValueError(f"cold must be 'reuse' or 'dense', got {cold!r}")
            config = dataclasses.replace(config, cold=cold)
        if config.tail != "exact":
            raise ValueError("AgentSession shares spans with exact tails only (MethodConfig.tail='exact')")
        if recompute is not None:
            config = dataclasses.replace(config, recompute=float(recompute))  # validated by MethodConfig
        root: str | os.PathLike[str] | None = None
        if calibration_dir is True:
            root = default_calibration_dir() if estimator is None else None
        elif calibration_dir is not False:
            root = calibration_dir
        self._store = CalibrationStore(root, model, method, workflow) if root and method == "kvcmas" else None
        if estimator is not None:
            self._estimator_lock = threading.RLock()
            if self._store is not None and isinstance(estimator, est.RidgeEstimator):
                self._store.load_into(estimator)
        else:
            estimator, self._estimator_lock = shared_estimator(model, method, workflow, self._store)
        self._runner = WorkflowRunner(model, Workflow(workflow, ()), config, estimator)
        self._runner.edge_of = self._edge_of
        self._lock = threading.RLock()
        self.agents: list[Agent] = []
        self._identities: list[str] = []  # per agent: agent_identity()
        self.cache_namespace = cache_namespace
        self._prefix_cache = PrefixCache.of(model)
        self._row_bytes = model.kv_row_bytes
        self._serial = 0
        self._n_runs = 0  # sub-run placeholders made (not reset: a prompt closed after reset() drops only its own)
        self._reset_state()

    # ------------------------------------------------------------------------------------------------ agents
    def agent(self, name: str, system: str = "", *, template: str | None = None) -> Agent:
        """Declares an agent. system: its role prompt. template: its user message with placeholders
        ({user_question}, {agent_<i>_current}, {condition_<k>_current}, {context}); default: every shared item. A
        template reads at least one of them, and every {word} in it is one (ValueError otherwise)."""
        if not isinstance(name, str) or not name:
            raise ValueError("agent: name must be a non-empty string")
        system = "" if system is None else system
        if not isinstance(system, str):
            raise ValueError(f"agent {name!r}: system must be a string, got {type(system).__name__}")
        if template is not None:
            _check_template(name, template)
        with self._lock:
            if any(a.name == name for a in self.agents):
                raise ValueError(f"agent: an agent named {name!r} exists already in this session")
            ag = Agent(self, len(self.agents), name, system, template)
            self.agents.append(ag)
            self._identities.append(agent_identity(system, template))
            self._runner.agent_names.append(name)
            return ag

    def share(
        self,
        content: str | Sequence[int] | None = None,
        *,
        text: str | None = None,
        image: Any = None,
        embeddings: np.ndarray | None = None,
        label: str | None = None,
    ) -> None:
        """Adds shared context every agent that responds later reads: text (or token ids), an image (a path, bytes
        or a PIL image; encoded once by the session's vision encoder, cached by content) and/or input vectors
        [n, n_embd] in place of token embeddings. Given together they form one span: image, vectors, then text."""
        if content is not None and text is not None:
            raise ValueError("share: give the text as `content` or as `text`, not both")
        body = content if content is not None else text
        with self._lock:
            ids: list[int] = []
            if image is not None:
                if self.vision is None:
                    raise ValueError("share(image=...): this session has no vision encoder (AgentSession(vision=...))")
                key = ("image", self.vision.image_hash(image))
                if key not in self._vector_ids:
                    rows = self.vision.encode(image)  # an M-RoPE tower's rows know their grid (ImageFeatures)
                    self._vector_ids[key] = self._state.add_vectors(rows, getattr(rows, "grid", None))
                ids += self._vector_ids[key]
            if embeddings is not None:
                ids += self._embedding_ids(embeddings, "share") or []
            if body is not None:
                ids += self._ids(body)
            if not ids:
                raise ValueError("share: the content is empty")
            self._add_span(Span(self._next_context_ph(), ids, f"context:{label or ''}", label))

    def _embedding_ids(self, embeddings: np.ndarray, where: str, register: bool = True) -> list[int] | None:
        """The prompt ids standing for input vectors [n, n_embd]; the same rows (by content) get the same ids. Rows
        the session has not seen are registered, or give None when not `register`."""
        rows = np.asarray(embeddings, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] != self.model.n_embd:
            raise ValueError(f"{where}: embeddings must have shape [n, {self.model.n_embd}], got {rows.shape}")
        if not np.isfinite(rows).all():
            raise ValueError(f"{where}: embeddings hold NaN or infinite values")
        grid = getattr(embeddings, "grid", None)  # an image's rows for an M-RoPE model (ImageFeatures)
        key = ("vectors" if grid is None else f"image{grid}", hashlib.sha256(rows.tobytes()).hexdigest())
        if key not in self._vector_ids:
            if not register:
                return None
            self._vector_ids[key] = self._state.add_vectors(rows, grid)
        return self._vector_ids[key]

    @property
    def context(self) -> list[tuple[str | None, str]]:
        """The shared items so far as (label, text)."""
        return [(it.label, self._describe(it.ids)) for it in self._items]

    def _describe(self, ids: list[int]) -> str:
        n_vec = sum(1 for t in ids if t < 0)
        text = self.model.detokenize([t for t in ids if t >= 0])
        return f"[{n_vec} input vectors]{text}" if n_vec else text

    # ------------------------------------------------------------------------------------------------ lifecycle
    def _reset_state(self) -> None:
        self._serial += 1
        self._state = RequestState(f"{self.workflow}#{id(self)}#{self._serial}")
        self._by_ids: dict[tuple[int, ...], str] = {}
        # A reply's text -> its placeholder: a client sends a reply back as text, whose tokens need not be the
        # generated ones (a model may generate a non-canonical tokenization); the text still names the span.
        self._by_text: dict[str, str] = {}
        self._seqs: list[KVSequence] = []  # sequences whose rows stored spans may read
        self._owned_rows: dict[int, int] = {}  # id(seq) -> rows it computed itself (prefix and shared rows excluded)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._replies: dict[int, int] = {}  # agent -> replies so far
        self._vector_ids: dict[tuple[str, str], list[int]] = {}  # image / vectors content hash -> their prompt ids
        self._reads: list[TrainingRead] = []  # training reads finished calls scheduled, not yet run
        self._reads_out: list[TrainingRead] = []  # of them, those handed out by take_training_reads() and running
        # token-run index of stored spans: aligned RUN_BLOCK-token blocks -> (placeholder, offset) (_stored_runs)
        self._blocks: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        self._indexed: set[str] = set()
        self._runs: set[str] = set()  # placeholders of sub-runs live prompts read (never indexed themselves)

    def reset(self) -> None:
        """Forgets the shared context and frees its KV; agents and what the estimator learned stay. Pending training
        reads run first (what they teach the estimator outlives the context); reads taken by
        take_training_reads() go on without the session's state."""
        with self._lock:
            self.run_training_reads()
            for read in self._reads_out:
                read.detach()
            for s in self._seqs:
                s.close()
            self._reset_state()

    def close(self) -> None:
        """Frees every KV row of the session. Agents' template prefixes stay in the model's prefix cache for later
        sessions (PrefixCache.of(model).clear() drops them)."""
        with self._lock:
            self.reset()

    def __enter__(self) -> AgentSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fork(self) -> AgentSession:
        """A new session with the same agents and a copy of the shared context (spans re-computed on first read)."""
        with self._lock:
            other = AgentSession(
                self.model,
                self.method,
                workflow=self.workflow,
                config=self._runner.config,
                calibration_dir=False,
                cache_namespace=self.cache_namespace,
                training_reads=self.training_reads,
            )
            other._runner.estimator, other._estimator_lock = self._runner.estimator, self._estimator_lock
            other._store = self._store
            for a in self.agents:
                other.agent(a.name, a.system, template=a.template)
            other.vision = self.vision
            other._state.vectors = None if self._state.vectors is None else self._state.vectors.copy()
            other._state.vector_pos = None if self._state.vector_pos is None else self._state.vector_pos.copy()
            other._vector_ids = dict(self._vector_ids)
            other._by_text = dict(self._by_text)
            for span in self._items:
                other._add_span(dataclasses.replace(span.with_rows(), ids=list(span.ids)))
            return other

    @property
    def stored_bytes(self) -> int:
        """KV bytes of the rows the session keeps computed (the rows of finished calls that stored spans still read),
        counted by rows (the pool allocates whole blocks). Template prefixes live in the model's prefix cache."""
        with self._lock:
            rows = sum(self._owned_rows.get(id(s), 0) for s in self._seqs)
            return rows * self._row_bytes

    def evict_lru(self) -> bool:
        """Drops the least recently used stored span (later readers compute it again). False when none is left."""
        with self._lock:
            while self._lru:
                ph, _ = self._lru.popitem(last=False)
                span = self._state.stored(ph)
                if span is not None:
                    self._state.spans[ph] = span.with_rows()
                    self._collect()
                    return True
            return False

    # ------------------------------------------------------------------------------------------------ calls
    def prefill(
        self,
        messages: list[dict[str, Any]],
        agent: str | None = None,
        *,
        chunks: ChunkExecutor | None = None,
        chunk_tokens: int = 256,
        recompute: float | None = None,
    ) -> Prefilled:
        """Puts a chat (OpenAI-style messages) in the engine under the method. A content is a string, or a list of
        strings and input vectors [n, n_embd] (e.g. an image's embeddings from the session's vision encoder). The
        agent is `agent` or the system prompt's text; each other message's content is a span keyed by its token ids
        (vectors by their rows), reused if the session computed it before. chunks: appends of the prompt run in
        chunks of about chunk_tokens rows (chunk_bounds) through this executor (the same rows and logits as in one
        piece). recompute: this call's recompute budget instead of the session's. Call finish() after
        generating, then close(). It runs prefill_plan to its end."""
        if chunk_tokens < 1:
            raise ValueError(f"prefill: chunk_tokens must be >= 1, got {chunk_tokens}")
        return run_plan(self.prefill_plan(messages, agent, recompute=recompute), chunks, chunk_tokens)

    def prefill_plan(
        self, messages: list[dict[str, Any]], agent: str | None = None, *, recompute: float | None = None
    ) -> Plan[Prefilled]:
        """prefill() as a plan (kvcmas_cpp.plan): it yields the appends that compute rows and returns the Prefilled;
        its errors (e.g. ValueError for messages it cannot read) are raised from its steps. It holds the session's
        lock (and, while the method reads its spans, the estimator's) from its first step to its last, so its driver
        runs it to its end on one thread, or closes it (which frees what it holds)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("prefill: messages must be a non-empty list")
        with self._lock, self._recompute_budget(recompute):
            self._idle.begin()
            runs: list[str] = []  # sub-runs of stored spans this prompt reads: dropped when it is done
            try:
                read_ms = self._run_pending_reads()  # eager: the last call's, before this prompt reads
                p = yield from self._prefill_messages(messages, agent, runs)
            except BaseException:
                self._drop_runs(runs)
                self._idle.end()
                raise
            p.runs, p.training_read_ms, p.in_flight = runs, read_ms, True
            return p

    def _prefill_messages(self, messages: list[dict[str, Any]], agent: str | None, runs: list[str]) -> Plan[Prefilled]:
        # Spans are marked with a marker no client can write (a fresh nonce per call): the messages' own text,
        # braces and all, is data and never expanded as a placeholder.
        nonce = secrets.token_hex(8)
        marker_re = re.compile(rf"<kvcmas-span-{nonce}:(\w+)>")
        system = ""
        rendered: list[dict[str, Any]] = []
        tools = attached_tools(messages)
        for i, msg in enumerate(messages):
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str):
                raise ValueError(f"prefill: message {i} needs string 'role' and 'content'")
            # what the template reads beside the content (tool_calls, tool_call_id, name, ...) is rendered with it
            keys = {k: v for k, v in msg.items() if k not in ("role", "content", TOOLS_KEY)}
            if role == "system" and i == 0:
                if not isinstance(content, str):
                    raise ValueError("prefill: the system prompt (message 0) must be a string")
                system = content
                rendered.append({**keys, "role": role, "content": content})
                continue
            ids = self._content_ids(i, role, content) or []
            if not ids:
                rendered.append({**keys, "role": role, "content": content if isinstance(content, str) else ""})
                continue
            ph = self._span(ids, content)
            pieces = self._pieces(content, ids) if ph is None and isinstance(content, str) else None
            if pieces is not None:  # shared text inside a bigger message: its spans between literal text
                marked = []
                for text, piece in pieces:
                    if isinstance(piece, _Run):
                        piece = self._add_run(piece, runs)
                    elif piece is not None and piece not in self._state.spans:
                        self._add_message_item(self._ids(text), text, role, piece)
                    marked.append(text if piece is None else f"<kvcmas-span-{nonce}:{piece}>")
                rendered.append({**keys, "role": role, "content": "".join(marked)})
                continue
            if ph is None:
                ph = self._add_message_item(ids, content if isinstance(content, str) else None, role)
            rendered.append({**keys, "role": role, "content": f"<kvcmas-span-{nonce}:{ph}>"})
        key = agent if agent is not None else (system or "assistant")
        if tools is not None:  # the tools are part of the agent's prompt prefix, and so of who it is
            rendered[0][TOOLS_KEY] = tools
            if agent is None:
                digest = hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:12]
                key = f"{key} [tools {digest}]"
        ag = next((a for a in self.agents if a.name == key), None)
        if ag is None:
            ag = self.agent(key, system)
        template = template_from_messages(self.model, rendered, ag.name, marker_re)
        return (yield from self._prefill_template(ag, template))

    @contextlib.contextmanager
    def _recompute_budget(self, recompute: float | None) -> Iterator[None]:
        """The runner's config with another recompute budget while the block runs (the session's lock is held)."""
        base = self._runner.config
        if recompute is None or recompute == base.recompute:
            yield
            return
        self._runner.config = dataclasses.replace(base, recompute=float(recompute))
        try:
            yield
        finally:
            self._runner.config = base

    def reusable_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of these messages' contents the session holds stored spans for: what prefill() would not compute
        (an estimate: an edge kvcmas is still calibrating reads densely). 0 under nonshared."""
        with self._lock:
            total = 0
            for i, msg in enumerate(messages):
                content = msg.get("content")
                if i == 0 and msg.get("role") == "system" and isinstance(content, str):
                    continue
                try:
                    ids = self._content_ids(i, msg.get("role"), content, register=False)
                except ValueError:
                    continue
                ph = self._span(ids, content) if ids else None
                if ph is None and ids and isinstance(content, str):
                    for _, piece in self._pieces(content, ids, register=False) or []:
                        if isinstance(piece, _Run):
                            total += len(piece.ids)
                        elif piece is not None and (span := self._state.stored(piece)) is not None:
                            total += len(span.ids)
                elif ph is not None and (span := self._state.stored(ph)) is not None:
                    total += len(span.ids)
            return total

    def _add_message_item(self, ids: list[int], text: str | None, role: str, ph: str | None = None) -> str:
        """Registers (part of) a client message as a new context span; returns its placeholder."""
        if ph is None:
            ph = self._next_context_ph()
        self._add_span(Span(ph, ids, f"message:{role}"))
        if text is not None:
            self._by_text.setdefault(text, ph)
        return ph

    def _next_context_ph(self, reserved: int = 0) -> str:
        n_ctx = sum(1 for span in self._items if span.author is None) + reserved
        return QUESTION if n_ctx == 0 else f"condition_{n_ctx}_current"

    def _pieces(
        self, content: str, ids: list[int], register: bool = True
    ) -> list[tuple[str, str | _Run | None]] | None:
        """A message content as literal text and spans, when shared text sits inside it: each span the session holds
        whose text occurs in it (a reply, a paragraph of an earlier message), then each run of at least
        MIN_PIECE_TOKENS of the content's ids equal to ids of a span the session holds (a _Run: part of an earlier
        reply, a reply edited at its start, wrapped in other text, or with its boundary tokens re-tokenized), then
        each other paragraph of at least MIN_PIECE_TOKENS tokens as a new span, and the rest of a paragraph that a
        run opens (a document that starts with text the session holds), after one literal token (placeholders the
        session has not registered yet; with `register` False, new paragraphs stay literal text). None when nothing
        would be split off.

        Cuts are made only at token boundaries of the content's own ids (`ids`). A new paragraph's span may take
        the whitespace next to it, as the tokenizer groups it, and is cut only where the pieces tokenize to `ids`
        exactly, so a first reader's prompt is the one a whole-message span gives. Around a span the session holds,
        the literal text may tokenize its whitespace differently from `ids` (the same text; only later readers,
        which reuse, see it). Spans are never adjacent (the method computes text between them), and literal text
        holds no special-token text (the template parses its text for special tokens). Under nonshared, None."""
        if self.method == "nonshared":
            return None  # nothing is reused: every message stays one piece, the exact reference prompt
        tok = self.model.tokenizer
        # Candidates (start, end, placeholder or run; None: a new paragraph), with a character between any two.
        found: list[tuple[int, int, str | _Run | None]] = []

        def free(a: int, b: int) -> bool:
            return all(b < s or a > e for s, e, _ in found)

        spans = self._state.spans
        known = [t for t, ph in self._by_text.items() if ph in spans and len(spans[ph].ids) >= MIN_PIECE_TOKENS]
        for text in sorted(known, key=len, reverse=True):
            at = content.find(text) if text.strip() else -1
            while at >= 0:
                if free(at, at + len(text)):
                    found.append((at, at + len(text), self._by_text[text]))
                at = content.find(text, at + len(text))
        # Runs may overlap the text matches (one whose cut is not at token boundaries gives way to a run in it) and
        # come with their first token left out too, for where one touches the span before it (a sentence cut out of
        # a reply): the walk below takes the first candidate that fits.
        bounds: dict[int, int | None] = {0: 0}
        for run in self._stored_runs(ids):
            for r in (run, _Run(run.span, run.offset + 1, run.ids[1:], run.at + 1)):
                cut = self._run_chars(content, ids, r, bounds)
                if cut is not None:
                    found.append(cut)
        runs_at = [(x, y) for x, y, ph in found if isinstance(ph, _Run)]
        for m in _PARAGRAPH_RE.finditer(content):
            a, b = m.start(), m.end()
            text_free = all(b < x or a > y for x, y, ph in found if not isinstance(ph, _Run))
            # a paragraph a run opens stays a candidate (after the run, in the stable sort): its rest may be new text
            opened = any(x <= a <= y for x, y in runs_at)
            if text_free and (opened or all(b < x or a > y for x, y in runs_at)):
                found.append((a, b, None))
        found.sort(key=lambda f: f[0])
        pieces: list[tuple[str, str | _Run | None]] = []
        pos, k, n_new = 0, 0, 0  # next character of the content, next id of `ids`, new spans so far
        for a, b, ph in found:
            rest_of_paragraph = False
            if a <= pos and pieces:  # touches the span before it
                if ph is not None or b <= pos or any(isinstance(r, _Run) and pos < x < b for x, _, r in found):
                    continue  # (a run further in the paragraph goes first: its rows exist)
                rest_of_paragraph = True  # a new paragraph a run took the start of: its rest may be a new span
            if isinstance(ph, _Run):  # its ids are the content's own: cut where they sit
                if ph.at >= k and self.model.detokenize(ids[k : ph.at]) == content[pos:a]:
                    pieces += [(content[pos:a], None), (content[a:b], ph)]
                    pos, k = b, ph.at + len(ph.ids)
                continue
            if ph is not None:  # a span the session holds: its text must start and end at token boundaries
                text = content[a:b]
                start = a + len(text) - len(text.lstrip())
                inner = (start, start + len(text.strip()))  # a reply is known with and without its whitespace
                for x, y in [(a, b)] + ([inner] if self._by_text.get(text.strip()) == ph and inner != (a, b) else []):
                    span = self._ids(content[x:y])
                    j = _find_run(ids, span, k)
                    if j >= 0 and self.model.detokenize(ids[k:j]) == content[pos:x]:
                        pieces += [(content[pos:x], None), (content[x:y], ph)]
                        pos, k = y, j + len(span)
                        break
                continue
            lead = a - 1 if a > 0 and content[a - 1].isspace() else a
            # the rest of a paragraph starts after one literal token: spans are never adjacent
            starts = [pos + len(self.model.detokenize(ids[k : k + 1]))] if rest_of_paragraph else [lead, a]
            trail = b + len(content[b:]) - len(content[b:].lstrip("\n"))
            for x, y in dict.fromkeys((x, y) for x in starts for y in (b, trail)):
                if x < pos or (x == pos and pieces):
                    continue
                literal, span = self._ids(content[pos:x]), self._ids(content[x:y])
                n = len(literal) + len(span)
                if len(span) < MIN_PIECE_TOKENS or ids[k : k + n] != literal + span:
                    continue
                ph = self._span(span, content[x:y])
                if ph is None and register:
                    ph = self._next_context_ph(n_new)
                    n_new += 1
                pieces += [(content[pos:x], None), (content[x:y], ph)]
                pos, k = y, k + n
                break
        tail = content[pos:]
        if not any(ph for _, ph in pieces) or self.model.detokenize(ids[k:]) != tail:
            return None
        for text, ph in [*pieces, (tail, None)]:
            if ph is None and tok.encode(text, add_special=False, parse_special=True) != self._ids(text):
                return None  # client text would read as special tokens in the template
        new = pieces[1][1] if len(pieces) == 2 else None
        new_whole = isinstance(new, str) and new not in self._state.spans
        if new_whole and not pieces[0][0].strip() and not tail.strip():
            return None  # the whole message is one new paragraph: a whole-message span, as before
        return [(text, ph) for text, ph in [*pieces, (tail, None)] if text or ph is not None]

    def _stored_runs(self, ids: list[int]) -> list[_Run]:
        """Runs of at least MIN_PIECE_TOKENS of `ids` equal to ids of spans the session holds stored rows of, left to
        right, each the longest such run where it starts: a hit of an aligned RUN_BLOCK-token block of a stored
        span, extended both ways to the longest common run. Matches compare token ids (a block's hash only finds
        candidates), and the index is the session's (one model, one method, one tenant's workflow), so no run
        matches across them. Empty under a method whose estimator keeps state per placeholder (anchor pools): a
        run's placeholder is new on every call."""
        st = self._state
        if self._runner.estimator.observes_dense:
            return []
        for ph, stored in st.spans.items():
            if ph not in self._indexed and ph not in self._runs and stored.stored and stored.shared is not None:
                self._indexed.add(ph)
                span = stored.ids
                for o in range(0, len(span) - RUN_BLOCK + 1, RUN_BLOCK):
                    self._blocks.setdefault(tuple(span[o : o + RUN_BLOCK]), []).append((ph, o))
        out: list[_Run] = []
        lo, i = 0, 0
        while i + RUN_BLOCK <= len(ids):
            best: tuple[int, int, str, int] | None = None  # (start, end, placeholder, offset)
            for ph, o in self._blocks.get(tuple(ids[i : i + RUN_BLOCK]), ()):
                held = st.stored(ph)
                if held is None or held.shared is None:  # evicted
                    continue
                span = held.ids
                a, pa = i, o
                while a > lo and pa > 0 and ids[a - 1] == span[pa - 1]:
                    a, pa = a - 1, pa - 1
                e, pe = i + RUN_BLOCK, o + RUN_BLOCK
                while e < len(ids) and pe < len(span) and ids[e] == span[pe]:
                    e, pe = e + 1, pe + 1
                if best is None or e - a > best[1] - best[0]:
                    best = (a, e, ph, pa)
            if best is not None and best[1] - best[0] >= MIN_PIECE_TOKENS:
                a, e, ph, pa = best
                out.append(_Run(ph, pa, tuple(ids[a:e]), a))
                lo = i = e
            else:
                i += 1
        return out

    def _run_chars(
        self, content: str, ids: list[int], run: _Run, bounds: dict[int, int | None]
    ) -> tuple[int, int, _Run] | None:
        """The characters of `content` a run covers, its ends moved inwards (a token at a time) to token boundaries
        whose text before them is the content's own (not inside a character several tokens spell); None when the
        run is then shorter than MIN_PIECE_TOKENS. bounds: token boundary -> its character (None: not one), a
        cache for one content."""

        def chars(j: int) -> int | None:
            if j not in bounds:  # the text from the nearest boundary before j; from the start where that differs
                i = max(i for i, c in bounds.items() if c is not None and i <= j)
                c = cast(int, bounds[i])
                text = self.model.detokenize(ids[i:j])
                if not content.startswith(text, c):
                    c, text = 0, self.model.detokenize(ids[:j])
                bounds[j] = c + len(text) if content.startswith(text, c) else None
            return bounds[j]

        a, e = run.at, run.at + len(run.ids)
        x = y = None
        while e - a >= MIN_PIECE_TOKENS and (x := chars(a)) is None:
            a += 1
        while e - a >= MIN_PIECE_TOKENS and (y := chars(e)) is None:
            e -= 1
        if x is None or y is None or e - a < MIN_PIECE_TOKENS or y <= x:
            return None
        if (a, e) != (run.at, run.at + len(run.ids)):
            run = _Run(run.span, run.offset + a - run.at, tuple(ids[a:e]), a)
        return x, y, run

    def _add_run(self, run: _Run, runs: list[str]) -> str:
        """A placeholder for a run of a stored span: the span's own when the run is all of it, else a new one whose
        stored state is the span's rows under the run (WorkflowRunner.sub_span; its first `head` ids are
        forwarded, as any span's) and whose estimator edges (key) are the span's. Appended to `runs` (dropped by
        _drop_runs)."""
        st = self._state
        whole = st.spans[run.span]
        if run.offset == 0 and len(run.ids) == len(whole.ids):
            return run.span
        self._n_runs += 1
        ph = f"run_{self._n_runs}_current"
        h = min(self._runner.config.head, len(run.ids))
        rows = self._runner.sub_span(whole, run.offset, len(run.ids) - h)
        st.spans[ph] = dataclasses.replace(rows, ph=ph, ids=list(run.ids), key=whole.key or whole.ph)
        self._runs.add(ph)
        runs.append(ph)
        if run.span in self._lru:
            self._lru.move_to_end(run.span)
        return ph

    def _drop_runs(self, runs: list[str]) -> None:
        """Forgets the placeholders of sub-runs a prompt read (their spans hold no rows of their own)."""
        for ph in runs:
            self._state.spans.pop(ph, None)
            self._runs.discard(ph)
        runs.clear()

    def _span(self, ids: list[int], content: Any) -> str | None:
        """The placeholder of a span the session holds already: by the content's ids, or a reply by the text its
        client received (also when it comes back with surrounding whitespace trimmed or added)."""
        ph = self._by_ids.get(tuple(ids))
        if ph is None and isinstance(content, str):
            ph = self._by_text.get(content) or self._by_text.get(content.strip())
        return ph

    def _content_ids(self, i: int, role: Any, content: Any, register: bool = True) -> list[int] | None:
        """Prompt ids of a message content: text tokens and input-vector ids (None: vectors the session has not
        seen, when not `register`)."""
        if not isinstance(role, str) or not isinstance(content, (str, list)):
            raise ValueError(
                f"prefill: message {i} needs string 'role' and 'content' (or a list of strings and arrays [n, n_embd])"
            )
        if isinstance(content, str):
            return self._ids(content)
        ids: list[int] = []
        for part in content:
            if isinstance(part, str):
                ids += self._ids(part)
            elif isinstance(part, np.ndarray):
                vector_ids = self._embedding_ids(part, f"prefill: message {i}", register)
                if vector_ids is None:
                    return None
                ids += vector_ids
            else:
                raise ValueError(f"prefill: message {i}: content parts are strings or arrays [n, n_embd]")
        return ids

    def prefill_agent(self, agent: Agent) -> Prefilled:
        """The agent's prompt over the shared context so far, in the engine (what respond() generates from)."""
        with self._lock:
            if agent.session is not self:
                raise ValueError(f"prefill_agent: {agent!r} belongs to another session")
            self._idle.begin()
            try:
                read_ms = self._run_pending_reads()
                messages = [{"role": "system", "content": agent.system}] if agent.system else []
                messages.append({"role": "user", "content": self._user_template(agent)})
                p = run_plan(self._prefill_template(agent, template_from_messages(self.model, messages, agent.name)))
            except BaseException:
                self._idle.end()
                raise
            p.training_read_ms, p.in_flight = read_ms, True
            return p

    def finish(self, p: Prefilled, generated: Sequence[int], text: str | None = None) -> None:
        """Registers a generated reply (its ids; a trailing end-of-generation token is dropped) as a span later
        prompts reuse. The rows of its last token are computed here if generation stopped before feeding it.
        text: what the client received (e.g. cut before a stop string): the span keeps the tokens that text covers,
        and the text (trimmed or not) names it when it comes back."""
        with self._lock:
            if p.finished:
                raise ValueError("finish: this prompt was finished already")
            if p.released:
                raise ValueError("finish: the prompt was closed")
            p.finished = True
            self._end_call(p)
            out = [int(t) for t in generated]
            if out and out[-1] in self.model.tokenizer.eog_ids:
                out = out[:-1]
            received = None
            if text is not None:
                out, received = self._received(out, text)
            p.hop.generated = out
            held = len(p.seq) - p.hop.prompt_tokens
            if held < len(out):
                p.seq.append(out[held:], logits="none")
            elif held > len(out):
                p.seq.truncate(p.hop.prompt_tokens + len(out))
            self._finish(p, out, received)

    def _received(self, out: list[int], text: str) -> tuple[list[int], str | None]:
        """The generated ids cut to those whose text the client received (a stop string ends it early), and the
        received text when those ids spell it (up to surrounding whitespace)."""
        k = len(out)
        while k > 0 and not text.startswith(self.model.detokenize(out[:k])):
            k -= 1
        spelled = self.model.detokenize(out[:k])
        return out[:k], (text if spelled.strip() == text.strip() else None)

    # ------------------------------------------------------------------------------------------------ internals
    def _ids(self, content: str | Sequence[int]) -> list[int]:
        if isinstance(content, str):
            return self.model.tokenizer.encode(content, add_special=False, parse_special=False)
        ids = token_ids(content, "content")
        n_vocab = self.model.n_vocab
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        return ids

    def _add_span(self, span: Span) -> None:
        self._state.spans[span.ph] = span
        self._by_ids.setdefault(tuple(span.ids), span.ph)

    @property
    def _items(self) -> list[Span]:
        """The shared items (context and replies) in the order they joined: every span but the sub-runs live
        prompts read."""
        return [span for ph, span in self._state.spans.items() if ph not in self._runs]

    def _user_template(self, ag: Agent) -> str:
        if ag.template is not None and CONTEXT_PLACEHOLDER not in ag.template:
            return ag.template
        parts = []
        for span in self._items:
            label = span.label
            if label is None and span.author is not None:
                label = f"{self.agents[span.author].name}'s output"
            parts.append((f"{label}:\n" if label else "") + "{" + span.ph + "}")
        ctx = "\n\n".join(parts)
        return ag.template.replace(CONTEXT_PLACEHOLDER, ctx) if ag.template is not None else ctx

    def _prefix(self, ag: Agent, t: Template) -> Plan[tuple[KVSequence, int]]:
        """The plan of a sequence holding the agent's template prefix (the caller owns it); returns it and how many
        of its rows an earlier call computed (the model's prefix cache, within the session's cache_namespace). A
        template without spans is all prefix: its last token is left to the hop, which computes it for the logits."""
        ids = t.texts[0] if t.placeholders else t.texts[0][:-1]
        return self._prefix_cache.plan_prefix(self.cache_namespace, ids)

    def _edge_of(self, ph: str, reader: int) -> est.Edge:
        """The estimator's edge for a span read by an agent: the span's role, and the reader's identity with that of
        the agent whose view of the span it reads (the base): the deviation depends on both prefixes, so a map learned
        for one base never corrects another (an agent re-reading its own view, whose rows are its own, included)."""
        span = self._state.spans.get(ph)
        key = span.key if span is not None and span.key else ph
        base = span.view_agent if span is not None else None  # None: not stored yet (no base to correct from)
        return (key, f"{self._identities[reader]}<-{self._identities[base] if base is not None else '?'}")

    def _prefill_template(self, ag: Agent, t: Template) -> Plan[Prefilled]:
        """The plan of agent ag's prompt from its template: its prefix (the prefix cache's), then the method's hop."""
        missing = [ph for ph in t.placeholders if ph not in self._state.spans]
        if missing:
            raise ValueError(f"agent {ag.name!r}: its template reads {{{missing[0]}}}, which nobody has shared yet")
        n_prompt = sum(map(len, t.texts)) + sum(len(self._state.spans[ph].ids) for ph in t.placeholders)
        if n_prompt >= self.model.n_ctx:  # refused before any compute (the core would stop at n_ctx, mid-prompt)
            raise ValueError(
                f"agent {ag.name!r}: its prompt is {n_prompt} tokens, which leaves no room in the model's context "
                f"(n_ctx = {self.model.n_ctx}): share less, reset() the session, or load the model with a larger n_ctx"
            )
        n = self._replies.get(ag.index, 0)
        reply_ph = f"agent_{ag.index}_current" if n == 0 else f"agent_{ag.index}_{n}_current"
        prefix_seq, cached = yield from self._prefix(ag, t)
        try:
            with self._estimator_lock:
                seq, logits, hop, pos_map, corrs = yield from self._runner.plan_hop(
                    ag.index, t, prefix_seq, self._state
                )
        except BaseException:
            prefix_seq.close()
            raise
        for ph in t.placeholders:
            if ph in self._lru:
                self._lru.move_to_end(ph)
        n = len(prefix_seq)
        return Prefilled(self, ag.index, seq, logits, hop, pos_map, corrs, reply_ph, n, cached, prefix_seq)

    def _finish(self, p: Prefilled, out: list[int], received: str | None = None) -> None:
        ag = p.agent
        self._replies[ag] = self._replies.get(ag, 0) + 1
        reply = Span(p.reply_ph, list(out), f"reply:{self._identities[ag]}", author=ag) if out else None
        if reply is not None:
            for text in (self.model.detokenize(out), received):
                if text is not None:
                    self._by_text.setdefault(text, p.reply_ph)
                    self._by_text.setdefault(text.strip(), p.reply_ph)
        if self.method == "nonshared":  # nothing is stored: replies are re-read as text
            if reply is not None:
                self._add_span(reply)
            return
        with self._estimator_lock:
            read = self._runner.finish_hop(ag, p.seq, p.hop, p.pos_map, p.corrs, self._state, reply, prefix=p.prefix)
        self._drop_runs(p.runs)  # a training read holds its own forks of the views it pairs with
        if read is not None:
            read.lock, read.on_done = self._read_lock, self._read_done
            self._reads.append(read)
            if self.training_reads == "idle":
                self._idle.submit(read)
        if reply is not None:  # the runner put it in the state, stored
            self._by_ids.setdefault(tuple(out), p.reply_ph)
        self._seqs.append(p.seq)
        self._owned_rows[id(p.seq)] = p.hop.computed_tokens + len(out)
        for ph, span in self._state.spans.items():
            if span.stored and (span.view_seq is p.seq or chains(ph)):
                self._lru[ph] = None
                self._lru.move_to_end(ph)
        self._collect()

    def _end_call(self, p: Prefilled) -> None:
        """The call p's prefill began is over (its reply registered, or the prompt closed)."""
        if p.in_flight:
            p.in_flight = False
            self._idle.end()

    @contextlib.contextmanager
    def _read_lock(self) -> Iterator[None]:
        with self._lock, self._estimator_lock:
            yield

    def _read_done(self, read: TrainingRead) -> None:
        """A training read ran to its end (under _read_lock): its fits are saved, its exact rows join the session's
        sequences when a chain reads on them."""
        self._read_ms_done += read.ms
        if read.fitted and self._store is not None and isinstance(read.estimator, est.RidgeEstimator):
            self._store.save(read.estimator, read.fitted)
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

    def _release(self, p: Prefilled) -> None:
        with self._lock:
            if p.released:
                return
            p.released = True
            self._end_call(p)
            self._drop_runs(p.runs)
            if p.seq not in self._seqs:
                p.seq.close()
            if p.prefix is not None:
                p.prefix.close()

    def _collect(self) -> None:
        """Closes session sequences no stored span reads any more."""
        live = {id(span.view_seq) for span in self._state.spans.values() if span.stored}
        keep = []
        for s in self._seqs:
            if id(s) in live:
                keep.append(s)
            else:
                self._owned_rows.pop(id(s), None)
                s.close()
        self._seqs = keep

    def _stats(self, p: Prefilled, generation_ms: float = 0.0) -> ResponseStats:
        h = p.hop
        gen = len(h.generated)
        computed = h.computed_tokens + p.prefix_rows - p.prefix_cached  # prefix rows this very call computed count
        return ResponseStats(
            self.agents[p.agent].name,
            self.method,
            h.mode,
            h.gate,
            round(h.ttft_ms + p.training_read_ms, 3),  # the caller waited for both
            h.prompt_tokens,
            computed,
            h.prompt_tokens - computed,
            gen,
            round(generation_ms, 3),
            (computed + gen) * self._row_bytes,
            h.corr_bytes,
            h.corr_rank,
            h.recomputed_tokens,
            p.prefix_cached,
            h.prompt_tokens - computed - p.prefix_cached,
            h.dense_reason if h.mode != "reuse" else None,
            h.shadow_tokens,
            round(p.training_read_ms, 3),
            self._reads_of(p),
        )

    def _reads_of(self, p: Prefilled) -> list[dict[str, Any]]:
        """The spans of p's prompt grouped by author (ResponseStats.reads); a reply's author is an agent's name."""
        by_author: dict[str | None, dict[str, Any]] = {}
        for ph, (_, n) in p.pos_map.items():
            span = self._state.spans.get(ph)
            if span is None or ph == p.reply_ph:
                continue
            author = span.author
            name = self.agents[author].name if author is not None and author < len(self.agents) else None
            entry = by_author.setdefault(name, {"from": name, "tokens": 0, "spans": 0})
            entry["tokens"] += n
            entry["spans"] += 1
        return list(by_author.values())

    def _respond(
        self,
        ag: Agent,
        max_tokens: int,
        params: SamplingParams,
        stops: list[str],
        constraint: Any = None,
        logprobs: int | None = None,
    ) -> Iterator[ResponseChunk]:
        with self._lock:
            p = self.prefill_agent(ag)
            ids: list[int] = []
            pieces: list[str] = []
            finish: Literal["stop", "length"] = "length"
            gen_ms = 0.0
            try:
                chunks = self.model._generate(
                    p.seq.tokens, max_tokens, params, stops, p.seq, p.logits, constraint, logprobs
                )
                lps: list[TokenLogprob] = []
                for c in chunks:
                    c_: CompletionChunk = c
                    if c_.logprob is not None:
                        lps.append(c_.logprob)
                    if c_.token is not None:
                        ids.append(c_.token)
                    if c_.finish_reason is not None:
                        finish = c_.finish_reason
                        gen_ms = c_.timings.generation_ms if c_.timings else 0.0
                        pieces.append(c_.text)
                        break
                    pieces.append(c_.text)
                    if c_.text:
                        yield ResponseChunk(c_.text, c_.token)
                text = "".join(pieces)
                self.finish(p, ids, text)
                stats = self._stats(p, gen_ms)
                chosen = chat_logprobs(self.model.tokenizer, lps) if logprobs is not None else None
                response = Response(ag.name, text, ids, finish, stats, p.logits, chosen)
                yield ResponseChunk(pieces[-1] if pieces else "", None, finish, response)
            finally:
                self._release(p)
