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
from typing import TYPE_CHECKING, Any, Literal, get_args

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from ..tools import OPEN as TOOL_CALL_OPEN
from .schemas import HARMLESS_FIELDS, KvcmasOptions, Number, _Body
from .validation import ApiError, parse_body, parse_request

if TYPE_CHECKING:
    from .app import Server


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # on output_text parts a client sends back; not rendered


MessageRole = Literal["user", "assistant", "system", "developer"]
MESSAGE_ROLES: tuple[str, ...] = get_args(MessageRole)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: MessageRole
    content: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Body):
    """A reasoning item of an earlier response, sent back: its text is the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None  # never produced here; a client's round trip may carry the field
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
PART_TYPES = ("input_text", "output_text")


def _unsupported_input(v: Any) -> str | None:
    """What in `input` this server does not take, in a client's words (pydantic's union error would name the
    classes it tried: 'input.0.MessageItem.content.list[InputText].0.text'); None when every item and part is of a
    supported type."""
    for i, item in enumerate(v if isinstance(v, list) else []):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind not in ITEM_TYPES:
            return f"item {i} (type {kind!r}) is not supported: input takes {', '.join(ITEM_TYPES)} items"
        role = item.get("role")
        if kind == "message" and role not in MESSAGE_ROLES:  # else pydantic blames the other item types' fields
            hint = " (a tool's result is a function_call_output item with the call's call_id)" if role == "tool" else ""
            return f"item {i} is a message whose role {role!r} is not one of {', '.join(MESSAGE_ROLES)}{hint}"
        if kind == "reasoning":
            continue  # its parts are checked by ReasoningItem
        parts = item.get("content" if kind == "message" else "output")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in PART_TYPES:
                return (
                    f"item {i}, part {j} (type {part_type!r}) is not supported: parts are input_text or output_text "
                    "(images go to /v1/chat/completions as image_url parts)"
                )
    return None


class FunctionTool(_Body):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only level a local model has


class ResponsesRequest(_Body):
    model: StrictStr | None = None
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    include: list[StrictStr] | None = Field(default=None, max_length=0)  # no extra output to include
    truncation: Literal["disabled"] | None = None
    reasoning: None = None
    kvcmas: KvcmasOptions | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)  # as on chat: its own namespace
    # HARMLESS_FIELDS
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _supported_input(cls, v: Any) -> Any:
        problem = _unsupported_input(v)
        if problem is not None:
            raise PydanticCustomError("unsupported", "{problem}", {"problem": problem})
        return v

    def chat_body(self) -> dict[str, Any]:
        """The equivalent chat/completions request body."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning.append(item.text())
                continue
            # an assistant turn takes the reasoning before it; any other item ends a turn that had none to take it
            assistant = isinstance(item, FunctionCallItem) or (
                isinstance(item, MessageItem) and item.role == "assistant"
            )
            turn_reasoning = "".join(reasoning) if assistant else ""
            reasoning = []
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if (
                    last is not None
                    and last["role"] == "assistant"
                    and not last.get("content")
                    and "tool_calls" in last
                ):
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if turn_reasoning:
                messages[-1]["reasoning_content"] = turn_reasoning
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if isinstance(choice, NamedFunctionChoice)
                else choice
            )
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"}
                if fmt.type == "json_object"
                else {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_ or {}}}
            )
        for key, value in (
            ("model", self.model),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("seed", self.seed),
            ("kvcmas", self.kvcmas.model_dump(exclude_none=True) if self.kvcmas else None),
            ("cache_salt", self.cache_salt),
        ):
            if value is not None:
                body[key] = value
        return body


assert all(f in ResponsesRequest.model_fields for f in HARMLESS_FIELDS)

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
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, _Body) else b.tool_choice)
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
    translator = _Translator(body, server.model_id, lambda t: len(tokenizer.encode(t, add_special=False)))
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(
            translator.stream(answer.body_iterator),  # type: ignore[arg-type]
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if not isinstance(answer, JSONResponse) or answer.status_code != 200:
        return answer  # 499: the client went away
    return JSONResponse(translator.from_completion(json.loads(bytes(answer.body))))
