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

The parts: agent.py (an Agent, its replies), agent_results.py (what calls give back), session_messages.py (how
messages become spans: sharing.segments, sharing.span_index), session_reads.py (the session's training reads),
sharing.pool.EstimatorPool (the estimators sessions share, handed to the session or the model's default).

Thread safety: a session serialises its own calls with a lock; sessions run concurrently on one model (compute
releases the GIL; the engine serialises compute), each with its own shared context."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from .agent import Agent, agent_identity, check_declaration
from .agent_results import Prefilled, Response, ResponseChunk, ResponseStats, response_stats
from .idle_reads import IdleReads
from .kv_budget import KVBudget
from .model import KVSequence, Model
from .plan import Plan, run_plan
from .prefix_cache import PrefixCache
from .session_messages import SessionMessages
from .session_reads import TRAINING_READ_POLICIES, SessionTrainingReads, TrainingReadPolicy
from .sharing import adapter_views
from .sharing import estimators as est
from .sharing import methods as registry
from .sharing.methods import CALIBRATION_READS, MethodConfig
from .sharing.persist import CalibrationStore, default_calibration_dir
from .sharing.pool import (
    EstimatorPool,
    bound_estimators,
    estimator_bytes,
    estimator_edges,
    forget_estimators,
    shared_estimator,
)
from .sharing.runner import WorkflowRunner
from .sharing.span import Span, chains
from .sharing.span_index import MIN_PIECE_TOKENS, RUN_BLOCK, SpanIndex
from .sharing.state import RequestState
from .sharing.training_read import TrainingRead
from .sharing.workflow import Template, Workflow, template_from_messages

__all__ = [  # kvcmas_cpp.agents.*: the public names, wherever they live now
    "CALIBRATION_READS",
    "MIN_PIECE_TOKENS",
    "RUN_BLOCK",
    "TRAINING_READ_POLICIES",
    "Agent",
    "AgentSession",
    "EstimatorPool",
    "MethodConfig",
    "Prefilled",
    "Response",
    "ResponseChunk",
    "ResponseStats",
    "TrainingReadPolicy",
    "agent_identity",
    "bound_estimators",
    "estimator_bytes",
    "estimator_edges",
    "forget_estimators",
    "shared_estimator",
]


class AgentSession(SessionMessages, SessionTrainingReads):
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
        pool: EstimatorPool | None = None,
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
        (run_training_reads(), take_training_reads(), reset()/close()). pool: the EstimatorPool whose shared
        estimator the session uses (sessions of one workflow name in a pool learn together; default: the model's
        own, EstimatorPool.of(model)); unused when `estimator` is given."""
        if training_reads not in TRAINING_READ_POLICIES:
            raise ValueError(
                f"training_reads must be one of {', '.join(TRAINING_READ_POLICIES)}, got {training_reads!r}"
            )
        self.training_reads: TrainingReadPolicy = training_reads
        self._idle = IdleReads.of(model)
        self._read_ms_done = 0.0  # training_read_ms_total of the reads that ran to their end
        entry = self._entry = registry.method(method, session=True)
        self.model, self.method, self.workflow, self.vision = model, method, workflow, vision
        if vision is not None:
            vision.check_text_model(model.n_embd, model.tokenizer)
        config = entry.session_config(config, cold=cold, recompute=recompute)
        root: str | os.PathLike[str] | None = None
        if calibration_dir is True:
            root = default_calibration_dir() if estimator is None else None
        elif calibration_dir is not False:
            root = calibration_dir
        self._store = CalibrationStore(root, model, method, workflow) if root and entry.learns_online else None
        if pool is not None and not pool.serves(model):
            raise ValueError("AgentSession: the EstimatorPool given as pool= belongs to another model")
        self.pool = pool if pool is not None else EstimatorPool.of(model)
        if estimator is not None:
            self._estimator_lock = threading.RLock()
            if self._store is not None and estimator.persists:
                self._store.load_into(estimator)  # type: ignore[arg-type]  # persists: a RidgeEstimator's maps
        else:
            estimator, self._estimator_lock = self.pool.get(method, workflow, self._store)
        self._runner = WorkflowRunner(model, Workflow(workflow, ()), config, estimator)
        self._runner.edge_of = self._edge_of
        self._lock = self.lock = threading.RLock()  # serialises the session's calls (re-entrant)
        self.agents: list[Agent] = []
        self._identities: list[str] = []  # per agent: agent_identity()
        self.cache_namespace = cache_namespace
        self._prefix_cache = PrefixCache.of(model)
        self._kv = KVBudget(model)  # prices the rows the session holds
        self._serial = 0
        self._n_runs = 0  # sub-run placeholders made (not reset: a prompt closed after reset() drops only its own)
        self._reset_state()

    # ------------------------------------------------------------------------------------------------ agents
    def agent(
        self,
        name: str,
        system: str = "",
        *,
        template: str | None = None,
        adapter: str | None = None,
        adapter_scale: float = 1.0,
    ) -> Agent:
        """Declares an agent. system: its role prompt. template: its user message with placeholders
        ({user_question}, {agent_<i>_current}, {condition_<k>_current}, {context}); default: every shared item. A
        template reads at least one of them, and every {word} in it is one (ValueError otherwise). adapter: the name
        of a LoRA adapter the model has loaded (Model.load_adapter) the agent runs with, at adapter_scale; spans
        other agents computed with other adapters (or none) are read through the method, their edges keyed on both
        adapters (sharing/adapter_views.py)."""
        system = check_declaration(name, system, template)
        lora = adapter_views.agent_adapter(self.model, adapter, adapter_scale)
        with self._lock:
            if any(a.name == name for a in self.agents):
                raise ValueError(f"agent: an agent named {name!r} exists already in this session")
            ag = Agent(self, len(self.agents), name, system, template, lora)
            self.agents.append(ag)
            self._identities.append(adapter_views.identity_with(agent_identity(system, template), lora))
            self._runner.agent_names.append(name)
            return ag

    # ------------------------------------------------------------------------------------------------ lifecycle
    def _reset_state(self) -> None:
        self._serial += 1
        self._state = RequestState(f"{self.workflow}#{id(self)}#{self._serial}")
        self._index = SpanIndex()  # the spans found again by ids, text and token runs; their LRU order
        self._seqs: list[KVSequence] = []  # sequences whose rows stored spans may read
        self._owned_rows: dict[int, int] = {}  # id(seq) -> rows it computed itself (prefix and shared rows excluded)
        self._replies: dict[int, int] = {}  # agent -> replies so far
        self._vector_ids: dict[tuple[str, str], list[int]] = {}  # image / vectors content hash -> their prompt ids
        self._reads: list[TrainingRead] = []  # training reads finished calls scheduled, not yet run
        self._reads_out: list[TrainingRead] = []  # of them, those handed out by take_training_reads() and running

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
                pool=self.pool,
            )
            other._runner.estimator, other._estimator_lock = self._runner.estimator, self._estimator_lock
            other._store = self._store
            for a in self.agents:
                other.agent(a.name, a.system, template=a.template, adapter=a.adapter, adapter_scale=a.adapter_scale)
            other.vision = self.vision
            other._state.vectors = None if self._state.vectors is None else self._state.vectors.copy()
            other._state.bidirectional = list(self._state.bidirectional)
            other._state.vector_pos = None if self._state.vector_pos is None else self._state.vector_pos.copy()
            other._vector_ids = dict(self._vector_ids)
            other._index.by_text = dict(self._index.by_text)
            for span in self._items:
                other._add_span(dataclasses.replace(span.with_rows(), ids=list(span.ids)))
            return other

    @property
    def stored_bytes(self) -> int:
        """KV bytes of the rows the session keeps computed (the rows of finished calls that stored spans still read),
        counted by rows (the pool allocates whole blocks). Template prefixes live in the model's prefix cache."""
        with self._lock:
            rows = sum(self._owned_rows.get(id(s), 0) for s in self._seqs)
            return self._kv.rows_bytes(rows)

    def evict_lru(self) -> bool:
        """Drops the least recently used stored span (later readers compute it again). False when none is left."""
        with self._lock:
            while (ph := self._index.pop_lru()) is not None:
                span = self._state.stored(ph)
                if span is not None:
                    self._state.spans[ph] = span.with_rows()
                    self._collect()
                    return True
            return False

    # ------------------------------------------------------------------------------------------------ calls
    def prefill_plan(
        self,
        messages: list[dict[str, Any]],
        agent: str | None = None,
        *,
        recompute: float | None = None,
        adapter: tuple[str, float] | None = None,
    ) -> Plan[Prefilled]:
        """prefill() as a plan (kvcmas_cpp.plan): it yields the appends that compute rows and returns the Prefilled;
        its errors (e.g. ValueError for messages it cannot read) are raised from its steps. It holds the session's
        lock (and, while the method reads its spans, the estimator's) from its first step to its last, so its driver
        runs it to its end on one thread, or closes it (which frees what it holds). adapter: (name, scale) of the
        LoRA adapter the agent runs with (a loaded one; the same role prompt with another adapter is another agent)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("prefill: messages must be a non-empty list")
        with self._lock, self._recompute_budget(recompute):
            self._idle.begin()
            runs: list[str] = []  # sub-runs of stored spans this prompt reads: dropped when it is done
            try:
                read_ms = self._run_pending_reads()  # eager: the last call's, before this prompt reads
                p = yield from self._prefill_messages(messages, agent, runs, adapter)
            except BaseException:
                self._drop_runs(runs)
                self._idle.end()
                raise
            p.runs, p.training_read_ms, p.in_flight = runs, read_ms, True
            return p

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
    def _prefix(self, ag: Agent, t: Template) -> Plan[tuple[KVSequence, int]]:
        """The plan of a sequence holding the agent's template prefix (the caller owns it); returns it and how many
        of its rows an earlier call computed (the model's prefix cache, within the session's cache_namespace). A
        template without spans is all prefix: its last token is left to the hop, which computes it for the logits."""
        ids = t.texts[0] if t.placeholders else t.texts[0][:-1]
        return adapter_views.agent_prefix(self._prefix_cache, self.cache_namespace, ids, self.model, ag.lora)

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
            self._index.touch(ph)
        n = len(prefix_seq)
        return Prefilled(self, ag.index, seq, logits, hop, pos_map, corrs, reply_ph, n, cached, prefix_seq)

    def _finish(self, p: Prefilled, out: list[int], received: str | None = None) -> None:
        ag = p.agent
        self._replies[ag] = self._replies.get(ag, 0) + 1
        reply = Span(p.reply_ph, list(out), f"reply:{self._identities[ag]}", author=ag) if out else None
        if reply is not None:
            for text in (self.model.detokenize(out), received):
                if text is not None:
                    self._index.name_text(text, p.reply_ph)
                    self._index.name_text(text.strip(), p.reply_ph)
        if not self._entry.shares:  # nothing is stored: replies are re-read as text
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
            self._index.by_ids.setdefault(tuple(out), p.reply_ph)
        self._seqs.append(p.seq)
        self._owned_rows[id(p.seq)] = p.hop.computed_tokens + len(out)
        for ph, span in self._state.spans.items():
            if span.stored and (span.view_seq is p.seq or chains(ph)):
                self._index.stored(ph)
        self._collect()

    def _end_call(self, p: Prefilled) -> None:
        """The call p's prefill began is over (its reply registered, or the prompt closed)."""
        if p.in_flight:
            p.in_flight = False
            self._idle.end()

    def release(self, p: Prefilled) -> None:
        """Releases a prompt (Prefilled.close): its sequence, unless stored spans read it, and its prefix fork."""
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

    def stats_of(self, p: Prefilled, generation_ms: float = 0.0) -> ResponseStats:
        """What p's call cost and reused (generation_ms: its generation's time, when it generated)."""
        names = [a.name for a in self.agents]
        return response_stats(p, names, self.method, self._kv, self._state.spans, generation_ms)
