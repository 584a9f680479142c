"""The recompute dial: a reader recomputes part of its shared spans in its own context instead of reusing them.

After the estimator's correction, a fraction `budget` of a hop's shared rows (the spans' rows after their exact
heads) is forwarded exactly by the reader, at their own positions, attending to everything before them in the reader's
sequence (the reused, corrected rows of the span included), as selective-recompute methods such as CacheBlend do;
the other rows are read by reference with the correction, as at budget 0.

Which rows (the rule): the rows whose KV the estimator expects to deviate most from the stored rows. The score of row
i is the correction's predicted deviation, per layer and for K and V separately normalised by the layer's mean over
all of the hop's shared rows (so every layer weighs the same and the spans compete on one scale), summed:
s_i = Σ_l ‖ΔK_l[i]‖² / mean_j ‖ΔK_l[j]‖² + (same for V), with ΔK_l = A_k B_k the correction of layer l. (The first
layer's own deviation, CacheBlend's signal, is zero here: a layer-0 key or value depends only on its token and
position, and the reused rows are re-positioned exactly.) Rows are chosen in blocks of `block` rows within a span
(so the reused pieces between them, each appended with its slice of the correction, stay few and long), ranked by
mean score over all of the hop's spans (ties to the earlier one), until at least ceil(budget * n) rows are chosen,
n the hop's shared rows after the exact heads: the budget is the hop's, so a short span (a relayed reply shorter
than a block) is recomputed only if it ranks among the hop's most deviating blocks. The chosen rows are reserved in
place between the reused pieces and computed with the rest of the reader's prompt in one forward pass
(KVSequence.reserve), so recomputing costs rows, not calls.
Budget 0 is the method unchanged; budget 1 forwards every row, so the reader computes exactly what `nonshared`
computes (bit for bit: the whole prompt after the template prefix goes to the engine in one append).

Without a correction (the selective-recompute-only baseline, MethodConfig.correct=False) the same scores choose the
rows and the rest is reused uncorrected, so the correction's value at each budget is measured with the same rows.
A chained span's next reader starts from the stored rows and this reader's correction, not from its recomputed
rows: recomputation helps the reader that paid for it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._native import core
from ..model import KVSequence, SharedKV
from . import estimators as est

if TYPE_CHECKING:
    from .runner import MethodConfig, WorkflowRunner

DEFAULT_BLOCK = 16  # rows per choice: few, long reused pieces between the chosen rows


def deviation_scores(corrs: list[tuple[est.Correction | None, int]], n_layer: int) -> list[np.ndarray]:
    """The rule's score of every row of a hop's spans: per span (its correction, or None, and its rows n) an array
    [n]. Each layer's K and V deviations are normalised by their mean over all of the hop's rows, so spans compete on
    one scale and no layer dominates; a span without a correction scores zeros."""
    parts: list[list[np.ndarray]] = []  # per span: its rows' squared deviation per (layer, K/V), zeros where none
    for corr, n in corrs:
        rows = [np.zeros(n, np.float64) for _ in range(2 * n_layer)]
        if corr is not None:
            for layer, f in enumerate(corr.factors(n_layer)):
                if f is None:
                    continue
                ak, bk, av, bv = f
                for kv, (a, b) in enumerate(((ak, bk), (av, bv))):
                    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
                    rows[2 * layer + kv] = np.einsum("ir,rs,is->i", a64, b64 @ b64.T, a64)  # ‖a_i B‖² = a_i G a_iᵀ
        parts.append(rows)
    scores = [np.zeros(n, np.float64) for _, n in corrs]
    n_rows = sum(n for _, n in corrs)
    for j in range(2 * n_layer):
        mean = sum(float(p[j].sum()) for p in parts) / max(n_rows, 1)
        if mean > 0:
            for sc, p in zip(scores, parts, strict=True):
                sc += p[j] / mean
    return scores


def select_rows(scores: list[np.ndarray], budget: float, block: int = DEFAULT_BLOCK) -> list[np.ndarray]:
    """The rule's choice over a hop's spans: per span a bool mask over its rows. Every span is cut into blocks of
    `block` rows (a span's last block may be shorter); blocks are taken by mean score, highest first (ties: the
    earlier span, then the earlier block), until at least ceil(budget * rows of all spans) rows are chosen."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"recompute budget must be in [0, 1], got {budget}")
    if block < 1:
        raise ValueError(f"recompute block must be >= 1, got {block}")
    masks = [np.zeros(len(s), bool) for s in scores]
    total = sum(len(s) for s in scores)
    want = math.ceil(budget * total - 1e-9)
    if want <= 0:
        return masks
    if want >= total:
        return [~m for m in masks]
    blocks = [(k, start) for k, s in enumerate(scores) for start in range(0, len(s), block)]
    means = np.array([scores[k][start : start + block].mean() for k, start in blocks])
    chosen = 0
    for bi in np.argsort(-means, kind="stable"):
        k, start = blocks[bi]
        masks[k][start : start + block] = True
        chosen += len(scores[k][start : start + block])
        if chosen >= want:
            break
    return masks


def runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """[start, end) runs of equal mask values, with the value."""
    out: list[tuple[int, int, bool]] = []
    i = 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        out.append((i, j, bool(mask[i])))
        i = j
    return out


def append_span(
    runner: WorkflowRunner,
    seq: KVSequence,
    shared: SharedKV,
    ids: list[int],
    corr: est.Correction | None,
    mask: np.ndarray,
    pending: list[int],
    held: list[int],
) -> list[int]:
    """Appends a shared span (rows `ids`, stored as `shared`) to seq with the rows the rule chose (`mask`, from
    select_rows over the hop): chosen rows join `pending`, to be computed in order with the rest of the prompt
    (pending rows are reserved in seq, and moved to `held`, before a reused piece is appended after them); the others
    are appended by reference, every piece reading its rows of the span's one correction (none when
    MethodConfig.correct is False), so however finely the rows are chosen the factors are held once. Returns
    pending."""
    from .runner import reserve_rows

    cfg, m = runner.config, runner.model
    n_reused = int((~mask).sum())
    kc: Any = None
    if corr is not None and cfg.correct and n_reused:
        kc = corr.kv_correction(len(ids), runner.kd, m.n_layer)
    copy = kc is not None and runner._wants_copy(kc, n_reused)
    for start, end, chosen in runs(mask):
        if chosen:
            pending = pending + ids[start:end]
            continue
        pending = reserve_rows(seq, pending, held)
        seq.append_shared(shared.slice(start, end - start), kc, corr_row0=start if kc is not None else 0)
        if copy:
            core.seq_materialize_last(m._core, seq.id)
            runner._materialized += end - start
    if kc is not None and not copy:
        runner._factor_bytes += kc.bytes
    return pending


BASELINE = "recompute"  # label prefix of the selective-recompute-only baseline


def parse_label(label: str) -> tuple[str, float | None, bool]:
    """A benchmark method label: a method name, `METHOD@B` (the method at recompute budget B) or `recompute@B` (the
    baseline: kvcmas' rows chosen, no correction applied). Returns (method, budget or None, correct)."""
    from .methods import METHODS

    name, sep, budget_text = label.partition("@")
    if not sep:
        if name not in METHODS:
            raise ValueError(f"unknown method {label!r}; choose from {', '.join(METHODS)}, METHOD@B or recompute@B")
        return name, None, True
    try:
        budget = float(budget_text)
    except ValueError:
        raise ValueError(f"{label!r}: the recompute budget after @ must be a number in [0, 1]") from None
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"{label!r}: the recompute budget must be in [0, 1]")
    if name == BASELINE:
        return "kvcmas", budget, False
    if name not in METHODS or name == "nonshared":
        raise ValueError(f"{label!r}: budgets apply to the sharing methods (or {BASELINE}@B)")
    return name, budget, True


def labelled_config(label: str, base: MethodConfig | None = None) -> MethodConfig:
    """The MethodConfig a label names: `base` (default: the method's default_config) with the label's budget."""
    import dataclasses

    from .methods import default_config

    name, budget, correct = parse_label(label)
    cfg = base if base is not None else default_config(name)
    if budget is None:
        return cfg
    return dataclasses.replace(cfg, recompute=budget, correct=correct)
