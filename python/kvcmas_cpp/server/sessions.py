"""The session store: the server's sharing sessions by namespace and workflow, and the idle state that ages out.

A sharing session (one workflow of one namespace under one method) holds the spans its agents computed, in a
MethodBackend (backend.py). The store opens sessions on demand, caps them (all tenants, and per tenant), closes
those idle past --idle-ttl and the workflows a client drops, evicts their stored spans under memory pressure, and
forgets a namespace (its estimator, its prefix cache entries) once it has been idle as long. It knows which
sessions have a prefill in flight (`busy`): those are left alone. Used from the scheduler thread only, but for
drop_workflow and the counters, which any thread may call.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import agents
from ..model import Model
from ..prefix_cache import PrefixCache
from .backend import MethodBackend, make_backend

MAX_SESSIONS = 256  # sharing sessions kept; idle least recently used ones are closed beyond this
# Idle state ages out (--idle-ttl): a sharing session unused this long is closed (its stored spans freed), and a
# namespace (tenant and cache_salt) with no session and no request this long forgets its estimator and its prefix
# cache entries (maps saved in --calibration-dir load again on its next request). Clients rarely end workflows.
IDLE_TTL_S = 600.0
# Sharing sessions one tenant may hold (--max-sessions-per-tenant): beyond it the tenant's least recently used idle
# one is closed, so one tenant's workflows and cache_salts cannot crowd out the others' up to MAX_SESSIONS.
MAX_TENANT_SESSIONS = 64
# A session keeps every message it has seen (its shared context only grows), so a long-lived one (the default
# session of unmodified clients) is replaced by a fresh one after this many requests, when idle. What kvcmas
# learned lives in the model-wide estimator and survives.
MAX_SESSION_REQUESTS = 512


class Namespace(NamedTuple):
    """Who may share with whom: requests share spans, prefix caches and what the estimator learns only within one
    namespace. tenant: the API key's tenant; salt: the request's cache_salt ('' when none)."""

    tenant: str
    salt: str = ""

    def estimator_name(self) -> str:
        """The name the namespace's sessions share their estimator under (AgentSession's workflow)."""
        return "ns-" + hashlib.sha256(f"{self.tenant}\x00{self.salt}".encode()).hexdigest()[:24]

    def cache_namespace(self) -> str:
        """The namespace's entries in the model's prefix cache: owned by its tenant (PrefixCache.owners), so one
        tenant's prompts never evict another's, whatever cache_salts it sends."""
        tenant = hashlib.sha256(self.tenant.encode()).hexdigest()[:16]
        return f"tenant-{tenant}/{self.estimator_name()}"


class SessionKey(NamedTuple):
    """A sharing session: one workflow of one namespace under one method."""

    namespace: Namespace
    workflow: str
    method: str


@dataclass(eq=False)
class Session:
    backend: MethodBackend
    active: int = 0  # jobs that hold it (from admission to release)
    requests: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sharing sessions and namespaces of one server (see the module's docstring)."""

    def __init__(
        self,
        model: Model,
        vision: Any,
        calibration_bytes: int | None,
        cold: str,
        calibration_dir: str | os.PathLike[str] | bool,
        idle_ttl: float | None = IDLE_TTL_S,
        max_tenant_sessions: int = MAX_TENANT_SESSIONS,
    ) -> None:
        self.model, self.vision = model, vision  # sessions get the vision encoder: image embeddings in messages
        self.calibration_bytes, self.cold, self.calibration_dir = calibration_bytes, cold, calibration_dir
        self.idle_ttl, self.max_tenant_sessions = idle_ttl, max_tenant_sessions
        self.prefix_cache = PrefixCache.of(model)  # agents' template prefixes and plain prompts, per namespace
        self.by_key: OrderedDict[SessionKey, Session] = OrderedDict()  # least recently used first
        self.namespaces: dict[Namespace, float] = {}  # namespace -> when a request of it last ended (monotonic)
        self.busy: dict[int, Any] = {}  # id() of a session -> its job whose prefill plan is in flight
        # idle state that went: sessions and namespaces past --idle-ttl, sessions beyond a cap (capped)
        self.expired: dict[str, int] = {"session": 0, "namespace": 0, "capped": 0}
        self._lock = threading.Lock()  # guards _workflows and _drops (drop_workflow comes from the HTTP side)
        self._workflows: dict[tuple[str, str], int] = {}  # (tenant, workflow) -> open sessions
        self._drops: set[tuple[str, str]] = set()  # (tenant, workflow) whose sessions are to be closed

    # ---------------------------------------------------------------------------------------------- counts
    def __len__(self) -> int:
        return len(self.by_key)

    @property
    def n_namespaces(self) -> int:
        """Namespaces whose requests ended within --idle-ttl, or that hold a session."""
        return len(set(self.namespaces) | {k.namespace for k in list(self.by_key)})

    @property
    def stored_bytes(self) -> int:
        """KV bytes the sessions' stored spans hold."""
        return sum(s.backend.stored_bytes for s in self.by_key.values())

    @property
    def has_drops(self) -> bool:
        with self._lock:
            return bool(self._drops)

    # ------------------------------------------------------------------------------------ open and close
    def open(self, key: SessionKey) -> Session:
        """The session of `key` (made when there is none, or when the one there served MAX_SESSION_REQUESTS and is
        idle), as the most recently used; closes idle sessions beyond the caps."""
        s = self.by_key.get(key)
        if s is not None and s.requests >= MAX_SESSION_REQUESTS and s.active == 0:
            self.close(key)
            s = None
        if s is None:
            backend = make_backend(
                self.model,
                key.method,
                self.vision,
                self.calibration_bytes,
                key.namespace.estimator_name(),
                self.cold,
                self.calibration_dir,
                key.namespace.cache_namespace(),
            )
            s = Session(backend)
            self.by_key[key] = s
            with self._lock:
                wf = (key.namespace.tenant, key.workflow)
                self._workflows[wf] = self._workflows.get(wf, 0) + 1
            self._close_idle_beyond(MAX_SESSIONS, key, None)
            self._close_idle_beyond(self.max_tenant_sessions, key, key.namespace.tenant)
        self.by_key.move_to_end(key)
        s.last_used = time.monotonic()
        s.requests += 1
        return s

    def release(self, session: Session | None, namespace: Namespace | None) -> None:
        """A job of this session (or of this namespace, a plain prompt) let go of it."""
        if session is not None:
            session.active -= 1
            session.last_used = time.monotonic()
        if namespace is not None:
            self.namespaces[namespace] = time.monotonic()

    def close(self, key: SessionKey) -> None:
        self.by_key.pop(key).backend.close()
        with self._lock:
            wf = (key.namespace.tenant, key.workflow)
            self._workflows[wf] -= 1
            if not self._workflows[wf]:
                del self._workflows[wf]

    def close_all(self) -> None:
        for s in self.by_key.values():
            s.backend.close()

    def _close_idle_beyond(self, limit: int, keep: SessionKey, tenant: str | None) -> None:
        """Closes the least recently used idle sessions (of one tenant, or of all) beyond `limit`, never `keep`."""
        while sum(tenant is None or k.namespace.tenant == tenant for k in self.by_key) > limit:
            mine = (k for k, v in self.by_key.items() if v.active == 0 and k != keep)
            idle = next((k for k in mine if tenant is None or k.namespace.tenant == tenant), None)
            if idle is None:
                return
            self.close(idle)
            self.expired["capped"] += 1

    def drop_workflow(self, tenant: str, workflow: str) -> bool:
        """Marks the tenant's sessions of this workflow (all methods and cache salts) to be closed once no job holds
        them (drop_workflows). False when the tenant has no such workflow. Any thread."""
        with self._lock:
            known = self._workflows.get((tenant, workflow), 0) > 0
            if known:
                self._drops.add((tenant, workflow))
            return known

    def drop_workflows(self) -> None:
        """Closes the sessions of dropped workflows that no job holds."""
        with self._lock:
            drops = set(self._drops)
        done: set[tuple[str, str]] = set()
        for tenant, workflow in drops:
            keys = [k for k in self.by_key if k.namespace.tenant == tenant and k.workflow == workflow]
            for key in keys:
                if self.by_key[key].active == 0:
                    self.close(key)
            if all(k not in self.by_key for k in keys):
                done.add((tenant, workflow))
        if done:
            with self._lock:
                self._drops -= done

    # ------------------------------------------------------------------------------------------ idle state
    def next_expiry(self) -> float | None:
        """Seconds until the next idle session or namespace ages out (at least 0.05), None when none will."""
        if self.idle_ttl is None:
            return None
        times = [s.last_used for s in self.by_key.values() if s.active == 0] + list(self.namespaces.values())
        return max(0.05, min(times) + self.idle_ttl - time.monotonic()) if times else None

    def expire(self, in_use: Collection[Namespace | None]) -> bool:
        """Closes sessions idle for --idle-ttl and forgets namespaces with no session, no request for as long and
        not `in_use` (their estimators and prefix cache entries). Returns whether anything went."""
        if self.idle_ttl is None:
            return False
        cutoff = time.monotonic() - self.idle_ttl
        gone = False
        for key, s in list(self.by_key.items()):
            if s.active == 0 and s.last_used < cutoff and id(s) not in self.busy:
                self.close(key)
                self.expired["session"] += 1
                gone = True
        held = {k.namespace for k in self.by_key} | set(in_use)
        for ns, last in list(self.namespaces.items()):
            if last < cutoff and ns not in held:
                del self.namespaces[ns]
                agents.forget_estimators(self.model, ns.estimator_name())
                self.prefix_cache.forget(ns.cache_namespace())
                self.expired["namespace"] += 1
                gone = True
        return gone

    # ---------------------------------------------------------------------------------------------- memory
    def evict_span(self) -> bool:
        """Evicts one stored span from the least recently used session that has any and no prefill in flight."""
        return any(id(s) not in self.busy and s.backend.evict_lru() for s in self.by_key.values())

    def close_idle_holder(self) -> bool:
        """Closes the least recently used idle session that holds stored spans (and whatever else it holds)."""
        for key, s in self.by_key.items():
            if s.active == 0 and s.backend.stored_bytes > 0:
                self.close(key)
                return True
        return False

    def bound_estimators(self, max_bytes: int) -> int:
        """Brings the shared estimators of every namespace within max_bytes (agents.bound_estimators); returns the
        bytes freed. Estimators of sessions with a prefill in flight keep their statistics."""
        live = {key.namespace.estimator_name() for key in self.by_key}
        busy = {key.namespace.estimator_name() for key, s in self.by_key.items() if id(s) in self.busy}
        return int(agents.bound_estimators(self.model, max_bytes, live, busy))
