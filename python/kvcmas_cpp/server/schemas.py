"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Fields follow OpenAI's chat/completions and completions APIs; llama.cpp-style extras (top_k, min_p,
repeat_penalty) and the kvcmas extension (``"kvcmas": {"workflow", "agent", "method"}``) are optional. Unknown
fields are ignored, as OpenAI clients send more than a local server needs. Types are strict (no "0.5" for a number,
no 1 for a bool), so a wrong type is a 400 rather than a silent coercion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = StrictFloat | StrictInt
METHODS = ("nonshared", "fullshared", "kvcmas")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Body):
    url: StrictStr


class ImagePart(_Body):
    """Accepted by the schema so the error names the real problem (no vision model yet), not the shape."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

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


class StreamOptions(_Body):
    include_usage: StrictBool = False


class KvcmasOptions(_Body):
    """Groups requests into one sharing workflow and names the agent; method overrides the server's --method."""

    workflow: StrictStr | None = Field(default=None, max_length=256)
    agent: StrictStr | None = Field(default=None, max_length=256)
    method: Literal["nonshared", "fullshared", "kvcmas"] | None = None


class _Sampling(_Body):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    repeat_penalty: Number = Field(default=1.0, gt=0.0, le=10.0)
    seed: StrictInt | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Narrows the namespace that may share this request's cached KV (as vLLM's cache_salt): only requests of the
    # same tenant with the same salt share spans, prefix caches and learned corrections.
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    kvcmas: KvcmasOptions | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

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
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def has_images(self) -> bool:
        return any(m.has_images() for m in self.messages)

    def plain_messages(self, image_marker: Callable[[str], str] | None = None) -> list[dict[str, Any]]:
        """OpenAI-style dicts with string content (what the chat template and AgentSession take); image parts
        become image_marker(url)."""
        return [{"role": m.role, "content": m.text(image_marker)} for m in self.messages]


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default for completions

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
