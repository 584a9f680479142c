"""`kvcmas-server` / `kvcmas serve`: the command line (argparse), building the Server from it, and serving it
with uvicorn until interrupted (SIGTERM drains within --shutdown-timeout)."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..arguments import DocsFormatter, add_engine_arguments, engine_options, port, positive_float, positive_int

if TYPE_CHECKING:
    from .app import Server

__all__ = ["add_serve_arguments", "main", "parse_bytes", "run_serve"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1048576', '512M', '1.5GiB', '64mb' -> bytes (binary multiples). Raises argparse.ArgumentTypeError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 536870912, 512M, 2GiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return value


def _budget(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _cannot_listen(host: str, port: int) -> str | None:
    """Why host:port cannot be bound (taken, not an address of this machine, not permitted), or None. Checked before
    the model loads, so a wrong address fails at once and plainly; uvicorn still reports a port taken in between."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"cannot resolve host {host!r}: {e}"
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            probe.bind(address)
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's command-line options (shared by `kvcmas-server` and `kvcmas serve`)."""
    from ..sharing.methods import SERVED_METHODS

    p.add_argument("-m", "--model", help="GGUF file or model name (default: SmolLM2-135M)")
    p.add_argument("--mmproj", default=None, help="vision tower + projector GGUF: accept image_url parts (data URLs)")
    p.add_argument("--alias", default=None, help="model id the API reports (default: the file name without .gguf)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="GGUF LoRA adapter of the model (`kvcmas convert-lora` writes one), served under NAME (default: the "
        'file stem): a request picks it by "model": NAME or llama.cpp\'s "lora": [{"id": 0, "scale": 1.0}] '
        "(docs/adapters.md); repeat for more",
    )
    p.add_argument(
        "--chat-template-file",
        default=None,
        help="Jinja chat template used instead of the model file's (as llama.cpp's; its tool-call format and "
        "reasoning follow it)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="API keys, one per line as `NAME KEY` or `KEY`; each key is its own tenant (sharing and workflow ids "
        "never cross tenants)",
    )
    p.add_argument(
        "--metrics-key",
        default=None,
        metavar="KEY",
        help="the key whose GET /metrics shows the whole server's metrics; a tenant's API key shows only its own "
        "requests' counters. Without it, with API keys, the whole server's go to keyless requests from loopback",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a Host header name to serve besides localhost/127.0.0.1/[::1] (repeatable; '*' for any). Bound to "
        "loopback, other Host names are refused (DNS rebinding)",
    )
    p.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request body may take to arrive once its headers are in; then 408 (default 30)",
    )
    p.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a connection may take to send a request's line and headers; then it is closed (default 10)",
    )
    p.add_argument("-np", "--parallel", type=positive_int, default=8, help="sequences generated at once (default 8)")
    p.add_argument("-c", "--ctx-size", type=positive_int, default=None, help="most tokens per sequence")
    p.add_argument(
        "--kv-budget",
        type=parse_bytes,
        default=None,
        help="bytes all KV memory may take, e.g. 512M (default: the engine's, four full sequences)",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--method", choices=SERVED_METHODS, default="kvcmas", help="KV sharing across agents (default kvcmas)"
    )
    p.add_argument(
        "--recompute",
        type=_budget,
        default=0.0,
        help="share of the shared rows later agents recompute in their own context, 0..1 (default 0: pure reuse)",
    )
    p.add_argument("-t", "--threads", type=positive_int, default=None, help="compute threads (default: all cores)")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for a slot; beyond it: 429 (default 64)"
    )
    p.add_argument(
        "--max-inflight",
        type=positive_int,
        default=256,
        help="HTTP requests handled at once (/health and /metrics aside); beyond it: 503 with Retry-After "
        "(default 256)",
    )
    p.add_argument(
        "--max-body-bytes", type=parse_bytes, default="8M", help="largest request body; beyond it: 413 (default 8M)"
    )
    p.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=4096,
        help="most new tokens one request may ask for (larger max_tokens: 400) or get by default (default 4096)",
    )
    p.add_argument(
        "--max-text-chars",
        type=positive_int,
        default=None,
        help="characters of text one request may have tokenized or rendered (chat messages, completion prompts, "
        "/tokenize, /apply-template); beyond it: 413 (default: 32 per context token, 262144 for an 8192-token "
        "context)",
    )
    p.add_argument("--max-images", type=int, default=8, help="image parts per chat request; beyond it: 400 (default 8)")
    p.add_argument(
        "--max-image-memory",
        type=parse_bytes,
        default="256M",
        help="memory decoding one image may take, judged from its header before decoding (two decode at once); "
        "beyond it: 400 (default 256M)",
    )
    p.add_argument(
        "--image-cache-memory",
        type=parse_bytes,
        default="256M",
        help="memory the encoded images kept for reuse may take, split evenly among the tenants (an AnyRes photo's "
        "rows take tens of MB); the least recently used go first (default 256M)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a request may take from arrival to its last token; then it ends with 408 and its KV is freed "
        "(default 600)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=positive_float,
        default=10.0,
        help="on SIGTERM/SIGINT: seconds running requests get to finish before they are ended (default 10)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from this origin (repeatable; '*' for any). Default: no CORS",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=128,
        help="prompt rows computed per step, each step with the next token of every generating request; "
        "shorter prompts' prefills run between chunks, the shortest prompt first (default 128)",
    )
    p.add_argument(
        "--calibration-memory",
        type=parse_bytes,
        default=512 << 20,
        help="memory kvcmas' estimators of all tenants and cache_salts together may hold: training statistics of "
        "edges still calibrating (~17 MB an edge for SmolLM2-135M, whatever the span) and fitted maps, e.g. 512M "
        "(the default)",
    )
    p.add_argument(
        "--cold",
        choices=("reuse", "dense"),
        default="reuse",
        help="kvcmas before an edge is calibrated: reuse its spans uncorrected (fullshared with exact head and "
        "tail; the exact rows for calibration are computed after the reply) or compute them densely (default reuse)",
    )
    cal = p.add_mutually_exclusive_group()
    cal.add_argument(
        "--calibration-dir",
        default=None,
        help="where kvcmas keeps learned corrections across restarts, per model (default: $XDG_CACHE_HOME/kvcmas, "
        "i.e. ~/.cache/kvcmas)",
    )
    cal.add_argument("--no-calibration-dir", action="store_true", help="keep learned corrections in memory only")
    p.add_argument(
        "--allow-unsaved-calibration",
        action="store_true",
        help="start even when the calibration directory cannot be written (a file, not writable): learned "
        "corrections are then kept in memory only, and /health, /metrics and the start-up log say so (default: "
        "refuse to start)",
    )
    p.add_argument(
        "--idle-ttl",
        type=float,
        default=600.0,
        help="seconds after which an idle sharing session is closed (its stored spans freed) and a namespace "
        "(tenant and cache_salt) with no request forgets its estimator and prefix cache entries; 0: never "
        "(default 600)",
    )
    p.add_argument(
        "--max-sessions-per-tenant",
        type=positive_int,
        default=64,
        help="sharing sessions (workflow x cache_salt x method) one tenant may hold; beyond it its least recently "
        "used idle one is closed (default 64)",
    )
    p.add_argument(
        "--no-ui",
        action="store_true",
        help="do not serve the page at /ui (workflows, spans and savings; docs/ui.md); its JSON endpoints stay",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def build_server(args: argparse.Namespace, replica: str | None = None) -> Server:
    """The model and the Server (app and scheduler) that `args` (from add_serve_arguments) describe, not yet
    serving. replica: the name this server answers in each response's `kvcmas.replica` (kvcmas.cluster)."""
    from ..model import Model, resolve_model_path
    from .app import Server, ServerConfig

    if args.max_queue < 0 or args.max_images < 0 or args.idle_ttl < 0:
        raise ValueError("--max-queue, --max-images and --idle-ttl must be >= 0")
    path = resolve_model_path(args.model)
    model = Model(path, n_threads=args.threads, n_ctx=args.ctx_size, kv_budget=args.kv_budget, **engine_options(args))
    if args.chat_template_file is not None:
        try:
            model.tokenizer.chat_template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template-file {args.chat_template_file}: {e}") from None
    cfg = ServerConfig(
        model_path=path,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        parallel=args.parallel,
        ctx_size=args.ctx_size,
        kv_budget=args.kv_budget,
        method=args.method,
        recompute=args.recompute,
        threads=args.threads,
        max_queue=args.max_queue,
        alias=args.alias,
        mmproj=args.mmproj,
        max_body_bytes=args.max_body_bytes,
        max_tokens=args.max_tokens_limit,
        max_images=args.max_images,
        max_inflight=args.max_inflight,
        request_timeout=args.request_timeout,
        cors_origins=tuple(args.cors_origin),
        prefill_chunk=args.prefill_chunk,
        calibration_bytes=args.calibration_memory,
        cold=args.cold,
        calibration_dir=False if args.no_calibration_dir else (args.calibration_dir or True),
        allowed_hosts=tuple(args.allowed_host),
        max_image_memory=args.max_image_memory,
        image_cache_bytes=args.image_cache_memory,
        body_timeout=args.body_timeout,
        header_timeout=args.header_timeout,
        replica=replica,
        max_text_chars=args.max_text_chars,
        allow_unsaved_calibration=args.allow_unsaved_calibration,
        idle_ttl=args.idle_ttl if args.idle_ttl > 0 else None,
        max_tenant_sessions=args.max_sessions_per_tenant,
        metrics_key=args.metrics_key,
        ui=not args.no_ui,
        loras=tuple(getattr(args, "lora", None) or ()),
    )
    return Server(cfg, model)


def run_serve(args: argparse.Namespace) -> int:
    """Loads the model and serves until interrupted. Returns the exit status."""
    import uvicorn

    from .backend import agents_available
    from .http_guard import HeaderTimeoutH11

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("kvcmas.server")
    if args.max_queue < 0 or args.max_images < 0:
        print("kvcmas-server: error: --max-queue and --max-images must be >= 0", file=sys.stderr)
        return 2
    problem = _cannot_listen(args.host, args.port)
    if problem is not None:
        print(f"kvcmas-server: error: {problem}", file=sys.stderr)
        return 1
    server = build_server(args)
    cfg, model = server.cfg, server.model
    sharing = "agent sessions" if agents_available() else "no agents module: every method runs nonshared"
    log.info(
        "kvcmas-server: %s (%s, n_ctx %d, %d threads), method %s (%s), parallel %d, KV budget %d bytes, "
        "listening on http://%s:%d",
        server.model_id,
        model.arch,
        model.n_ctx,
        model.n_threads,
        cfg.method,
        sharing,
        cfg.parallel,
        server.scheduler.kv_budget,
        cfg.host,
        cfg.port,
    )
    if cfg.ui:
        shown = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        log.info("kvcmas-server: workflows, spans and savings at http://%s:%d/ui", shown, cfg.port)
    # Drain on SIGTERM/SIGINT: uvicorn stops accepting connections at once and waits for running requests; those
    # still running after --shutdown-timeout seconds are ended by the scheduler (a 503 / an SSE error event, then the
    # stream closes), so every response ends cleanly before uvicorn's own deadline (a little later) would cancel it.
    # uvicorn re-raises the signal it caught with the handler found here once it is done: a handler that only notes
    # it makes a drained shutdown exit 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    protocol = type("KvcmasH11", (HeaderTimeoutH11,), {"header_timeout": cfg.header_timeout})
    config = uvicorn.Config(
        server.app,
        host=cfg.host,
        port=cfg.port,
        http=protocol,
        loop="asyncio",  # the loop it is tested on, also where an extra installed uvloop (kvcmas_cpp[cluster])
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    )
    http_server = uvicorn.Server(config)

    def end_requests_at_deadline() -> None:
        while not http_server.should_exit:
            time.sleep(0.05)
        log.info("kvcmas-server: draining (at most %.1f s)", args.shutdown_timeout)
        deadline = time.monotonic() + args.shutdown_timeout
        while time.monotonic() < deadline and (server.scheduler.n_active or server.scheduler.n_queued):
            time.sleep(0.05)
        server.scheduler.stop()  # ends what still runs with 503 server_shutting_down

    drain = threading.Thread(target=end_requests_at_deadline, name="kvcmas-drain", daemon=True)
    drain.start()
    try:
        http_server.run()
    except SystemExit as e:  # uvicorn's way out of a failed start (it has logged why)
        http_server.should_exit = True  # the drain thread stops the scheduler and lets go of the engine
        drain.join(timeout=args.shutdown_timeout + 5)
        return e.code if isinstance(e.code, int) else 1
    log.info("kvcmas-server: shut down")
    return 0


# the one line atop `kvcmas-server --help` (`kvcmas serve --help` says the same)
DESCRIPTION = "kvcmas-server: an OpenAI-compatible local server that shares KV across agents by itself (docs/server.md)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvcmas-server` console script."""
    parser = argparse.ArgumentParser(prog="kvcmas-server", description=DESCRIPTION, formatter_class=DocsFormatter)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"kvcmas-server: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
