"""The factor algebra of KV corrections: a reader's low-rank delta on a shared span's rows, per layer.

All arrays are in the span's canonical frame: keys rotated to positions 0..n-1 of the span, rows = tokens, columns =
head-major n_head_kv * head_dim ("kd"). Shapes: base/exact/delta [n_layer, n, kd]. Factors: a list over layers of
(A_k [n, r], B_k [r, kd], A_v [n, r], B_v [r, kd]) or None (layer uncorrected; layer 0 always). A Correction is what
the runner carries from hop to hop: numpy Factors or a core KvCorrection (the engine's value type), one type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._native import core

LayerFactors = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
Factors = list[LayerFactors | None]  # a correction's numpy form, per layer (see the module docstring)
MAX_KERNEL_RANK = 256  # cpu::kMaxCorrectionRank


def orth(y: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning y: Cholesky-QR2 with a small ridge as the reference code does, Householder QR
    when Cholesky fails."""
    try:
        for _ in range(2):
            g = y.T @ y
            g += 1e-6 * max(float(np.mean(np.diag(g))), 1e-30) * np.eye(g.shape[0], dtype=g.dtype)
            lo = np.linalg.cholesky(g)
            y = np.linalg.solve(lo, y.T).T
        return y
    except np.linalg.LinAlgError:
        return np.linalg.qr(y)[0]


def rsvd(m: np.ndarray, rank: int, rng: np.random.Generator, power_iters: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Randomized range finder (spec §3.4): returns (Q [S, r], Q^T M [r, HD]) with M ≈ Q Q^T M, r = min(rank, S, HD)."""
    m = np.asarray(m, dtype=np.float32)
    r = min(rank, m.shape[0], m.shape[1])
    omega = rng.standard_normal((m.shape[1], r)).astype(np.float32)
    q = orth(m @ omega)
    for _ in range(power_iters):
        z = orth(m.T @ q)
        q = orth(m @ z)
    return q.astype(np.float32), (q.T @ m).astype(np.float32)


def truncated(m: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Best rank-`rank` factors (U S [n, r], Vt [r, kd]) of m by exact SVD."""
    u, s, vt = np.linalg.svd(np.asarray(m, dtype=np.float32), full_matrices=False)
    r = min(rank, len(s))
    return (u[:, :r] * s[:r]).astype(np.float32), vt[:r].astype(np.float32)


def exact_factors(delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Factors whose product is exactly delta [n, kd] with the smallest trivial rank (identity on one side); SVD
    truncation to the kernel's rank limit only when both sides exceed it."""
    n, kd = delta.shape
    delta = np.asarray(delta, dtype=np.float32)
    if n <= kd and n <= MAX_KERNEL_RANK:
        return np.eye(n, dtype=np.float32), delta
    if kd <= MAX_KERNEL_RANK:
        return delta, np.eye(kd, dtype=np.float32)
    return truncated(delta, MAX_KERNEL_RANK)


def dense_to_correction(dk: np.ndarray, dv: np.ndarray) -> Factors:
    """A correction that adds the full deltas dk, dv [n_layer, n, kd] from layer 1 on."""
    out: Factors = [None]
    for il in range(1, dk.shape[0]):
        ak, bk = exact_factors(dk[il])
        av, bv = exact_factors(dv[il])
        out.append((ak, bk, av, bv))
    return out


def correction_rank(corr: Factors) -> int:
    return max((max(f[0].shape[1], f[2].shape[1]) for f in corr if f is not None), default=0)


def materialize(corr: Factors, n_layer: int, n: int, kd: int) -> tuple[np.ndarray, np.ndarray]:
    """The deltas [n_layer, n, kd] a correction adds."""
    dk = np.zeros((n_layer, n, kd), np.float32)
    dv = np.zeros_like(dk)
    for il, f in enumerate(corr):
        if f is not None:
            dk[il] = f[0] @ f[1]
            dv[il] = f[2] @ f[3]
    return dk, dv


def concat(corrs: list[Factors]) -> Factors:
    """The sum of several corrections as one, by concatenating factors along the rank axis."""
    n_layer = max(len(c) for c in corrs)
    out: Factors = []
    for il in range(n_layer):
        parts = [f for c in corrs if il < len(c) and (f := c[il]) is not None]
        if not parts:
            out.append(None)
            continue
        ak, bk, av, bv = (np.concatenate([p[j] for p in parts], axis=1 if j % 2 == 0 else 0) for j in range(4))
        out.append((ak, bk, av, bv))
    return out


class Correction:
    """A reader's correction of a shared span's rows, in the span's stored frame: numpy Factors (what estimators
    compute) or a core KvCorrection (what the core's ridge path builds and the engine reads). Either form converts to
    the other on demand, each time (nothing cached: a chained span holds one form only). Immutable."""

    __slots__ = ("_factors", "_kv")

    def __init__(self, factors: Factors | None = None, kv: Any = None) -> None:
        if (factors is None) == (kv is None):
            raise ValueError("a Correction holds numpy factors or a core KvCorrection, exactly one of them")
        self._factors, self._kv = factors, kv

    @property
    def in_core(self) -> bool:
        """Built in the core (a KvCorrection): the core's ridge path can put it in front of a new one."""
        return self._kv is not None

    @property
    def core(self) -> Any:
        """The core KvCorrection it was built as, or None (numpy factors)."""
        return self._kv

    @property
    def rank(self) -> int:
        return int(self._kv.rank) if self._kv is not None else correction_rank(self._factors or [])

    @property
    def rows(self) -> int | None:
        """Span rows it corrects; None for numpy factors that correct no layer."""
        if self._kv is not None:
            return int(self._kv.n_rows)
        return next((int(f[0].shape[0]) for f in self._factors or [] if f is not None), None)

    def factors(self, n_layer: int) -> Factors:
        """Per layer (A_k, B_k, A_v, B_v) or None, as numpy arrays (copied out of the core for a KvCorrection)."""
        if self._factors is not None:
            return self._factors
        return [core.correction_layer(self._kv, il) for il in range(n_layer)]

    def kv_correction(self, n: int, kd: int, n_layer: int) -> Any:
        """The core KvCorrection of n rows the engine reads: the core's own, or built from the factors (K and V
        zero-padded to one rank, at least 1)."""
        if self._kv is not None:
            return self._kv
        corr = self.factors(n_layer)
        rank = max(correction_rank(corr), 1)
        kc = core.KvCorrection(n, rank, kd, n_layer)
        for il, f in enumerate(corr):
            if f is None:
                continue
            ak, bk, av, bv = pad_rank(f)
            if ak.shape[1] < rank:
                pad = np.zeros((n, rank - ak.shape[1]), np.float32)
                padb = np.zeros((rank - ak.shape[1], kd), np.float32)
                ak, av = np.concatenate([ak, pad], 1), np.concatenate([av, pad], 1)
                bk, bv = np.concatenate([bk, padb], 0), np.concatenate([bv, padb], 0)
            kc.set_layer(il, *(np.ascontiguousarray(x, np.float32) for x in (ak, bk, av, bv)))
        return kc

    def shifted(self, rope_rotate: Any, shift: int, n_layer: int) -> Correction:
        """The same correction with keys `shift` positions later (B_k rotated by rope_rotate(rows, shift, layer), the
        model's rotation of that layer): canonical-frame factors to a span's stored frame (shift = its first stored
        position)."""
        out: Factors = []
        for il, f in enumerate(self.factors(n_layer)):
            if f is None:
                out.append(None)
                continue
            ak, bk, av, bv = f
            out.append((ak, rope_rotate(np.ascontiguousarray(bk, np.float32), shift, il), av, bv))
        return Correction(out)

    def sliced(self, start: int, n: int, n_layer: int) -> Correction:
        """Rows [start, start + n) as numpy factors (B is shared by all rows; the frame stays the span's stored one)."""
        end = start + n
        return Correction(
            [None if f is None else (f[0][start:end], f[1], f[2][start:end], f[3]) for f in self.factors(n_layer)]
        )


def pad_rank(f: LayerFactors) -> LayerFactors:
    """Zero-pads K or V factors so both have the same rank (one KvCorrection rank)."""
    ak, bk, av, bv = f
    r = max(ak.shape[1], av.shape[1], 1)

    def pad(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if a.shape[1] == r:
            return a, b
        a2 = np.zeros((a.shape[0], r), np.float32)
        b2 = np.zeros((r, b.shape[1]), np.float32)
        a2[:, : a.shape[1]] = a
        b2[: b.shape[0]] = b
        return a2, b2

    ak, bk = pad(ak, bk)
    av, bv = pad(av, bv)
    return ak, bk, av, bv
