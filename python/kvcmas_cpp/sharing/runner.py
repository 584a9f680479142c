"""Runs a workflow's agents for one request under a sharing method, on the engine's shared spans.

Per agent (hop), in execution order:
- the template prefix (text before the first placeholder) is prefilled once per agent and kept; each request forks
  it (exact prefix cache);
- `nonshared` prefills the rest of the prompt; the first agent of a request always does (it is exact and its rows
  of the question are the stored span);
- a sharing method appends each shared span by reference (`append_shared`, re-positioned in the kernel), optionally
  after forwarding its first `head` tokens exactly, with the estimator's low-rank correction, and forwards the
  template text after the span (exact tail, default) or reuses it rotate-only from the agent's template prefill
  (`tail="rotate"`, the reference code's behaviour; the last prompt token is always forwarded).

Chaining (question span): the span is stored once (the first agent's exact rows). Hop i's base is hop i-1's view of
the span; its correction is hop i-1's correction concatenated with hop i's own factors (rank grows by the per-edge
rank each hop), so the engine still stores the span once and applies base + Σ factors in the kernel. A dense
(fallback) hop becomes the new stored span. Agents' replies are not chained: each reader corrects relative to the
producer's rows (star), as in the reference code. Spans are `span.Span` values in RequestState.spans.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np

from .._native import core
from ..model import KVSequence, Model, SharedKV
from ..plan import Append, Plan, chunk_bounds, run_plan
from . import estimators as est
from . import recompute as recompute_mod
from ._blas import single_threaded_blas
from .methods import MethodConfig, make_estimator
from .span import Span, chains
from .workflow import QUESTION, Template, Workflow, build_template, response_placeholder


@dataclass
class HopReport:
    """What one agent call did. Fidelity fields are set in evaluation mode (against the exact run)."""

    agent: int
    name: str
    mode: str  # "source" | "dense" | "reuse" | "fallback"
    gate: str  # the gate's decision ("n/a", "reuse", "novel -> dense")
    ttft_ms: float
    prompt_tokens: int
    computed_tokens: int  # tokens this request forwarded for the prompt (prefix-cache hits excluded)
    reused_tokens: int  # prefix-cache rows + shared span rows
    kv_bytes: int  # KV blocks this hop allocated (prompt + generation)
    corr_bytes: int  # KvCorrection memory held by this hop's sequence
    corr_rank: int = 0
    corr_factor_bytes: int = 0  # the same, counted from the corrections handed to the engine and kept fused
    materialized_tokens: int = 0  # corrected span rows copied into the sequence (MethodConfig.apply) instead
    recomputed_tokens: int = 0  # shared span rows this reader forwarded itself (MethodConfig.recompute; in computed)
    dense_reason: str | None = None  # why shared spans were computed: calibrating | gate | forced | no match
    shadow_tokens: int = 0  # rows computed after the reply for training reads (cold reuse while calibrating)
    peak_bytes: int = 0  # KV + correction bytes the request holds after this hop: its peak so far (nothing is freed)
    generated: list[int] = field(default_factory=list)
    first_logits: np.ndarray | None = None
    tf_logits: np.ndarray | None = None  # teacher-forced logits over the generated tokens [len-1, n_vocab]
    kl: float | None = None
    top1: bool | None = None
    tf_top1: float | None = None
    k_err: list[float] | None = None
    v_err: list[float] | None = None
    identical: bool | None = None
    prompt: list[int] = field(default_factory=list, repr=False)  # the prompt ids

    def row(self) -> dict[str, object]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("first_logits", "tf_logits", "generated", "prompt")}
        d["generated_tokens"] = len(self.generated)
        return d


@dataclass
class RequestState:
    """One request's spans as the method sees them (placeholder -> Span: ids, role, the stored state later readers
    start from), and per hop its prompt, its placeholder positions and its report."""

    message: str  # the request's key for the estimator's anchors
    spans: dict[str, Span] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)
    spans_at: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    hops: list[HopReport] = field(default_factory=list)
    kv0: int = 0  # model KV bytes when the current hop started
    vectors: np.ndarray | None = None  # input vectors [n, n_embd] that ids -(1 + row) stand for (e.g. image features)
    vector_pos: np.ndarray | None = None  # [n, 3] per vector (k, rows, cols): row k of an image (M-RoPE); rows 0: not
    owned: list[KVSequence] = field(default_factory=list)  # sequences spans read besides the hops' (caller closes)

    def add_vectors(self, rows: np.ndarray, image_grid: tuple[int, int] | None = None) -> list[int]:
        """Registers input vectors (rows [n, n_embd]; image_grid: they are an image of (rows, cols) tokens,
        row-major) and returns the ids that stand for them in prompts."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        first = 0 if self.vectors is None else self.vectors.shape[0]
        self.vectors = rows.copy() if self.vectors is None else np.concatenate([self.vectors, rows])
        n = rows.shape[0]
        pos = np.zeros((n, 3), dtype=np.int64)
        if image_grid is not None:
            pos[:, 0], pos[:, 1], pos[:, 2] = np.arange(n), image_grid[0], image_grid[1]
        self.vector_pos = pos if self.vector_pos is None else np.concatenate([self.vector_pos, pos])
        return [-(1 + first + i) for i in range(rows.shape[0])]

    def stored(self, ph: str) -> Span | None:
        """The span `ph` if a reader has computed it (Span.stored), else None."""
        span = self.spans.get(ph)
        return span if span is not None and span.stored else None


def reserve_rows(seq: KVSequence, pending: list[int], held: list[int]) -> list[int]:
    """Reserves `pending` (prompt ids; -(1 + r) for row r of the request's input vectors) at seq's end, to be computed
    later with the rest (KVSequence.reserve), and moves them to `held`; returns the new, empty pending list."""
    if pending:
        seq.reserve([t if t >= 0 else -1 for t in pending])
        held += pending
    return []


def append_mixed(
    seq: KVSequence,
    ids: list[int],
    logits: Literal["last", "none"],
    vectors: np.ndarray | None,
    vector_pos: np.ndarray | None = None,
) -> Plan[np.ndarray | None]:
    """The plan of appending a prompt piece that mixes token ids with input vectors (an id -(1 + r) stands for row r
    of `vectors`, at image position vector_pos[r]): one Append per run of ids or of vectors; returns the last one's
    logits."""
    if not ids:
        return None
    if min(ids) >= 0:
        return (yield Append(seq, ids, logits))
    if vectors is None:
        raise ValueError("a prompt holds input-vector ids but no vectors were registered")
    out: np.ndarray | None = None
    i = 0
    while i < len(ids):
        j, is_vec = i, ids[i] < 0
        while j < len(ids) and (ids[j] < 0) == is_vec:
            j += 1
        want = logits if j == len(ids) else "none"
        picked = [-t - 1 for t in ids[i:j]]
        rows: list[int] | np.ndarray = vectors[picked] if is_vec else ids[i:j]
        pos = vector_pos[picked] if is_vec and vector_pos is not None and vector_pos[picked, 1].any() else None
        out = yield Append(seq, rows, want, image_pos=pos)
        i = j
    return out


@dataclass
class RequestResult:
    hops: list[HopReport]
    seqs: list[KVSequence]
    span_pos: list[dict[str, tuple[int, int]]]  # per agent: placeholder -> (position, length) in its sequence
    prompt_ids: list[list[int]]
    owned: list[KVSequence] = field(default_factory=list)  # RequestState.owned

    def close(self) -> None:
        for s in self.seqs + self.owned:
            s.close()


_NUMPY = object()  # _core_ridge's answer when the numpy path must compute the correction


def _canonical(model: Model, seq: KVSequence, pos: int, n: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's view of span rows [first, first + n) of the span starting at pos, keys rotated back to span
    positions first..first+n-1 (the canonical frame)."""
    k, v = seq.kv(pos + first, n)
    k = np.stack([model._core.rope_rotate(np.ascontiguousarray(k[il]), -pos, il) for il in range(k.shape[0])])
    return k, v


TRAINING_READ_ROWS = 512  # a training read goes into the ridge statistics in pieces of this many span rows

# What a cold-reuse training read appends after its prefix: prompt ids it computes, or stored rows it appends by
# reference (SharedKV, the core KvCorrection the reader read them with or None, that correction's first row).
ReadPiece = list[int] | tuple[SharedKV, Any, int]


@dataclass
class _ReadPart:
    """One span of a training read: its edge, the view the reader read it from (base) and where its exact rows sit."""

    ph: str
    edge: est.Edge
    base_seq: KVSequence
    base_pos: int
    pos: int  # the exact rows' position in the read's source
    n: int
    chain: Span | None = None  # the span the exact rows replace if it is still current (cold reuse, chained)


class TrainingRead:
    """One hop's training reads for the ridge estimator's calibrating edges, run after the hop's reply in small steps
    (step()), so a caller can keep them off every reply's path: a server runs one step at a time between other work.

    A read owns forks of what it reads (the base views, and its source: the dense hop's sequence or, under cold
    reuse, the agent's template prefix it computes the span's exact rows after, `rows` of them, in chunks of
    `chunk` rows), so it stays valid whatever the session does meanwhile. Its steps: the exact rows' chunks, then the
    rows folded into the edges' statistics TRAINING_READ_ROWS at a time, then the edges that hold their
    `calibrate` reads are fitted (`fitted`). When the read is done, its exact rows continue the chain of a span
    no later reader has moved (they go to st.owned, which the caller closes), and on_done(read) is
    called. close() drops a read not run to its end (`dropped`) and frees what it holds. Each step runs inside
    lock() (the session's and the estimator's locks); detach() cuts it from its session's state (the read still
    teaches the estimator)."""

    def __init__(
        self, runner: WorkflowRunner, st: RequestState, parts: list[_ReadPart], source: KVSequence, computes: bool
    ) -> None:
        self.runner: WorkflowRunner | None = runner
        self.st: RequestState | None = st
        self.estimator, self.calibrate = runner.estimator, runner.config.calibrate
        self.vectors, self.vector_pos = st.vectors, st.vector_pos
        self.source = source  # this read's own sequence
        bases: dict[int, KVSequence] = {}
        for part in parts:  # a fork per base view (no copy), shared by the parts that read the same one
            part.base_seq = bases.setdefault(id(part.base_seq), part.base_seq.fork())
        self._bases = list(bases.values())
        self.parts = parts
        self.computes = computes
        # cold reuse: what the read appends after its prefix, in order: prompt ids to compute, or (rows, correction,
        # first correction row) appended by reference (the rest of a span a sampled read reads only the start of)
        self.pieces: list[ReadPiece] = []
        self.rows = 0  # rows the read computes (cold reuse), set with pieces
        self.fit = True  # fit the edges that hold their reads (not when a benchmark gathers examples to fit later)
        self.chunk = 1 << 30  # rows per step of the exact rows' computation
        self.fitted: list[est.Edge] = []
        self.ms = 0.0  # time its steps took, wherever they ran (a call's path, an idle worker, close())
        self.steps = 0  # steps run so far
        self.kept = False  # its exact rows continue a chain (the source went to st.owned)
        self.done = self.dropped = False
        self.lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.on_done: Callable[[TrainingRead], None] | None = None
        self._steps: Iterator[None] | None = None

    def step(self, when: Callable[[], bool] | None = None) -> bool:
        """Runs the next step; returns whether steps are left. when: checked once the locks are held; False runs
        nothing (an idle worker's test that no call has started meanwhile)."""
        if self.done or self.dropped:
            return False
        with self.lock():
            if self.done or self.dropped:  # run to its end by another thread while this one waited for the locks
                return False
            if when is not None and not when():
                return True
            start = time.perf_counter()
            if self._steps is None:
                self._steps = self._run()
            try:
                next(self._steps)
                return True
            except StopIteration:
                pass
            except BaseException:
                self.close()
                raise
            finally:
                self.ms += (time.perf_counter() - start) * 1000.0
                self.steps += 1
            self.done = True
            self._free(keep_source=self.kept)
            if self.on_done is not None:
                self.on_done(self)
        return False

    def run(self) -> list[est.Edge]:
        """Runs the read to its end; returns the edges it fitted."""
        while self.step():
            pass
        return self.fitted

    def detach(self) -> None:
        """Cuts the read from its session's state: its rows then continue no chain."""
        self.st = None

    def close(self) -> None:
        """Drops a read that has not run to its end (counted by the caller as `dropped`) and frees its sequences."""
        if not self.done and not self.dropped:
            self.dropped = True
            self._steps = None
            self._free(keep_source=False)

    def _free(self, keep_source: bool) -> None:
        for s in self._bases + ([] if keep_source else [self.source]):
            s.close()
        self._bases, self.pieces = [], []
        self.runner = None

    def _run(self) -> Iterator[None]:
        runner = self.runner
        assert runner is not None
        n0, computed = len(self.source), 0
        for piece in self.pieces:
            if isinstance(piece, tuple):
                shared, kc, row0 = piece
                self.source.append_shared(shared, kc, row0)
                continue
            for a, b in chunk_bounds(len(piece), self.chunk):
                run_plan(append_mixed(self.source, piece[a:b], "none", self.vectors, self.vector_pos))
                computed += b - a
                yield
        assert computed == self.rows and len(self.source) >= n0 + computed
        e = cast(est.LearnsFromReads, self.estimator)
        for part in self.parts:
            for r0 in range(0, part.n, TRAINING_READ_ROWS):
                if self.fit and not e.calibrating(part.edge):
                    break  # another read completed the edge meanwhile
                nr = min(TRAINING_READ_ROWS, part.n - r0)
                with single_threaded_blas():
                    base_k, base_v = _canonical(runner.model, part.base_seq, part.base_pos, nr, r0)
                    ex_k, ex_v = _canonical(runner.model, self.source, part.pos, nr, r0)
                    e.add_rows(part.edge, base_k, base_v, ex_k, ex_v)
                yield
            else:
                e.end_read(part.edge)
        if self.fit:  # an edge per step: a step is what a call arriving meanwhile may wait for
            for edge in dict.fromkeys(part.edge for part in self.parts):
                if e.examples(edge) >= self.calibrate:
                    self.fitted += e.fit([edge])
                    yield
        st = self.st
        if st is not None and self.computes:
            for part in self.parts:
                if part.chain is not None and st.spans.get(part.ph) is part.chain:
                    shared = self.source.share(part.pos, part.n)
                    chain = part.chain
                    st.spans[part.ph] = chain.with_rows(shared, None, part.pos, self.source, part.pos, chain.view_agent)
                    self.kept = True
            if self.kept:
                st.owned.append(self.source)


def _default_edge(ph: str, reader: int) -> est.Edge:
    return (ph, reader)


class WorkflowRunner:
    """Executes requests of a workflow under one method. Keeps per-agent template state between requests."""

    def __init__(
        self, model: Model, workflow: Workflow, config: MethodConfig, estimator: est.Estimator | None = None
    ) -> None:
        self.model, self.workflow, self.config = model, workflow, config
        self.templates: list[Template] = [build_template(model, a) for a in workflow.agents]
        self.agent_names = [a.name for a in workflow.agents]
        self.kd = model.n_head_kv * model._core.head_dim
        self.estimator = estimator if estimator is not None else make_estimator(model, config, workflow.name)
        # The estimator's edge for (placeholder, reader): placeholders and agent indices name the edges of a fixed
        # workflow; agent sessions name them by content (the span's role and the reader's identity).
        self.edge_of: Callable[[str, int], est.Edge] = _default_edge
        kv0 = model.kv_bytes_in_use
        self.prefixes = []
        for t in self.templates:
            s = model.new_sequence()
            s.append(t.texts[0], logits="none")
            self.prefixes.append(s)
        self._template_seqs: list[KVSequence | None] = [None] * len(self.templates)
        self._factor_bytes = 0
        self._materialized = 0
        self._recomputed = 0
        self._template_bytes_in_hop = 0
        self.template_kv_bytes = model.kv_bytes_in_use - kv0  # prefix caches

    def close(self) -> None:
        for s in self.prefixes + [t for t in self._template_seqs if t is not None]:
            s.close()

    # ------------------------------------------------------------------------------------------- template tails
    def _template_tail(self, agent: int, i: int) -> tuple[KVSequence, int]:
        """The agent's template prefill (placeholders as their literal stand-ins) and the position of tail i."""
        t = self.templates[agent]
        if self._template_seqs[agent] is None:
            kv0 = self.model.kv_bytes_in_use
            s = self.prefixes[agent].fork()
            s.append(t.prompt_ids(dict(zip(t.placeholders, t.standins, strict=True)))[len(t.texts[0]) :], logits="none")
            self._template_seqs[agent] = s
            grown = self.model.kv_bytes_in_use - kv0
            self.template_kv_bytes += grown  # once-per-agent state, not the hop's
            self._template_bytes_in_hop += grown
        pos = len(t.texts[0]) + sum(len(t.standins[j]) + len(t.texts[j + 1]) for j in range(i)) + len(t.standins[i])
        return self._template_seqs[agent], pos  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------- request
    def run(
        self,
        question: list[int],
        message: str,
        *,
        max_new_tokens: int = 16,
        forced: list[list[int]] | None = None,
        exact: RequestResult | None = None,
        ridge_training: bool = False,
    ) -> RequestResult:
        """Runs every agent once. forced: per agent, the generated ids to teacher-force (evaluation: reply spans
        then hold the same ids in every method); exact: the nonshared run of the same request, for fidelity
        metrics and the oracle. ridge_training: this (nonshared) run feeds the given RidgeEstimator's examples."""
        m = self.model
        n_agents = len(self.templates)
        st = RequestState(message, {QUESTION: Span(QUESTION, list(question))})
        seqs: list[KVSequence] = []
        for a in range(n_agents):
            t = self.templates[a]
            seq, logits, hop, pos_map, corrs = self.prefill_hop(a, t, self.prefixes[a], st, exact)
            seqs.append(seq)
            # generation (greedy, or teacher-forced); the last token's KV is never computed (reply spans exclude it)
            gen: list[int] = []
            if forced is not None:
                gen = list(forced[a])
                if len(gen) > 1:
                    hop.tf_logits = seq.append(gen[:-1], logits="all")
            else:
                cur = logits
                while len(gen) < max_new_tokens:
                    tok = int(np.argmax(cur))
                    gen.append(tok)
                    if tok in m.tokenizer.eog_ids or len(gen) == max_new_tokens:
                        break
                    step = seq.append([tok], logits="last")
                    assert step is not None
                    cur = step
            hop.generated = gen
            hop.kv_bytes = m.kv_bytes_in_use - st.kv0 - self._template_bytes_in_hop
            self._template_bytes_in_hop = 0
            hop.peak_bytes = sum(h.kv_bytes + h.corr_bytes for h in st.hops)
            # the rows the sequence holds after its prompt
            out = Span(response_placeholder(a), gen[:-1], author=a) if a < n_agents - 1 else None
            read = self.finish_hop(a, seq, hop, pos_map, corrs, st, out, ridge_training, exact, self.prefixes[a])
            if read is not None:  # a benchmark's hops run one after the other: the read runs at once
                read.run()
        result = RequestResult(st.hops, seqs, st.spans_at, st.prompts, st.owned)
        if exact is not None:
            self._evaluate(result, exact, teacher_forced=forced is not None)
        return result

    def prefill_hop(
        self, a: int, t: Template, prefix: KVSequence, st: RequestState, exact: RequestResult | None = None
    ) -> tuple[KVSequence, np.ndarray, HopReport, dict[str, tuple[int, int]], dict[str, est.Correction]]:
        """plan_hop run to its end here, each append in one piece."""
        return run_plan(self.plan_hop(a, t, prefix, st, exact))

    def plan_hop(
        self, a: int, t: Template, prefix: KVSequence, st: RequestState, exact: RequestResult | None = None
    ) -> Plan[tuple[KVSequence, np.ndarray, HopReport, dict[str, tuple[int, int]], dict[str, est.Correction]]]:
        """The plan (kvcmas_cpp.plan) of agent a's prompt under the method: a fork of its template prefix, then its
        spans (dense or shared with corrections). Returns (sequence, next-token logits, hop report without
        generation, placeholder positions, corrections used). Every placeholder of t must be in st.spans. The hop's
        ttft_ms is the plan's wall time, its driver's other work included."""
        m, cfg = self.model, self.config
        phs = t.placeholders
        prompt = t.prompt_ids({ph: st.spans[ph].ids for ph in phs})
        st.prompts.append(prompt)
        st.kv0 = m.kv_bytes_in_use
        t0 = time.perf_counter()
        seq = prefix.fork()
        reason: str | None = None
        if cfg.name == "nonshared" or cfg.gate == "dense":
            mode, gate = ("source" if not st.hops else "dense"), "n/a" if cfg.name == "nonshared" else "forced dense"
            reason = None if cfg.name == "nonshared" else "forced"  # nonshared shares nothing: no reason to give
        elif not any(st.stored(ph) for ph in phs):
            mode, gate, reason = "source", "n/a", "no match"
        elif cfg.gate == "auto" and (why := self.estimator.decide(a, phs, st.message)) is not None:
            mode, gate, reason = "fallback", "novel -> dense" if why == "gate" else f"{why} -> dense", why
        elif self._uncalibrated(a, phs, st):
            if cfg.cold == "reuse":
                mode, gate = "reuse", "calibrating -> reuse"
            else:
                mode, gate, reason = "fallback", "calibrating -> dense", "calibrating"
        else:
            mode, gate = "reuse", "reuse"
        pos_map: dict[str, tuple[int, int]] = {}
        pos = len(t.texts[0])
        for i, ph in enumerate(phs):
            n = len(st.spans[ph].ids)
            pos_map[ph] = (pos, n)
            pos += n + len(t.texts[i + 1])
        st.spans_at.append(pos_map)
        corrs: dict[str, est.Correction] = {}
        self._factor_bytes = self._materialized = self._recomputed = 0  # counted for this hop (_assemble)
        try:
            if mode != "reuse":
                rest = prompt[len(seq) :]  # the prefix holds all but the last row when t has no spans
                if not rest:  # a prefix that is the whole prompt: its last row is computed again, for the logits
                    seq.truncate(len(prompt) - 1)
                    rest = prompt[-1:]
                logits = yield from append_mixed(seq, rest, "last", st.vectors, st.vector_pos)
                computed = len(rest)
            else:
                logits, computed, corrs = yield from self._assemble(a, t, seq, st, exact)
        except BaseException:  # an append failed, or the plan was closed part-way
            seq.close()
            raise
        ttft = (time.perf_counter() - t0) * 1000.0
        assert logits is not None
        corr_bytes = sum(s["corr_bytes"] for s in m._core.seq_segments(seq.id))
        hop = HopReport(
            a,
            self.agent_names[a] if a < len(self.agent_names) else f"agent {a}",
            mode,
            gate,
            ttft,
            len(prompt),
            computed,
            len(prompt) - computed,
            0,
            corr_bytes,
            corr_rank=max((c.rank for c in corrs.values()), default=0),
            first_logits=logits,
            dense_reason=reason,
            prompt=prompt,
        )
        hop.corr_factor_bytes, hop.materialized_tokens = self._factor_bytes, self._materialized
        hop.recomputed_tokens = self._recomputed
        self._factor_bytes = self._materialized = self._recomputed = 0
        st.hops.append(hop)
        return seq, logits, hop, pos_map, corrs

    def _uncalibrated(self, a: int, phs: list[str], st: RequestState) -> bool:
        """Online ridge: some span this reader would share has no fitted map for its edge yet."""
        return bool(self._calibrating_spans(a, phs, st))

    def _calibrating_spans(self, a: int, phs: Any, st: RequestState) -> list[str]:
        """Online ridge: the spans this reader would share whose edge has no fitted map yet."""
        e = self.estimator
        if not self.config.calibrate or not e.learns_from_reads:
            return []
        shared = [ph for ph in phs if (span := st.stored(ph)) is not None and span.shared is not None]
        return [ph for ph in shared if e.calibrating(self.edge_of(ph, a))]

    def finish_hop(
        self,
        a: int,
        seq: KVSequence,
        hop: HopReport,
        pos_map: dict[str, tuple[int, int]],
        corrs: dict[str, est.Correction],
        st: RequestState,
        out: Span | None,
        ridge_training: bool = False,
        exact: RequestResult | None = None,
        prefix: KVSequence | None = None,
    ) -> TrainingRead | None:
        """After agent a's generation: its view of the spans becomes the next readers' base (chain), and `out` (the
        reply span: ids whose rows seq holds right after the prompt; None: not passed on) joins st.spans.
        Calibrating edges get a training read, returned unstarted (None: no read): its exact rows are the dense
        hop's own (a fork of seq) or, under cold reuse, rows it computes in a fork of `prefix` (the agent's template
        prefix the hop started from). The caller runs it now (TrainingRead.run) or later, off the reply's path;
        hop.shadow_tokens says how many rows it computes."""
        train: list[str] | None = None  # the spans whose edges get a training read
        pieces: list[ReadPiece] = []  # cold reuse: what the read appends after the prefix
        sampled: dict[str, int] = {}  # spans the read reads the first rows of (MethodConfig.read_rows)
        if ridge_training:
            train = list(pos_map)
        elif hop.gate.startswith("calibrating"):
            train = self._calibrating_spans(a, pos_map, st)
            gone = prefix is None or list(prefix.tokens) != hop.prompt[: len(prefix)]
            if hop.mode == "reuse" and train and gone:
                train = []  # the prefix is gone (a session replaced it): no read this time
            if hop.mode == "reuse" and train:
                assert prefix is not None
                pieces, sampled = self._read_pieces(hop.prompt, len(prefix), pos_map, train, st, corrs)
                hop.shadow_tokens = sum(len(x) for x in pieces if isinstance(x, list))
        cold_prefix = prefix if pieces else None
        read = self._update_spans(a, seq, pos_map, st, hop.mode, corrs, exact, train, cold_prefix, sampled)
        if read is not None:
            read.pieces, read.rows, read.fit = pieces, hop.shadow_tokens, not ridge_training
        if out is not None:
            self._pass_on(seq, hop, st, out)
        return read

    def _read_pieces(
        self,
        prompt: list[int],
        start: int,
        pos_map: dict[str, tuple[int, int]],
        train: list[str],
        st: RequestState,
        corrs: dict[str, est.Correction],
    ) -> tuple[list[ReadPiece], dict[str, int]]:
        """What a cold-reuse read appends after the reader's prefix (prompt[:start]) to get the exact rows of the
        spans in `train`: the prompt up to the end of the last one, computed, except that a span with more than
        MethodConfig.read_rows rows after its head is computed only up to its first read_rows rows, and its other
        rows are appended by reference as the reader read them (stored rows, the reader's correction): the rows
        after it (template text, later spans) then see what the reader saw. Returns the pieces and the spans read
        in part (placeholder -> rows read)."""
        m, h, cap = self.model, self.config.head, self.config.read_rows
        pieces: list[ReadPiece] = []
        sampled: dict[str, int] = {}
        at = start
        for ph in sorted(train, key=lambda ph: pos_map[ph][0]):
            p, n = pos_map[ph]
            b = st.stored(ph)
            if cap and n - h > cap and b is not None and b.shared is not None and self.config.recompute == 0:
                pieces.append(prompt[at : p + h + cap])
                corr = corrs.get(ph)
                kc = corr.kv_correction(n - h, self.kd, m.n_layer) if corr is not None else None
                pieces.append((b.shared.slice(cap, n - h - cap), kc, cap if kc is not None else 0))
                sampled[ph], at = cap, p + n
        end = max(pos_map[ph][0] + pos_map[ph][1] for ph in train)
        if end > at:
            pieces.append(prompt[at:end])
        return [x for x in pieces if not isinstance(x, list) or x], sampled

    def _pass_on(self, seq: KVSequence, hop: HopReport, st: RequestState, out: Span) -> None:
        """The reply span `out` (its ids: rows of seq right after the prompt) joins st.spans, stored in seq."""
        m, cfg = self.model, self.config
        st.spans[out.ph] = out
        p_out, n = hop.prompt_tokens, len(out.ids)
        h = min(cfg.head, n)
        if n:
            shared = seq.share(p_out + h, n - h) if n > h else None
            st.spans[out.ph] = out.with_rows(shared, None, p_out + h, seq, p_out + h, hop.agent)
            gated = cfg.gate == "auto" and cfg.name != "nonshared"
            if gated and self.estimator.gates_outputs:
                _, v = _canonical(m, seq, p_out, n)
                novel = self.estimator.observe_output(out.ph, st.message, v)
                hop.gate += f"; output {'novel' if novel else 'reusable'}"

    def _assemble(
        self, a: int, t: Template, seq: KVSequence, st: RequestState, exact: RequestResult | None
    ) -> Plan[tuple[np.ndarray, int, dict[str, est.Correction]]]:
        """The plan of a reuse hop's prompt: shared spans by reference with corrections, heads and tails forwarded.
        Every row the reader computes is reserved in place while the spans between them are appended, and all are
        computed in one Append at the end (the scheduler chunks it): one forward pass instead of one per span.
        Returns (next-token logits, rows computed, corrections used)."""
        cfg = self.config
        message = st.message
        pending: list[int] = []  # rows to compute next, not yet in seq
        held: list[int] = []  # rows reserved in seq, computed with the last rows in one pass (reserve_rows)
        corrs: dict[str, est.Correction] = {}
        chosen_rows = self._recompute_choice(a, t, seq, st, exact) if cfg.recompute > 0 or not cfg.correct else {}
        for i, ph in enumerate(t.placeholders):
            ids = st.spans[ph].ids
            h = min(cfg.head, len(ids))
            pending += ids[:h]
            b = st.stored(ph)
            if b is None or b.shared is None:  # nobody has computed this span yet: this reader does, exactly
                pending += ids[h:]
            elif ph in chosen_rows:  # sharing/recompute.py
                corr, mask = chosen_rows[ph]
                if corr is not None and cfg.correct:
                    corrs[ph] = corr
                pending = recompute_mod.append_span(self, seq, b.shared, ids[h:], corr, mask, pending, held)
                self._recomputed += int(mask.sum())
            elif len(ids) > h:
                pending = reserve_rows(seq, pending, held)
                pos, n = len(seq), len(ids) - h
                corr = self._correction(a, ph, b, pos, n, message, exact)
                kc: Any = None  # a core KvCorrection
                if corr is not None:
                    corrs[ph] = corr
                    kc = corr.kv_correction(n, self.kd, self.model.n_layer)
                seq.append_shared(b.shared, kc)
                if kc is not None:
                    if self._wants_copy(kc, n):
                        core.seq_materialize_last(self.model._core, seq.id)
                        self._materialized += n
                    else:
                        self._factor_bytes += kc.bytes
            tail = t.texts[i + 1]
            last = i == len(t.placeholders) - 1
            if cfg.tail == "rotate" and cfg.recompute < 1 and len(tail) > (1 if last else 0):
                pending = reserve_rows(seq, pending, held)
                tseq, tpos = self._template_tail(a, i)
                n_rot = len(tail) - (1 if last else 0)
                seq.append_shared(tseq.share(tpos, n_rot))
                pending += tail[n_rot:]
            else:
                pending += tail
        if not pending:  # the last computed row would not be the prompt's last: no next-token logits to take
            raise ValueError("a reusing prompt must end with template text after its last shared span")
        rows = held + pending  # the reserved rows, filled in order, then the prompt's last rows
        logits = yield from append_mixed(seq, rows, "last", st.vectors, st.vector_pos)
        assert logits is not None
        return logits, len(rows), corrs

    def _recompute_choice(
        self, a: int, t: Template, seq: KVSequence, st: RequestState, exact: RequestResult | None
    ) -> dict[str, tuple[est.Correction | None, np.ndarray]]:
        """The recompute path of a reuse hop: per stored span with rows after its exact head, its correction (None
        at budgets 0 and 1, which score no row) and the rows the rule chose over all of the hop's spans."""
        cfg = self.config
        parts: dict[str, tuple[est.Correction | None, int]] = {}
        pos = len(seq)  # the prefix holds the template text before the first span
        for i, ph in enumerate(t.placeholders):
            ids = st.spans[ph].ids
            h = min(cfg.head, len(ids))
            b = st.stored(ph)
            if b is not None and b.shared is not None and len(ids) > h:
                n = len(ids) - h
                scored = 0 < cfg.recompute < 1
                parts[ph] = (self._correction(a, ph, b, pos + h, n, st.message, exact) if scored else None, n)
            pos += len(ids) + len(t.texts[i + 1])
        scores = recompute_mod.deviation_scores(list(parts.values()), self.model.n_layer)
        masks = recompute_mod.select_rows(scores, cfg.recompute, cfg.recompute_block)
        return {ph: (corr, mask) for (ph, (corr, _)), mask in zip(parts.items(), masks, strict=True)}

    def sub_span(self, b: Span, first: int, n: int) -> Span:
        """Rows [first, first + n) of a stored span as a span of their own (a sub-run of it, read by
        reference): the same stored rows (no copy), the accumulated correction restricted to those rows (a per-row
        low-rank correction restricts by slicing A), the reader's base view moved with them."""
        if b.shared is None or not (first >= 0 and n > 0 and first + n <= len(b.shared)):
            raise ValueError(f"sub_span: rows [{first}, {first + n}) are outside the stored span")
        shared = b.shared.slice(first, n)
        corr = b.corr
        if corr is not None:
            part = corr.sliced(first, n, self.model.n_layer)
            corr = est.Correction(kv=part.kv_correction(n, self.kd, self.model.n_layer)) if corr.in_core else part
        return b.with_rows(shared, corr, b.frame0 + first, b.view_seq, b.view_pos + first, b.view_agent)

    def _copy_bytes(self, n: int) -> int:
        """KV bytes of a private copy of n span rows (every layer, K and V, in the cache's row type)."""
        return n * self.model.kv_row_bytes

    def _wants_copy(self, kc: Any, n: int) -> bool:
        """MethodConfig.apply for one corrected span of n rows: 'auto' copies when the correction's factors take at
        least the copy's bytes (then fused attention saves no memory, and a copy is faster per call)."""
        if self.config.apply == "auto":
            return int(kc.bytes) >= self._copy_bytes(n)
        return self.config.apply == "materialize"

    def _correction(
        self, a: int, ph: str, b: Span, pos: int, n: int, message: str, exact: RequestResult | None
    ) -> est.Correction | None:
        """The reader's total correction in the stored frame: the span's accumulated one plus this edge's. The
        ridge estimator's comes from the core as a ready KvCorrection; the other estimators' as numpy factors."""
        made = self._core_ridge(self.edge_of(ph, a), b, n)
        if made is not _NUMPY:
            return cast("est.Correction | None", made)
        return self._correction_numpy(a, ph, b, pos, n, message, exact)

    def _core_ridge(self, edge: est.Edge, b: Span, n: int) -> est.Correction | None | object:
        """The ridge estimator's total correction computed in the core from the reader's base view (b.view_seq at
        b.view_pos), b.corr in front; _NUMPY where the numpy path must do it (another estimator, the numpy
        reference path, numpy factors in the chain, or a total rank over the kernel's limit)."""
        e = self.estimator
        if self.config.ridge_path != "core" or not e.core_path:
            return _NUMPY
        prev = b.corr
        if prev is not None and not prev.in_core:
            return _NUMPY
        maps = e.core_maps(edge)
        if maps is None:
            return prev if e.calibrating(edge) else _NUMPY  # no map for this edge: the view's correction as it is
        if (prev.rank if prev is not None else 0) + maps.rank + 1 > est.MAX_KERNEL_RANK:
            return _NUMPY
        prev_kv = prev.core if prev is not None else None
        return est.Correction(
            kv=core.ridge_correction(self.model._core, maps, b.view.id, b.view_pos, n, b.frame0, prev_kv)
        )

    def _correction_numpy(
        self, a: int, ph: str, b: Span, pos: int, n: int, message: str, exact: RequestResult | None
    ) -> est.Correction | None:
        """The reference path: the base view read back from the engine, the estimator's factors in numpy."""
        e = self.estimator
        key = self.edge_of(ph, a) if e.content_edges else (ph, a)
        if not e.reads_base or e.calibrating(key):
            return b.corr  # no estimate for this edge (fullshared, an unfitted edge): the view's correction
        base_k, base_v = _canonical(self.model, b.view, b.view_pos, n)
        ctx = est.EdgeContext(*key, message, base_k, base_v)
        if self.estimator.needs_exact:
            if exact is None:
                raise ValueError(f"method {self.config.name!r} needs the exact run (evaluation mode)")
            # the prompts hold the same ids in both runs, so the rows sit at the same positions
            ctx.exact_k, ctx.exact_v = _canonical(self.model, exact.seqs[a], pos, n)
        new = self.estimator.correction(ctx)
        n_layer = self.model.n_layer
        # a chain built in the core is folded in numpy here
        parts = [c.factors(n_layer) for c in (b.corr,) if c is not None]
        if new:  # canonical-frame factors to the span's stored frame (B_k rotated by the stored first position)
            parts.append(est.Correction(new).shifted(self.model._core.rope_rotate, b.frame0, n_layer).factors(n_layer))
        if not parts:
            return None
        total = est.concat(parts) if len(parts) > 1 else parts[0]
        if est.correction_rank(total) > est.MAX_KERNEL_RANK:
            dk, dv = est.materialize(total, n_layer, n, self.kd)
            total = est.dense_to_correction(dk, dv)
        return est.Correction(total)

    def _update_spans(
        self,
        a: int,
        seq: KVSequence,
        pos_map: dict[str, tuple[int, int]],
        st: RequestState,
        mode: str,
        corrs: dict[str, est.Correction],
        exact: RequestResult | None,
        train: list[str] | None,
        prefix: KVSequence | None,
        sampled: dict[str, int] | None = None,
    ) -> TrainingRead | None:
        """train: spans whose edges get a ridge training read, returned (the base each read pairs with is the view
        the reader read, taken now); their exact rows are seq's at the prompt's positions, or, with `prefix` (cold
        reuse), rows the read computes after a fork of it. The anchor estimators record every dense hop's delta.
        A cold-reuse hop's exact rows continue the chain of the spans it trained on, as a dense hop's rows would
        (the next reader's base, while calibrating and after, is then a reader's exact view, the same as under
        cold='dense'): until its read has run, the chain goes on from this reader's view, and the read's rows
        replace that if no later reader has moved the chain meanwhile."""
        m, cfg = self.model, self.config
        h = cfg.head
        e = self.estimator
        spans = st.spans
        parts: list[_ReadPart] = []
        for ph, (p, n) in pos_map.items():
            if n <= h:
                continue
            prev = st.stored(ph)
            trained = prev is not None and train is not None and ph in train and e.learns_from_reads
            if trained:
                assert prev is not None
                # the exact rows' delta against the base the reader would have read (the first rows of a sampled one)
                rows = (sampled or {}).get(ph, n - h)
                parts.append(_ReadPart(ph, self.edge_of(ph, a), prev.view, prev.view_pos, p + h, rows))
            elif prev is not None and mode != "reuse" and e.observes_dense and cfg.name != "nonshared":
                base_k, base_v = _canonical(m, prev.view, prev.view_pos, n - h)
                ex_k, ex_v = _canonical(m, seq, p + h, n - h)
                e.observe(est.EdgeContext(ph, a, st.message, base_k, base_v, ex_k, ex_v), ph == QUESTION)
            if prev is not None and not chains(ph):
                continue  # replies: star, the producer's rows stay the base
            if prev is None or (mode != "reuse" and cfg.chain):
                spans[ph] = spans[ph].with_rows(seq.share(p + h, n - h), None, p + h, seq, p + h, a)
            elif mode == "reuse" and cfg.chain:
                # same stored rows; this reader's total correction is what the next reader's base starts from
                spans[ph] = prev.with_rows(prev.shared, corrs.get(ph), prev.frame0, seq, p + h, a)
                if trained and prefix is not None and ph not in (sampled or {}):  # exact rows for all of it
                    parts[-1].chain = spans[ph]
        if not parts:
            return None
        return TrainingRead(self, st, parts, (prefix if prefix is not None else seq).fork(), prefix is not None)

    # ------------------------------------------------------------------------------------------- evaluation
    def _evaluate(self, res: RequestResult, exact: RequestResult, teacher_forced: bool) -> None:
        m = self.model
        for a, (hop, ehop) in enumerate(zip(res.hops, exact.hops, strict=True)):
            assert hop.first_logits is not None and ehop.first_logits is not None
            p = _log_softmax(ehop.first_logits)
            q = _log_softmax(hop.first_logits)
            hop.kl = float(np.sum(np.exp(p) * (p - q)))
            hop.top1 = bool(np.argmax(hop.first_logits) == np.argmax(ehop.first_logits))
            preds = [int(np.argmax(hop.first_logits))]
            if hop.tf_logits is not None:
                preds += [int(x) for x in np.argmax(hop.tf_logits, axis=1)]
            # the exact run decodes greedily: its argmax at each step is the token it generated
            ref = list(ehop.generated) if ehop.generated else [int(np.argmax(ehop.first_logits))]
            if ehop.tf_logits is not None:  # an exact run that was itself teacher-forced
                ref = [int(np.argmax(ehop.first_logits))] + [int(x) for x in np.argmax(ehop.tf_logits, axis=1)]
            k = min(len(preds), len(ref))
            hop.tf_top1 = float(np.mean([x == y for x, y in zip(preds[:k], ref[:k], strict=True)]))
            start = len(self.templates[a].texts[0])
            n = len(res.prompt_ids[a]) - start
            k1, v1 = res.seqs[a].kv(start, n)
            k0, v0 = exact.seqs[a].kv(start, n)
            hop.k_err = [
                float(np.linalg.norm(k1[il] - k0[il]) / max(np.linalg.norm(k0[il]), 1e-30)) for il in range(m.n_layer)
            ]
            hop.v_err = [
                float(np.linalg.norm(v1[il] - v0[il]) / max(np.linalg.norm(v0[il]), 1e-30)) for il in range(m.n_layer)
            ]
            hop.identical = None if teacher_forced else hop.generated == ehop.generated


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())
