"""Where a request's prompt KV comes from: a fresh sequence (nonshared) or an agent session that reuses spans other
agents computed (kvcmas_cpp.agents.AgentSession, methods fullshared / kvcmas).

Every backend returns a Prefilled: a sequence positioned after the prompt, the next-token logits and stats. Backends
are used from the scheduler thread only.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..model import KVSequence, Model


class Prefilled(Protocol):
    seq: KVSequence
    logits: np.ndarray
    stats: dict[str, Any]

    def close(self) -> None: ...


class Backend(Protocol):
    method: str

    def prefill_chat(self, messages: list[dict[str, Any]], ids: list[int], agent: str | None) -> Prefilled: ...

    def finish(self, p: Prefilled, generated_ids: list[int]) -> None: ...

    def evict_lru(self) -> bool: ...

    @property
    def stored_bytes(self) -> int: ...

    def close(self) -> None: ...


@dataclass
class PlainPrefilled:
    """A prompt computed from scratch in its own sequence."""

    seq: KVSequence
    logits: np.ndarray
    stats: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        self.seq.close()


def prefill_plain(model: Model, ids: list[int], method: str = "nonshared") -> PlainPrefilled:
    """Computes ids in a new sequence. The sequence is closed again if the engine refuses (e.g. KV budget)."""
    t0 = time.perf_counter()
    seq = model.new_sequence()
    try:
        logits = seq.append(ids, logits="last")
    except BaseException:
        seq.close()
        raise
    assert logits is not None
    stats = {
        "method": method,
        "prompt_tokens": len(ids),
        "computed_tokens": len(ids),
        "reused_tokens": 0,
        "ttft_ms": (time.perf_counter() - t0) * 1000.0,
        "gate": None,
    }
    return PlainPrefilled(seq, logits, stats)


def prefill_segments(model: Model, segments: list[list[int] | np.ndarray]) -> PlainPrefilled:
    """Computes a prompt of text (token ids) and image (embeddings [n, n_embd]) segments in a new sequence."""
    t0 = time.perf_counter()
    seq = model.new_sequence()
    n_prompt = 0
    logits: np.ndarray | None = None
    try:
        for i, segment in enumerate(segments):
            last = i == len(segments) - 1
            if isinstance(segment, np.ndarray):
                logits = seq.append_embeddings(segment, logits=last)
            elif segment:
                logits = seq.append(segment, logits="last" if last else "none")
            n_prompt += len(segment)
    except BaseException:
        seq.close()
        raise
    if logits is None:
        seq.close()
        raise ValueError("the prompt ends with an empty text segment")
    stats = {
        "method": "nonshared",
        "prompt_tokens": n_prompt,
        "computed_tokens": n_prompt,
        "reused_tokens": 0,
        "ttft_ms": (time.perf_counter() - t0) * 1000.0,
        "gate": None,
    }
    return PlainPrefilled(seq, logits, stats)


class PlainBackend:
    """nonshared without the agents module: every request computes its whole prompt."""

    method = "nonshared"

    def __init__(self, model: Model) -> None:
        self.model = model

    def prefill_chat(self, messages: list[dict[str, Any]], ids: list[int], agent: str | None) -> Prefilled:
        return prefill_plain(self.model, ids)

    def finish(self, p: Prefilled, generated_ids: list[int]) -> None:
        pass

    def evict_lru(self) -> bool:
        return False

    @property
    def stored_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class SessionBackend:
    """An AgentSession (kvcmas_cpp.agents): spans computed by any agent of the workflow are reused by the method."""

    def __init__(self, model: Model, method: str) -> None:
        agents = importlib.import_module("kvcmas_cpp.agents")
        self.method = method
        self.session = agents.AgentSession(model, method=method)

    def prefill_chat(self, messages: list[dict[str, Any]], ids: list[int], agent: str | None) -> Prefilled:
        p: Prefilled = self.session.prefill(messages, agent=agent)
        return p

    def finish(self, p: Prefilled, generated_ids: list[int]) -> None:
        self.session.finish(p, generated_ids)

    def evict_lru(self) -> bool:
        return bool(self.session.evict_lru())

    @property
    def stored_bytes(self) -> int:
        return int(self.session.stored_bytes)

    def close(self) -> None:
        self.session.close()


def agents_available() -> bool:
    """True when kvcmas_cpp.agents (AgentSession) can be imported and KVCMAS_SERVER_AGENTS is not '0'."""
    if os.environ.get("KVCMAS_SERVER_AGENTS", "1") == "0":
        return False
    try:
        module = importlib.import_module("kvcmas_cpp.agents")
    except ImportError:
        return False
    return hasattr(module, "AgentSession")


def make_backend(model: Model, method: str) -> Backend:
    """The backend for a sharing method; nonshared requests fall back to PlainBackend when there is no agents module,
    and so do the sharing methods (their stats then say method 'nonshared')."""
    if agents_available():
        return SessionBackend(model, method)
    return PlainBackend(model)
