"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Fields follow OpenAI's chat/completions and completions APIs; llama.cpp-style extras (top_k, min_p,
repeat_penalty) and, on chat, the kvcmas extension (``"kvcmas": {"workflow", "agent", "method"}``) are optional. A
field the server does not implement is refused (400 naming it) rather than silently ignored, except the harmless ones
in HARMLESS_FIELDS (bookkeeping that does not change the answer). Types are strict (no "0.5" for a number, no 1 for a
bool), so a wrong type is a 400 rather than a silent coercion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..chat import RESERVED_TEMPLATE_VARIABLES, TEMPLATE_KWARGS_KEY
from ..sharing.methods import SERVED_METHODS
from ..tools import render_tool_messages

Number = StrictFloat | StrictInt
MAX_CHOICES = 16  # n: choices per request (forks of one prefill)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs (completions: 5)


# Accepted and ignored: they label or route a request on OpenAI's side and do not change what is generated.
HARMLESS_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


class RequestBody(BaseModel):
    """The base of every request body schema: unknown fields refused, types strict, null read as left out."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        """null for an optional field is that field left out (its default), as OpenAI reads it: clients send
        `"max_tokens": null`, `"temperature": null`... for settings they leave alone. A required field stays null,
        so its error still says what it should be."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        optional = {f.alias or name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class TextPart(RequestBody):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(RequestBody):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None  # "low": an AnyRes model's single view (docs/vision.md)


class ImagePart(RequestBody):
    """Accepted by the schema so the error names the real problem (no vision model yet), not the shape."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(RequestBody):
    name: StrictStr
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(RequestBody):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionDef(RequestBody):
    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: StrictBool | None = None  # arguments always follow the schema when the call is constrained


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: StrictStr


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestBody):
    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the output always follows the schema (constrained decoding)


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' (and only then)")
        return self


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    refusal: StrictStr | None = None  # echoed back by clients that resend a reply; not rendered
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: StrictStr | None = None  # tool messages: the call this is the result of
    reasoning_content: StrictStr | None = None  # assistant messages: a thinking model's reasoning, as it was returned

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)

    def text(self, image_marker: Callable[[str], str] | None = None) -> str:
        """The content as one string. Image parts become image_marker(url); without one they raise ValueError."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces: list[str] = []
        for part in self.content:
            if isinstance(part, ImagePart):
                if image_marker is None:
                    raise ValueError("image content parts need a vision model: start the server with --mmproj")
                pieces.append(image_marker(part.image_url.url))
            else:
                pieces.append(part.text)
        return "".join(pieces)


class StreamOptions(RequestBody):
    include_usage: StrictBool = False


class KvcmasOptions(RequestBody):
    """Groups requests into one sharing workflow and names the agent; method and recompute (the share of each shared
    span recomputed in the agent's context) override the server's --method and --recompute."""

    workflow: StrictStr | None = Field(default=None, min_length=1, max_length=256)  # '': would be `default`'s
    agent: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    method: StrictStr | None = None  # one of sharing.methods.SERVED_METHODS
    recompute: Number | None = Field(default=None, ge=0.0, le=1.0)  # overrides the server's --recompute

    @field_validator("method")
    @classmethod
    def _served(cls, v: str | None) -> str | None:
        if v is not None and v not in SERVED_METHODS:
            raise ValueError(f"unknown method {v!r}; the server runs {', '.join(SERVED_METHODS)}")
        return v


class LoraChoice(RequestBody):
    """llama.cpp's per-request adapter entry: the adapter's id (its place in GET /lora-adapters, load order) and
    its scale (0: not applied)."""

    id: StrictInt = Field(ge=0)
    scale: Number = Field(default=1.0, ge=-100.0, le=100.0)


class _Sampling(RequestBody):
    model: StrictStr | None = None  # the served model's id or a loaded adapter's name (vLLM's way of picking one)
    lora: list[LoraChoice] | None = Field(default=None, max_length=64)  # llama.cpp's way (server/lora.py)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    repeat_penalty: Number = Field(default=1.0, gt=0.0, le=10.0)
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[StrictStr, Number] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Narrows the namespace that may share this request's cached KV (as vLLM's cache_salt): only requests of the
    # same tenant with the same salt share spans, prefix caches and learned corrections.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # HARMLESS_FIELDS: accepted, not used
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            # ASCII digits only: str.isdigit() also takes '²' and '①' (int() refuses them) and '٣' (read as 3)
            if not (key.isascii() and key.isdigit()) or len(key) > 9:
                raise ValueError(f"logit_bias keys are token ids written as strings, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value!r} for token {key}")
        return v

    def bias_by_id(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def stop_list(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    kvcmas: KvcmasOptions | None = None
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    # Variables for the chat template, as vLLM and llama.cpp take them (e.g. {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(v or {}))
        if reserved:
            raise ValueError(f"{', '.join(reserved)} cannot be set here: the server sets them")
        return v

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def logprobs_top(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def has_images(self) -> bool:
        return any(m.has_images() for m in self.messages)

    def plain_messages(self, image_marker: Callable[[str], str] | None = None) -> list[dict[str, Any]]:
        """OpenAI-style dicts with string content (what the chat template and AgentSession take); image parts
        become image_marker(url)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text(image_marker)}
            if m.name is not None:
                msg["name"] = m.name  # kept: templates that know names render it (e.g. an agent's name)
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            for key in ("tool_call_id", "reasoning_content"):  # what templates read beside the content
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            out.append(msg)
        if self.chat_template_kwargs:
            out[0][TEMPLATE_KWARGS_KEY] = dict(self.chat_template_kwargs)
        # the tool list and tool calls for the chat template (kvcmas_cpp.tools)
        return render_tool_messages(out, self.tool_dicts())


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    kvcmas: Any = None  # refused by name, with the reason (not silently dropped)

    def logprobs_top(self) -> int | None:
        return self.logprobs

    @field_validator("kvcmas")
    @classmethod
    def _no_sharing_session(cls, v: Any) -> None:
        if v is not None:
            raise PydanticCustomError(
                "unsupported",
                "not supported on /v1/completions: workflows, agents and methods apply to chat requests; a completion "
                "runs its prompt alone (it reuses only the exact prefix cache's rows)",
            )

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # OpenAI answers echo + logprobs with the prompt's token logprobs too (what scoring harnesses read): not
        # computed here, so refused rather than answered with the generated tokens' alone
        if v is not None and info.data.get("echo"):
            raise ValueError(
                "'echo' with 'logprobs' asks for the prompt's token logprobs, which this server does not compute"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif not v:
            raise ValueError("prompt must not be empty")
        return v

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens
