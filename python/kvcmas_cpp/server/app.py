"""The HTTP layer: FastAPI routes for the OpenAI-compatible API, errors in OpenAI's shape, API-key checks.

Handlers never compute: they validate (validation.py, model-free: read the body within its limit, parse it to a
ParsedRequest or an OpenAI-style 4xx), tokenize (in a worker thread), hand a Job to the Scheduler and await its
events, so the event loop stays responsive while the engine works. A client that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import ipaddress
import json
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import h11
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..model import Model
from ..sharing import persist
from .backend import Segment
from .choices import Choice, ReplyFormat
from .dashboard import UI_PATHS, dashboard_routes, record_response
from .history import History
from .metrics import Metrics
from .scheduler import (
    CALIBRATION_BYTES,
    GENERATION_RESERVE,
    IDLE_TTL_S,
    MAX_TENANT_SESSIONS,
    PREFILL_CHUNK,
    Done,
    Event,
    Failed,
    Job,
    Namespace,
    QueueFull,
    Scheduler,
    SessionKey,
)
from .schemas import ChatCompletionRequest, CompletionRequest, ImagePart
from .structured import output_plan
from .utility import utility_routes
from .validation import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_TOKENS,
    ApiError,
    Limits,
    ParsedRequest,
    error_body,
    loggable,
    parse_request,
    validation_message,
)

__all__ = ["ApiError", "Server", "ServerConfig", "error_body", "error_response"]

log = logging.getLogger("kvcmas.server")

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there
DEFAULT_WORKFLOW = "default"  # the sharing session of requests that name no workflow (one per namespace)
# encoded images kept (by content): agents that read the same image do not encode it again; split evenly among the
# tenants, each making room from its own (another tenant's images evicting them would show in the timing). Bounded
# by count and by bytes (ServerConfig.image_cache_bytes): an AnyRes view is thousands of rows.
IMAGE_CACHE = 32
DEFAULT_IMAGE_CACHE_BYTES = 256 << 20
IMAGE_DECODES = 2  # images decoded at once: each may take up to --max-image-memory
DEFAULT_IMAGE_MEMORY = 256 << 20  # decoding one image may take this much (checked from its header, before decoding)
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for a request body to arrive once its headers are in (--body-timeout)
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for the request line and headers to arrive (--header-timeout)
# Default --max-text-chars: characters per context token. A prompt that fits the context is far shorter (English
# averages ~4 characters a token), and tokenizing this much takes well under a second of one core.
TEXT_CHARS_PER_CTX = 32


@dataclass
class ServerConfig:
    """Settings of one server (see `kvcmas-server --help`)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_key_file: str | None = None  # `NAME KEY` or `KEY` per line: each key its own tenant
    parallel: int = 8
    ctx_size: int | None = None
    kv_budget: int | None = None
    method: str = "kvcmas"
    recompute: float = 0.0  # default share of the shared rows later agents recompute (request: kvcmas.recompute)
    threads: int | None = None
    max_queue: int = 64
    alias: str | None = None
    mmproj: str | None = None  # vision tower + projector (mmproj GGUF): image_url parts become image embeddings
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies: 413
    max_tokens: int = DEFAULT_MAX_TOKENS  # the most new tokens one request may ask for (or get by default)
    max_images: int = DEFAULT_MAX_IMAGES  # image parts per chat request
    max_inflight: int = 256  # HTTP requests handled at once (but /health, /metrics); beyond it: 503 + Retry-After
    request_timeout: float = 600.0  # seconds from arrival to the last token; then the request ends with 408
    cors_origins: tuple[str, ...] = ()  # origins allowed by CORS; empty: no CORS headers at all
    prefill_chunk: int = PREFILL_CHUNK  # prompt rows per prefill step (other requests' work runs between steps)
    calibration_bytes: int = CALIBRATION_BYTES  # training statistics kvcmas may hold while it calibrates
    cold: str = "reuse"  # kvcmas before an edge is calibrated: reuse (fullshared-like) or dense
    calibration_dir: str | bool = True  # kvcmas' learned maps across restarts: True = the user's cache dir
    # an unusable calibration_dir: start anyway, learned maps in memory only, reported in /health and /metrics
    # (otherwise start-up fails naming the problem)
    allow_unsaved_calibration: bool = False
    idle_ttl: float | None = IDLE_TTL_S  # idle sessions and namespaces age out after this many seconds; None: never
    max_tenant_sessions: int = MAX_TENANT_SESSIONS  # sharing sessions one tenant may hold
    metrics_key: str | None = None  # the key whose /metrics are the whole server's (tenant keys see their own)
    allowed_hosts: tuple[str, ...] = ()  # Host header names served besides the loopback names (loopback binds)
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_image_memory: int = DEFAULT_IMAGE_MEMORY  # per image being decoded (IMAGE_DECODES at once)
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES  # encoded images kept for reuse, all tenants together
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    replica: str | None = None  # a cluster replica's name: answered in each response's kvcmas.replica
    max_text_chars: int | None = None  # text one request may have tokenized or rendered; None: TEXT_CHARS_PER_CTX
    ui: bool = True  # GET /ui, the page of workflows, spans and savings (--no-ui: off; its JSON endpoints stay)

    def host_allow_list(self) -> frozenset[str] | None:
        """The Host names accepted: bound to loopback, the loopback names and --allowed-host (a page on another
        site that rebinds its DNS name to 127.0.0.1 still sends its own name); otherwise only --allowed-host, if
        given (None: any Host)."""
        extra = {host_name(h) for h in self.allowed_hosts}
        if "*" in extra:
            return None
        if loopback_host(self.host):
            return frozenset(LOOPBACK_NAMES | extra | {host_name(self.host)})
        return frozenset(extra) if extra else None


def resident_bytes() -> int:
    """The process's resident memory from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def internal_error_response(exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


ALL_METRICS = "\x00all"  # a /metrics request that sees the whole server's (no tenant has this name: names are words)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
JSON_MEDIA_TYPES = frozenset({"application/json"})
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def loopback_host(host: str) -> bool:
    """True when a bind address is a loopback one (then Host headers are checked against LOOPBACK_NAMES)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """The host of a Host header, without its port: 'localhost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Tenants:
    """API keys -> tenants. Each key is its own tenant: sharing (spans, prefix caches, what the estimators learn from)
    and workflow ids never cross tenants. Without keys every client is the one tenant LOCAL_TENANT."""

    LOCAL_TENANT = "local"

    def __init__(self, api_key: str | None = None, key_file: str | None = None) -> None:
        self.keys: dict[bytes, str] = {}
        if api_key is not None:
            self._add(api_key, "default", "--api-key")
        if key_file is not None:
            self._load(key_file)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def _add(self, key: str, name: str, where: str) -> None:
        if not key:
            raise ValueError(f"{where}: an API key must not be empty")
        raw = key.encode()
        if raw in self.keys:
            raise ValueError(f"{where}: the same API key is given twice")
        if name in self.keys.values():
            raise ValueError(f"{where}: the tenant name {name!r} is given twice")
        self.keys[raw] = name

    def _load(self, path: str) -> None:
        """One key per line, `NAME KEY` or just `KEY` (the tenant is then named by the key's hash); '#' comments."""
        try:
            lines = open(path, encoding="utf-8").read().splitlines()  # noqa: SIM115 (read at once)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {path}: cannot read it: {e}") from None
        for n, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) > 2:
                raise ValueError(f"--api-key-file {path}, line {n}: expected `NAME KEY` or `KEY`")
            key = words[-1]
            name = words[0] if len(words) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
            self._add(key, name, f"--api-key-file {path}, line {n}")
        if not self.keys:
            raise ValueError(f"--api-key-file {path}: no keys in the file")

    def tenant(self, token: str) -> str | None:
        """The tenant a presented key belongs to (None: no such key). Every known key is compared in constant
        time, so the time taken says nothing about which keys exist."""
        if not self.keys:
            return self.LOCAL_TENANT
        found = None
        presented = token.encode()
        for key, name in self.keys.items():
            if hmac.compare_digest(presented, key):
                found = name
        return found


class _ApiKeyAndAccounting:
    """Pure ASGI middleware (streaming-safe) in front of every route:
    - Host header against an allow-list (DNS rebinding), and the API key -> the request's tenant (scope state);
    - POST bodies must be JSON (Content-Type application/json: a browser cannot send that cross-site without a CORS
      preflight) and are read here in full, within --max-body-bytes and --body-timeout, before the request counts
      against --max-inflight: a client that sends half a body holds a connection, never a slot;
    - requests beyond the in-flight limit get 503, and every request is counted by endpoint and status."""

    PUBLIC = frozenset({"/health", *UI_PATHS})  # the page holds no data: it asks for the key its requests send
    UNLIMITED = frozenset({"/health", "/metrics"})  # probes still answer when the server is saturated

    def __init__(
        self,
        app: Any,
        tenants: Tenants,
        metrics: Metrics,
        known_paths: frozenset[str],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_inflight: int = 256,
        allowed_hosts: frozenset[str] | None = None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        metrics_key: str | None = None,
    ) -> None:
        self.app = app
        self.metrics_key = metrics_key
        self.tenants = tenants
        self.metrics = metrics
        self.known_paths = known_paths
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.allowed_hosts = allowed_hosts
        self.body_timeout = body_timeout
        self.inflight = 0

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.known_paths else "other"
        status_seen = 500
        started = False

        async def counting_send(message: MutableMapping[str, Any]) -> None:
            nonlocal status_seen, started
            if message["type"] == "http.response.start":
                status_seen = int(message["status"])
                started = True
            await send(message)

        limited = path not in self.UNLIMITED
        refusal = self._refusal(scope, path)
        if refusal is None and scope.get("method") == "POST":
            body, refusal = await self._read_body(receive)
            if body is not None:
                receive = _replay(body, receive)
        if refusal is None and limited and self.inflight >= self.max_inflight:
            self.metrics.bump("rejected_too_many_requests")
            refusal = error_response(
                503,
                f"the server is handling {self.inflight} requests, its limit; retry shortly",
                "too_many_requests",
                headers={"Retry-After": "1"},
            )
        if refusal is not None:
            await refusal(scope, receive, counting_send)
        else:
            self.inflight += limited
            try:
                await self.app(scope, receive, counting_send)
            except Exception as exc:
                # Answered here: Starlette's outer error handler would send the 500 but re-raise past this
                # middleware (no count, no log line below) to uvicorn (a second traceback). A response already
                # started (a stream that broke) cannot become a 500: the connection is closed.
                log.exception("unhandled error on %s", loggable(path))
                if not started:
                    await internal_error_response(exc)(scope, receive, counting_send)
            finally:
                self.inflight -= limited
        self.metrics.count_request(endpoint, status_seen, scope.get("state", {}).get("tenant"))
        if status_seen != 200 or endpoint not in ("/v1/chat/completions", "/v1/completions"):
            # Probes (health checks, metric scrapes) log at debug level: they come every few seconds.
            level = logging.DEBUG if status_seen == 200 and endpoint in ("/health", "/metrics") else logging.INFO
            log.log(level, "%s %s -> %d", loggable(scope.get("method", "?")), loggable(path), status_seen)

    def _refusal(self, scope: MutableMapping[str, Any], path: str) -> Response | None:
        """The error response for a request refused on its headers alone, or None. Sets the request's tenant."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = headers.get("host")
        if self.allowed_hosts is not None and host is not None and host_name(host) not in self.allowed_hosts:
            self.metrics.bump("rejected_host")
            return error_response(
                400, "the Host header names a host this server does not serve (see --allowed-host)", "invalid_host"
            )
        auth = headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        tenant = self.tenants.tenant(token)
        state = scope.setdefault("state", {})
        if path == "/metrics":
            state["metrics_of"] = self._metrics_of(scope, token, tenant)
            if state["metrics_of"] is None:
                return error_response(401, "invalid or missing API key (or --metrics-key)", "invalid_api_key")
        elif tenant is None and path not in self.PUBLIC:
            return error_response(401, "invalid or missing API key", "invalid_api_key")
        state["tenant"] = tenant
        if scope.get("method") == "POST":
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type not in JSON_MEDIA_TYPES:
                self.metrics.bump("rejected_content_type")
                shown = media_type.encode("ascii", "backslashreplace").decode() or "none"
                return error_response(
                    415,
                    f"the request body must be JSON (Content-Type: application/json), not {shown}",
                    "unsupported_media_type",
                )
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            self.metrics.bump("rejected_body_too_large")
            return error_response(
                413, f"the request body has {int(length)} bytes; the limit is {self.max_body_bytes}", "body_too_large"
            )
        return None

    def _metrics_of(self, scope: MutableMapping[str, Any], token: str, tenant: str | None) -> str | None:
        """Whose metrics a /metrics request sees: ALL_METRICS (the whole server's) for --metrics-key, or, without
        it, for a keyless request from loopback or any request of a server without API keys; a tenant's key: its
        own; None: refused. A tenant must not read the others' volume in the server-wide counters and gauges."""
        if self.metrics_key is not None:
            if hmac.compare_digest(token.encode(), self.metrics_key.encode()):
                return ALL_METRICS
            return tenant if self.tenants.required else None
        if not self.tenants.required:
            return ALL_METRICS
        if tenant is not None:
            return tenant
        client = scope.get("client") or ("", 0)
        return ALL_METRICS if not token and loopback_host(str(client[0])) else None

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, Response | None]:
        """The whole body, or the response that refuses it: too large (413), not complete within body_timeout (408),
        the client gone (None, None)."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.metrics.bump("rejected_body_timeout")
                return None, error_response(
                    408, f"the request body did not arrive within {self.body_timeout:g} s", "body_timeout"
                )
            if message["type"] != "http.request":  # http.disconnect
                return None, Response(status_code=499)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                self.metrics.bump("rejected_body_too_large")
                return None, error_response(
                    413, f"the request body is over the limit of {self.max_body_bytes} bytes", "body_too_large"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that gives the body read already, then what the connection says next (a disconnect)."""
    sent = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for the request line and headers (uvicorn has none: a connection that
    sends a header byte now and then is kept forever). The clock starts when the connection opens and again after
    each response; a connection whose headers are not complete by then is closed."""

    header_timeout = DEFAULT_HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Server:
    """The model, its scheduler and the FastAPI app around them."""

    def __init__(self, cfg: ServerConfig, model: Model) -> None:
        self.cfg = cfg
        self.model = model
        # Load what the model reads lazily from its file now: the file may be gone later (the weights are mapped).
        _ = model.tokenizer
        from ..sharing.persist import model_fingerprint

        model_fingerprint(model)  # read from the file once, now (calibration files are keyed by it)
        with contextlib.suppress(ValueError):  # a template that refuses this message refuses it per request too
            model.apply_chat_template([{"role": "user", "content": "warm-up"}], add_generation_prompt=True)
        self.metrics = Metrics()
        self.history = History(model.kv_row_bytes)  # what the responses reported, per tenant (dashboard.py)
        self.tenants = Tenants(cfg.api_key, cfg.api_key_file)
        self._image_decodes = asyncio.Semaphore(IMAGE_DECODES)
        text_chars = cfg.max_text_chars if cfg.max_text_chars is not None else TEXT_CHARS_PER_CTX * model.n_ctx
        self.limits = Limits(cfg.max_body_bytes, cfg.max_tokens, cfg.max_images, text_chars)
        self.vision: Any = None
        if cfg.mmproj:
            from ..vision import VisionEncoder

            # cache_size 0: the server keeps its own cache, per namespace (_encode_image)
            self.vision = VisionEncoder(
                cfg.mmproj, n_threads=cfg.threads, cache_size=0, max_decode_bytes=cfg.max_image_memory
            )
            self.vision.check_text_model(model.n_embd)
        # (namespace, image bytes' sha256) -> embeddings (LRU): per namespace, so that a cache hit (which /metrics'
        # kvcmas_images_encoded_total and the timing would show) never says another tenant sent the same image.
        self._images: OrderedDict[tuple[Namespace, str, str | None], np.ndarray] = OrderedDict()
        self.calibration_problem = self._check_calibration_dir()
        budget = int(model._core.kv_budget)
        self.scheduler = Scheduler(
            model,
            cfg.method,
            cfg.parallel,
            budget,
            cfg.max_queue,
            self.metrics,
            cfg.prefill_chunk,
            self.vision,
            cfg.calibration_bytes,
            cold=cfg.cold,
            calibration_dir=cfg.calibration_dir if self.calibration_problem is None else False,
            idle_ttl=cfg.idle_ttl,
            max_tenant_sessions=cfg.max_tenant_sessions,
        )
        # each tenant's prefix-cache entries make room by evicting only its own (Namespace.cache_namespace)
        self.scheduler.prefix_cache.owners = max(1, len(self.tenants.keys))
        self.model_id = cfg.alias or os.path.basename(cfg.model_path).removesuffix(".gguf")
        self.model_names = {self.model_id, os.path.basename(cfg.model_path)}
        self.created = int(time.time())
        m, s = self.metrics, self.scheduler
        # The prefix cache counts its evictions, the scheduler's and its own (beyond its share of the budget); it is
        # the model's, so what it counted before this server is left out.
        evicted_before = s.prefix_cache.evictions
        m.add_count("evictions", lambda: s.prefix_cache.evictions - evicted_before)
        m.add_gauge("kvcmas_active_requests", "Requests being generated.", lambda: s.n_active)
        m.add_gauge("kvcmas_queued_requests", "Requests waiting for a slot or KV memory.", lambda: s.n_queued)
        m.add_gauge(
            "kvcmas_training_reads_pending",
            "Training reads (kvcmas calibrating) scheduled by replies and not yet run.",
            lambda: s.n_training_reads,
        )
        m.add_gauge("kvcmas_engine_sequences", "KV sequences alive in the engine.", lambda: model._core.n_seqs)
        m.add_gauge("kvcmas_kv_bytes", "KV memory in use (bytes).", lambda: model.kv_bytes_in_use)
        m.add_gauge("kvcmas_kv_peak_bytes", "Most KV memory in use so far (bytes).", lambda: s.peak_kv_bytes)
        m.add_gauge("kvcmas_kv_budget_bytes", "KV memory budget (bytes).", lambda: s.kv_budget)
        m.add_gauge("kvcmas_kv_stored_bytes", "KV bytes held by stored shared spans.", lambda: s.stored_bytes)
        m.add_gauge(
            "kvcmas_prefix_cache_entries",
            "Token prefixes the exact prefix cache holds.",
            lambda: s.prefix_cache.entries,
        )
        m.add_gauge(
            "kvcmas_prefix_cache_tokens",
            "Tokens of the prefix cache's entries (a run two entries share counted for each).",
            lambda: s.prefix_cache.tokens,
        )
        m.add_gauge(
            "kvcmas_kv_allocated_bytes",
            "KV block memory the engine holds: in use plus free blocks kept for reuse (bytes).",
            lambda: model.kv_bytes_allocated,
        )
        m.add_gauge(
            "kvcmas_kv_trimmed_bytes",
            "Free KV block memory handed back to the system when the server went idle, in all (bytes).",
            lambda: s.trimmed_bytes,
        )
        m.add_gauge(
            "kvcmas_estimator_bytes",
            "What the KV-correction estimators hold: learned maps plus calibration reads pending, bounded by "
            "--calibration-memory (bytes).",
            lambda: s.estimator_bytes,
        )
        m.add_gauge("kvcmas_sessions", "Sharing sessions open (workflow, cache_salt and method).", lambda: s.n_sessions)
        m.add_gauge(
            "kvcmas_namespaces",
            "Namespaces (tenant and cache_salt) whose state is kept until they have been idle for --idle-ttl.",
            lambda: s.n_namespaces,
        )
        m.add_counter(
            "kvcmas_expired_total",
            "Idle state that went, by kind: sharing sessions idle for --idle-ttl (session; their stored spans freed), "
            "namespaces idle for as long (namespace; their estimators and prefix cache entries dropped), and idle "
            "sessions closed beyond --max-sessions-per-tenant or the server's 256 (capped).",
            "kind",
            lambda: dict(s.expired),
        )
        m.add_gauge(
            "process_resident_memory_bytes",
            "Resident memory of the server process (bytes): model weights read so far, KV blocks, estimators, "
            "Python objects and the allocator's free pages.",
            resident_bytes,
        )
        m.add_gauge(
            "kvcmas_calibration_saved",
            "1 when what kvcmas learns is kept in --calibration-dir across restarts; 0 when it is kept in memory only "
            "(--no-calibration-dir, or an unusable directory with --allow-unsaved-calibration).",
            lambda: int(cfg.calibration_dir is not False and self.calibration_problem is None),
        )
        m.add_gauge(
            "kvcmas_calibration_save_failures",
            "Fitted maps kvcmas could not write to --calibration-dir since start-up (they stay in memory).",
            lambda: persist.save_failure_count(),
        )
        self._handlers: list[Callable[..., Awaitable[Any]]] = []  # the endpoints' targets (_route)
        self.app = self._build_app()

    def _check_calibration_dir(self) -> str | None:
        """Proves --calibration-dir writable before serving: a server that cannot keep what it is told to keep
        refuses to start (ValueError naming why), unless --allow-unsaved-calibration, when the problem is returned
        (reported in /health and /metrics, and logged now) and the learned maps stay in memory."""
        root = self.cfg.calibration_dir
        if root is False:
            return None
        try:
            persist.check_calibration_dir(persist.default_calibration_dir() if root is True else root, self.model)
        except ValueError as e:
            if not self.cfg.allow_unsaved_calibration:
                raise ValueError(
                    f"{e} (--no-calibration-dir keeps learned corrections in memory only; "
                    "--allow-unsaved-calibration starts anyway and reports it)"
                ) from None
            log.warning("kvcmas-server: learned corrections are kept in memory only: %s", e)
            return str(e)
        return None

    # ---------------------------------------------------------------------------------------------- the app
    def _route(self, app: FastAPI, path: str, handler: Callable[..., Awaitable[Any]], methods: list[str]) -> None:
        """Registers an endpoint that reaches `handler` (which holds this server) weakly: FastAPI keeps what it learns
        of each endpoint in module-level caches, which would keep every server built, and its model, alive until
        exit. The server owns its handlers; an app that outlives its server answers 503."""
        self._handlers.append(handler)
        target = weakref.ref(handler)

        async def endpoint(*args: Any, **kwargs: Any) -> Any:
            live = target()
            if live is None:
                raise ApiError(503, "this server has shut down", "unavailable")
            return await live(*args, **kwargs)

        endpoint.__signature__ = inspect.signature(handler, eval_str=True)  # type: ignore[attr-defined]
        endpoint.__name__ = endpoint.__qualname__ = handler.__name__
        app.add_api_route(path, endpoint, methods=methods)

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            yield
            await run_in_threadpool(self.scheduler.stop)

        app = FastAPI(title="kvcmas-server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestValidationError)
        async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
            message, param = validation_message(list(exc.errors()))
            return error_response(400, message, "invalid_request", param)

        @app.exception_handler(ApiError)
        async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
            return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

        @app.exception_handler(StarletteHTTPException)
        async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            message = f"{request.method} {request.url.path}: {exc.detail}"
            return error_response(exc.status_code, message, None, None, dict(exc.headers or {}))

        @app.exception_handler(Exception)
        async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:  # errors of the middleware itself
            log.exception("unhandled error on %s", loggable(request.url.path))
            return internal_error_response(exc)

        for prefix in ("/v1", ""):
            self._route(app, f"{prefix}/chat/completions", self.chat_completions, ["POST"])
            self._route(app, f"{prefix}/completions", self.completions, ["POST"])
            self._route(app, f"{prefix}/models", self.list_models, ["GET"])
            self._route(app, f"{prefix}/models/{{model_name:path}}", self.get_model, ["GET"])
        self._route(app, "/v1/kvcmas/workflows/{workflow:path}", self.drop_workflow, ["DELETE"])
        extra_routes = utility_routes(self)  # /v1/responses, /tokenize, /detokenize, /apply-template, /props
        for path, handler, methods in extra_routes:
            self._route(app, path, handler, methods)
        ui_routes = dashboard_routes(self, self.cfg.ui)  # /v1/kvcmas/workflows, /v1/kvcmas/summary, /ui
        for path, handler, methods in ui_routes:
            self._route(app, path, handler, methods)
        self._route(app, "/health", self.health, ["GET", "HEAD"])
        self._route(app, "/metrics", self.prometheus, ["GET"])
        known = frozenset(
            {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/chat/completions"}
            | {path for path, _, _ in extra_routes}
            | {path for path, _, _ in ui_routes if "{" not in path}
        )
        if self.cfg.cors_origins:  # off unless asked: browsers on other origins get no CORS headers
            from starlette.middleware.cors import CORSMiddleware

            app.add_middleware(
                CORSMiddleware,
                allow_origins=list(self.cfg.cors_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["Authorization", "Content-Type", "X-Api-Key"],
            )
        app.add_middleware(
            _ApiKeyAndAccounting,
            tenants=self.tenants,
            metrics=self.metrics,
            known_paths=known,
            max_body_bytes=self.cfg.max_body_bytes,
            max_inflight=self.cfg.max_inflight,
            allowed_hosts=self.cfg.host_allow_list(),
            body_timeout=self.cfg.body_timeout,
            metrics_key=self.cfg.metrics_key,
        )
        return app

    # ------------------------------------------------------------------------------------------ simple routes
    async def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": "ok", "active": self.scheduler.n_active, "queued": self.scheduler.n_queued}
        warnings = [f"calibration not saved: {self.calibration_problem}"] if self.calibration_problem else []
        warnings += [f"calibration save failed: {failure}" for failure in persist.save_failures()[-3:]]
        if warnings:
            out["warnings"] = warnings
        return out

    async def drop_workflow(self, workflow: str, request: Request) -> dict[str, Any]:
        """Ends one of the caller's workflows: its sharing sessions and their stored spans are freed (after its
        running requests). Another tenant's workflow, or none by that id: 404 (the same answer for both)."""
        if not self.scheduler.drop_workflow(request.state.tenant, workflow):
            shown = workflow.encode("utf-8", "backslashreplace").decode()
            raise ApiError(404, f"no workflow {shown!r} of yours is open", "workflow_not_found")
        return {"workflow": workflow, "deleted": True}

    async def prometheus(self, request: Request) -> PlainTextResponse:
        of = request.state.metrics_of
        text = self.metrics.render(None if of == ALL_METRICS else of)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _model_card(self) -> dict[str, Any]:
        m = self.model
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "kvcmas",
            "meta": {
                "arch": m.arch,
                "n_ctx": m.n_ctx,
                "n_ctx_train": m.n_ctx_train,
                "n_vocab": m.n_vocab,
                "n_layer": m.n_layer,
                "n_embd": m.n_embd,
                "method": self.cfg.method,
                "parallel": self.cfg.parallel,
                "kv_budget": self.scheduler.kv_budget,
            },
        }

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model_name: str) -> dict[str, Any]:
        if model_name not in self.model_names:
            raise ApiError(404, f"the model '{model_name}' does not exist", "model_not_found", "model")
        return self._model_card()

    # ---------------------------------------------------------------------------------------- generation
    def _check_logit_bias(self, parsed: ParsedRequest) -> None:
        bad = next((t for t in parsed.sampling.logit_bias or {} if t >= self.model.n_vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"logit_bias: token id {bad} is outside [0, {self.model.n_vocab})", "invalid_value", "logit_bias"
            )

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(
                400, f"unknown model '{name}': this server serves '{self.model_id}'", "model_not_found", "model"
            )

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered chat prompt (as Model.chat builds them)."""
        text = self.model.apply_chat_template(messages, add_generation_prompt=True)
        tok = self.model.tokenizer
        ids = tok.encode(text, add_special=False, parse_special=True)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id, *ids]
        return ids

    def _budget_tokens(self, n_prompt: int, requested: int | None, prompt_param: str) -> int:
        """max_tokens for the job: checks the context size and the KV budget; the default fills what is left.
        prompt_param: the field that holds the prompt (messages, prompt)."""
        n_ctx = self.model.n_ctx
        if n_prompt >= n_ctx:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; the context holds {n_ctx} (prompt plus completion)",
                "context_length_exceeded",
                prompt_param,
            )
        fitting = self.scheduler.max_tokens_fitting(n_prompt)
        if requested is None:
            limit = min(n_ctx - n_prompt, fitting, self.limits.max_tokens)
            if limit < 1:
                raise ApiError(400, f"a {n_prompt}-token prompt does not fit the KV budget", "context_length_exceeded")
            return limit
        if n_prompt + requested > n_ctx:
            raise ApiError(
                400,
                f"prompt ({n_prompt} tokens) plus max_tokens ({requested}) exceeds the context size ({n_ctx})",
                "context_length_exceeded",
                "max_tokens",
            )
        if requested > fitting:
            raise ApiError(
                400,
                f"prompt ({n_prompt} tokens) plus max_tokens ({requested}) needs more KV memory than the budget "
                f"({self.scheduler.kv_budget} bytes) allows; at most {max(fitting, 0)} new tokens fit",
                "context_length_exceeded",
                "max_tokens",
            )
        return requested

    def _deadline(self) -> float:
        """When a request arriving now must be done (time.perf_counter() clock)."""
        return time.perf_counter() + self.cfg.request_timeout

    def _submit(self, job: Job) -> None:
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            self.metrics.bump("rejected_queue_full")
            raise ApiError(429, str(e), "queue_full", headers={"Retry-After": str(e.retry_after)}) from None

    @staticmethod
    def _event_queue() -> tuple[asyncio.Queue[Event], Callable[[Event], None]]:
        """A queue the scheduler thread can feed (events are posted to the running event loop)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
                loop.call_soon_threadsafe(queue.put_nowait, event)

        return queue, sink

    async def _next_event(self, queue: asyncio.Queue[Event], request: Request) -> Event | None:
        """The job's next event, or None when the client went away first. The client is checked every
        DISCONNECT_POLL_S seconds even while events keep coming (a long answer to a client that left)."""
        while True:
            now = time.monotonic()
            if now - getattr(request.state, "disconnect_checked", 0.0) >= DISCONNECT_POLL_S:
                request.state.disconnect_checked = now
                if await request.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def _parse(self, kind: Literal["chat", "completion"], request: Request) -> ParsedRequest:
        """Reads the body (at most --max-body-bytes, whatever Content-Length said) and validates it."""
        raw = await self.read_body(request)
        if len(raw) < 65536:
            return parse_request(kind, raw, self.limits)
        return await run_in_threadpool(parse_request, kind, raw, self.limits)  # big bodies: off the event loop

    async def read_body(self, request: Request) -> bytes:
        """The request body, at most --max-body-bytes (413 beyond, whatever Content-Length said)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.limits.max_body_bytes:
                    self.metrics.bump("rejected_body_too_large")
                    raise ApiError(
                        413,
                        f"the request body is over the limit of {self.limits.max_body_bytes} bytes",
                        "body_too_large",
                    )
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
            raise ApiError(499, "the client disconnected while sending the body", "client_disconnected") from None
        return b"".join(chunks)

    async def _encode_image(self, data: bytes, namespace: Namespace, view: str | None = None) -> np.ndarray:
        """The image's embeddings [n, n_embd] in a view (VisionEncoder.view_for), from the cache when the same bytes
        came before in that view."""
        key = (namespace, hashlib.sha256(data).hexdigest(), view)
        if key not in self._images:
            try:
                async with self._image_decodes:  # bounded concurrency: each decode may hold its decoded bytes
                    encoded: np.ndarray = await run_in_threadpool(self.vision.encode, data, view)
            except ValueError as e:  # ImageError, KvcmasError: unusable image
                raise ApiError(400, f"image_url: {e}", "invalid_image", "messages") from None
            self._images[key] = encoded
            self.metrics.bump("images_encoded")
            n_tenants = max(1, len(self.tenants.keys))
            count_cap, byte_cap = max(1, IMAGE_CACHE // n_tenants), self.cfg.image_cache_bytes // n_tenants
            own = [k for k in self._images if k[0].tenant == namespace.tenant]  # oldest first; the new one last
            held = sum(self._images[k].nbytes for k in own)
            while len(own) > 1 and (len(own) > count_cap or held > byte_cap):
                held -= self._images[own[0]].nbytes
                del self._images[own.pop(0)]
        self._images.move_to_end(key)
        return self._images[key]

    async def _image_prompt(
        self, body: ChatCompletionRequest, image_data: list[bytes], namespace: Namespace
    ) -> tuple[list[dict[str, Any]], list[Segment]]:
        """A chat with images as (messages whose contents hold the images' embeddings between their texts, for a
        sharing session; the rendered prompt as text-id and embedding segments, for a plain prefill)."""
        # AnyRes models: detail "low", and OneVision's rule for several images per prompt, take the single view
        details = [p.image_url.detail for m in body.messages if isinstance(m.content, list) for p in m.content
                   if isinstance(p, ImagePart)]  # fmt: skip
        views = [self.vision.view_for(len(image_data), detail) for detail in details]
        images = [await self._encode_image(data, namespace, view) for data, view in zip(image_data, views, strict=True)]
        marker = f"<kvcmas-image-{uuid.uuid4().hex}>"
        n_images = 0

        def mark(url: str) -> str:
            nonlocal n_images
            n_images += 1
            return f"{marker}{n_images - 1}{marker}"

        marked = body.plain_messages(mark)
        messages: list[dict[str, Any]] = []
        for msg in marked:
            pieces = msg["content"].split(marker)  # text, index, text, index, ..., text
            if len(pieces) == 1:
                messages.append(msg)
                continue
            parts: list[str | np.ndarray] = [images[int(p)] if i % 2 else p for i, p in enumerate(pieces)]
            messages.append({**msg, "content": [p for p in parts if not isinstance(p, str) or p]})
        text = await run_in_threadpool(self.model.apply_chat_template, marked, True)
        # the model's own tokens around an image (Qwen2.5-VL: <|vision_start|> ... <|vision_end|>), as its template
        # writes them for an image part
        before, after = self.vision.image_tokens
        for i in range(n_images):
            text = text.replace(f"{marker}{i}{marker}", f"{before}{marker}{i}{marker}{after}")
        tok = self.model.tokenizer
        segments: list[Segment] = []
        for i, piece in enumerate(text.split(marker)):
            if i % 2:
                segments.append(images[int(piece)])
                continue
            ids = await run_in_threadpool(tok.encode, piece, False, True)
            if i == 0 and tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
                ids = [tok.bos_id, *ids]
            segments.append(ids)
        return messages, segments

    async def chat_completions(self, request: Request) -> Response:
        return await self.chat(await self._parse("chat", request), request)

    async def chat(self, parsed: ParsedRequest, request: Request) -> Response:
        """A validated chat request, answered as chat.completion (or its chunks); /v1/responses goes through here."""
        body = parsed.body
        assert isinstance(body, ChatCompletionRequest)
        self._check_model(body.model)
        self._check_logit_bias(parsed)
        namespace = Namespace(request.state.tenant, body.cache_salt or "")
        segments: list[Segment] | None = None
        if not (body.has_images() and self.vision is not None):
            try:
                messages = body.plain_messages()
            except ValueError as e:  # image parts without --mmproj
                raise ApiError(400, str(e), "invalid_content", "messages") from None
        try:
            if body.has_images() and self.vision is not None:
                messages, segments = await self._image_prompt(body, parsed.images, namespace)
                ids = [t for seg in segments if isinstance(seg, list) for t in seg]
                n_prompt = sum(len(seg) for seg in segments)
            else:
                ids = await run_in_threadpool(self._chat_ids, messages)
                n_prompt = len(ids)
        except ValueError as e:  # ChatTemplateError, or text the tokenizer refuses (lone surrogates)
            raise ApiError(400, f"the messages cannot be rendered: {e}", "invalid_messages", "messages") from None
        max_tokens = self._budget_tokens(n_prompt, parsed.max_tokens, "messages")
        plan = await run_in_threadpool(output_plan, body, self.model, ids)  # tools, response_format, reasoning
        options = body.kvcmas
        method = (options.method if options else None) or self.cfg.method
        workflow = (options.workflow if options else None) or DEFAULT_WORKFLOW
        agent = options.agent if options else None
        if agent is None and (messages[0]["role"] != "system" or not messages[0]["content"]):
            agent = "assistant"  # no role prompt: every such request is the same anonymous agent
        queue, sink = self._event_queue()
        job = Job(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            ids=ids,
            max_tokens=max_tokens,
            reserve=max_tokens if parsed.max_tokens is not None else min(max_tokens, GENERATION_RESERVE),
            params=parsed.sampling,
            n=body.n,
            logprobs=parsed.logprobs,
            stops=parsed.stops,
            sink=sink,
            deadline=self._deadline(),
            messages=messages,
            agent=agent,
            session_key=SessionKey(namespace, workflow, method),
            recompute=options.recompute if options and options.recompute is not None else self.cfg.recompute,
            segments=segments,
            n_prompt=n_prompt,
            constraint=plan.constraint,
        )
        self._submit(job)
        extra: dict[str, Any] = {"workflow": workflow, "agent": agent}
        if segments is not None:
            extra["images"] = sum(isinstance(seg, np.ndarray) for seg in segments)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self._respond(job, queue, request, "chat", body.stream, include_usage, extra, "", plan.reply)

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse("completion", request)
        body = parsed.body
        assert isinstance(body, CompletionRequest)
        self._check_model(body.model)
        self._check_logit_bias(parsed)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < self.model.n_vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside [0, {self.model.n_vocab})", "invalid_value", "prompt")
            prompt_text = self.model.detokenize(ids) if body.echo else ""
        else:
            prompt_text = str(prompt[0]) if isinstance(prompt, list) else str(prompt)
            try:
                ids = await run_in_threadpool(self.model.tokenize, prompt_text, True)
            except ValueError as e:  # lone surrogates and other text the tokenizer refuses
                raise ApiError(400, f"prompt: {e}", "invalid_value", "prompt") from None
        max_tokens = self._budget_tokens(len(ids), parsed.max_tokens, "prompt")
        queue, sink = self._event_queue()
        job = Job(
            id=f"cmpl-{uuid.uuid4().hex[:24]}",
            ids=ids,
            max_tokens=max_tokens,
            reserve=max_tokens if parsed.max_tokens is not None else min(max_tokens, GENERATION_RESERVE),
            params=parsed.sampling,
            n=body.n,
            logprobs=parsed.logprobs,
            stops=parsed.stops,
            sink=sink,
            deadline=self._deadline(),
            namespace=Namespace(request.state.tenant, body.cache_salt or ""),
        )
        self._submit(job)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = prompt_text if body.echo else ""
        return await self._respond(job, queue, request, "completion", body.stream, include_usage, {}, echo)

    async def _respond(
        self,
        job: Job,
        queue: asyncio.Queue[Event],
        request: Request,
        kind: str,
        stream: bool,
        include_usage: bool,
        extra: dict[str, Any],
        echo: str,
        reply: ReplyFormat | None = None,
    ) -> Response:
        """Waits for the first event (so early failures keep their status code), then answers or streams. reply:
        how a chat reply is read (reasoning, tool calls; None: plain text)."""
        first = await self._next_event(queue, request)
        if first is None:
            self.scheduler.cancel(job)
            return Response(status_code=499)
        if isinstance(first, Failed):
            self.scheduler.cancel(job)  # the other choices (n > 1)
            raise ApiError(first.status, first.message, first.code)
        choices = self._new_choices(job, kind, echo, reply)
        if not stream:
            dones: list[Done] = []
            event: Event | None = first
            while True:
                if event is None or isinstance(event, Failed):
                    self.scheduler.cancel(job)
                    if event is None:
                        return Response(status_code=499)
                    raise ApiError(event.status, event.message, event.code)
                if isinstance(event, Done):
                    choices[event.index].on_done(event)
                    dones.append(event)
                    if len(dones) == len(choices):
                        break
                else:
                    choices[event.index].on_delta(event)
                event = await self._next_event(queue, request)
            dones.sort(key=lambda d: d.index)
            self._log_done(job, kind, dones[0])
            return JSONResponse(self._final_body(job, kind, choices, dones, extra))
        return StreamingResponse(
            self._stream(job, queue, kind, first, include_usage, extra, choices),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _new_choices(self, job: Job, kind: str, echo: str, reply: ReplyFormat | None) -> list[Choice]:
        tok = self.model.tokenizer
        return [Choice(i, kind, tok, reply, echo) for i in range(job.n)]

    async def _stream(
        self,
        job: Job,
        queue: asyncio.Queue[Event],
        kind: str,
        first: Event,
        include_usage: bool,
        extra: dict[str, Any],
        choices: list[Choice],
    ) -> AsyncIterator[bytes]:
        finished = False
        created = int(time.time())
        dones: list[Done] = []
        try:
            for c in choices:
                if kind == "chat":
                    opening: dict[str, Any] = {"role": "assistant", "content": ""}
                    yield _sse(self._chunk(job, kind, created, [c._stream_choice(opening, None, None)]))
                if c.echo_len:
                    yield _sse(self._chunk(job, kind, created, [c._stream_choice(c.text[0], None, None)]))
            event = first
            while True:
                if isinstance(event, Failed):
                    finished = True
                    self.scheduler.cancel(job)  # the other choices (n > 1)
                    yield _sse(error_body(event.status, event.message, event.code))
                    break
                if isinstance(event, Done):
                    dones.append(event)
                    last = choices[event.index].on_done(event)
                    for part in last[:-1]:
                        yield _sse(self._chunk(job, kind, created, [part]))
                    chunk = self._chunk(job, kind, created, last[-1:])
                    if len(dones) == len(choices):
                        finished = True
                        dones.sort(key=lambda d: d.index)
                        self._log_done(job, kind, dones[0])
                        extras = self._extras(job, dones, extra)
                        # include_usage: OpenAI's shape, usage in the last chunk only (clients add usages up)
                        usage = extras.pop("usage") if include_usage else None
                        yield _sse({**chunk, **extras})
                        if usage is not None:
                            yield _sse({**self._chunk(job, kind, created, []), "usage": usage})
                        break
                    yield _sse(chunk)
                else:
                    for part in choices[event.index].on_delta(event):
                        yield _sse(self._chunk(job, kind, created, [part]))
                event = await queue.get()
            yield _sse("[DONE]")
        finally:
            if not finished:  # the client went away (the task was cancelled) or the stream broke
                self.scheduler.cancel(job)

    # ------------------------------------------------------------------------------------------- bodies
    def _chunk(self, job: Job, kind: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        return {"id": job.id, "object": obj, "created": created, "model": self.model_id, "choices": choices}

    @staticmethod
    def _usage(dones: list[Done]) -> dict[str, Any]:
        """The prompt once (n > 1 choices are forks of one prefill), the completions of every choice."""
        s = dones[0].stats
        completion = sum(d.stats["completion_tokens"] for d in dones)
        return {
            "prompt_tokens": s["prompt_tokens"],
            "completion_tokens": completion,
            "total_tokens": s["prompt_tokens"] + completion,
            "prompt_tokens_details": {"cached_tokens": s["reused_tokens"]},
        }

    def _extras(self, job: Job, dones: list[Done], extra: dict[str, Any]) -> dict[str, Any]:
        """usage, timings and kvcmas of a finished response; recorded in the caller's history (dashboard.py)."""
        s = dones[0].stats
        timings = {
            "prompt_n": s["prompt_tokens"] - s["reused_tokens"],
            "cache_n": s["reused_tokens"],
            "prompt_ms": round(s["prompt_ms"], 3),
            "prompt_per_second": round(s["prompt_per_second"], 2),
            "predicted_n": s["completion_tokens"],
            "predicted_ms": round(s["predicted_ms"], 3),
            "predicted_per_second": round(s["predicted_per_second"], 2),
            "queue_ms": round(s["queue_ms"], 3),
            "wait_ms": round(s["wait_ms"], 3),
            "engine_ms": round(s["engine_ms"], 3),
            "session_ms": round(s["session_ms"], 3),
            "interleaved_ms": round(s["interleaved_ms"], 3),
            "ttft_ms": round(s["ttft_ms"], 3),
        }
        kvcmas = {
            "method": s["method"],
            "reused_tokens": s["reused_tokens"],
            "computed_tokens": s["computed_tokens"],
            "recomputed_tokens": s["recomputed_tokens"],
            "mode": s["mode"],
            "gate": s["gate"],
            "kv_bytes": s["kv_bytes"],
            "corr_bytes": s["corr_bytes"],
            "prefix_cached_tokens": s["prefix_cached_tokens"],
            "span_tokens": s["span_tokens"],
            "calibration_tokens_scheduled": s["calibration_tokens_scheduled"],
            "dense_reason": s["dense_reason"],
            **extra,
        }
        if self.cfg.replica is not None:
            kvcmas["replica"] = self.cfg.replica
        extras = {"usage": self._usage(dones), "timings": timings, "kvcmas": kvcmas}
        record_response(self.history, job, extras, s)
        return extras

    def _final_body(
        self, job: Job, kind: str, choices: list[Choice], dones: list[Done], extra: dict[str, Any]
    ) -> dict[str, Any]:
        obj = "chat.completion" if kind == "chat" else "text_completion"
        body = {
            "id": job.id,
            "object": obj,
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [c.final() for c in choices],
        }
        body.update(self._extras(job, dones, extra))
        return body

    def _log_done(self, job: Job, kind: str, done: Done) -> None:
        s = done.stats
        log.info(
            "%s %s: prompt %d (reused %d) + %d tokens, %s, ttft %.0f ms = queue %.0f + wait %.0f + prefill %.0f "
            "(engine %.0f, session %.0f, others' work %.0f), %.1f tok/s, method %s (%s), agent %s",
            kind,
            job.id,
            s["prompt_tokens"],
            s["reused_tokens"],
            s["completion_tokens"],
            done.finish_reason,
            s["ttft_ms"],
            s["queue_ms"],
            s["wait_ms"],
            s["prompt_ms"],
            s["engine_ms"],
            s["session_ms"],
            s["interleaved_ms"],
            s["predicted_per_second"],
            s["method"],
            s["gate"] or s["mode"],
            loggable(str(job.agent)),
        )
