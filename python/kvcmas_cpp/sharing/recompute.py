"""The recompute dial: a reader recomputes part of a shared span in its own context instead of reusing it.

After the estimator's correction, a fraction `budget` of a shared span's rows (the rows after the exact head) is
forwarded exactly by the reader, at their own positions, attending to everything before them in the reader's
sequence (the reused, corrected rows of the span included), as selective-recompute methods such as CacheBlend do;
the other rows are read by reference with the correction, as at budget 0.

Which rows (the rule): the rows whose KV the estimator expects to deviate most from the stored rows. The score of row
i is the correction's predicted deviation, per layer and for K and V separately normalised by the layer's mean over
the span (so every layer weighs the same), summed:  s_i = Σ_l ‖ΔK_l[i]‖² / mean_j ‖ΔK_l[j]‖² + (same for V), with
ΔK_l = A_k B_k the correction of layer l. (The first layer's own deviation, CacheBlend's signal, is zero here: a
layer-0 key or value depends only on its token and position, and the reused rows are re-positioned exactly.) The
engine forwards contiguous rows per call, so rows are chosen in blocks of `block` rows (ranked by mean score, ties
to the earlier block) until at least ceil(budget * n) rows are chosen; chosen blocks that touch run as one call.
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
    from ..plan import Plan
    from .runner import MethodConfig, RequestState, WorkflowRunner

DEFAULT_BLOCK = 16  # rows per choice: the engine's prefill kernels run appends of >= 13 rows


def deviation_scores(corr: est.Correction | None, n: int, n_layer: int) -> np.ndarray:
    """Per row of the span [n], the rule's score from a correction; zeros where there is none."""
    score = np.zeros(n, np.float64)
    if corr is None:
        return score
    for f in corr.factors(n_layer):
        if f is None:
            continue
        ak, bk, av, bv = f
        for a, b in ((ak, bk), (av, bv)):
            a64 = np.asarray(a, np.float64)
            g = np.asarray(b, np.float64) @ np.asarray(b, np.float64).T  # [r, r]: ‖a_i B‖² = a_i G a_iᵀ
            rows = np.einsum("ir,rs,is->i", a64, g, a64)
            mean = rows.mean()
            if mean > 0:
                score += rows / mean
    return score


def select_rows(scores: np.ndarray, budget: float, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """The rule's choice: a bool mask over the span's rows (see the module docstring)."""
    n = len(scores)
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"recompute budget must be in [0, 1], got {budget}")
    if block < 1:
        raise ValueError(f"recompute block must be >= 1, got {block}")
    mask = np.zeros(n, bool)
    want = math.ceil(budget * n - 1e-9)
    if want <= 0:
        return mask
    if want >= n:
        mask[:] = True
        return mask
    starts = np.arange(0, n, block)
    means = np.array([scores[s : s + block].mean() for s in starts])
    for bi in np.argsort(-means, kind="stable"):
        mask[starts[bi] : starts[bi] + block] = True
        if mask.sum() >= want:
            break
    return mask


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
    st: RequestState,
    shared: SharedKV,
    ids: list[int],
    corr: est.Correction | None,
    pending: list[int],
) -> Plan[tuple[list[int], int, int]]:
    """The plan (kvcmas_cpp.plan) of appending a shared span (rows `ids`, stored as `shared`) to seq under the
    budget: chosen rows join `pending` (forwarded in order with the rest of the prompt), the others are appended by
    reference with their slice of the correction (none when MethodConfig.correct is False). Returns (pending, rows
    computed by flushes, rows chosen)."""
    from .runner import append_mixed

    cfg, m = runner.config, runner.model
    n = len(ids)
    mask = select_rows(deviation_scores(corr, n, m.n_layer), cfg.recompute, cfg.recompute_block)
    applied = corr if cfg.correct else None
    if applied is not None and applied.in_core and mask.any():  # sliced below: copied out of the core once
        applied = est.Correction(applied.factors(m.n_layer))
    computed = 0
    for start, end, chosen in runs(mask):
        if chosen:
            pending = pending + ids[start:end]
            continue
        if pending:
            yield from append_mixed(seq, pending, "none", st.vectors)
            computed += len(pending)
            pending = []
        piece = shared.slice(start, end - start)
        kc: Any = None
        if applied is not None:
            part = applied.sliced(start, end - start, m.n_layer) if start or end < n else applied
            kc = part.kv_correction(end - start, runner.kd, m.n_layer)
        seq.append_shared(piece, kc)
        if kc is not None:
            if runner._wants_copy(kc, end - start):
                core.seq_materialize_last(m._core, seq.id)
                runner._materialized += end - start
            else:
                runner._factor_bytes += kc.bytes
    return pending, computed, int(mask.sum())


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
