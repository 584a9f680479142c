"""LoRA adapters in the sharing layer: an agent that runs with its own adapter (issue 49, item 4).

An agent's rows (its template prefix, the spans it computes, its replies, its training reads) are computed with its
adapter at its scale: every sequence of its calls descends from its template prefix, which the prefix cache computes
with the adapter set, and forks inherit it. A span stored by an agent with adapter a and read by an agent
with adapter b is that agent's view: the estimator's edge names both (the reader's identity and that of the agent
whose view it reads carry their adapters' keys, `identity_with`), so a map learned for (a -> b) never corrects
(a -> c), and the exact rows of a training read are the reader's own (its adapter). A base-model agent is an agent
without adapter: its identity is unchanged.

An adapter's key is its file's content (a SHA-256 prefix) and its scale, never the engine's id or the name it was
loaded under: maps persisted for one adapter load again for the same file in another process, under any name.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass

from .. import adapters as lora
from ..model import KVSequence, Model
from ..plan import Plan
from ..prefix_cache import PrefixCache


@dataclass(frozen=True)
class AgentAdapter:
    """The adapter an agent runs with: its name in the model, scale, and key (content hash and scale)."""

    name: str
    scale: float
    key: str  # "lora:<sha256 of the file, 16 hex>*<scale>"

    def engine_id(self, model: Model) -> int:
        """The engine's id of the adapter loaded under `name`, checked to be the same file as when the agent was
        declared (ValueError otherwise: its learned maps would belong to another adapter)."""
        now = agent_adapter(model, self.name, self.scale)
        assert now is not None
        if now.key != self.key:
            raise ValueError(
                f"adapter {self.name!r} was loaded again from another file since the agent was declared; "
                "declare the agent again"
            )
        return lora.lookup(model, self.name).id


_hashes: dict[tuple[str, int, int], str] = {}
_hashes_lock = threading.Lock()


def file_digest(path: str) -> str:
    """The SHA-256 of a file's content (16 hex digits), computed once per (path, size, modification time)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _hashes_lock:
        known = _hashes.get(key)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()[:16]
    with _hashes_lock:
        _hashes[key] = digest
    return digest


def agent_adapter(model: Model, name: str | None, scale: float = 1.0) -> AgentAdapter | None:
    """The adapter an agent declared with adapter=`name` (a name the model has loaded, Model.load_adapter) at
    `scale` runs with; None for the base model. Raises UnknownAdapterError (a ValueError) for a name not loaded,
    ValueError for a scale that is not a finite number."""
    scale = lora.check_scale(scale)
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"adapter must be the name of a loaded adapter (a string), got {type(name).__name__}")
    loaded = lora.lookup(model, name)
    try:
        digest = file_digest(loaded.path)
    except OSError as e:
        raise ValueError(f"adapter {name!r}: its file {loaded.path} cannot be read to key its maps ({e})") from None
    return AgentAdapter(name, scale, f"lora:{digest}*{scale:g}")


def identity_with(identity: str, adapter: AgentAdapter | None) -> str:
    """An agent's identity in the estimator's edges with its adapter's key (unchanged without one)."""
    return identity if adapter is None else f"{identity}+{adapter.key}"


def agent_prefix(
    cache: PrefixCache, namespace: str, ids: list[int], model: Model, adapter: AgentAdapter | None
) -> Plan[tuple[KVSequence, int]]:
    """The plan of an agent's template prefix (PrefixCache.plan_prefix) run with its adapter: the prefix cache
    keys entries on the adapter and scale (a base or other adapter's prefix never serves it) and the sequence it
    returns runs the adapter, so the hop's forks and the reply inherit it."""
    key = None if adapter is None else (adapter.engine_id(model), adapter.scale)
    return cache.plan_prefix(namespace, ids, adapter=key)
