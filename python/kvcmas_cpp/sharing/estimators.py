"""Estimators of the KV delta a reader agent needs on a shared span, and the factor algebra around them: the names in
one place (the protocol is in estimator_base, the algebra in factors, the estimators in ridge, anchors and here).

All arrays here are in the span's canonical frame: keys rotated to positions 0..n-1 of the span, rows = tokens,
columns = head-major n_head_kv * head_dim ("kd"). Shapes: base/exact/delta [n_layer, n, kd]. Estimators compute
Factors: a list over layers of (A_k [n, r], B_k [r, kd], A_v [n, r], B_v [r, kd]) or None (layer uncorrected; layer
0 always). A Correction is what the runner carries from hop to hop: numpy Factors or a core KvCorrection, one type.

Estimators:
- RidgeEstimator (default `kvcmas`): a ridge map base -> delta per (edge, layer), reduced to rank r, plus the
  per-(edge, layer) mean offset; fitted on dense runs of training questions. Its output is naturally factored:
  delta = (X - mu_x) P Vt + 1 mu_y^T, i.e. A = [(X - mu_x) P, 1], B = [Vt; mu_y] (rank r + 1).
- AnchorEstimator (`kvcmas-ref` at rank 32, `kvcomm` at full rank): the reference code's anchor pool, per-token
  softmax weights of negative mean |base distance|, entropy reuse gate, LFU-in-window eviction.
- OracleEstimator: the exact delta truncated to rank r (needs the exact KV: an upper bound, not deployable).
"""

from __future__ import annotations

from .anchors import AnchorEstimator
from .estimator_base import Edge, EdgeContext, Estimator, LearnsFromReads
from .factors import (
    MAX_KERNEL_RANK,
    Correction,
    Factors,
    LayerFactors,
    concat,
    correction_rank,
    dense_to_correction,
    exact_factors,
    materialize,
    pad_rank,
    rsvd,
    truncated,
)
from .ridge import RidgeEstimator, RidgeMap, RowMoments, fit_ridge_map

__all__ = [
    "MAX_KERNEL_RANK",
    "AnchorEstimator",
    "Correction",
    "Edge",
    "EdgeContext",
    "Estimator",
    "Factors",
    "LayerFactors",
    "LearnsFromReads",
    "OracleEstimator",
    "RidgeEstimator",
    "RidgeMap",
    "RowMoments",
    "concat",
    "correction_rank",
    "dense_to_correction",
    "exact_factors",
    "fit_ridge_map",
    "materialize",
    "pad_rank",
    "rsvd",
    "truncated",
]


class OracleEstimator(Estimator):
    """The exact delta truncated to rank r per layer (layer 0 uncorrected)."""

    name = "oracle"
    needs_exact = True
    reads_base = True

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def correction(self, ctx: EdgeContext) -> Factors | None:
        if ctx.exact_k is None or ctx.exact_v is None:
            raise ValueError("oracle: the exact KV is needed (evaluation mode)")
        out: Factors = [None]
        for il in range(1, ctx.base_k.shape[0]):
            ak, bk = truncated(ctx.exact_k[il] - ctx.base_k[il], self.rank)
            av, bv = truncated(ctx.exact_v[il] - ctx.base_v[il], self.rank)
            out.append(pad_rank((ak, bk, av, bv)))
        return out
