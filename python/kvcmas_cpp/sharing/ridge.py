"""The ridge estimator (method `kvcmas`): a reduced-rank ridge map base -> delta per (edge, layer), fitted online
from training reads. Its output is naturally factored: delta = (X - mu_x) P Vt + 1 mu_y^T, i.e. A = [(X - mu_x) P,
1], B = [Vt; mu_y] (rank r + 1)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .blas_threads import single_threaded_blas
from .estimator_base import Edge, EdgeContext, Estimator
from .factors import Factors, pad_rank


@dataclass
class RidgeMap:
    """One fitted map. rows (0: every row): it was fitted on span rows [0, rows) only (training reads of a span's
    first MethodConfig.read_rows rows), and rows after those get no delta from it (A's rows are zero there): a map
    fitted on a span's first rows over-corrects the rows after them (held-out residual above 1.0, worse than no
    correction; docs/cold-start.md)."""

    mu_x: np.ndarray  # [kd]
    proj: np.ndarray  # [kd, r]  = W V_r
    vt: np.ndarray  # [r, kd]
    mu_y: np.ndarray  # [kd]
    rows: int = 0

    def factors(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = np.concatenate([(x - self.mu_x) @ self.proj, np.ones((x.shape[0], 1), np.float32)], axis=1)
        if self.rows:
            a[self.rows :] = 0.0
        return a.astype(np.float32), np.concatenate([self.vt, self.mu_y[None]], axis=0).astype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.mu_x.nbytes + self.proj.nbytes + self.vt.nbytes + self.mu_y.nbytes


def fit_ridge_map(x: np.ndarray, y: np.ndarray, rank: int, alpha: float) -> RidgeMap:
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

    def fit(self, rank: int, alpha: float) -> list[RidgeMap]:
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
            RidgeMap(
                self.mu_x[i].astype(np.float32),
                proj[i].astype(np.float32),
                vt[i].astype(np.float32),
                self.mu_y[i].astype(np.float32),
            )
            for i in range(g.shape[0])
        ]


# The ridge strength of maps fitted on a span's first rows only (bounded reads): held out on the next 2K context,
# their residual on the rows they cover is 0.88-0.93 at 10 against 0.94-0.99 at the default 0.1 on SmolLM2-135M, and
# 0.80-0.94 against 0.86-1.21 on Qwen2.5-0.5B (docs/cold-start.md); maps of whole spans keep alpha.
BOUNDED_ALPHA = 10.0


@dataclass
class _EdgeMoments:
    """An edge still calibrating: the moments of its reads (maps 2 * (layer - 1) + {0: K, 1: V} for layers >= 1) and
    how many reads went in."""

    moments: RowMoments
    reads: int = 0
    rows: int = 0  # the most span rows a read covered, when no read covered its whole span
    whole: bool = False  # some read covered every row of its span: the maps apply to every row
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
    persists = True

    def __init__(
        self,
        rank: int = 8,
        alpha: float = 0.1,
        max_pending_bytes: int = 256 << 20,
        max_edges: int = 64,
        bounded_alpha: float = BOUNDED_ALPHA,
    ) -> None:
        """max_pending_bytes: memory of the training statistics of edges still calibrating (a fixed size per edge,
        RowMoments, however long the span and however many reads); past it the statistics of the edge that went
        longest without a read are dropped (a server meets edges that never reach their calibration count). The
        edge being read is always kept. max_edges: fitted edges kept, least recently used dropped beyond it.
        bounded_alpha: the ridge strength of maps fitted on bounded reads only (a span's first rows), at least
        alpha."""
        self.rank, self.alpha, self.bounded_alpha = rank, alpha, max(alpha, bounded_alpha)
        self.max_pending_bytes, self.max_edges = max_pending_bytes, max_edges
        # insertion order = least recently added to first
        self._pending: dict[Edge, _EdgeMoments] = {}
        self.maps: dict[Edge, list[tuple[RidgeMap, RidgeMap] | None]] = {}
        # per edge: the maps list a core copy was made from (identity: refits and loads replace the list) and it
        self._core_maps: dict[Edge, tuple[list[tuple[RidgeMap, RidgeMap] | None], Any]] = {}

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

    def end_read(self, edge: Edge, rows: int | None = None) -> None:
        """Counts one complete training read of the edge (its rows went in through add_rows). rows: the read covered
        only span rows [0, rows) of a longer span (a bounded read); None: it covered every row of its span. The
        maps apply to the rows the reads covered (RidgeMap.rows); one read of a whole span lifts the bound."""
        em = self._pending.get(edge)
        if em is not None:
            em.reads += 1
            if rows is None:
                em.whole = True
            else:
                em.rows = max(em.rows, rows)

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

    def calibration_counts(self) -> tuple[int, int, int]:
        """(fitted edges, calibrating edges without a map, reads gathered for those)."""
        pending = [edge for edge in self._pending if edge not in self.maps]
        return len(self.maps), len(pending), sum(self.examples(edge) for edge in pending)

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
                bounded = bool(em.rows) and not em.whole
                fitted = em.moments.fit(self.rank, self.bounded_alpha if bounded else self.alpha)
            for m in fitted:
                m.rows = 0 if em.whole else em.rows
            maps: list[tuple[RidgeMap, RidgeMap] | None] = [None]
            maps += [(fitted[j], fitted[j + 1]) for j in range(0, len(fitted), 2)]
            self.set_maps(edge, maps)
            done.append(edge)
        return done

    def set_maps(self, edge: Edge, maps: list[tuple[RidgeMap, RidgeMap] | None]) -> None:
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
            core_maps.rows = fitted[0][0].rows
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
            out.append(pad_rank((ak, bk, av, bv)))
        return out

    def state_bytes(self) -> int:
        """The fitted maps, plus their copies in the core (made on first use of an edge)."""
        numpy_maps = sum(mk.nbytes + mv.nbytes for maps in self.maps.values() for m in maps if m for mk, mv in [m])
        return numpy_maps + sum(int(c.bytes) for _, c in self._core_maps.values() if c is not None)
