"""The exact prefix cache: KV rows of token prefixes computed once per model and reused by any later prompt that
starts with them, across sessions, workflows and server requests.

An entry is an engine sequence holding the rows of a run of token ids (an agent's template prefix, a completion's
prompt). A new prompt is matched against the entries of its namespace by its longest common token prefix (chained
hashes of 16-token blocks find the candidates, a token-by-token comparison extends the match), forks the entry (no
copy: the fork reads the entry's blocks), keeps the matched rows and computes the rest.

Contracts:
- Exact: rows served from the cache equal the rows a fresh one-piece prefill computes. The engine computes an
  append of fewer than plan.MIN_CHUNK_ROWS rows with its decode kernels, which round differently from its prefill
  kernels, so a match is shortened until the rest is at least that long (or nothing is left to compute), and an
  entry remembers how many of its leading rows came from prefill kernels (`exact`); only those serve other prompts.
  An entry computed as one short piece serves only its own ids (the same rows its computation gives each time).
- Per adapter: rows depend on the LoRA adapter (and scale) the sequence ran with (kvcmas_cpp.adapters). An entry
  records the adapter of the sequence it stores (KVSequence.adapter, at adopt) and serves only a prompt asking for
  the same one (reuse(..., adapter=)): a prefix computed with adapter a never serves adapter b nor the base. (An
  adapter cannot be unloaded while an entry's sequence uses it, so an engine id never names two adapters here.)
- Namespaced: one cache per Model object (so per model file, KV type and activations setting); within it, a prompt
  sees only entries of its own namespace (the server's tenant and cache_salt: one tenant never gets another's rows,
  nor a timing that says another tenant sent the same prompt). Sharing methods do not matter: rows are exact.
- Bounded: least recently used entries are evicted beyond max_bytes (a quarter of the KV budget by default, counted
  as `tokens`, the distinct rows, times the row size: rows two entries share count once), and on demand (evict_lru:
  the server's admission evicts before it would refuse a request). Entries never hold rows a request generates.
  With `owners` > 1 (a server's tenants) each owner has max_bytes / owners of it and its entries make room only by
  evicting its own, so what one tenant sends never evicts another's entries (only evict_lru, under KV memory
  pressure, takes any owner's). A namespace "OWNER/REST" belongs to OWNER; one without "/" to the owner "".
- Counted: `tokens` is the distinct rows the entries hold. An entry made from a fork of another (reuse, then adopt)
  reads that one's first rows instead of holding its own; those rows stay alive while any entry reads them, an
  evicted entry's included.
- Thread-safe: one lock guards the index; rows are computed outside it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._native import KvcmasError
from .kv_budget import KVBudget
from .model import KVSequence, Model
from .plan import MIN_CHUNK_ROWS, Append, Plan, run_plan

BLOCK = 16  # tokens per hashed block of the index
BASE: tuple[int, float] = (-1, 0.0)  # the adapter key of sequences that run the base model


def adapter_key(adapter: tuple[int, float] | None) -> tuple[int, float]:
    """The key of (engine adapter id, scale) as KVSequence.adapter reports it: the scale rounded to the engine's
    float32, and every base-model pair (id -1, or scale 0: no update) the one key BASE."""
    if adapter is None:
        return BASE
    aid, scale = int(adapter[0]), float(np.float32(adapter[1]))
    return BASE if aid < 0 or scale == 0.0 else (aid, scale)


@dataclass(eq=False)
class _Entry:
    namespace: str
    adapter: tuple[int, float]  # adapter_key of the rows' adapter
    ids: tuple[int, ...]
    seq: KVSequence
    exact: int  # leading rows computed by prefill kernels (equal to a one-piece prefill's)
    hashes: list[int]
    parent: _Entry | None = None  # the entry whose rows [0, shared) this one's sequence reads (it was forked from it)
    shared: int = 0
    live: bool = True  # False once evicted (its rows may live on in entries forked from it)


def _block_hashes(ids: Sequence[int]) -> list[int]:
    """Chained hashes of the full BLOCK-token blocks of ids: element k names ids[: (k + 1) * BLOCK]."""
    out: list[int] = []
    h = 0
    for k in range(len(ids) // BLOCK):
        h = hash((h, tuple(ids[k * BLOCK : (k + 1) * BLOCK])))
        out.append(h)
    return out


def _owner(namespace: str) -> str:
    """Whose share of the cache a namespace's entries take: the part before "/" ("" without one)."""
    return namespace.split("/", 1)[0] if "/" in namespace else ""


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
        self.budget = KVBudget(model)
        self.max_bytes = max_bytes if max_bytes is not None else self.budget.budget // 4
        self._lock = threading.RLock()
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._by_key: dict[tuple[str, tuple[int, float], tuple[int, ...]], _Entry] = {}
        self._index: dict[tuple[str, tuple[int, float], int], dict[_Entry, None]] = {}
        self.hits = 0  # prompts that reused rows
        self.hit_tokens = 0  # rows served
        self.evictions = 0
        self.owners = 1  # max_bytes is split evenly among this many owners (the server's tenants)
        self.version = 0  # bumped whenever an entry comes or goes (callers memoize matches on it)
        # sequences reuse() forked from an entry -> (that entry, rows kept): adopt() records where their rows live
        self._forks: weakref.WeakKeyDictionary[KVSequence, tuple[_Entry, int]] = weakref.WeakKeyDictionary()
        self._ghosts: set[_Entry] = set()  # evicted entries whose own rows two or more entries still read

    @staticmethod
    def of(model: Model) -> PrefixCache:
        """The model's prefix cache (made on first use; sessions and the server share it). It lives as long as the
        model: an attribute of it (its entries' sequences refer to the model, so a table keyed by the model would
        keep it alive for good; the cycle goes with the model)."""
        with _caches_lock:
            cache = model.extensions.get("prefix_cache")
            if not isinstance(cache, PrefixCache):
                cache = model.extensions["prefix_cache"] = PrefixCache(model)
            return cache

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def tokens(self) -> int:
        """Distinct KV rows the entries hold: rows an entry reads from the entry it was forked from count once (and
        still count when that one was evicted, as long as an entry reads them)."""
        with self._lock:
            return self._distinct_rows()

    def _distinct_rows(self, owner: str | None = None) -> int:
        """`tokens` (lock held); of one owner's entries only when given (entries fork only within a namespace)."""
        children: dict[_Entry, list[_Entry]] = {}
        nodes: dict[_Entry, None] = {}
        for e in self._lru if owner is None else [e for e in self._lru if _owner(e.namespace) == owner]:
            node: _Entry | None = e
            while node is not None and node not in nodes:
                nodes[node] = None
                if node.parent is not None:
                    children.setdefault(node.parent, []).append(node)
                node = node.parent
        cover: dict[_Entry, int] = {}  # rows [0, cover) of a node's sequence some live entry reads

        def covered(n: _Entry) -> int:
            if n not in cover:
                below = [min(c.shared, covered(c)) for c in children.get(n, [])]
                cover[n] = max([len(n.ids) if n.live else 0, *below])
            return cover[n]

        return sum(max(0, covered(n) - (n.shared if n.parent is not None else 0)) for n in nodes)

    def cached_rows(self, namespace: str, ids: Sequence[int], adapter: tuple[int, float] | None = None) -> int:
        """How many rows reuse(namespace, ids, adapter=adapter) would serve now (no side effects): what a prompt
        need not compute."""
        with self._lock:
            return self._usable(namespace, adapter_key(adapter), [int(t) for t in ids], True)[1]

    def _match(self, namespace: str, adapter: tuple[int, float], ids: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry of the namespace and adapter key with the longest common prefix with ids, and its length (lock
        held)."""
        same = self._by_key.get((namespace, adapter, tuple(ids)))
        if same is not None:
            return same, len(ids)
        candidates: dict[_Entry, None] | None = None
        for h in _block_hashes(ids):
            found = self._index.get((namespace, adapter, h))
            if not found:
                break
            candidates = found
        best, best_m = None, 0
        for e in candidates or ():
            m = _common(e.ids, ids)  # also rules out hash collisions
            if m > best_m:
                best, best_m = e, m
        return best, best_m

    def reuse(
        self, namespace: str, ids: Sequence[int], rest: bool = True, adapter: tuple[int, float] | None = None
    ) -> tuple[KVSequence, int]:
        """A new sequence (the caller owns it) running `adapter` ((engine id, scale) as KVSequence.adapter; None:
        the base model) and holding the first m rows of ids served from the cache by entries of that adapter, and m
        (0: an empty sequence). rest: the caller appends ids[m:] and needs at least one row of it (for logits); m is
        chosen so that the rest is empty (only when not `rest`) or at least MIN_CHUNK_ROWS long (exactness)."""
        ids = [int(t) for t in ids]
        key = adapter_key(adapter)
        with self._lock:
            entry, m = self._usable(namespace, key, ids, rest)
            if entry is None:
                seq = self.model.new_sequence()
                if key != BASE:
                    seq.set_adapter(*key)
                return seq, 0
            seq = entry.seq.fork()
            self._forks[seq] = (entry, m)
            self._lru.move_to_end(entry)
            self.hits += 1
            self.hit_tokens += m
        if len(seq) > m:
            seq.truncate(m)
        return seq, m

    def _usable(
        self, namespace: str, adapter: tuple[int, float], ids: list[int], rest: bool
    ) -> tuple[_Entry | None, int]:
        """reuse()'s choice (lock held): the entry to fork and the rows to keep, or (None, 0)."""
        n = len(ids)
        entry, m = self._match(namespace, adapter, ids) if ids and min(ids) >= 0 else (None, 0)
        if entry is not None and not (not rest and m == n == len(entry.ids)):  # else: the same short key
            m = min(m, entry.exact)
            if rest or m < n:
                m = min(m, n - MIN_CHUNK_ROWS)
        return (entry, m) if entry is not None and m > 0 else (None, 0)

    # ------------------------------------------------------------------------------------------------ storing
    def adopt(self, namespace: str, seq: KVSequence, exact: int) -> KVSequence:
        """Stores seq (all its rows: token ids >= 0) as an entry, keyed by the adapter it runs (KVSequence.adapter),
        and returns a fork of it for the caller to go on with (its appends never touch the entry's rows); seq itself
        when it is not stored (another entry holds its ids already, it does not fit max_bytes, or it holds input
        vectors). exact: its leading rows computed by prefill kernels (see the module's docstring)."""
        ids = tuple(seq.tokens)
        if not ids or min(ids) < 0 or self.budget.rows_bytes(len(ids)) > self._owner_bytes():
            return seq
        key = adapter_key(seq.adapter)
        with self._lock:
            entry, m = self._match(namespace, key, ids)
            if entry is not None and m == len(ids) and (entry.exact >= m or len(entry.ids) == m):
                self._lru.move_to_end(entry)  # an entry serves these ids already
                return seq
            if entry is not None and len(entry.ids) == m == len(ids):
                self._drop(entry)  # the same ids, fewer exact rows: replaced
            new = _Entry(namespace, key, ids, seq, min(exact, len(ids)), _block_hashes(ids))
            origin = self._forks.pop(seq, None)
            if origin is not None:  # its first rows are the entry's it was forked from
                new.parent, new.shared = origin[0], min(origin[1], len(ids))
            self.version += 1
            self._lru[new] = None
            self._by_key[(namespace, key, ids)] = new
            for h in new.hashes:
                self._index.setdefault((namespace, key, h), {})[new] = None
            self._shrink(keep=new)
            return seq.fork()

    def prefix(
        self, namespace: str, ids: Sequence[int], adapter: tuple[int, float] | None = None
    ) -> tuple[KVSequence, int]:
        """plan_prefix run to its end here."""
        return run_plan(self.plan_prefix(namespace, ids, adapter))

    def plan_prefix(
        self, namespace: str, ids: Sequence[int], adapter: tuple[int, float] | None = None
    ) -> Plan[tuple[KVSequence, int]]:
        """The plan (kvcmas_cpp.plan) of a new sequence (the caller owns it) running `adapter` (None: the base)
        and holding exactly ids; returns it and how many of its rows came from the cache. The rest is computed
        (one append of at least MIN_CHUNK_ROWS rows, or the whole of ids) and stored. What an agent's template prefix
        comes from. The engine refusing for lack of KV memory evicts every entry and tries again once."""
        ids = [int(t) for t in ids]
        for attempt in (0, 1):
            seq, m = self.reuse(namespace, ids, rest=False, adapter=adapter)
            try:
                if len(ids) > m:
                    yield Append(seq, ids[m:], "none")
            except KvcmasError:
                seq.close()
                if attempt or not self.clear():
                    raise
                continue
            except BaseException:
                seq.close()
                raise
            short = 0 < len(ids) - m < MIN_CHUNK_ROWS
            return self.adopt(namespace, seq, m if short else len(ids)), m
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------------ eviction
    def _prune(self, g: _Entry | None) -> None:
        """An evicted entry stays (a ghost, for `tokens`) only while two or more entries read rows of its own; with
        one, that one takes its place under its parent; with none, its parent may lose a reader in turn."""
        while g is not None and not g.live:
            readers = [x for x in (*self._lru, *self._ghosts) if x.parent is g]
            if len(readers) >= 2:
                self._ghosts.add(g)
                return
            self._ghosts.discard(g)
            for c in readers:
                c.shared = min(c.shared, g.shared) if g.parent is not None else 0
                c.parent = g.parent
            g = None if readers else g.parent

    def _drop(self, e: _Entry) -> None:
        self.version += 1
        e.live = False
        self._lru.pop(e, None)
        if self._by_key.get((e.namespace, e.adapter, e.ids)) is e:
            del self._by_key[(e.namespace, e.adapter, e.ids)]
        for h in e.hashes:
            bucket = self._index.get((e.namespace, e.adapter, h))
            if bucket is not None:
                bucket.pop(e, None)
                if not bucket:
                    del self._index[(e.namespace, e.adapter, h)]
        e.seq.close()  # its blocks go back once no fork reads them
        self._prune(e)

    def _owner_bytes(self) -> int:
        return self.max_bytes // max(1, self.owners)

    def _shrink(self, keep: _Entry) -> None:
        """Evicts the least recently used entries of keep's owner (never `keep`) until that owner's distinct rows fit
        its share of max_bytes; then, should more owners than `owners` hold entries, any owner's until all fit."""
        owner = _owner(keep.namespace)
        for limit, of in ((self._owner_bytes(), owner), (self.max_bytes, None)):
            for e in list(self._lru):
                if self.budget.rows_bytes(self._distinct_rows(of)) <= limit:
                    break
                if e is not keep and (of is None or _owner(e.namespace) == of):
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

    def forget(self, namespace: str) -> int:
        """Drops every entry of one namespace (an idle one aging out); returns how many there were."""
        with self._lock:
            mine = [e for e in self._lru if e.namespace == namespace]
            for e in mine:
                self._drop(e)
            return len(mine)

    def clear(self) -> int:
        """Drops every entry; returns how many there were."""
        with self._lock:
            n = len(self._lru)
            for e in list(self._lru):
                self._drop(e)
            return n
