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
(KVSequence.reserve), so recomputing costs rows, not calls. This module only chooses the rows; sharing.assemble
appends the span around them.
Budget 0 is the method unchanged; budget 1 forwards every row, so the reader computes exactly what `nonshared`
computes (bit for bit: the whole prompt after the template prefix goes to the engine in one append).

Without a correction (the selective-recompute-only baseline, MethodConfig.correct=False) the same scores choose the
rows and the rest is reused uncorrected, so the correction's value at each budget is measured with the same rows.
A chained span's next reader starts from the stored rows and this reader's correction, not from its recomputed
rows: recomputation helps the reader that paid for it.
"""

from __future__ import annotations

import math

import numpy as np

from .factors import Correction

DEFAULT_BLOCK = 16  # rows per choice: few, long reused pieces between the chosen rows


def deviation_scores(corrs: list[tuple[Correction | None, int]], n_layer: int) -> list[np.ndarray]:
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
