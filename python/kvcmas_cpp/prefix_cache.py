"""The exact prefix cache: KV rows of token prefixes computed once per model and reused by any later prompt that
starts with them, across sessions, workflows and server requests.

An entry is an engine sequence holding the rows of a run of token ids (an agent's template prefix, a completion's
prompt). A new prompt is matched against the entries of its namespace by its longest common token prefix (chained
hashes of 16-token blocks find the candidates, a token-by-token comparison extends the match), forks the entry (no
copy: the fork reads the entry's blocks), keeps the matched rows and computes the rest.

Contracts:
- Exact: rows served from the cache equal the rows a fresh one-piece prefill computes. The engine computes an
  append of fewer than agents.MIN_CHUNK_ROWS rows with its decode kernels, which round differently from its prefill
  kernels, so a match is shortened until the rest is at least that long (or nothing is left to compute), and an
  entry remembers how many of its leading rows came from prefill kernels (`exact`); only those serve other prompts.
  An entry computed as one short piece serves only its own ids (the same rows its computation gives each time).
- Namespaced: one cache per Model object (so per model file, KV type and activations setting); within it, a prompt
  sees only entries of its own namespace (the server's tenant and cache_salt: one tenant never gets another's rows,
  nor a timing that says another tenant sent the same prompt). Sharing methods do not matter: rows are exact.
- Bounded: least recently used entries are evicted beyond max_bytes (a quarter of the KV budget by default, counted
  as every entry's tokens times the row size, rows two entries share counted for each), and on demand (evict_lru:
  the server's admission evicts before it would refuse a request). Entries never hold rows a request generates.
- Thread-safe: one lock guards the index; rows are computed outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ._native import KvcmasError
from .model import KVSequence, Model

BLOCK = 16  # tokens per hashed block of the index


@dataclass(eq=False)
class _Entry:
    namespace: str
    ids: tuple[int, ...]
    seq: KVSequence
    exact: int  # leading rows computed by prefill kernels (equal to a one-piece prefill's)
    hashes: list[int]


def _block_hashes(ids: Sequence[int]) -> list[int]:
    """Chained hashes of the full BLOCK-token blocks of ids: element k names ids[: (k + 1) * BLOCK]."""
    out: list[int] = []
    h = 0
    for k in range(len(ids) // BLOCK):
        h = hash((h, tuple(ids[k * BLOCK : (k + 1) * BLOCK])))
        out.append(h)
    return out


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_caches_lock = threading.Lock()


class PrefixCache:
    """Exact KV rows of token prefixes for one model (see the module's docstring). Use PrefixCache.of(model)."""

    def __init__(self, model: Model, max_bytes: int | None = None) -> None:
        self.model = model
        budget = int(getattr(model._core, "kv_budget", 0) or 0)
        self.max_bytes = max_bytes if max_bytes is not None else budget // 4
        self._lock = threading.RLock()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._by_key: dict[tuple[str, tuple[int, ...]], _Entry] = {}
        self._index: dict[tuple[str, int], dict[_Entry, None]] = {}
        self.hits = 0  # prompts that reused rows
        self.hit_tokens = 0  # rows served
        self.evictions = 0

    @staticmethod
    def of(model: Model) -> PrefixCache:
        """The model's prefix cache (made on first use; sessions and the server share it). It lives as long as the
        model: an attribute of it (its entries' sequences refer to the model, so a table keyed by the model would
        keep it alive for good; the cycle goes with the model)."""
        with _caches_lock:
            cache = model._prefix_cache
            if not isinstance(cache, PrefixCache):
                cache = model._prefix_cache = PrefixCache(model)
            return cache

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def tokens(self) -> int:
        """Tokens the entries hold (a run two entries share is counted for each)."""
        with self._lock:
            return sum(len(e.ids) for e in self._lru)

    def _match(self, namespace: str, ids: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry of the namespace with the longest common prefix with ids, and its length (lock held)."""
        key = (namespace, tuple(ids))
        same = self._by_key.get(key)
        if same is not None:
            return same, len(ids)
        candidates: dict[_Entry, None] | None = None
        for h in _block_hashes(ids):
            found = self._index.get((namespace, h))
            if not found:
                break
            candidates = found
        best, best_m = None, 0
        for e in candidates or ():
            m = _common(e.ids, ids)  # also rules out hash collisions
            if m > best_m:
                best, best_m = e, m
        return best, best_m

    def reuse(self, namespace: str, ids: Sequence[int], rest: bool = True) -> tuple[KVSequence, int]:
        """A new sequence (the caller owns it) holding the first m rows of ids served from the cache, and m (0: an
        empty sequence). rest: the caller appends ids[m:] and needs at least one row of it (for logits); m is
        chosen so that the rest is empty (only when not `rest`) or at least MIN_CHUNK_ROWS long (exactness)."""
        from .agents import MIN_CHUNK_ROWS  # here: agents imports this module

        ids = [int(t) for t in ids]
        n = len(ids)
        with self._lock:
            entry, m = self._match(namespace, ids) if ids and min(ids) >= 0 else (None, 0)
            if entry is not None and not (not rest and m == n == len(entry.ids)):  # else: the same short key
                m = min(m, entry.exact)
                if rest or m < n:
                    m = min(m, n - MIN_CHUNK_ROWS)
            if entry is None or m <= 0:
                return self.model.new_sequence(), 0
            seq = entry.seq.fork()
            self._lru.move_to_end(entry)
            self.hits += 1
            self.hit_tokens += m
        if len(seq) > m:
            seq.truncate(m)
        return seq, m

    # ------------------------------------------------------------------------------------------------ storing
    def adopt(self, namespace: str, seq: KVSequence, exact: int) -> KVSequence:
        """Stores seq (all its rows: token ids >= 0) as an entry and returns a fork of it for the caller to go on
        with (its appends never touch the entry's rows); seq itself when it is not stored (another entry holds its
        ids already, it does not fit max_bytes, or it holds input vectors). exact: its leading rows computed by
        prefill kernels (see the module's docstring)."""
        ids = tuple(seq.tokens)
        if not ids or min(ids) < 0 or len(ids) * self.model.kv_row_bytes > self.max_bytes:
            return seq
        with self._lock:
            entry, m = self._match(namespace, ids)
            if entry is not None and m == len(ids) and (entry.exact >= m or len(entry.ids) == m):
                self._lru.move_to_end(entry)  # an entry serves these ids already
                return seq
            if entry is not None and len(entry.ids) == m == len(ids):
                self._drop(entry)  # the same ids, fewer exact rows: replaced
            new = _Entry(namespace, ids, seq, min(exact, len(ids)), _block_hashes(ids))
            self._lru[new] = None
            self._by_key[(namespace, ids)] = new
            for h in new.hashes:
                self._index.setdefault((namespace, h), {})[new] = None
            self._shrink(keep=new)
            return seq.fork()

    def prefix(self, namespace: str, ids: Sequence[int]) -> tuple[KVSequence, int]:
        """A new sequence (the caller owns it) holding exactly ids, and how many of its rows came from the cache;
        the rest is computed here (in pieces of at least MIN_CHUNK_ROWS rows) and stored. What an agent's template
        prefix comes from. The engine refusing for lack of KV memory evicts every entry and tries again once."""
        from .agents import MIN_CHUNK_ROWS, chunk_bounds
        from .model import PROMPT_CHUNK

        ids = [int(t) for t in ids]
        for attempt in (0, 1):
            seq, m = self.reuse(namespace, ids, rest=False)
            try:
                for a, b in chunk_bounds(len(ids) - m, PROMPT_CHUNK):
                    seq.append(ids[m + a : m + b], logits="none")
            except KvcmasError:
                seq.close()
                if attempt or not self.clear():
                    raise
                continue
            short = 0 < len(ids) - m < MIN_CHUNK_ROWS
            return self.adopt(namespace, seq, m if short else len(ids)), m
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------------ eviction
    def _drop(self, e: _Entry) -> None:
        self._lru.pop(e, None)
        if self._by_key.get((e.namespace, e.ids)) is e:
            del self._by_key[(e.namespace, e.ids)]
        for h in e.hashes:
            bucket = self._index.get((e.namespace, h))
            if bucket is not None:
                bucket.pop(e, None)
                if not bucket:
                    del self._index[(e.namespace, h)]
        e.seq.close()  # its blocks go back once no fork reads them

    def _shrink(self, keep: _Entry | None = None) -> None:
        row = self.model.kv_row_bytes
        total = sum(len(e.ids) for e in self._lru)
        for e in list(self._lru):
            if total * row <= self.max_bytes:
                break
            if e is not keep:
                total -= len(e.ids)
                self._drop(e)
                self.evictions += 1

    def evict_lru(self) -> bool:
        """Drops the least recently used entry; False when there is none."""
        with self._lock:
            if not self._lru:
                return False
            self._drop(next(iter(self._lru)))
            self.evictions += 1
            return True

    def clear(self) -> int:
        """Drops every entry; returns how many there were."""
        with self._lock:
            n = len(self._lru)
            for e in list(self._lru):
                self._drop(e)
            return n
