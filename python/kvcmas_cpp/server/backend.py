"""Where a request's prompt KV comes from: a fresh sequence (nonshared) or an agent session that reuses spans other
agents computed (kvcmas_cpp.agents.AgentSession, methods fullshared / kvcmas).

Every backend gives a prefill plan (kvcmas_cpp.plan) whose result is a Prefilled: a sequence positioned after the
prompt, the next-token logits and stats; the scheduler drives the plans. Backends are used from the scheduler thread
only.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..model import KVSequence, Model, image_pos_of
from ..plan import MIN_CHUNK_ROWS, Append, ChunkExecutor, Plan, run_plan
from ..prefix_cache import PrefixCache
from ..sharing.runner import TrainingRead
from .lora import BASE, Pick

Segment = list[int] | np.ndarray  # text token ids, or input vectors [n, n_embd] (an image's embeddings)


class Prefilled(Protocol):
    seq: KVSequence
    logits: np.ndarray
    stats: dict[str, Any]

    def close(self) -> None: ...


class MethodBackend(Protocol):
    """Where a request's prompt KV comes from, for one sharing method (see the module's docstring)."""

    method: str

    def prefill_plan(
        self,
        messages: list[dict[str, Any]],
        segments: list[Segment],
        agent: str | None,
        recompute: float = 0.0,
        *,
        lora: Pick = BASE,
    ) -> Plan[Prefilled]:
        """The plan (kvcmas_cpp.plan) of the chat's prompt in the engine: messages (contents: strings, or lists of
        strings and input vectors) for sessions, segments (the rendered prompt) for a plain prefill. recompute: a
        session's recompute budget for this prompt (sharing/recompute.py); a plain prefill computes every row
        anyway. lora: the LoRA adapter the prompt runs with (server/lora.py; BASE: none). Closing the plan
        part-way frees what it holds."""
        ...

    def reusable_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens the backend holds already (an estimate of what a prefill will not compute)."""
        ...

    def finish(self, p: Prefilled, generated_ids: list[int], text: str | None = None) -> list[TrainingRead]:
        """Registers the reply: its ids and the text the client received (after stop strings). Returns the training
        reads it scheduled (kvcmas calibrating), for the caller to run after the reply (TrainingRead.step)."""
        ...

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


def plan_segments(
    model: Model,
    segments: list[Segment],
    method: str = "nonshared",
    namespace: str | None = None,
    adapter: tuple[int, float] | None = None,
) -> Plan[PlainPrefilled]:
    """The plan (kvcmas_cpp.plan) of a prompt of text (token ids) and image (embeddings [n, n_embd]) segments in a
    new sequence: one append per segment. namespace: a text-only prompt starts from the longest match in the
    model's prefix cache within this namespace (and adapter) and is stored there when done (None: neither).
    adapter: (engine id, scale) of the LoRA adapter the sequence runs with (None: the base model). The sequence is
    closed again if an append fails (e.g. the KV budget) or the plan is closed part-way. Raises ValueError (on its
    first step) for an empty prompt."""
    n_prompt = sum(len(seg) for seg in segments)
    cache = PrefixCache.of(model) if namespace is not None and all(isinstance(g, list) for g in segments) else None
    t0 = time.perf_counter()
    if cache is not None and n_prompt:
        assert namespace is not None
        seq, cached = cache.reuse(namespace, [t for seg in segments for t in seg], adapter=adapter)
        segments = [[t for seg in segments for t in seg][cached:]]
    else:
        seq, cached = model.new_sequence(), 0
        if adapter is not None:
            seq.set_adapter(*adapter)
    segments = [seg for seg in segments if len(seg)]
    if not segments:
        seq.close()
        raise ValueError("the prompt is empty")
    logits: np.ndarray | None = None
    try:
        for k, seg in enumerate(segments):
            logits = yield Append(seq, seg, "last" if k == len(segments) - 1 else "none", image_pos=image_pos_of(seg))
    except BaseException:
        seq.close()
        raise
    assert logits is not None
    if cache is not None:  # the request goes on in a fork: its generated rows stay out of the stored entry
        assert namespace is not None
        seq = cache.adopt(namespace, seq, n_prompt if n_prompt - cached >= MIN_CHUNK_ROWS else cached)
    stats = {
        "method": method,
        "mode": "source",
        "prompt_tokens": n_prompt,
        "computed_tokens": n_prompt - cached,
        "reused_tokens": cached,
        "prefix_cached_tokens": cached,
        "ttft_ms": (time.perf_counter() - t0) * 1000.0,
        "gate": None,
    }
    return PlainPrefilled(seq, logits, stats)


def prefill_segments(
    model: Model,
    segments: list[Segment],
    chunks: ChunkExecutor | None = None,
    chunk_tokens: int = 1 << 30,
    method: str = "nonshared",
    namespace: str | None = None,
) -> PlainPrefilled:
    """plan_segments run to its end here: each segment in chunks of about chunk_tokens rows (chunk_bounds) run by
    the executor `chunks` (None: each by itself). Each row attends to the rows before it whatever the chunking, so
    the rows and logits equal a one-piece prefill."""
    return run_plan(plan_segments(model, segments, method, namespace), chunks, chunk_tokens)


def prefill_plain(model: Model, ids: list[int], method: str = "nonshared") -> PlainPrefilled:
    """Computes ids in a new sequence, in one piece."""
    return prefill_segments(model, [ids], method=method)


class PlainBackend:
    """nonshared without the agents module: every request computes its prompt, less the longest match in the
    model's prefix cache within `namespace` (None: no prefix cache)."""

    method = "nonshared"

    def __init__(self, model: Model, namespace: str | None = None) -> None:
        self.model = model
        self.namespace = namespace

    def prefill_plan(
        self,
        messages: list[dict[str, Any]],
        segments: list[Segment],
        agent: str | None,
        recompute: float = 0.0,
        *,
        lora: Pick = BASE,
        namespace: str | None = None,
    ) -> Plan[Prefilled]:
        """namespace: the prefix cache namespace of this prompt instead of the backend's. lora: the LoRA adapter the
        prompt and its reply run with (BASE: none)."""
        ns = namespace if namespace is not None else self.namespace
        plan: Plan[Prefilled] = plan_segments(self.model, segments, namespace=ns, adapter=lora.adapter)
        return plan

    def reusable_tokens(self, messages: list[dict[str, Any]]) -> int:
        return 0

    def finish(self, p: Prefilled, generated_ids: list[int], text: str | None = None) -> list[TrainingRead]:
        return []

    def evict_lru(self) -> bool:
        return False

    @property
    def stored_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class SessionBackend:
    """An AgentSession (kvcmas_cpp.agents): spans computed by any agent of the workflow are reused by the method."""

    def __init__(
        self,
        model: Model,
        method: str,
        vision: Any = None,
        calibration_bytes: int | None = None,
        estimator_name: str = "default",
        cold: str = "reuse",
        calibration_dir: str | os.PathLike[str] | bool = True,
        cache_namespace: str | None = None,
        pool: Any = None,
    ) -> None:
        """pool: the server's EstimatorPool (sharing.pool), whose estimators its sessions share (None: the model's
        default pool). estimator_name: sessions with the same name share what the method's estimator learns and (unless
        cache_namespace names another) their agents' template prefixes in the model's prefix cache (the server gives
        each namespace its own, so nothing learned from one tenant's reads shapes another's answers, and no tenant
        reads another's prompt rows; its calibration files are keyed by it too). calibration_bytes: the least
        memory the method's shared estimator may hold in the statistics of edges still calibrating (kvcmas: ~17 MB
        an edge on SmolLM2-135M, whatever the span; the server bounds all namespaces' estimators together).
        cold, calibration_dir: see AgentSession (kvcmas)."""
        agents = importlib.import_module("kvcmas_cpp.agents")
        self.method = method
        learns = importlib.import_module("kvcmas_cpp.sharing.methods").method(method).learns_online
        kw: dict[str, Any] = {"cold": cold, "calibration_dir": calibration_dir} if learns else {}
        kw["training_reads"] = "manual"  # the scheduler takes them (finish) and runs them between its own work
        self.session = agents.AgentSession(
            model,
            method=method,
            workflow=estimator_name,
            vision=vision,
            cache_namespace=estimator_name if cache_namespace is None else cache_namespace,
            pool=pool,
            **kw,
        )
        if calibration_bytes is not None:
            estimator, lock = self.session.pool.get(method, self.session.workflow)
            with lock:
                if getattr(estimator, "max_pending_bytes", calibration_bytes) < calibration_bytes:
                    estimator.max_pending_bytes = calibration_bytes

    def prefill_plan(
        self,
        messages: list[dict[str, Any]],
        segments: list[Segment],
        agent: str | None,
        recompute: float = 0.0,
        *,
        lora: Pick = BASE,
    ) -> Plan[Prefilled]:
        plan: Plan[Prefilled] = self.session.prefill_plan(messages, agent, recompute=recompute, adapter=lora.named)
        return plan

    def reusable_tokens(self, messages: list[dict[str, Any]]) -> int:
        return int(self.session.reusable_tokens(messages))

    def finish(self, p: Prefilled, generated_ids: list[int], text: str | None = None) -> list[TrainingRead]:
        self.session.finish(p, generated_ids, text)
        reads: list[TrainingRead] = self.session.take_training_reads()
        return reads

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


def make_backend(
    model: Model,
    method: str,
    vision: Any = None,
    calibration_bytes: int | None = None,
    estimator_name: str = "default",
    cold: str = "reuse",
    calibration_dir: str | os.PathLike[str] | bool = True,
    cache_namespace: str | None = None,
    pool: Any = None,
) -> MethodBackend:
    """The backend for a sharing method; nonshared requests fall back to PlainBackend when there is no agents module,
    and so do the sharing methods (their stats then say method 'nonshared'). vision: the server's VisionEncoder, if
    any (the session checks that its embeddings fit the model). calibration_bytes, estimator_name, cold,
    calibration_dir, cache_namespace, pool: see SessionBackend."""
    if agents_available():
        return SessionBackend(
            model, method, vision, calibration_bytes, estimator_name, cold, calibration_dir, cache_namespace, pool
        )
    return PlainBackend(model, estimator_name if cache_namespace is None else cache_namespace)
