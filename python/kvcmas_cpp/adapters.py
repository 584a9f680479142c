"""LoRA adapters of a loaded model: loading them by name and running sequences with one.

The engine (cpp/engine/lora-adapter.h) loads GGUF LoRA files as llama.cpp writes them (``kvcmas convert-lora``
makes one from a PEFT folder), checked against the base model, and runs each sequence with its adapter and scale:
every adapted matmul computes W x + scale · (alpha / rank) · B (A x), so one batch may mix sequences of several
adapters and of none. ``Model.load_adapter`` / ``Model.generate(..., adapter=)`` are the public face; this module
holds the bookkeeping (the names of a model's adapters) so the Model class only forwards to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import CompletionChunk, KVSequence, Model


class UnknownAdapterError(ValueError):
    """An adapter name the model has not loaded (the message lists the loaded ones)."""


@dataclass(frozen=True)
class Adapter:
    """A loaded LoRA adapter: its name, the engine's id, file, alpha, largest rank, adapted matrices and memory."""

    name: str
    id: int
    path: str
    alpha: float
    max_rank: int
    n_matrices: int
    bytes: int


def registry(model: Model) -> dict[str, Adapter]:
    """The model's adapters by name (made on first use: Model.__init__ knows nothing of adapters)."""
    return model.__dict__.setdefault("_adapters", {})


def new_name(model: Model, path: str, name: str | None) -> str:
    """The name a file loads under (default: its stem), checked before the engine loads anything: a ValueError for
    an empty name or one in use. (Model.load_adapter loads; the engine checks the file against the model and raises
    KvcmasError naming the problem, nothing loaded then.)"""
    name = Path(path).stem if name is None else name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"load_adapter: the name must be a non-empty string, got {name!r}")
    adapters = registry(model)
    if name in adapters:
        raise ValueError(f"load_adapter: an adapter named {name!r} is loaded already ({adapters[name].path})")
    return name


def register(model: Model, name: str, aid: int, path: str, info: dict[str, Any]) -> Adapter:
    """Records an adapter the engine loaded (id `aid`, its adapter_info) under `name`."""
    adapter = Adapter(name, aid, path, info["alpha"], info["max_rank"], info["n_pairs"], info["bytes"])
    registry(model)[name] = adapter
    return adapter


def lookup(model: Model, name: str) -> Adapter:
    """The adapter loaded as `name`; UnknownAdapterError naming it and the loaded ones otherwise."""
    adapters = registry(model)
    if name not in adapters:
        loaded = ", ".join(map(repr, adapters)) or "none"
        raise UnknownAdapterError(f"no adapter named {name!r} is loaded (loaded: {loaded})")
    return adapters[name]


def forget(model: Model, name: str) -> None:
    """Drops the record of an adapter Model.unload_adapter freed in the engine."""
    del registry(model)[name]


def check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"adapter_scale must be a finite number, got {scale!r}")
    return float(scale)


def set_sequence_adapter(model: Model, seq: KVSequence, name: str | None, scale: float = 1.0) -> None:
    """Runs the sequence's next tokens with adapter `name` at `scale` (None: the base model); forks inherit it."""
    scale = check_scale(scale)
    aid = -1 if name is None else lookup(model, name).id
    seq.set_adapter(aid, scale)


def run_with(
    model: Model,
    name: str,
    scale: float,
    sequence: KVSequence | None,
    run: Callable[[KVSequence | None], Iterator[CompletionChunk]],
) -> Iterator[CompletionChunk]:
    """run(seq)'s chunks with the sequence set to the adapter: a fresh sequence (closed at the end) when `sequence`
    is None, else `sequence` (its previous adapter restored at the end). The name and scale are checked now."""
    adapter, scale = lookup(model, name), check_scale(scale)

    def chunks() -> Iterator[CompletionChunk]:
        seq = sequence if sequence is not None else model.new_sequence()
        before = seq.adapter
        try:
            seq.set_adapter(adapter.id, scale)
            yield from run(seq)
        finally:
            if sequence is None:
                seq.close()
            elif seq.alive:
                seq.set_adapter(*before)

    return chunks()
