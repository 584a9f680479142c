"""The span index of an agent session: the spans it holds found again by their ids, by the text their client
received, and by runs of their tokens inside other messages; and the least-recently-used order its KV bound evicts
stored spans in.

Stored spans are indexed by their aligned token blocks of RUN_BLOCK tokens: a common run of MIN_PIECE_TOKENS tokens,
at any offset, holds a whole aligned block (2 * RUN_BLOCK - 1 <= MIN_PIECE_TOKENS), which is then extended both ways.
The index is one session's (one model, one method, one tenant's workflow), so no run matches across them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .span import Span
from .state import RequestState

# Inside a bigger message, a paragraph becomes its own span, and a span the session holds is found again, only from
# this many tokens on: shorter runs cost more in exact head and tail rows than reusing them saves.
MIN_PIECE_TOKENS = 16
RUN_BLOCK = MIN_PIECE_TOKENS // 2


@dataclass(frozen=True)
class Run:
    """A run of a message's ids (starting at `at`) equal to the ids of a stored span from `offset` on: read from that
    span's stored rows (a sub-run span, WorkflowRunner.sub_span)."""

    span: str
    offset: int
    ids: tuple[int, ...]
    at: int


class SpanIndex:
    """Where a session finds the spans it holds (see the module's docstring). `runs`: placeholders of sub-runs live
    prompts read (never indexed themselves)."""

    def __init__(self) -> None:
        self.by_ids: dict[tuple[int, ...], str] = {}
        # A reply's text -> its placeholder: a client sends a reply back as text, whose tokens need not be the
        # generated ones (a model may generate a non-canonical tokenization); the text still names the span.
        self.by_text: dict[str, str] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()  # stored spans, least recently used first
        self.runs: set[str] = set()
        self._blocks: dict[tuple[int, ...], list[tuple[str, int]]] = {}  # aligned block -> (placeholder, offset)
        self._indexed: set[str] = set()

    def add(self, span: Span) -> None:
        """A span the session holds, found again by its ids (the first span with those ids keeps them)."""
        self.by_ids.setdefault(tuple(span.ids), span.ph)

    def name_text(self, text: str, ph: str) -> None:
        """The text a client received for span ph names it too (the first span with that text keeps it)."""
        self.by_text.setdefault(text, ph)

    def lookup(self, ids: list[int], content: Any) -> str | None:
        """The placeholder of a span the session holds already: by the content's ids, or a reply by the text its
        client received (also when it comes back with surrounding whitespace trimmed or added)."""
        ph = self.by_ids.get(tuple(ids))
        if ph is None and isinstance(content, str):
            ph = self.by_text.get(content) or self.by_text.get(content.strip())
        return ph

    # -------------------------------------------------------------------------------------------------- LRU
    def touch(self, ph: str) -> None:
        """A prompt read span ph: it is evicted last."""
        if ph in self.lru:
            self.lru.move_to_end(ph)

    def stored(self, ph: str) -> None:
        """Span ph holds stored rows now (most recently used)."""
        self.lru[ph] = None
        self.lru.move_to_end(ph)

    def pop_lru(self) -> str | None:
        """The least recently used stored span, taken out of the order; None when none is left."""
        return self.lru.popitem(last=False)[0] if self.lru else None

    # -------------------------------------------------------------------------------------------------- runs
    def stored_runs(self, ids: list[int], st: RequestState, observes_dense: bool) -> list[Run]:
        """Runs of at least MIN_PIECE_TOKENS of `ids` equal to ids of spans st holds stored rows of, left to right,
        each the longest such run where it starts: a hit of an aligned RUN_BLOCK-token block of a stored span,
        extended both ways to the longest common run. Matches compare token ids (a block's hash only finds
        candidates). Empty under an estimator that keeps state per placeholder (observes_dense: anchor pools): a
        run's placeholder is new on every call."""
        if observes_dense:
            return []
        for ph, stored in st.spans.items():
            if ph not in self._indexed and ph not in self.runs and stored.stored and stored.shared is not None:
                self._indexed.add(ph)
                span = stored.ids
                for o in range(0, len(span) - RUN_BLOCK + 1, RUN_BLOCK):
                    self._blocks.setdefault(tuple(span[o : o + RUN_BLOCK]), []).append((ph, o))
        out: list[Run] = []
        lo, i = 0, 0
        while i + RUN_BLOCK <= len(ids):
            best: tuple[int, int, str, int] | None = None  # (start, end, placeholder, offset)
            for ph, o in self._blocks.get(tuple(ids[i : i + RUN_BLOCK]), ()):
                held = st.stored(ph)
                if held is None or held.shared is None:  # evicted
                    continue
                span = held.ids
                a, pa = i, o
                while a > lo and pa > 0 and ids[a - 1] == span[pa - 1]:
                    a, pa = a - 1, pa - 1
                e, pe = i + RUN_BLOCK, o + RUN_BLOCK
                while e < len(ids) and pe < len(span) and ids[e] == span[pe]:
                    e, pe = e + 1, pe + 1
                if best is None or e - a > best[1] - best[0]:
                    best = (a, e, ph, pa)
            if best is not None and best[1] - best[0] >= MIN_PIECE_TOKENS:
                a, e, ph, pa = best
                out.append(Run(ph, pa, tuple(ids[a:e]), a))
                lo = i = e
            else:
                i += 1
        return out
