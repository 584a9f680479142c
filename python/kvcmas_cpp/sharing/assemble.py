"""Span assembly: a reusing reader's prompt put together from its template text and the shared spans, by reference
with the method's corrections, with the rows it computes (heads, tails, recomputed rows) reserved in place and
computed in one forward pass at the end. The runner (sharing.runner.WorkflowRunner) calls it per hop; which rows a
reader recomputes is sharing.recompute's choice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..kv_budget import KVBudget
from ..model import BidirectionalRows, KVSequence, Model, SharedKV
from ..plan import Append, Plan
from . import recompute as recompute_mod
from .factors import Correction
from .methods import MethodConfig
from .span import Span
from .state import RequestState
from .workflow import Template


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
    bidirectional: list[bool] | None = None,
    vector_pos: np.ndarray | None = None,
) -> Plan[np.ndarray | None]:
    """The plan of appending a prompt piece that mixes token ids with input vectors (an id -(1 + r) stands for row r
    of `vectors`, at image position vector_pos[r] for M-RoPE): one Append per run of ids or of vectors (a run of rows
    flagged in `bidirectional`, per vector row, is appended as BidirectionalRows: Gemma 3's images, separated by
    their begin / end tokens); returns the last one's logits."""
    if not ids:
        return None
    if min(ids) >= 0:
        return (yield Append(seq, ids, logits))
    if vectors is None:
        raise ValueError("a prompt holds input-vector ids but no vectors were registered")
    out: np.ndarray | None = None
    i = 0

    def kind(t: int) -> int:  # 0: a token, 1: a vector row, 2: a bidirectional vector row
        return 0 if t >= 0 else 2 if bidirectional and bidirectional[-t - 1] else 1

    while i < len(ids):
        j, run = i, kind(ids[i])
        while j < len(ids) and kind(ids[j]) == run:
            j += 1
        want = logits if j == len(ids) else "none"
        picked = [-t - 1 for t in ids[i:j]]
        rows: list[int] | np.ndarray = vectors[picked] if run else ids[i:j]
        if run == 2:
            rows = np.asarray(rows).view(BidirectionalRows)
        pos = vector_pos[picked] if run and vector_pos is not None and vector_pos[picked, 1].any() else None
        out = yield Append(seq, rows, want, image_pos=pos)
        i = j
    return out


# A reader's correction of one stored span: (placeholder, the span, the position of its first stored row in the
# reader's sequence, its stored rows) -> the total correction in the stored frame, or None.
Corrector = Callable[[str, Span, int, int], Correction | None]


@dataclass
class HopCounts:
    """What one hop's assembly did with its corrections, for its HopReport."""

    factor_bytes: int = 0  # bytes of the corrections handed to the engine and kept fused
    materialized: int = 0  # corrected span rows copied into the sequence instead (MethodConfig.apply)
    recomputed: int = 0  # shared span rows the reader forwarded itself (MethodConfig.recompute)


class SpanAssembly:
    """Assembles reusing prompts under one method for a model: `prompt` is the plan of one hop's prompt."""

    def __init__(self, model: Model, config: MethodConfig) -> None:
        self.model, self.config = model, config
        self.kd = model.kv_width
        self.kv = KVBudget(model)

    def copy_bytes(self, n: int) -> int:
        """KV bytes of a private copy of n span rows (every layer, K and V, in the cache's row type)."""
        return self.kv.rows_bytes(n)

    def wants_copy(self, kc: Any, n: int) -> bool:
        """MethodConfig.apply for one corrected span of n rows: 'auto' copies when the correction's factors take at
        least the copy's bytes (then fused attention saves no memory, and a copy is faster per call)."""
        if self.config.apply == "auto":
            return int(kc.bytes) >= self.copy_bytes(n)
        return self.config.apply == "materialize"

    def prompt(
        self,
        t: Template,
        seq: KVSequence,
        st: RequestState,
        correct: Corrector,
        template_tail: Callable[[int], tuple[KVSequence, int]],
        counts: HopCounts,
    ) -> Plan[tuple[np.ndarray, int, dict[str, Correction]]]:
        """The plan of a reuse hop's prompt after its template prefix (in seq): shared spans by reference with
        corrections (`correct`), heads and tails forwarded (a rotate-only tail i from template_tail(i): the agent's
        template prefill and the tail's position in it). Every row the reader computes is reserved in place while
        the spans between them are appended, and all are computed in one Append at the end (the scheduler chunks
        it): one forward pass instead of one per span. Returns (next-token logits, rows computed, corrections
        used)."""
        cfg = self.config
        pending: list[int] = []  # rows to compute next, not yet in seq
        held: list[int] = []  # rows reserved in seq, computed with the last rows in one pass (reserve_rows)
        corrs: dict[str, Correction] = {}
        chosen_rows = self._recompute_choice(t, seq, st, correct) if cfg.recompute > 0 or not cfg.correct else {}
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
                pending = self._append_chosen(seq, b.shared, ids[h:], corr, mask, pending, held, counts)
                counts.recomputed += int(mask.sum())
            elif len(ids) > h:
                pending = reserve_rows(seq, pending, held)
                n = len(ids) - h
                corr = correct(ph, b, len(seq), n)
                kc: Any = None  # a core KvCorrection
                if corr is not None:
                    corrs[ph] = corr
                    kc = corr.kv_correction(n, self.kd, self.model.n_layer)
                seq.append_shared(b.shared, kc)
                if kc is not None:
                    self._hold(seq, kc, n, self.wants_copy(kc, n), counts)
            tail = t.texts[i + 1]
            last = i == len(t.placeholders) - 1
            if cfg.tail == "rotate" and cfg.recompute < 1 and len(tail) > (1 if last else 0):
                pending = reserve_rows(seq, pending, held)
                tseq, tpos = template_tail(i)
                n_rot = len(tail) - (1 if last else 0)
                seq.append_shared(tseq.share(tpos, n_rot))
                pending += tail[n_rot:]
            else:
                pending += tail
        if not pending:  # the last computed row would not be the prompt's last: no next-token logits to take
            raise ValueError("a reusing prompt must end with template text after its last shared span")
        rows = held + pending  # the reserved rows, filled in order, then the prompt's last rows
        logits = yield from append_mixed(seq, rows, "last", st.vectors, st.bidirectional, st.vector_pos)
        assert logits is not None
        return logits, len(rows), corrs

    def _hold(self, seq: KVSequence, kc: Any, n: int, copy: bool, counts: HopCounts) -> None:
        """The corrected rows seq appended last: copied (materialized) or kept fused, counted."""
        if copy:
            self.model.materialize_last(seq)
            counts.materialized += n
        else:
            counts.factor_bytes += int(kc.bytes)

    def _recompute_choice(
        self, t: Template, seq: KVSequence, st: RequestState, correct: Corrector
    ) -> dict[str, tuple[Correction | None, np.ndarray]]:
        """The recompute path of a reuse hop: per stored span with rows after its exact head, its correction (None
        at budgets 0 and 1, which score no row) and the rows the rule chose over all of the hop's spans."""
        cfg = self.config
        parts: dict[str, tuple[Correction | None, int]] = {}
        pos = len(seq)  # the prefix holds the template text before the first span
        for i, ph in enumerate(t.placeholders):
            ids = st.spans[ph].ids
            h = min(cfg.head, len(ids))
            b = st.stored(ph)
            if b is not None and b.shared is not None and len(ids) > h:
                n = len(ids) - h
                scored = 0 < cfg.recompute < 1
                parts[ph] = (correct(ph, b, pos + h, n) if scored else None, n)
            pos += len(ids) + len(t.texts[i + 1])
        scores = recompute_mod.deviation_scores(list(parts.values()), self.model.n_layer)
        masks = recompute_mod.select_rows(scores, cfg.recompute, cfg.recompute_block)
        return {ph: (corr, mask) for (ph, (corr, _)), mask in zip(parts.items(), masks, strict=True)}

    def _append_chosen(
        self,
        seq: KVSequence,
        shared: SharedKV,
        ids: list[int],
        corr: Correction | None,
        mask: np.ndarray,
        pending: list[int],
        held: list[int],
        counts: HopCounts,
    ) -> list[int]:
        """Appends a shared span (rows `ids`, stored as `shared`) to seq with the rows the rule chose (`mask`, from
        recompute.select_rows over the hop): chosen rows join `pending`, to be computed in order with the rest of
        the prompt (pending rows are reserved in seq, and moved to `held`, before a reused piece is appended after
        them); the others are appended by reference, every piece reading its rows of the span's one correction (none
        when MethodConfig.correct is False), so however finely the rows are chosen the factors are held once.
        Returns pending."""
        n_reused = int((~mask).sum())
        kc: Any = None
        if corr is not None and self.config.correct and n_reused:
            kc = corr.kv_correction(len(ids), self.kd, self.model.n_layer)
        copy = kc is not None and self.wants_copy(kc, n_reused)
        for start, end, chosen in recompute_mod.runs(mask):
            if chosen:
                pending = pending + ids[start:end]
                continue
            pending = reserve_rows(seq, pending, held)
            seq.append_shared(shared.slice(start, end - start), kc, corr_row0=start if kc is not None else 0)
            if copy:
                self._hold(seq, kc, end - start, True, counts)
        if kc is not None and not copy:
            counts.factor_bytes += int(kc.bytes)
        return pending
