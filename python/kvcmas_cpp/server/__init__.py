"""kvcmas-server: an OpenAI-compatible local server that shares KV across agents by itself.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming SSE and not), GET /v1/models, GET /health,
GET /metrics (Prometheus text). Requests may carry ``"kvcmas": {"workflow": ..., "agent": ..., "method": ...}``
to group agents of one workflow into one sharing session; requests without it share the server's default session.

Run it as ``kvcmas-server --model PATH`` or ``kvcmas serve``.

Safe defaults: binds 127.0.0.1; no CORS unless --cors-origin; the API key (--api-key) is compared in constant time;
limits on the body size (--max-body-bytes, 413), max_tokens (--max-tokens-limit, 400), images per request
(--max-images, 400), requests in flight (--max-inflight, 503 + Retry-After), waiting requests (--max-queue, 429 +
Retry-After) and time per request (--request-timeout, 408; its KV is freed); SIGTERM drains within --shutdown-timeout.
No endpoint reads or writes files: images come only as data URLs.
"""

from __future__ import annotations

from .cli import add_serve_arguments, build_server, main, parse_bytes, run_serve

__all__ = ["add_serve_arguments", "build_server", "main", "parse_bytes", "run_serve"]
