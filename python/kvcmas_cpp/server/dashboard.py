"""The UI's endpoints (docs/ui.md): GET /v1/kvcmas/workflows, GET /v1/kvcmas/workflows/{id}, GET /v1/kvcmas/summary
(JSON, the caller's tenant only, API keys as on every endpoint) and GET /ui with its assets (one static page from the
package's server/static folder; it holds no data and loads without a key, then asks for one if the API wants it).
The page draws only from the JSON endpoints."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from .history import History
from .jobs import Job
from .sessions import Namespace
from .validation import ApiError

if TYPE_CHECKING:
    from .app import Server

Handler = Callable[..., Awaitable[Any]]

# the page and its assets: file name -> media type (nothing else under /ui is served)
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
UI_PATHS = frozenset({"/ui", "/ui/", *(f"/ui/{name}" for name in ASSETS)})
# The page runs only its own script and style, talks only to this server, and cannot be framed by another site.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def read_asset(name: str) -> bytes:
    return (resources.files("kvcmas_cpp.server") / "static" / name).read_bytes()


def record_response(history: History, job: Job, extras: dict[str, Any], stats: dict[str, Any]) -> None:
    """Records a finished response (its `kvcmas`, `timings` and `usage` as sent) in the caller's history."""
    key = job.session_key
    namespace = key.namespace if key is not None else job.namespace
    if namespace is None:
        return
    kvcmas = extras["kvcmas"]
    workflow = key.workflow if key is not None else None
    history.record(
        namespace.tenant,
        namespace.salt,
        workflow,
        job.id,
        kvcmas,
        extras["timings"],
        extras["usage"],
        stats.get("reads", []),
        display_agent(job),
    )


def display_agent(job: Job) -> str:
    """The reader's name in the graph: kvcmas.agent, else the name its sharing session gives it (the system prompt)."""
    if job.agent is not None:
        return job.agent
    messages = job.messages or []
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return str(messages[0]["content"])
    return "assistant"


def dashboard_routes(server: Server, with_page: bool) -> list[tuple[str, Handler, list[str]]]:
    """(path, handler, methods) of the UI's endpoints; with_page: also /ui and its assets (--no-ui: not)."""
    history: History = server.history

    async def list_workflows(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": history.workflows(request.state.tenant)}

    async def get_workflow(workflow: str, request: Request) -> dict[str, Any]:
        found = history.workflow(request.state.tenant, workflow)
        if found is None:
            shown = workflow.encode("utf-8", "backslashreplace").decode()
            raise ApiError(404, f"no workflow {shown!r} of yours is known", "workflow_not_found")
        return found

    async def summary(request: Request) -> dict[str, Any]:
        tenant = request.state.tenant
        s, model = server.scheduler, server.model
        mine = history.tenant_summary(tenant)
        edges = dict(s.estimator_edges)  # a snapshot the engine thread replaces whole
        estimators = []
        for salt in mine.pop("cache_salts"):
            name = Namespace(tenant, salt).estimator_name()
            for (method, workflow), row in sorted(edges.items()):
                if workflow == name:
                    estimators.append({"method": method, "cache_salt": salt, **row})
        rate = history.prefill_rate()
        return {
            "object": "kvcmas.summary",
            "model": server.model_id,
            "method": server.cfg.method,
            "tenant": mine,
            "estimators": estimators,
            "prefill_rate_tokens_per_s": None if rate is None else round(rate, 2),
            "server": {
                "active_requests": s.n_active,
                "queued_requests": s.n_queued,
                "training_reads_pending": s.n_training_reads,
                "kv_bytes": model.kv_bytes_in_use,
                "kv_peak_bytes": s.peak_kv_bytes,
                "kv_budget_bytes": s.kv_budget,
                "kv_stored_bytes": s.stored_bytes,
                "prefix_cache_tokens": s.prefix_cache.tokens,
                "estimator_bytes": s.estimator_bytes,
                "calibration_bytes": s.calibration_bytes,
            },
        }

    routes: list[tuple[str, Handler, list[str]]] = [
        ("/v1/kvcmas/workflows", list_workflows, ["GET"]),
        ("/v1/kvcmas/workflows/{workflow:path}", get_workflow, ["GET"]),
        ("/v1/kvcmas/summary", summary, ["GET"]),
    ]
    if not with_page:
        return routes
    pages = {name: read_asset(name) for name in ASSETS}  # read once: the package's files, nothing from a request

    async def page() -> Response:
        return Response(pages["index.html"], media_type=ASSETS["index.html"], headers=PAGE_HEADERS)

    async def asset(name: str) -> Response:
        if name not in pages:
            raise ApiError(404, "no such file", "not_found")
        return Response(pages[name], media_type=ASSETS[name], headers=PAGE_HEADERS)

    routes += [("/ui", page, ["GET"]), ("/ui/", page, ["GET"]), ("/ui/{name}", asset, ["GET"])]
    return routes
