"""POST /v1/responses, minimal: OpenAI's Responses API (the OpenAI Agents SDK's default) for text and function tools,
streamed and not.

A request is translated into a chat request (instructions -> system message, input items -> messages, function_call
/ function_call_output items -> assistant tool_calls / tool messages, text.format -> response_format) and answered
by the chat path (its errors renamed to the fields the client sent), whose output is translated back: a thinking
model's reasoning (the chat path's `reasoning_content`) as a `reasoning` item with one `reasoning_text` part, as
OpenAI's API and vLLM return it, a `message` item with `output_text`, and one `function_call` item per call.
`reasoning` items sent back as input become the next assistant turn's `reasoning_content` (the template decides what
it renders). Not covered (400 naming the field): previous_response_id and conversation (nothing is stored), built-in
tools (web search, file search, computer use...), `reasoning` settings, input_image parts, `include` entries, prompt
templates, background mode. Streaming sends the semantic events (response.created, output_item.added,
content_part.added, reasoning_text.delta / .done, output_text.delta / .done, function_call_arguments.delta / .done,
content_part.done, output_item.done, response.completed).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..tools import OPEN as TOOL_CALL_OPEN
from .responses_request import ResponsesRequest
from .schemas import RequestBody
from .validation import ApiError, parse_body, parse_request

if TYPE_CHECKING:
    from .app import Server


# The chat path's parameter names -> the Responses API's, for its errors: the request is answered as a chat request,
# but the client sent these fields. messages: the input items' indices shift (instructions, merged calls).
_CHAT_PARAMS = (
    (re.compile(r"^messages(\..*)?$"), "input"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\.(\d+)\.function"), r"tools.\1"),
    (re.compile(r"^tool_choice\.function"), "tool_choice"),
    (re.compile(r"^max_tokens$"), "max_output_tokens"),
)


def _as_responses_error(e: ApiError) -> ApiError:
    """An error of the chat path, naming the field of the Responses API request it is about."""
    if e.param is None:
        return e
    param = e.param
    for chat_name, name in _CHAT_PARAMS:
        param = chat_name.sub(name, param)
    message = e.message.replace(f"'{e.param}'", f"'{param}'", 1)
    if e.param == "max_tokens":
        message = re.sub(r"\bmax_tokens\b", "max_output_tokens", message)
    return ApiError(e.status, message, e.code, param, e.headers)


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": []}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": f"fc_{call['id'].removeprefix('call_')}",
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
    }


class _TextKind:
    """An output item made of one text part, streamed delta by delta: the answer or the reasoning. `part` is the
    part's type and the stream events' name (response.<part>.delta / .done)."""

    def __init__(self, item: Callable[[str, str, str], dict[str, Any]], prefix: str, part: str) -> None:
        self.item, self.prefix, self.part = item, prefix, part

    def part_of(self, text: str) -> dict[str, Any]:
        return {"type": self.part, "text": text, **({"annotations": []} if self.part == "output_text" else {})}


_MESSAGE = _TextKind(_message_item, "msg", "output_text")
_REASONING = _TextKind(_reasoning_item, "rs", "reasoning_text")


class _Translator:
    """Builds the response object (and its stream events) from the chat path's output."""

    def __init__(self, body: ResponsesRequest, model_id: str, count_tokens: Callable[[str], int]) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model_id = model_id
        self.count_tokens = count_tokens  # text -> its length in tokens of the model's vocabulary
        self.output: list[dict[str, Any]] = []
        self.seq = 0

    def reasoning_tokens(self, output_tokens: int) -> int:
        """The reasoning's length in tokens: the reasoning text re-tokenized (the block's markers and the blank
        lines around it are not counted), at most the reply's tokens."""
        texts = [p["text"] for item in self.output if item["type"] == "reasoning" for p in item["content"]]
        return min(output_tokens, sum(self.count_tokens(t) for t in texts))

    def response(
        self, status: str, usage: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        b = self.body
        tools = [t.model_dump(exclude_none=True) for t in b.tools or []]
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model_id,
            "output": self.output,
            "instructions": b.instructions,
            "tools": tools,
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, RequestBody) else b.tool_choice)
            or "auto",
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "max_output_tokens": b.max_output_tokens,
            "text": {"format": {"type": "text"}}
            if b.text is None
            else b.text.model_dump(exclude_none=True, by_alias=True),
            "metadata": b.metadata or {},
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        if usage is not None:
            out["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                },
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(usage["completion_tokens"])},
                "total_tokens": usage["total_tokens"],
            }
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if extra:
            out.update(extra)
        return out

    def from_completion(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        calls = [_call_item(call, "completed") for call in message.get("tool_calls") or []]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or ""
        # the output's items in the order they were generated, as the stream gives them: content that is a block cut
        # off by max_output_tokens came after the calls; the last item cut off is incomplete, like the response
        text = [_message_item(f"msg_{uuid.uuid4().hex[:24]}", content, status)] if content else []
        items = calls + text if calls and content.lstrip().startswith(TOOL_CALL_OPEN) else text + calls
        if reasoning:
            last = "completed" if items else status
            items.insert(0, _reasoning_item(f"rs_{uuid.uuid4().hex[:24]}", reasoning, last))
        self.output += items
        return self.response(status, chat.get("usage"), {"kvcmas": chat.get("kvcmas")})

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def stream(self, chunks: AsyncIterator[bytes | str]) -> AsyncIterator[bytes]:
        """The chat SSE stream -> the Responses API's events."""
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        kind: _TextKind | None = None  # the text item being streamed, if any
        item_id = ""
        index = -1
        text: list[str] = []
        finish: str | None = None
        usage: dict[str, Any] | None = None

        def open_item(new: _TextKind) -> list[bytes]:
            nonlocal kind, item_id, index
            if kind is new:
                return []
            out = close_item()
            kind, item_id, index = new, f"{new.prefix}_{uuid.uuid4().hex[:24]}", len(self.output)
            text.clear()
            self.output.append(new.item(item_id, "", "in_progress"))
            return [
                *out,
                self.event("response.output_item.added", output_index=index, item=self.output[index]),
                self.event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=new.part_of(""),
                ),
            ]

        def close_item(status: str = "completed") -> list[bytes]:
            nonlocal kind
            if kind is None:
                return []
            full = "".join(text)
            self.output[index] = kind.item(item_id, full, status)
            logprobs: dict[str, Any] = {"logprobs": []} if kind is _MESSAGE else {}
            out = [
                self.event(
                    f"response.{kind.part}.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=full,
                    **logprobs,
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=kind.part_of(full),
                ),
                self.event("response.output_item.done", output_index=index, item=self.output[index]),
            ]
            kind = None
            return out

        async for raw in chunks:
            data = (raw.encode() if isinstance(raw, str) else raw).decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                for e in close_item():
                    yield e
                yield self.event(
                    "error", code=chunk["error"].get("code"), message=chunk["error"]["message"], param=None
                )
                yield self.event("response.failed", response=self.response("failed", None, {"error": chunk["error"]}))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                for text_kind, piece in (
                    (_REASONING, delta.get("reasoning_content")),
                    (_MESSAGE, delta.get("content")),
                ):
                    if not piece:
                        continue
                    for e in open_item(text_kind):
                        yield e
                    text.append(piece)
                    logprobs: dict[str, Any] = {"logprobs": []} if text_kind is _MESSAGE else {}
                    yield self.event(
                        f"response.{text_kind.part}.delta",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        delta=piece,
                        **logprobs,
                    )
                for call in delta.get("tool_calls") or []:
                    for e in close_item():
                        yield e
                    call_index = len(self.output)
                    item = _call_item(call, "in_progress", "")
                    self.output.append(item)
                    yield self.event("response.output_item.added", output_index=call_index, item=item)
                    arguments = call["function"]["arguments"]
                    yield self.event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=call_index,
                        delta=arguments,
                    )
                    yield self.event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=call_index,
                        name=item["name"],
                        arguments=arguments,
                    )
                    self.output[call_index] = _call_item(call, "completed")
                    yield self.event("response.output_item.done", output_index=call_index, item=self.output[call_index])
        status = "incomplete" if finish == "length" else "completed"
        for e in close_item(status):  # the last item: cut off with the response
            yield e
        yield self.event(f"response.{status}", response=self.response(status, usage))


async def create_response(server: Server, request: Request) -> Response:
    """POST /v1/responses."""
    body = parse_body(await server.read_body(request), ResponsesRequest, server.limits)
    try:
        parsed = parse_request("chat", json.dumps(body.chat_body()).encode(), server.limits)
        answer = await server.chat(parsed, request)
    except ApiError as e:
        raise _as_responses_error(e) from None
    tokenizer = server.model.tokenizer
    translator = _Translator(
        body,
        server.adapters.reply_model(body.model) or server.model_id,
        lambda t: len(tokenizer.encode(t, add_special=False)),
    )
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(
            translator.stream(answer.body_iterator),  # type: ignore[arg-type]
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if not isinstance(answer, JSONResponse) or answer.status_code != 200:
        return answer  # 499: the client went away
    return JSONResponse(translator.from_completion(json.loads(bytes(answer.body))))
