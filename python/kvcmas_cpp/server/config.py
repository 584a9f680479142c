"""The server's settings (ServerConfig: `kvcmas-server --help` fills it) and their defaults."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .scheduler import CALIBRATION_BYTES, PREFILL_CHUNK
from .sessions import IDLE_TTL_S, MAX_TENANT_SESSIONS
from .validation import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_IMAGES, DEFAULT_MAX_TOKENS

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


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


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
    loras: tuple[str, ...] = ()  # --lora NAME=PATH or PATH: LoRA adapters loaded at start (server/lora.py)
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
