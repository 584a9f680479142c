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

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from ..model import KVSequence, Model
from ..plan import Plan, run_plan
from . import estimators as est
from .assemble import HopCounts, SpanAssembly, append_mixed, reserve_rows
from .fidelity import evaluate_hops
from .methods import REGISTRY, MethodConfig, make_estimator
from .span import Span, chains
from .state import HopReport, RequestResult, RequestState
from .training_read import TRAINING_READ_ROWS, ReadPart, ReadPiece, TrainingRead, canonical
from .workflow import QUESTION, Template, Workflow, build_template, response_placeholder

__all__ = [
    "TRAINING_READ_ROWS",
    "HopReport",
    "RequestResult",
    "RequestState",
    "TrainingRead",
    "WorkflowRunner",
    "append_mixed",
    "reserve_rows",
]


_NUMPY = object()  # _core_ridge's answer when the numpy path must compute the correction


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
        self.kd = model.kv_width
        entry = REGISTRY.get(config.name)
        self.shares = entry.shares if entry is not None else True  # nonshared: every hop computes its whole prompt
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
        self._counts = HopCounts()  # what the current hop's assembly did (its report's fields)
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
            evaluate_hops(m, self.templates, result, exact, teacher_forced=forced is not None)
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
        if not self.shares or cfg.gate == "dense":
            mode, gate = ("source" if not st.hops else "dense"), "n/a" if not self.shares else "forced dense"
            reason = None if not self.shares else "forced"  # nonshared shares nothing: no reason to give
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
        self._counts = HopCounts()  # counted for this hop (_assemble)
        try:
            if mode != "reuse":
                rest = prompt[len(seq) :]  # the prefix holds all but the last row when t has no spans
                if not rest:  # a prefix that is the whole prompt: its last row is computed again, for the logits
                    seq.truncate(len(prompt) - 1)
                    rest = prompt[-1:]
                logits = yield from append_mixed(seq, rest, "last", st.vectors, st.bidirectional, st.vector_pos)
                computed = len(rest)
            else:
                logits, computed, corrs = yield from self._assemble(a, t, seq, st, exact)
        except BaseException:  # an append failed, or the plan was closed part-way
            seq.close()
            raise
        ttft = (time.perf_counter() - t0) * 1000.0
        assert logits is not None
        corr_bytes = m.correction_bytes(seq)
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
        c = self._counts
        hop.corr_factor_bytes, hop.materialized_tokens, hop.recomputed_tokens = (
            c.factor_bytes,
            c.materialized,
            c.recomputed,
        )
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
            gated = cfg.gate == "auto" and self.shares
            if gated and self.estimator.gates_outputs:
                _, v = canonical(m, seq, p_out, n)
                novel = self.estimator.observe_output(out.ph, st.message, v)
                hop.gate += f"; output {'novel' if novel else 'reusable'}"

    def _assemble(
        self, a: int, t: Template, seq: KVSequence, st: RequestState, exact: RequestResult | None
    ) -> Plan[tuple[np.ndarray, int, dict[str, est.Correction]]]:
        """The plan of a reuse hop's prompt (sharing.assemble.SpanAssembly.prompt) with this reader's corrections."""

        def correct(ph: str, b: Span, pos: int, n: int) -> est.Correction | None:
            return self._correction(a, ph, b, pos, n, st.message, exact)

        assembly = SpanAssembly(self.model, self.config)
        return (yield from assembly.prompt(t, seq, st, correct, lambda i: self._template_tail(a, i), self._counts))

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
        """KV bytes of a private copy of n span rows (SpanAssembly.copy_bytes)."""
        return SpanAssembly(self.model, self.config).copy_bytes(n)

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
        return est.Correction(kv=self.model.ridge_correction(maps, b.view, b.view_pos, n, b.frame0, prev_kv))

    def _correction_numpy(
        self, a: int, ph: str, b: Span, pos: int, n: int, message: str, exact: RequestResult | None
    ) -> est.Correction | None:
        """The reference path: the base view read back from the engine, the estimator's factors in numpy."""
        e = self.estimator
        key = self.edge_of(ph, a) if e.content_edges else (ph, a)
        if not e.reads_base or e.calibrating(key):
            return b.corr  # no estimate for this edge (fullshared, an unfitted edge): the view's correction
        base_k, base_v = canonical(self.model, b.view, b.view_pos, n)
        ctx = est.EdgeContext(*key, message, base_k, base_v)
        if self.estimator.needs_exact:
            if exact is None:
                raise ValueError(f"method {self.config.name!r} needs the exact run (evaluation mode)")
            # the prompts hold the same ids in both runs, so the rows sit at the same positions
            ctx.exact_k, ctx.exact_v = canonical(self.model, exact.seqs[a], pos, n)
        new = self.estimator.correction(ctx)
        n_layer = self.model.n_layer
        # a chain built in the core is folded in numpy here
        parts = [c.factors(n_layer) for c in (b.corr,) if c is not None]
        if new:  # canonical-frame factors to the span's stored frame (B_k rotated by the stored first position)
            parts.append(est.Correction(new).shifted(self.model.rope_rotate, b.frame0, n_layer).factors(n_layer))
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
        parts: list[ReadPart] = []
        for ph, (p, n) in pos_map.items():
            if n <= h:
                continue
            prev = st.stored(ph)
            trained = prev is not None and train is not None and ph in train and e.learns_from_reads
            if trained:
                assert prev is not None
                # the exact rows' delta against the base the reader would have read (the first rows of a sampled one)
                rows = (sampled or {}).get(ph, n - h)
                edge = self.edge_of(ph, a)
                parts.append(ReadPart(ph, edge, prev.view, prev.view_pos, p + h, rows, whole=rows == n - h))
            elif prev is not None and mode != "reuse" and e.observes_dense and self.shares:
                base_k, base_v = canonical(m, prev.view, prev.view_pos, n - h)
                ex_k, ex_v = canonical(m, seq, p + h, n - h)
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
        source = (prefix if prefix is not None else seq).fork()
        return TrainingRead(m, e, cfg.calibrate, st, parts, source, prefix is not None)
