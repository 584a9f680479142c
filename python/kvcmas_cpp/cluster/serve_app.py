"""The Ray Serve applications: one per engine rank and a stateless HTTP ingress (config.py writes their config).

Engine application and deployment `kvcmas-engine-<rank>` (one replica each, `engine`): runs the kvcmas server
in-process, the same Server (FastAPI app and scheduler) `kvcmas-server` serves, built from the same command-line
arguments; the ingress calls its ASGI app directly through `Engine.forward` (no HTTP hop, no port per replica).
Serve health-checks it and replaces it when it dies; the replacement keeps the rank, so the hashing below sends it
the same workflows. Each rank is an application of its own so that adding or removing ranks leaves the others'
replicas running (config.py says why).

Ingress application `kvcmas` (`ingress`, deployment `kvcmas-ingress`): the OpenAI endpoints of kvcmas-server. Each
request goes to the first rank of `rendezvous_order(routing_key(...))` (see routing.py); before any byte of the
answer has come back, a failed rank (its actor died, it is down, or it is not deployed yet) is replaced once by the
next rank, where the request runs dense. Keys that failed over stay on the rank that now holds their spans (a
bounded per-ingress memory, `MOVED_KEYS`): later hops share again there, and the key's DELETE reaches it. `/health`
and `/metrics` cover every rank (labelled `replica`).

Ray Serve's own `ConsistentHashRouter` was not used: its ring hashes a replica's unique id, which changes when Serve
replaces the replica, so a replacement would take keys from every survivor (docs/cluster.md).
"""

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import DeploymentUnavailableError, RayServeException, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from ..server.http_guard import replay_body
from ..server.replies import sse_event
from ..server.validation import DEFAULT_MAX_BODY_BYTES, error_body
from .config import APP_NAME, engine_args, engine_name, ingress_args, parse_server_args
from .routing import SESSION_HEADER, rendezvous_order, routing_key, workflow_key

log = logging.getLogger("kvcmas.cluster")

INGRESS_NAME = "kvcmas-ingress"
MOVED_KEYS = 100_000  # failed-over keys remembered per ingress replica (LRU): past it, the oldest return home
HEALTH_TIMEOUT_S = 5.0  # per rank, for /health and /metrics
DOWN_POLL_S = 0.5  # how often a request waiting for its first byte checks that its rank still has a live replica
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


def replica_name(rank: int) -> str:
    return f"r{rank}"


class _ReplicaDown(Exception):
    """The rank has no live replica (its actor died or Serve is replacing it)."""


def _cancel(gen: Any) -> None:
    """Cancels a handle call, best effort: Serve's cancel() re-raises the call's own error (a deployment scaled away:
    DeploymentUnavailableError) when the call already failed."""
    with contextlib.suppress(Exception):
        gen.cancel()


async def _collect(gen: Any) -> list[dict[str, Any]]:
    return [m async for m in gen]


async def _body(gen: Any, sse: bool) -> AsyncIterator[bytes]:
    """The rest of an answer's body. A replica that dies mid-answer cannot be retried (bytes were sent): an event
    stream (sse) then ends with an error event in the shape the server's own stream errors have (code
    `replica_lost`, no `[DONE]`); any other body ends short."""
    try:
        async for message in gen:
            if message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
    except (ray.exceptions.RayError, RayServeException) as e:
        log.warning("a replica died mid-answer: %s", e)
        if sse:
            why = "the replica serving this stream was lost mid-answer; the answer is incomplete: send it again"
            yield sse_event(error_body(503, why, "replica_lost"))
    finally:
        _cancel(gen)


def _labelled(sample: str, replica: str) -> str:
    """A Prometheus sample line with replica="..." added first among its labels."""
    label = f'replica="{replica}"'
    brace, space = sample.find("{"), sample.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        return f"{sample[:space]}{{{label}}}{sample[space:]}"
    sep = "" if sample[brace + 1 : brace + 2] == "}" else ","
    return f"{sample[: brace + 1]}{label}{sep}{sample[brace + 1 :]}"


@serve.deployment(max_ongoing_requests=1000, health_check_period_s=2, health_check_timeout_s=30)
class Engine:
    """One kvcmas server in this replica's process (rank: its stable slot; server_args: kvcmas-server arguments)."""

    def __init__(self, rank: int, server_args: list[str]) -> None:
        from ..server import build_server

        args = parse_server_args(server_args)
        logging.basicConfig(level=getattr(logging, args.log_level.upper()))
        self.rank = rank
        self.started = time.time()
        self.server = build_server(args, replica=replica_name(rank))
        self.app = self.server.app

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.server.scheduler.stop()

    async def process(self) -> dict[str, Any]:
        """Which process serves the rank: a replacement (or a restart on redeploy) has another pid and start."""
        return {"pid": os.getpid(), "started": self.started, "node": ray.get_runtime_context().get_node_id()}

    async def check_health(self) -> None:
        if not self.server.scheduler.alive:
            raise RuntimeError("the scheduler thread is gone")

    async def forward(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[dict[str, Any]]:
        """Runs one HTTP request through the server's ASGI app; yields its ASGI messages (http.response.start,
        then http.response.body parts) as they come. Cancelling the generator (the client went away) tells the app
        that the client disconnected, which cancels the request's job."""
        out: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()

        async def disconnect() -> MutableMapping[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        receive = replay_body(body, disconnect)

        async def send(message: MutableMapping[str, Any]) -> None:
            await out.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("utf-8", "surrogateescape"),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            # not loopback: the client is whoever reached the ingress (a keyless /metrics from loopback is the
            # operator's view of a server with API keys; through the ingress it takes --metrics-key)
            "client": ("cluster-ingress", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
        }
        task = asyncio.create_task(self.app(scope, receive, send))
        try:
            while True:
                getter = asyncio.ensure_future(out.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    task.result()  # the app ended without finishing its response: raise what it raised
                    while not out.empty():
                        yield dict(out.get_nowait())
                    return
                message = getter.result()
                yield dict(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, 5.0)


ingress_app = FastAPI(title="kvcmas cluster", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(ingress_app)
class Ingress:
    """The cluster's HTTP front: routes by key (routing.py), fails over once, aggregates /health and /metrics."""

    def __init__(self, replicas: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        # index: rank. Handles to other applications, which may not be deployed yet (a declarative deploy builds
        # every application at once): not checked here (the flag get_app_handle itself passes); a call to a rank
        # without a running replica fails over (_first).
        self.engines: list[DeploymentHandle] = [
            serve.get_deployment_handle(engine_name(r), app_name=engine_name(r), _check_exists=False)
            for r in range(replicas)
        ]
        self.max_body_bytes = max_body_bytes
        self.moved: OrderedDict[str, int] = OrderedDict()  # key -> the rank that holds it after a failover
        self.failovers = 0
        self.routed = [0] * len(self.engines)
        self._status_lock = asyncio.Lock()
        self._status_at = -1e9
        self._running: dict[int, bool] = {}

    # ------------------------------------------------------------------------------------------ routing
    def order(self, key: str) -> list[int]:
        ranks = rendezvous_order(key, range(len(self.engines)))
        moved = self.moved.get(key)
        if moved is not None:
            self.moved.move_to_end(key)
            ranks.remove(moved)
            ranks.insert(0, moved)
        return ranks

    def _remember(self, key: str, rank: int, home: int) -> None:
        if rank == home:
            self.moved.pop(key, None)
            return
        self.moved[key] = rank
        self.moved.move_to_end(key)
        while len(self.moved) > MOVED_KEYS:
            self.moved.popitem(last=False)

    async def _live(self, rank: int) -> bool:
        """Whether Serve has a running replica for the rank (the controller's view, at most DOWN_POLL_S old; one
        controller call serves every request waiting at the time)."""
        async with self._status_lock:
            if time.monotonic() - self._status_at >= DOWN_POLL_S:
                try:
                    status = await asyncio.to_thread(serve.status)
                    apps = status.applications
                    self._running = {
                        r: engine_name(r) in apps
                        and any(
                            getattr(state, "value", state) == "RUNNING" and n > 0
                            for d in apps[engine_name(r)].deployments.values()
                            for state, n in d.replica_states.items()
                        )
                        for r in range(len(self.engines))
                    }
                except Exception as e:  # noqa: BLE001 - no view: assume live and let the call itself fail
                    log.warning("no Serve status: %s", e)
                    self._running = {}
                self._status_at = time.monotonic()
        return self._running.get(rank, True)

    async def _first(self, rank: int, call: Any) -> tuple[Any, dict[str, Any]]:
        """Starts the call on the rank and waits for its first message; _ReplicaDown when the rank dies first."""
        gone = (ray.exceptions.RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)
        try:
            gen: Any = self.engines[rank].options(stream=True).forward.remote(*call)
        except gone as e:
            raise _ReplicaDown(str(e)) from None
        first = asyncio.ensure_future(gen.__anext__())
        first.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even when abandoned
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=DOWN_POLL_S)
                if done:
                    try:
                        return gen, first.result()
                    # the actor died; or Serve no longer has the deployment (its rank was just scaled away)
                    except gone as e:
                        raise _ReplicaDown(str(e)) from None
                if not await self._live(rank):
                    raise _ReplicaDown(f"{engine_name(rank)} has no running replica")
        except BaseException:
            first.cancel()
            _cancel(gen)
            raise

    async def forward(self, request: Request, key: str, body: bytes, path: str | None = None) -> Response:
        call = (
            request.method,
            path or request.url.path,
            request.scope.get("query_string", b""),
            list(request.scope["headers"]),
            body,
        )
        ranks = self.order(key)
        home = rendezvous_order(key, range(len(ranks)))[0]
        errors: list[str] = []
        for attempt, rank in enumerate(ranks[:2]):  # the owner, then once the next rank
            try:
                gen, start = await self._first(rank, call)
            except _ReplicaDown as e:
                log.warning("replica %s is down (%s): %s", replica_name(rank), key, e)
                errors.append(f"{replica_name(rank)}: {e}")
                continue
            if attempt:
                self.failovers += 1
            self._remember(key, rank, home)
            self.routed[rank] += 1
            headers = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in start.get("headers", [])
                if k.decode("latin-1").lower() not in HOP_HEADERS
            }
            headers["x-kvcmas-replica"] = replica_name(rank)
            sse = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(_body(gen, sse), status_code=int(start["status"]), headers=headers)
        message = "no replica could take the request: " + "; ".join(errors)
        return JSONResponse(
            error_body(503, message, "replica_unavailable"), status_code=503, headers={"Retry-After": "1"}
        )

    async def _read(self, request: Request) -> bytes | Response:
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                body = error_body(413, f"the request body is larger than {self.max_body_bytes} bytes", "too_large")
                return JSONResponse(body, status_code=413)
            parts.append(part)
        return b"".join(parts)

    # ------------------------------------------------------------------------------------------ routes
    @ingress_app.api_route("/v1/kvcmas/workflows/{workflow:path}", methods=["DELETE"])
    async def drop_workflow(self, workflow: str, request: Request) -> Response:
        key = workflow_key(workflow)
        response = await self.forward(request, key, b"")
        if response.status_code == 200:
            self.moved.pop(key, None)
        return response

    @ingress_app.get("/health")
    async def health(self, request: Request) -> Response:
        replies, processes = await asyncio.gather(self._everyone("/health", request), self._processes())
        replicas: dict[str, Any] = {}
        for rank, (status, text) in enumerate(replies):
            if status == 200:
                replicas[replica_name(rank)] = json.loads(text) | processes[rank]
            else:
                replicas[replica_name(rank)] = {"status": "down", "error": text}
        up = sum(r.get("status") == "ok" for r in replicas.values())
        overall = "ok" if up == len(replicas) else ("degraded" if up else "down")
        body = {"status": overall, "replicas": replicas, "failovers": self.failovers}
        return JSONResponse(body, status_code=200 if up else 503)

    @ingress_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        replies = await self._everyone("/metrics", request)
        refused = next(((status, text) for status, text in replies if status in (400, 401)), None)
        if refused is not None:  # the replicas' own API-key and Host checks: the same answer as one server's
            return Response(refused[1], status_code=refused[0], media_type="application/json")
        seen: set[str] = set()
        lines: list[str] = []
        for rank, (status, text) in enumerate(replies):
            if status != 200:
                continue
            for line in text.splitlines():
                if line.startswith("#"):
                    if line not in seen:
                        seen.add(line)
                        lines.append(line)
                elif line.strip():
                    lines.append(_labelled(line, replica_name(rank)))
        lines += [
            "# HELP kvcmas_cluster_replica_up Whether the replica answered /metrics.",
            "# TYPE kvcmas_cluster_replica_up gauge",
        ]
        lines += [
            f'kvcmas_cluster_replica_up{{replica="{replica_name(r)}"}} {int(s == 200)}'
            for r, (s, _) in enumerate(replies)
        ]
        lines += [
            "# HELP kvcmas_cluster_failovers_total Requests this ingress retried on the next replica.",
            "# TYPE kvcmas_cluster_failovers_total counter",
            f"kvcmas_cluster_failovers_total {self.failovers}",
            "# HELP kvcmas_cluster_routed_total Requests this ingress sent to each replica.",
            "# TYPE kvcmas_cluster_routed_total counter",
        ]
        lines += [f'kvcmas_cluster_routed_total{{replica="{replica_name(r)}"}} {n}' for r, n in enumerate(self.routed)]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "OPTIONS"])
    async def proxy(self, path: str, request: Request) -> Response:
        raw = await self._read(request)
        if isinstance(raw, Response):
            return raw
        try:
            body: Any = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            body = None  # the replica answers it with its own 400
        headers = {k.lower(): v for k, v in request.headers.items()}
        return await self.forward(request, routing_key(body, headers), raw)

    async def _processes(self) -> list[dict[str, Any]]:
        """Engine.process of every rank ({} for one that did not answer)."""

        async def one(rank: int) -> dict[str, Any]:
            try:
                return dict(await asyncio.wait_for(self.engines[rank].process.remote(), HEALTH_TIMEOUT_S))
            except (asyncio.TimeoutError, ray.exceptions.RayError, RayServeException):
                return {}

        return list(await asyncio.gather(*(one(r) for r in range(len(self.engines)))))

    async def _everyone(self, path: str, request: Request) -> list[tuple[int, str]]:
        """GET path on every rank at once, with the request's headers (API key, Host): (status, text) each; (503,
        why) for a rank that did not answer."""

        async def one(rank: int) -> tuple[int, str]:
            call = ("GET", path, b"", list(request.scope["headers"]), b"")
            try:
                gen = self.engines[rank].options(stream=True).forward.remote(*call)
                messages = await asyncio.wait_for(_collect(gen), HEALTH_TIMEOUT_S)
            except (asyncio.TimeoutError, ray.exceptions.RayError, RayServeException) as e:
                return 503, f"{type(e).__name__}: {e}"[:300]
            status = next(int(m["status"]) for m in messages if m["type"] == "http.response.start")
            text = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
            return status, text.decode("utf-8", "replace")

        return list(await asyncio.gather(*(one(r) for r in range(len(self.engines)))))


def engine(args: dict[str, Any]) -> Any:
    """The application of one engine rank (a Serve config's `import_path: kvcmas_cpp.cluster.serve_app:engine`):
    args rank, server_args (kvcmas-server arguments: --model, -t, --calibration-dir ...) and engine_actor_options
    (Ray actor options, default {"num_cpus": 0})."""
    rank, server_args, actor_options = engine_args(args)
    deployment: Any = Engine  # a Serve Deployment (its class type to a checker without Ray)
    return deployment.options(name=engine_name(rank), num_replicas=1, ray_actor_options=actor_options).bind(
        rank, server_args
    )


def ingress(args: dict[str, Any]) -> Any:
    """The ingress application (`import_path: kvcmas_cpp.cluster.serve_app:ingress`): args replicas (the ranks
    0..replicas-1 it routes over) and max_body_bytes."""
    replicas, max_body = ingress_args(args)
    deployment: Any = Ingress
    return deployment.options(name=INGRESS_NAME, ray_actor_options={"num_cpus": 0}).bind(
        replicas, max_body_bytes=max_body or DEFAULT_MAX_BODY_BYTES
    )


__all__ = ["APP_NAME", "SESSION_HEADER", "engine", "engine_name", "ingress", "replica_name"]
