"""The endpoints people script against, in llama.cpp server's shapes: POST /tokenize, POST /detokenize,
POST /apply-template and GET /props (tokenizer and chat template only, never the engine); and POST /v1/responses
(responses.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from .. import __version__
from .._native import core
from .responses import create_response
from .schemas import ChatCompletionRequest, RequestBody
from .validation import ApiError, check_text_length, messages_text_chars, parse_body

if TYPE_CHECKING:
    from .app import Server

Handler = Callable[[Request], Awaitable[Any]]


def json_bytes(obj: Any) -> bytes:
    """A JSON answer's bytes, as Starlette's JSONResponse writes them (made off the event loop for big answers)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_response(content: bytes) -> Response:
    return Response(content, media_type="application/json")


class TokenizeRequest(RequestBody):
    content: StrictStr
    add_special: StrictBool = False  # BOS when the model wants it
    parse_special: StrictBool = True  # special-token text (<|im_start|>) becomes the special token
    with_pieces: StrictBool = False  # [{"id", "piece"}] instead of ids


class DetokenizeRequest(RequestBody):
    tokens: list[StrictInt] = Field(max_length=1 << 20)


class ApplyTemplateRequest(ChatCompletionRequest):
    """A chat request's messages and tools; the sampling fields are accepted and have no effect here."""


def utility_routes(server: Server) -> list[tuple[str, Handler, list[str]]]:
    """(path, handler, methods) of each utility endpoint, bound to the server."""
    model = server.model
    tok = model.tokenizer

    def tokenized(body: TokenizeRequest) -> bytes:
        """The /tokenize answer, encoded: the encoding, the pieces and the JSON of a long text all take a while,
        so the whole answer is made in a worker thread (the tokenizer lets go of the GIL for long text)."""
        ids = tok.encode(body.content, body.add_special, body.parse_special)
        if not body.with_pieces:
            return json_bytes({"tokens": ids})
        pieces: list[dict[str, Any]] = []
        for i in ids:
            raw = tok.token_to_piece(i)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes, as llama.cpp gives them
                piece = list(raw)
            pieces.append({"id": i, "piece": piece})
        return json_bytes({"tokens": pieces})

    async def tokenize(request: Request) -> Response:
        body = parse_body(await server.read_body(request), TokenizeRequest, server.limits)
        check_text_length(len(body.content), server.limits, "content")
        try:
            return json_response(await run_in_threadpool(tokenized, body))
        except ValueError as e:  # lone surrogates and other text the tokenizer refuses
            raise ApiError(400, f"content: {e}", "invalid_value", "content") from None

    async def detokenize(request: Request) -> Response:
        body = parse_body(await server.read_body(request), DetokenizeRequest, server.limits)
        limit = server.limits.max_text_chars
        if limit is not None and len(body.tokens) > limit:
            raise ApiError(
                413,
                f"'tokens' has {len(body.tokens)} token ids; this server takes at most {limit} per request "
                "(--max-text-chars)",
                "text_too_long",
                "tokens",
            )
        bad = next((t for t in body.tokens if not 0 <= t < model.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside [0, {model.n_vocab})", "invalid_value", "tokens")
        return json_response(await run_in_threadpool(lambda: json_bytes({"content": tok.decode(body.tokens)})))

    async def apply_template(request: Request) -> Response:
        body = parse_body(await server.read_body(request), ApplyTemplateRequest, server.limits)
        try:
            messages = body.plain_messages()
            check_text_length(messages_text_chars(messages), server.limits, "messages")
            prompt = await run_in_threadpool(model.apply_chat_template, messages, True)
        except ValueError as e:  # image parts, templates that refuse the messages
            raise ApiError(400, f"the messages cannot be rendered: {e}", "invalid_messages", "messages") from None
        return json_response(await run_in_threadpool(json_bytes, {"prompt": prompt}))

    async def props(request: Request) -> dict[str, Any]:
        cfg = server.cfg
        return {
            "model_path": os.path.basename(cfg.model_path),  # the file's name: where it lives is the operator's
            "model_alias": server.model_id,
            "arch": model.arch,
            "n_ctx": model.n_ctx,
            "n_ctx_train": model.n_ctx_train,
            "n_vocab": model.n_vocab,
            "total_slots": cfg.parallel,
            "method": cfg.method,
            "kv_budget": server.scheduler.kv_budget,
            "chat_template": tok.chat_template or "",
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else None,
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else None,
            "modalities": {"vision": server.vision is not None},
            "build_info": f"kvcmas {__version__}",
            "backends": [{"name": "cpu", "features": dict(core.cpu_features())}],
            "default_generation_settings": {
                "n_ctx": model.n_ctx,
                "params": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": cfg.max_tokens},
            },
        }

    async def responses(request: Request) -> Response:
        return await create_response(server, request)

    return [
        ("/v1/responses", responses, ["POST"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/apply-template", apply_template, ["POST"]),
        ("/props", props, ["GET"]),
    ]
