"""Estimators of the KV delta a reader agent needs on a shared span, and the factor algebra around them.

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

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .._native import core
from ._blas import single_threaded_blas

LayerFactors = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
Factors = list[LayerFactors | None]  # a correction's numpy form, per layer (see the module docstring)
Edge = tuple[str, int | str]  # (span key, reader key) an estimator learns per
MAX_KERNEL_RANK = 256  # cpu::kMaxCorrectionRank


@dataclass
class EdgeContext:
    """What an estimator sees for one (span, reader) read. exact_* are set only on dense hops (anchor recording) and
    for the oracle."""

    ph: str
    reader: int | str
    message: str
    base_k: np.ndarray
    base_v: np.ndarray
    exact_k: np.ndarray | None = None
    exact_v: np.ndarray | None = None


# ---------------------------------------------------------------------------------------------- factor algebra
def _orth(y: np.ndarray) -> np.ndarray:
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
    q = _orth(m @ omega)
    for _ in range(power_iters):
        z = _orth(m.T @ q)
        q = _orth(m @ z)
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

    __slots__ = ("_factors", "_core")

    def __init__(self, factors: Factors | None = None, kv: Any = None) -> None:
        if (factors is None) == (kv is None):
            raise ValueError("a Correction holds numpy factors or a core KvCorrection, exactly one of them")
        self._factors, self._core = factors, kv

    @property
    def in_core(self) -> bool:
        """Built in the core (a KvCorrection): the core's ridge path can put it in front of a new one."""
        return self._core is not None

    @property
    def core(self) -> Any:
        """The core KvCorrection it was built as, or None (numpy factors)."""
        return self._core

    @property
    def rank(self) -> int:
        return int(self._core.rank) if self._core is not None else correction_rank(self._factors or [])

    @property
    def rows(self) -> int | None:
        """Span rows it corrects; None for numpy factors that correct no layer."""
        if self._core is not None:
            return int(self._core.n_rows)
        return next((int(f[0].shape[0]) for f in self._factors or [] if f is not None), None)

    def factors(self, n_layer: int) -> Factors:
        """Per layer (A_k, B_k, A_v, B_v) or None, as numpy arrays (copied out of the core for a KvCorrection)."""
        if self._factors is not None:
            return self._factors
        return [core.correction_layer(self._core, il) for il in range(n_layer)]

    def kv_correction(self, n: int, kd: int, n_layer: int) -> Any:
        """The core KvCorrection of n rows the engine reads: the core's own, or built from the factors (K and V
        zero-padded to one rank, at least 1)."""
        if self._core is not None:
            return self._core
        corr = self.factors(n_layer)
        rank = max(correction_rank(corr), 1)
        kc = core.KvCorrection(n, rank, kd, n_layer)
        for il, f in enumerate(corr):
            if f is None:
                continue
            ak, bk, av, bv = _pad_rank(f)
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


# ---------------------------------------------------------------------------------------------- estimators
class Estimator:
    """The estimator protocol the runner (sharing.runner.WorkflowRunner) drives, and its base: no correction
    (fullshared, nonshared). An estimator says what it needs through these members; the runner checks no classes.

    - name; needs_exact: correction() needs the exact rows (the oracle: evaluation only); reads_base: correction()
      reads the base view (else the runner skips reading it back).
    - content_edges: it learns per content edge (the span's role, the reader's identity: runner.edge_of); False: per
      (placeholder, agent index), as the reference code's anchor pools.
    - decide(reader, placeholders, message): a reason to compute a reader's spans densely ('gate'), or None.
    - gates_outputs / observe_output(ph, message, span_v): a freshly produced span's values; returns whether it is
      novel (the anchor pools' gate; None: the estimator gates nothing).
    - observes_dense / observe(ctx, is_question): a dense hop's exact rows next to the base it would have read (the
      anchor pools record them).
    - calibrating(edge): the edge is still learning (online ridge): its readers share cold (MethodConfig.cold) and
      get a training read (learns_from_reads: the LearnsFromReads methods, RidgeEstimator's).
    - core_path / core_maps(edge): the correction is computed in the core from these maps (None: the numpy path).
    - correction(ctx): the delta factors for one read, or None."""

    name = "fullshared"
    needs_exact = False
    reads_base = False  # correction() never looks at the base view: callers may skip reading it back
    content_edges = False
    gates_outputs = False
    observes_dense = False
    learns_from_reads = False
    core_path = False

    def decide(self, reader: int | str, phs: list[str], message: str) -> str | None:
        """A reason to compute this reader's spans densely instead of sharing them, or None."""
        return None

    def observe_output(self, ph: str, message: str, span_v: np.ndarray) -> bool | None:
        """A produced span's values [n_layer, n, kd]: whether it is novel; None when the estimator gates nothing."""
        return None

    def observe(self, ctx: EdgeContext, is_question: bool) -> None:
        """A dense hop's exact rows (ctx.exact_*) next to its base (called where observes_dense)."""

    def calibrating(self, edge: Edge) -> bool:
        """The edge is still learning (no correction for it yet; its readers get training reads)."""
        return False

    def core_maps(self, edge: Edge) -> Any:
        """Maps the core computes the edge's correction from (where core_path), or None."""
        return None

    def correction(self, ctx: EdgeContext) -> Factors | None:
        return None

    def state_bytes(self) -> int:
        """Persistent estimator state (maps, anchor pools) in bytes."""
        return 0

    def pending_bytes(self) -> int:
        """Bytes held by training reads not yet turned into state (online calibration)."""
        return 0


class LearnsFromReads(Protocol):
    """What an estimator with learns_from_reads offers the runner's training reads (RidgeEstimator)."""

    def calibrating(self, edge: Edge) -> bool: ...

    def add_rows(
        self, edge: Edge, base_k: np.ndarray, base_v: np.ndarray, exact_k: np.ndarray, exact_v: np.ndarray
    ) -> None: ...

    def end_read(self, edge: Edge) -> None: ...

    def examples(self, edge: Edge) -> int: ...

    def fit(self, edges: list[Edge] | None = None) -> list[Edge]: ...


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
            out.append(_pad_rank((ak, bk, av, bv)))
        return out


def _pad_rank(f: LayerFactors) -> LayerFactors:
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


@dataclass
class _RidgeMap:
    mu_x: np.ndarray  # [kd]
    proj: np.ndarray  # [kd, r]  = W V_r
    vt: np.ndarray  # [r, kd]
    mu_y: np.ndarray  # [kd]

    def factors(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = np.concatenate([(x - self.mu_x) @ self.proj, np.ones((x.shape[0], 1), np.float32)], axis=1)
        return a.astype(np.float32), np.concatenate([self.vt, self.mu_y[None]], axis=0).astype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.mu_x.nbytes + self.proj.nbytes + self.vt.nbytes + self.mu_y.nbytes


def fit_ridge_map(x: np.ndarray, y: np.ndarray, rank: int, alpha: float) -> _RidgeMap:
    """Reduced-rank ridge regression y ≈ (x - mu_x) W V V^T + mu_y on rows x, y [N, kd] (the batch form of
    RowMoments.fit: the same fit from the same rows)."""
    m = RowMoments(1, x.shape[1])
    m.add(x[None], y[None])
    return m.fit(rank, alpha)[0]


class RowMoments:
    """The sufficient statistics of a ridge fit over paired rows (x, y), for `n_maps` independent maps of width kd:
    the row count, the means of x and y, the centred Gram matrix sum (x - mu_x)(x - mu_x)^T and the centred cross
    product sum (x - mu_x)(y - mu_y)^T. Updated batch by batch (the pairwise merge of Chan et al.), so the memory is
    about 2 * n_maps * kd * kd floats whatever the number of rows. Batch moments are single-precision matrix products
    of rows centred on the batch mean; the matrices are kept in float32 (17 MB an edge on SmolLM2-135M), the means in
    float64."""

    def __init__(self, n_maps: int, kd: int) -> None:
        self.count = 0
        self.mu_x = np.zeros((n_maps, kd))
        self.mu_y = np.zeros((n_maps, kd))
        self.gram = np.zeros((n_maps, kd, kd), np.float32)
        self.cross = np.zeros((n_maps, kd, kd), np.float32)

    @property
    def nbytes(self) -> int:
        return self.mu_x.nbytes + self.mu_y.nbytes + self.gram.nbytes + self.cross.nbytes

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Adds rows x, y [n_maps, n, kd] (map i's inputs and targets)."""
        n = x.shape[1]
        if n == 0:
            return
        x = np.asarray(x, np.float32)
        y = np.asarray(y, np.float32)
        mx, my = x.mean(1, dtype=np.float64), y.mean(1, dtype=np.float64)
        xc = x - mx[:, None].astype(np.float32)
        yc = y - my[:, None].astype(np.float32)
        xt = xc.transpose(0, 2, 1)
        n0 = self.count
        total = n0 + n
        dx, dy = mx - self.mu_x, my - self.mu_y
        self.gram += np.matmul(xt, xc)
        self.cross += np.matmul(xt, yc)
        if n0:  # the shift between the two means (float32 is plenty: it is a rank-1 term)
            wdx = (dx * (n0 * n / total)).astype(np.float32)
            self.gram += wdx[:, :, None] * dx.astype(np.float32)[:, None, :]
            self.cross += wdx[:, :, None] * dy.astype(np.float32)[:, None, :]
        self.mu_x += dx * (n / total)
        self.mu_y += dy * (n / total)
        self.count = total

    def fit(self, rank: int, alpha: float) -> list[_RidgeMap]:
        """Every map's reduced-rank ridge fit, batched: W = (G + lambda I)^-1 C with lambda = alpha times G's mean
        diagonal, then the top `rank` right singular vectors V of the fitted values X_c W (eigenvectors of
        W^T G W)."""
        if self.count == 0:
            raise ValueError("ridge fit: no rows")
        g, c = self.gram.astype(np.float64), self.cross.astype(np.float64)
        kd = g.shape[1]
        lam = alpha * np.maximum(np.trace(g, axis1=1, axis2=2) / kd, 1e-12)
        w = np.linalg.solve(g + lam[:, None, None] * np.eye(kd), c)
        wt = w.transpose(0, 2, 1)
        evals, evecs = np.linalg.eigh(np.matmul(np.matmul(wt, g), w))
        order = np.argsort(evals, axis=1)[:, ::-1][:, : min(rank, kd)]
        vt = np.take_along_axis(evecs, order[:, None, :], axis=2).transpose(0, 2, 1)  # [n_maps, r, kd]
        proj = np.matmul(w, vt.transpose(0, 2, 1))
        return [
            _RidgeMap(
                self.mu_x[i].astype(np.float32),
                proj[i].astype(np.float32),
                vt[i].astype(np.float32),
                self.mu_y[i].astype(np.float32),
            )
            for i in range(g.shape[0])
        ]


@dataclass
class _EdgeMoments:
    """An edge still calibrating: the moments of its reads (maps 2 * (layer - 1) + {0: K, 1: V} for layers >= 1) and
    how many reads went in."""

    moments: RowMoments
    reads: int = 0
    added: int = 0  # when rows last came in (_ADDED: one clock for every estimator, so stalest compares across them)


_ADDED = itertools.count(1)


class RidgeEstimator(Estimator):
    """A map base -> delta per (edge, layer >= 1, K/V), fitted across requests. An edge is a (span key, reader key)
    pair: (placeholder, agent index) in fixed workflows, content keys in agent sessions (agents.AgentSession)."""

    name = "kvcmas"
    reads_base = True
    content_edges = True
    learns_from_reads = True
    core_path = True

    def __init__(
        self, rank: int = 8, alpha: float = 0.1, max_pending_bytes: int = 256 << 20, max_edges: int = 64
    ) -> None:
        """max_pending_bytes: memory of the training statistics of edges still calibrating (a fixed size per edge,
        RowMoments, however long the span and however many reads); past it the statistics of the edge that went
        longest without a read are dropped (a server meets edges that never reach their calibration count). The
        edge being read is always kept. max_edges: fitted edges kept, least recently used dropped beyond it."""
        self.rank, self.alpha = rank, alpha
        self.max_pending_bytes, self.max_edges = max_pending_bytes, max_edges
        # insertion order = least recently added to first
        self._pending: dict[Edge, _EdgeMoments] = {}
        self.maps: dict[Edge, list[tuple[_RidgeMap, _RidgeMap] | None]] = {}
        # per edge: the maps list a core copy was made from (identity: refits and loads replace the list) and it
        self._core_maps: dict[Edge, tuple[list[tuple[_RidgeMap, _RidgeMap] | None], Any]] = {}

    def add_rows(
        self, edge: Edge, base_k: np.ndarray, base_v: np.ndarray, exact_k: np.ndarray, exact_v: np.ndarray
    ) -> None:
        """Adds rows of one training read (base and exact K/V of the span at the reader, [n_layer, n, kd] in the
        canonical frame) to the edge's statistics; a read may come in several batches of rows. end_read() counts it."""
        n_layer, _, kd = base_k.shape
        em = self._pending.pop(edge, None)
        if em is None:
            em = _EdgeMoments(RowMoments(2 * (n_layer - 1), kd))
        self._pending[edge] = em  # now the most recently added to
        em.added = next(_ADDED)
        self._bound(edge)
        x = np.stack([base_k[1:], base_v[1:]], axis=1).reshape(2 * (n_layer - 1), -1, kd)
        y = np.stack([exact_k[1:] - base_k[1:], exact_v[1:] - base_v[1:]], axis=1).reshape(x.shape)
        em.moments.add(x, y)

    def end_read(self, edge: Edge) -> None:
        """Counts one complete training read of the edge (its rows went in through add_rows)."""
        em = self._pending.get(edge)
        if em is not None:
            em.reads += 1

    def add_example(self, ctx: EdgeContext) -> None:
        """Adds one whole training read (base and exact KV of the same span at the reader)."""
        assert ctx.exact_k is not None and ctx.exact_v is not None
        edge = (ctx.ph, ctx.reader)
        self.add_rows(edge, ctx.base_k, ctx.base_v, ctx.exact_k, ctx.exact_v)
        self.end_read(edge)

    def _bound(self, keep: Edge) -> None:
        """Drops the statistics of the stalest edges (never `keep`) while over max_pending_bytes."""
        while self.pending_bytes() > self.max_pending_bytes:
            stale = next(iter(self._pending))
            if stale == keep:
                break
            del self._pending[stale]

    def pending_bytes(self) -> int:
        """Bytes held by the statistics of edges not yet fitted."""
        return sum(em.moments.nbytes for em in self._pending.values())

    def pending_edges(self) -> list[Edge]:
        """The edges gathering training reads (no fitted map yet), least recently added to first."""
        return list(self._pending)

    def stalest_pending(self) -> tuple[int, Edge] | None:
        """(when rows last came in, edge) of the calibrating edge that went longest without rows; None when none."""
        if not self._pending:
            return None
        edge, em = next(iter(self._pending.items()))
        return em.added, edge

    def drop_pending(self, edge: Edge) -> int:
        """Drops a calibrating edge's statistics (its reads start over); the bytes freed."""
        em = self._pending.pop(edge, None)
        return em.moments.nbytes if em is not None else 0

    def drop_stalest_map(self) -> int:
        """Drops the least recently used fitted edge (it calibrates again when read); the bytes freed."""
        if not self.maps:
            return 0
        before = self.state_bytes()
        self._forget_map(next(iter(self.maps)))
        return before - self.state_bytes()

    def examples(self, edge: Edge) -> int:
        """Training reads gathered (not yet fitted) for an edge."""
        em = self._pending.get(edge)
        return em.reads if em is not None else 0

    def calibrating(self, edge: Edge) -> bool:
        """The edge has no fitted map yet."""
        return edge not in self.maps

    def fit(self, edges: list[Edge] | None = None) -> list[Edge]:
        """Fits the maps of the given edges (default: every edge with gathered reads), drops their statistics and
        returns the edges fitted."""
        done = []
        for edge in list(self._pending) if edges is None else edges:
            em = self._pending.pop(edge, None)
            if em is None or em.moments.count == 0:
                continue
            with single_threaded_blas():  # a loaded machine makes OpenBLAS' thread pool many times slower
                fitted = em.moments.fit(self.rank, self.alpha)
            maps: list[tuple[_RidgeMap, _RidgeMap] | None] = [None]
            maps += [(fitted[j], fitted[j + 1]) for j in range(0, len(fitted), 2)]
            self.set_maps(edge, maps)
            done.append(edge)
        return done

    def set_maps(self, edge: Edge, maps: list[tuple[_RidgeMap, _RidgeMap] | None]) -> None:
        """Installs an edge's fitted maps (a fit, or maps loaded from disk) as the most recently used."""
        self.maps.pop(edge, None)
        self.maps[edge] = maps
        while len(self.maps) > self.max_edges:
            self._forget_map(next(iter(self.maps)))

    def _forget_map(self, edge: Edge) -> None:
        del self.maps[edge]
        self._core_maps.pop(edge, None)

    def _touch(self, edge: Edge) -> None:
        """Marks a fitted edge as used (it is dropped last when max_edges is exceeded)."""
        if edge in self.maps:
            self.maps[edge] = self.maps.pop(edge)

    def core_maps(self, edge: Edge) -> Any:
        """The edge's maps copied into the core (a `_core.RidgeMaps`, made once per fitted map list), or None when
        the edge has no map or its layers' ranks differ (then the numpy path applies them)."""
        maps = self.maps.get(edge)
        if maps is None:
            return None
        self._touch(edge)
        cached = self._core_maps.get(edge)
        if cached is not None and cached[0] is maps:
            return cached[1]
        fitted = [m for m in maps if m is not None]
        ranks = {mm.vt.shape[0] for m in fitted for mm in m}
        core_maps = None
        if len(ranks) == 1 and fitted:
            from .._native import core

            kd = fitted[0][0].mu_x.shape[0]
            core_maps = core.RidgeMaps(len(maps), kd, ranks.pop())
            for il, m in enumerate(maps):
                if m is not None:
                    parts = [
                        np.ascontiguousarray(x, np.float32) for mm in m for x in (mm.mu_x, mm.proj, mm.vt, mm.mu_y)
                    ]
                    core_maps.set_layer(il, *parts)
        self._core_maps[edge] = (maps, core_maps)
        return core_maps

    def correction(self, ctx: EdgeContext) -> Factors | None:
        maps = self.maps.get((ctx.ph, ctx.reader))
        if maps is None:
            return None
        self._touch((ctx.ph, ctx.reader))
        out: Factors = [None]
        for il in range(1, len(maps)):
            mk, mv = maps[il]  # type: ignore[misc]
            ak, bk = mk.factors(ctx.base_k[il])
            av, bv = mv.factors(ctx.base_v[il])
            out.append(_pad_rank((ak, bk, av, bv)))
        return out

    def state_bytes(self) -> int:
        """The fitted maps, plus their copies in the core (made on first use of an edge)."""
        numpy_maps = sum(mk.nbytes + mv.nbytes for maps in self.maps.values() for m in maps if m for mk, mv in [m])
        return numpy_maps + sum(int(c.bytes) for _, c in self._core_maps.values() if c is not None)


# ---------------------------------------------------------------------------------------------- anchors
@dataclass
class _Anchor:
    base_k: list[tuple[np.ndarray, np.ndarray] | np.ndarray]  # per layer: low-rank (US, Vt) or full [n, kd]
    base_v: list[tuple[np.ndarray, np.ndarray] | np.ndarray]
    length: int
    deltas: dict[int | str, tuple[list, list]] = field(default_factory=dict)  # reader -> (per-layer K, V)
    count: int = 0


def _expand(x: tuple[np.ndarray, np.ndarray] | np.ndarray) -> np.ndarray:
    return x[0] @ x[1] if isinstance(x, tuple) else x


def _nbytes(x: tuple[np.ndarray, np.ndarray] | np.ndarray) -> int:
    return x[0].nbytes + x[1].nbytes if isinstance(x, tuple) else x.nbytes


class AnchorEstimator(Estimator):
    """The reference code's estimator (spec §3.3-3.6). rank=None keeps full-rank deltas and bases (KVCOMM)."""

    reads_base = True
    gates_outputs = True
    observes_dense = True

    def __init__(
        self,
        rank: int | None = 32,
        base_rank: int | None = 32,
        max_anchors: int = 10,
        window: int = 5,
        gamma: float = 0.32,
        top_p: float = 0.9,
        seed: int = 0,
        name: str = "kvcmas-ref",
    ) -> None:
        self.rank, self.base_rank = rank, base_rank
        self.max_anchors, self.window, self.gamma, self.top_p = max_anchors, window, gamma, top_p
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.pools: dict[str, OrderedDict[str, _Anchor]] = {}
        self.novel: dict[tuple[str, str], bool] = {}

    def _compress(self, m: np.ndarray, rank: int | None) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
        return m.astype(np.float32).copy() if rank is None else rsvd(m, rank, self.rng)

    # -- gate
    def gate(self, ph: str, message: str, span_v: np.ndarray) -> bool:
        """Novelty test of a freshly produced span (values [n_layer, k, kd]); records and returns `novel`."""
        pool = self.pools.get(ph, OrderedDict())
        k = span_v.shape[1]
        avail = [a for a in pool.values() if a.length >= k]
        novel = True
        if len(pool) > 1 and len(avail) > 1 and k > 0:
            d = np.array(
                [
                    np.sqrt(
                        sum(
                            float(np.sum((span_v[il] - _expand(a.base_v[il])[:k]) ** 2))
                            for il in range(span_v.shape[0])
                        )
                    )
                    for a in avail
                ]
            )
            p = np.exp(-(d - d.min()))
            p /= p.sum()
            entropy = float(-np.sum(p * np.log2(p + 1e-40)))
            if entropy <= self.gamma * np.log2(len(avail)):
                novel = False
                order = np.argsort(-p)
                keep = [i for i, c in zip(order, np.cumsum(p[order]), strict=True) if c < self.top_p] or list(order)
                for i in keep:
                    avail[i].count += 1
        self.novel[(ph, message)] = novel
        return novel

    def decide(self, reader: int | str, phs: list[str], message: str) -> str | None:
        return "gate" if self.needs_dense(reader, phs, message) else None

    def observe_output(self, ph: str, message: str, span_v: np.ndarray) -> bool | None:
        return self.gate(ph, message, span_v)

    def observe(self, ctx: EdgeContext, is_question: bool) -> None:
        self.record(ctx, is_question)

    def needs_dense(self, reader: int | str, phs: list[str], message: str) -> bool:
        """Dense fallback: some placeholder is novel and its anchor lacks this reader's delta."""
        for ph in phs:
            if self.novel.get((ph, message)):
                pool = self.pools.get(ph)
                a = pool.get(message) if pool is not None else None
                if a is None or reader not in a.deltas:
                    return True
        return False

    # -- anchors
    def record(self, ctx: EdgeContext, is_question: bool) -> bool:
        """On a dense hop: admits an anchor for (placeholder, message) with this reader's delta, per the spec's
        admission rules. Returns whether it was recorded."""
        assert ctx.exact_k is not None and ctx.exact_v is not None
        pool = self.pools.setdefault(ctx.ph, OrderedDict())
        existing = pool.get(ctx.message)
        admit = existing is not None or (
            len(pool) < self.max_anchors if is_question else self.novel.get((ctx.ph, ctx.message), True)
        )
        if not admit:
            return False
        n_layer = ctx.base_k.shape[0]
        base_k = [self._compress(ctx.base_k[il], self.base_rank) for il in range(n_layer)]
        base_v = [self._compress(ctx.base_v[il], self.base_rank) for il in range(n_layer)]
        dk = [self._compress(ctx.exact_k[il] - ctx.base_k[il], self.rank) for il in range(n_layer)]
        dv = [self._compress(ctx.exact_v[il] - ctx.base_v[il], self.rank) for il in range(n_layer)]
        if existing is None:
            if len(pool) > self.max_anchors:  # "more than" before inserting: a steady pool holds max + 1
                oldest = list(pool.items())[: self.window]
                victim = min(oldest, key=lambda kv: kv[1].count)[0]  # min() keeps the first (oldest) on ties
                del pool[victim]
            existing = pool[ctx.message] = _Anchor(base_k, base_v, ctx.base_k.shape[1])
        else:  # the spec's quirk: the last dense writer's base overwrites the entry's base
            existing.base_k, existing.base_v, existing.length = base_k, base_v, ctx.base_k.shape[1]
        existing.deltas[ctx.reader] = (dk, dv)
        return True

    def correction(self, ctx: EdgeContext) -> Factors | None:
        pool = self.pools.get(ctx.ph, OrderedDict())
        anchors = [a for a in pool.values() if ctx.reader in a.deltas]  # the "consume invariant"
        n_layer, n, kd = ctx.base_k.shape
        if not anchors or n == 0:
            return None
        full = [a for a in anchors if a.length >= n]
        if full:
            anchors, cover = full, n
        else:  # partial coverage: anchors of maximal length correct their first rows only
            cover = max(a.length for a in anchors)
            anchors = [a for a in anchors if a.length == cover]
        dist_k = np.zeros((len(anchors), cover))
        dist_v = np.zeros_like(dist_k)
        for v, a in enumerate(anchors):
            for il in range(n_layer):
                dist_k[v] += np.abs(ctx.base_k[il, :cover] - _expand(a.base_k[il])[:cover]).mean(1)
                dist_v[v] += np.abs(ctx.base_v[il, :cover] - _expand(a.base_v[il])[:cover]).mean(1)
        wk, wv = _softmax_neg(dist_k / n_layer), _softmax_neg(dist_v / n_layer)
        dk = np.zeros((n_layer, n, kd), np.float32)
        dv = np.zeros_like(dk)
        for v, a in enumerate(anchors):
            ak, av = a.deltas[ctx.reader]
            for il in range(1, n_layer):
                dk[il, :cover] += wk[v][:, None] * _expand(ak[il])[:cover]
                dv[il, :cover] += wv[v][:, None] * _expand(av[il])[:cover]
        return dense_to_correction(dk, dv)

    def state_bytes(self) -> int:
        total = 0
        for pool in self.pools.values():
            for a in pool.values():
                total += sum(_nbytes(x) for x in a.base_k + a.base_v)
                total += sum(_nbytes(x) for dk, dv in a.deltas.values() for x in dk + dv)
        return total


def _softmax_neg(d: np.ndarray) -> np.ndarray:
    """softmax over axis 0 of -d (temperature 1)."""
    e = np.exp(-(d - d.min(axis=0, keepdims=True)))
    return (e / e.sum(axis=0, keepdims=True)).astype(np.float32)
