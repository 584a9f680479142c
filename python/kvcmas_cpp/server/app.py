"""The HTTP layer: FastAPI routes for the OpenAI-compatible API, errors in OpenAI's shape, API-key checks.

Handlers never compute: they validate (validation.py, model-free: read the body within its limit, parse it to a
ParsedRequest or an OpenAI-style 4xx), tokenize (in a worker thread), hand a Job to the Scheduler and await its
events, so the event loop stays responsive while the engine works. A client that disconnects cancels its job.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..kv_budget import KVBudget
from ..model import Model
from ..model.chat import chat_prompt_ids
from ..sharing import persist
from .backend import Segment
from .config import TEXT_CHARS_PER_CTX, ServerConfig
from .dashboard import dashboard_routes
from .gauges import register_gauges
from .history import History
from .http_guard import ALL_METRICS, ApiKeyAndAccounting, Tenants, error_response, internal_error_response
from .images import ImagePrompts
from .jobs import Job, QueueFull
from .lora import Pick, ServedAdapters
from .metrics import Metrics
from .replies import Replies
from .scheduler import GENERATION_RESERVE, Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest
from .sessions import Namespace, SessionKey
from .structured import output_plan
from .utility import utility_routes
from .validation import ApiError, Limits, ParsedRequest, error_body, loggable, parse_request, validation_message

__all__ = ["ApiError", "Server", "ServerConfig", "error_body", "error_response"]

log = logging.getLogger("kvcmas.server")

DEFAULT_WORKFLOW = "default"  # the sharing session of requests that name no workflow (one per namespace)


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
        self.model_id = cfg.alias or os.path.basename(cfg.model_path).removesuffix(".gguf")
        self.metrics = Metrics(self.model_id)
        self.history = History(KVBudget(model).rows_bytes)  # what the responses reported, per tenant (dashboard.py)
        self.tenants = Tenants(cfg.api_key, cfg.api_key_file)
        self.model_names = {self.model_id, os.path.basename(cfg.model_path)}
        self.adapters = ServedAdapters(model, self.model_id, self.model_names, cfg.loras)  # loads --lora files
        self.adapters.check_limits(self.tenants.adapters)
        text_chars = cfg.max_text_chars if cfg.max_text_chars is not None else TEXT_CHARS_PER_CTX * model.n_ctx
        self.limits = Limits(cfg.max_body_bytes, cfg.max_tokens, cfg.max_images, text_chars)
        self.vision: Any = None
        if cfg.mmproj:
            from ..vision import VisionEncoder

            # cache_size 0: the server keeps its own cache, per namespace (ImagePrompts); the tower runs on the
            # text model's backend
            self.vision = VisionEncoder(
                cfg.mmproj,
                n_threads=cfg.threads,
                cache_size=0,
                max_decode_bytes=cfg.max_image_memory,
                backend=model.device,
            )
            self.vision.check_text_model(model.n_embd, model.tokenizer)
        self.images = ImagePrompts(model, self.vision, self.metrics, len(self.tenants.keys), cfg.image_cache_bytes)
        self.calibration_problem = self._check_calibration_dir()
        budget = model.kv_budget
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
        self.created = int(time.time())
        self.replies = Replies(self.scheduler, model, self.model_id, self.history, cfg.replica)
        register_gauges(self)
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
        self._route(app, "/lora-adapters", self.lora_adapters, ["GET"])
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
            | {"/lora-adapters"}
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
            ApiKeyAndAccounting,
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

    def _tenant_adapters(self, request: Request) -> list[Any]:
        return self.adapters.allowed(request.state.tenant, self.tenants.adapters)

    async def list_models(self, request: Request) -> dict[str, Any]:
        """The base model, then the LoRA adapters the caller may use (each with its parent, as vLLM lists them)."""
        cards = self.adapters.cards(self._tenant_adapters(request), self.created)
        return {"object": "list", "data": [self._model_card(), *cards]}

    async def get_model(self, model_name: str, request: Request) -> dict[str, Any]:
        if model_name in self.model_names:
            return self._model_card()
        cards = self.adapters.cards([a for a in self._tenant_adapters(request) if a.name == model_name], self.created)
        if not cards:
            raise ApiError(404, f"the model '{model_name}' does not exist", "model_not_found", "model")
        return cards[0]

    async def lora_adapters(self, request: Request) -> list[dict[str, Any]]:
        """GET /lora-adapters (llama.cpp's): the adapters the caller may use, with their `lora` field ids."""
        return self.adapters.lora_list(self._tenant_adapters(request))

    # ---------------------------------------------------------------------------------------- generation
    def _check_logit_bias(self, parsed: ParsedRequest) -> None:
        bad = next((t for t in parsed.sampling.logit_bias or {} if t >= self.model.n_vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"logit_bias: token id {bad} is outside [0, {self.model.n_vocab})", "invalid_value", "logit_bias"
            )

    def _pick_adapter(self, body: Any, request: Request) -> Pick:
        """The adapter the request runs with (its `model` or `lora` field; server/lora.py), or the base model."""
        return self.adapters.pick(body.model, body.lora, request.state.tenant, self.tenants.adapters)

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the rendered chat prompt (as Model.chat builds them)."""
        return chat_prompt_ids(self.model.tokenizer, self.model.apply_chat_template(messages, True))

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

    async def chat_completions(self, request: Request) -> Response:
        return await self.chat(await self._parse("chat", request), request)

    async def chat(self, parsed: ParsedRequest, request: Request) -> Response:
        """A validated chat request, answered as chat.completion (or its chunks); /v1/responses goes through here."""
        body = parsed.body
        assert isinstance(body, ChatCompletionRequest)
        pick = self._pick_adapter(body, request)
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
                messages, segments = await self.images.prompt(body, parsed.images, namespace)
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
        queue, sink = self.replies.event_queue()
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
            session_key=SessionKey(namespace, workflow, method),  # an agent with an adapter shares spans too
            adapter=pick.adapter,
            model=pick.name,
            recompute=options.recompute if options and options.recompute is not None else self.cfg.recompute,
            segments=segments,
            n_prompt=n_prompt,
            constraint=plan.constraint,
        )
        self._submit(job)
        extra: dict[str, Any] = {"workflow": workflow, "agent": agent}
        if pick.name is not None:
            extra["adapter"] = pick.name
        if segments is not None:
            extra["images"] = sum(isinstance(seg, np.ndarray) for seg in segments)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self.replies.respond(
            job, queue, request, "chat", body.stream, include_usage, extra, "", plan.reply
        )

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse("completion", request)
        body = parsed.body
        assert isinstance(body, CompletionRequest)
        pick = self._pick_adapter(body, request)
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
        queue, sink = self.replies.event_queue()
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
            adapter=pick.adapter,
            model=pick.name,
        )
        self._submit(job)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = prompt_text if body.echo else ""
        extra = {} if pick.name is None else {"adapter": pick.name}
        return await self.replies.respond(job, queue, request, "completion", body.stream, include_usage, extra, echo)
