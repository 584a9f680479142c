"""What stands in front of every route: API keys and tenants, the Host check, bodies read within their limits,
the in-flight limit and the request counts (ApiKeyAndAccounting, a pure ASGI middleware), errors in OpenAI's shape,
and uvicorn's h11 protocol with a deadline for the request headers (HeaderTimeoutH11)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from fastapi.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, host_name, loopback_host
from .dashboard import UI_PATHS
from .metrics import Metrics
from .validation import DEFAULT_MAX_BODY_BYTES, error_body, loggable

log = logging.getLogger("kvcmas.server")


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def internal_error_response(exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")


ALL_METRICS = "\x00all"  # a /metrics request that sees the whole server's (no tenant has this name: names are words)
JSON_MEDIA_TYPES = frozenset({"application/json"})
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Tenants:
    """API keys -> tenants. Each key is its own tenant: sharing (spans, prefix caches, what the estimators learn from)
    and workflow ids never cross tenants. Without keys every client is the one tenant LOCAL_TENANT."""

    LOCAL_TENANT = "local"

    def __init__(self, api_key: str | None = None, key_file: str | None = None) -> None:
        self.keys: dict[bytes, str] = {}
        # tenant -> the LoRA adapters it may use (server/lora.py); a tenant not here may use every one
        self.adapters: dict[str, frozenset[str]] = {}
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
        """One key per line, `NAME KEY` or just `KEY` (the tenant is then named by the key's hash); '#' comments.
        `NAME KEY adapters=a,b` limits the tenant to those LoRA adapters (and the base model; `adapters=`: the base
        only)."""
        try:
            lines = open(path, encoding="utf-8").read().splitlines()  # noqa: SIM115 (read at once)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {path}: cannot read it: {e}") from None
        for n, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            limit = words.pop() if len(words) == 3 and words[2].startswith("adapters=") else None
            if len(words) > 2 or (limit is None and len(words) == 2 and words[1].startswith("adapters=")):
                raise ValueError(f"--api-key-file {path}, line {n}: expected `NAME KEY [adapters=a,b]` or `KEY`")
            key = words[-1]
            name = words[0] if len(words) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
            self._add(key, name, f"--api-key-file {path}, line {n}")
            if limit is not None:
                self.adapters[name] = frozenset(a for a in limit.removeprefix("adapters=").split(",") if a)
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


class ApiKeyAndAccounting:
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
                receive = replay_body(body, receive)
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


def replay_body(body: bytes, receive: Receive) -> Receive:
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
