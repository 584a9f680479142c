"""The request body of POST /v1/responses (server/responses.py): input items, tools, text format, and its chat
request (ResponsesRequest.chat_body): what is accepted, and the 400 naming the field for what is not."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from .schemas import HARMLESS_FIELDS, KvcmasOptions, LoraChoice, Number, RequestBody


class InputText(RequestBody):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # on output_text parts a client sends back; not rendered


MessageRole = Literal["user", "assistant", "system", "developer"]
MESSAGE_ROLES: tuple[str, ...] = get_args(MessageRole)


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: MessageRole
    content: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(RequestBody):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(RequestBody):
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


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(RequestBody):
    type: Literal["function"]
    name: StrictStr


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextOptions(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only level a local model has


class ResponsesRequest(RequestBody):
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
    lora: list[LoraChoice] | None = Field(default=None, max_length=64)  # as on chat (server/lora.py)
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
            ("lora", [c.model_dump() for c in self.lora] if self.lora is not None else None),
        ):
            if value is not None:
                body[key] = value
        return body


assert all(f in ResponsesRequest.model_fields for f in HARMLESS_FIELDS)
