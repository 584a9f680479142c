"""The anchor-pool estimators (`kvcmas-ref` at rank 32, `kvcomm` at full rank): the reference code's anchor pool,
per-token softmax weights of negative mean |base distance|, entropy reuse gate, LFU-in-window eviction."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .estimator_base import EdgeContext, Estimator
from .factors import Factors, dense_to_correction, rsvd


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
