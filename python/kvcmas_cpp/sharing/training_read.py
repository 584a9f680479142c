"""Training reads: the exact rows of a span in a reader's context, paired with the base view the reader read,
folded into the ridge estimator's statistics of the edge, then the fit. Run after the reply, in small steps, off the
reply's path (an idle worker, a server's scheduler, a session's close)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..model import KVSequence, Model, SharedKV
from ..plan import chunk_bounds, run_plan
from .assemble import append_mixed
from .blas_threads import single_threaded_blas
from .estimator_base import Edge, Estimator, LearnsFromReads
from .span import Span
from .state import RequestState


def canonical(model: Model, seq: KVSequence, pos: int, n: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's view of span rows [first, first + n) of the span starting at pos, keys rotated back to span
    positions first..first+n-1 (the canonical frame)."""
    k, v = seq.kv(pos + first, n)
    k = np.stack([model.rope_rotate(k[il], -pos, il) for il in range(k.shape[0])])
    return k, v


TRAINING_READ_ROWS = 512  # a training read goes into the ridge statistics in pieces of this many span rows

# What a cold-reuse training read appends after its prefix: prompt ids it computes, or stored rows it appends by
# reference (SharedKV, the core KvCorrection the reader read them with or None, that correction's first row).
ReadPiece = list[int] | tuple[SharedKV, Any, int]


@dataclass
class ReadPart:
    """One span of a training read: its edge, the view the reader read it from (base) and where its exact rows sit."""

    ph: str
    edge: Edge
    base_seq: KVSequence
    base_pos: int
    pos: int  # the exact rows' position in the read's source
    n: int
    chain: Span | None = None  # the span the exact rows replace if it is still current (cold reuse, chained)
    whole: bool = True  # the n rows are all of the span's rows after the head (False: its first n, a bounded read)


class TrainingRead:
    """One hop's training reads for the ridge estimator's calibrating edges, run after the hop's reply in small steps
    (step()), so a caller can keep them off every reply's path: a server runs one step at a time between other work.

    A read owns forks of what it reads (the base views, and its source: the dense hop's sequence or, under cold
    reuse, the agent's template prefix it computes the span's exact rows after, `rows` of them, in chunks of
    `chunk` rows), so it stays valid whatever the session does meanwhile. Its steps: the exact rows' chunks, then the
    rows folded into the edges' statistics TRAINING_READ_ROWS at a time, then the edges that hold their
    `calibrate` reads are fitted (`fitted`). When the read is done, its exact rows continue the chain of a span
    no later reader has moved (they go to st.owned, which the caller closes), and on_done(read) is
    called. close() drops a read not run to its end (`dropped`) and frees what it holds. Each step runs inside
    lock() (the session's and the estimator's locks); detach() cuts it from its session's state (the read still
    teaches the estimator)."""

    def __init__(
        self,
        model: Model,
        estimator: Estimator,
        calibrate: int,
        st: RequestState,
        parts: list[ReadPart],
        source: KVSequence,
        computes: bool,
    ) -> None:
        """calibrate: the reads an edge is fitted after (MethodConfig.calibrate)."""
        self.model: Model | None = model
        self.st: RequestState | None = st
        self.estimator, self.calibrate = estimator, calibrate
        self.vectors, self.vector_pos = st.vectors, st.vector_pos
        self.bidirectional = st.bidirectional
        self.source = source  # this read's own sequence
        bases: dict[int, KVSequence] = {}
        for part in parts:  # a fork per base view (no copy), shared by the parts that read the same one
            part.base_seq = bases.setdefault(id(part.base_seq), part.base_seq.fork())
        self._bases = list(bases.values())
        self.parts = parts
        self.computes = computes
        # cold reuse: what the read appends after its prefix, in order: prompt ids to compute, or (rows, correction,
        # first correction row) appended by reference (the rest of a span a sampled read reads only the start of)
        self.pieces: list[ReadPiece] = []
        self.rows = 0  # rows the read computes (cold reuse), set with pieces
        self.fit = True  # fit the edges that hold their reads (not when a benchmark gathers examples to fit later)
        self.chunk = 1 << 30  # rows per step of the exact rows' computation
        self.fitted: list[Edge] = []
        self.ms = 0.0  # time its steps took, wherever they ran (a call's path, an idle worker, close())
        self.steps = 0  # steps run so far
        self.kept = False  # its exact rows continue a chain (the source went to st.owned)
        self.done = self.dropped = False
        self.lock: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.on_done: Callable[[TrainingRead], None] | None = None
        self._steps: Iterator[None] | None = None

    def step(self, when: Callable[[], bool] | None = None) -> bool:
        """Runs the next step; returns whether steps are left. when: checked once the locks are held; False runs
        nothing (an idle worker's test that no call has started meanwhile)."""
        if self.done or self.dropped:
            return False
        with self.lock():
            if self.done or self.dropped:  # run to its end by another thread while this one waited for the locks
                return False
            if when is not None and not when():
                return True
            start = time.perf_counter()
            if self._steps is None:
                self._steps = self._run()
            try:
                next(self._steps)
                return True
            except StopIteration:
                pass
            except BaseException:
                self.close()
                raise
            finally:
                self.ms += (time.perf_counter() - start) * 1000.0
                self.steps += 1
            self.done = True
            self._free(keep_source=self.kept)
            if self.on_done is not None:
                self.on_done(self)
            self._cut()
        return False

    def run(self) -> list[Edge]:
        """Runs the read to its end; returns the edges it fitted."""
        while self.step():
            pass
        return self.fitted

    def detach(self) -> None:
        """Cuts the read from its session's state: its rows then continue no chain."""
        self.st = None

    def close(self) -> None:
        """Drops a read that has not run to its end (counted by the caller as `dropped`) and frees its sequences."""
        if not self.done and not self.dropped:
            self.dropped = True
            self._steps = None
            self._free(keep_source=False)
            self._cut()

    def _free(self, keep_source: bool) -> None:
        for s in self._bases + ([] if keep_source else [self.source]):
            s.close()
        self._bases, self.pieces = [], []
        self.model = None

    def _cut(self) -> None:
        """Lets go of everything a finished read refers to: its parts' spans hold stored rows (SharedKV) and its
        callbacks the session, so a read still referenced (an idle worker's queue, a caller's list) keeps no KV and
        no session alive, and forms no reference cycle through them."""
        self.parts, self.st, self.vectors, self.vector_pos = [], None, None, None
        self.lock, self.on_done = contextlib.nullcontext, None

    def _run(self) -> Iterator[None]:
        model = self.model
        assert model is not None
        n0, computed = len(self.source), 0
        for piece in self.pieces:
            if isinstance(piece, tuple):
                shared, kc, row0 = piece
                self.source.append_shared(shared, kc, row0)
                continue
            # an image whose rows attend to each other (Gemma 3) is computed in one piece
            bidi = any(t < 0 and self.bidirectional[-t - 1] for t in piece)
            for a, b in chunk_bounds(len(piece), max(self.chunk, len(piece)) if bidi else self.chunk):
                run_plan(
                    append_mixed(self.source, piece[a:b], "none", self.vectors, self.bidirectional, self.vector_pos)
                )
                computed += b - a
                yield
        assert computed == self.rows and len(self.source) >= n0 + computed
        e = cast(LearnsFromReads, self.estimator)
        for part in self.parts:
            for r0 in range(0, part.n, TRAINING_READ_ROWS):
                if self.fit and not e.calibrating(part.edge):
                    break  # another read completed the edge meanwhile
                nr = min(TRAINING_READ_ROWS, part.n - r0)
                with single_threaded_blas():
                    base_k, base_v = canonical(model, part.base_seq, part.base_pos, nr, r0)
                    ex_k, ex_v = canonical(model, self.source, part.pos, nr, r0)
                    e.add_rows(part.edge, base_k, base_v, ex_k, ex_v)
                yield
            else:
                e.end_read(part.edge, None if part.whole else part.n)  # the maps apply to the rows read
        if self.fit:  # an edge per step: a step is what a call arriving meanwhile may wait for
            for edge in dict.fromkeys(part.edge for part in self.parts):
                if e.examples(edge) >= self.calibrate:
                    self.fitted += e.fit([edge])
                    yield
        st = self.st
        if st is not None and self.computes:
            for part in self.parts:
                if part.chain is not None and st.spans.get(part.ph) is part.chain:
                    shared = self.source.share(part.pos, part.n)
                    chain = part.chain
                    st.spans[part.ph] = chain.with_rows(shared, None, part.pos, self.source, part.pos, chain.view_agent)
                    self.kept = True
            if self.kept:
                st.owned.append(self.source)
