"""Request bodies to validated parameters, without a model: the path every POST body takes before any engine work.

`parse_request` turns raw bytes into a validated request (schemas.py) and its normalised parameters, or raises
ApiError (an OpenAI-style error, 4xx). Nothing here touches the model, so fuzz/fuzz_server.py runs it on arbitrary
bytes: its contract is "a ParsedRequest or an ApiError with a 4xx status, never another exception".
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from ..sampling import SamplingParams
from .schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: room for a few data-URL images
DEFAULT_MAX_TOKENS = 4096  # the most tokens one request may ask to generate
DEFAULT_MAX_IMAGES = 8  # image parts per chat request


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def printable(text: str) -> str:
    """text as UTF-8 can carry it: lone surrogates (which a JSON string may hold) written as \\udXXX escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def loggable(text: str) -> str:
    """Client-supplied text as one log line can hold it: backslashes, control and other unprintable characters
    (newlines, NUL, escape sequences, lone surrogates) written as escapes, so a value cannot forge or hide a line."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode() for c in text)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error response, as OpenAI's API writes it (messages quote client input: made printable)."""
    return {
        "error": {
            "message": printable(message),
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": printable(param) if param is not None else None,
            "code": code,
        }
    }


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where a JSON value holds a string with a lone UTF-16 surrogate (not UTF-8 text: nothing downstream can
    encode it), as a dotted path; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "(body)"
        elif isinstance(item, dict):
            for k, v in item.items():
                stack.append((k, where or "(body)"))
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


# pydantic-core's schema names, which it uses as a union member's tag in an error's location ('list[str]',
# 'tagged-union[TextPart,ImagePart]'); a model member is tagged with its class name
_MEMBER_SCHEMAS = frozenset(
    {
        "float",
        "int",
        "str",
        "bool",
        "bytes",
        "none",
        "list",
        "dict",
        "set",
        "tuple",
        "literal",
        "tagged-union",
        "union",
        "nullable",
        "is-instance",
        "constrained-str",
        "function-after",
        "function-before",
        "function-wrap",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "default",
        "model",
        "dataclass",
        "typed-dict",
    }
)


def _is_member_tag(tag: Any) -> bool:
    return isinstance(tag, str) and (tag.split("[", 1)[0] in _MEMBER_SCHEMAS or tag[:1].isupper())


def _member_form(tag: str) -> str:
    """What a union member's tag accepts, in a client's words: 'list[str]' -> 'a list of strings'."""
    base, _, inner = tag.partition("[")
    if base == "literal":
        return "one of " + inner[:-1].replace(",", ", ")
    if base == "list":
        inner = inner[:-1]
        plural = {"a number": "numbers", "an integer": "integers", "a string": "strings"}
        return "a list of " + plural.get(_member_form(inner), "objects")
    return {
        "float": "a number",
        "int": "an integer",
        "str": "a string",
        "constrained-str": "a string",
        "bool": "a boolean",
        "none": "null",
    }.get(base, "an object")


@dataclass
class _UnionErrors:
    """The errors pydantic reports for one union parameter (one per failing member), folded into one."""

    where: tuple[Any, ...]  # the parameter's location (before the member tag)
    first: dict[str, Any]
    forms: list[str] = field(default_factory=list)  # what the members accept, in a client's words
    broken_rule: tuple[dict[str, Any], tuple[Any, ...]] | None = None  # (error, untagged loc): a member's rule failed
    inside: dict[Any, tuple[dict[str, Any], tuple[Any, ...]]] = field(default_factory=dict)  # per member tag

    def add(self, e: dict[str, Any], loc: tuple[Any, ...], k: int) -> None:
        form = _member_form(str(loc[k]))
        if form not in self.forms:
            self.forms.append(form)
        untagged = loc[:k] + loc[k + 1 :]
        kind = str(e.get("type", ""))
        if self.broken_rule is None and not (kind.endswith("_type") or kind == "literal_error"):
            self.broken_rule = (e, untagged)  # the value had this member's form but broke its rules
        if len(loc) > k + 1:  # an error inside the member: the value has its outer form
            self.inside.setdefault(loc[k], (e, untagged))

    def error(self) -> dict[str, Any]:
        chosen = self.broken_rule or (next(iter(self.inside.values())) if len(self.inside) == 1 else None)
        if chosen is not None:
            e, loc = chosen
            return {**e, "loc": loc}
        forms = [f for f in self.forms if not (f == "an integer" and "a number" in self.forms)]
        said = (", ".join(forms[:-1]) + " or " if len(forms) > 1 else "") + forms[-1]
        return {**self.first, "loc": self.where, "msg": f"Input should be {said}"}


def _one_per_field(errors: list[Any]) -> list[dict[str, Any]]:
    """pydantic's errors with each union folded into one error of the client's parameter. A value that is none of
    a union's forms comes back as errors under each member's tag ('temperature.float', 'temperature.int',
    'prompt.list[int].0'); the parameter is the location before the first tag ('temperature', 'prompt'). If the
    value had a member's form but broke its rules (a list item too long, or the wrong type inside the one member
    whose outer form it has), that error is the one reported, without the tag; otherwise the message lists the forms
    the parameter accepts."""
    located = []  # (error, its location, the index of its first member tag or None)
    tags: dict[tuple[Any, ...], set[Any]] = {}
    for e in errors:
        loc = tuple(e.get("loc", ()))
        k = next((i for i in range(1, len(loc)) if _is_member_tag(loc[i])), None)
        located.append((e, loc, k))
        if k is not None:
            tags.setdefault(loc[:k], set()).add(loc[k])
    out: list[dict[str, Any] | _UnionErrors] = []
    unions: dict[tuple[Any, ...], _UnionErrors] = {}
    for e, loc, k in located:
        # a union reports every member's failure: two or more tags under one location (a lone tag-like name, such
        # as a field called 'model' or a metadata key 'Run', is a plain location)
        if k is None or len(tags[loc[:k]]) < 2:
            out.append(e)
            continue
        if loc[:k] not in unions:
            unions[loc[:k]] = _UnionErrors(loc[:k], e)
            out.append(unions[loc[:k]])
        unions[loc[:k]].add(e, loc, k)
    return [x.error() if isinstance(x, _UnionErrors) else x for x in out]


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One readable line from pydantic's (or FastAPI's) errors, and the parameter it is about."""
    if not errors:
        return "invalid request", None
    errors = _one_per_field(errors)
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    n_more = len(errors) - 1
    more = f" (and {n_more} more problem{'s' if n_more > 1 else ''})" if n_more else ""
    if first.get("type") == "extra_forbidden":
        return f"'{param}' is not supported by this server{more}", param
    where = f"'{param}': " if param else "request body: "
    return f"{where}{first.get('msg', 'invalid value')}{more}", param


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data URL (data:image/png;base64,...). Other URLs are refused: the server fetches
    nothing from the network and reads no files."""
    if not url.startswith("data:"):
        raise ApiError(400, "image_url: only data URLs (data:image/...;base64,...) are accepted", "invalid_image")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(
            400, "image_url: the data URL must be base64-encoded (data:<type>;base64,<data>)", "invalid_image"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "image_url: the data URL's payload is not valid base64", "invalid_image") from None


@dataclass
class Limits:
    """Per-request limits (see `kvcmas-server --help`)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_images: int = DEFAULT_MAX_IMAGES
    max_text_chars: int | None = None  # characters of text one request may have tokenized; None: no bound


def check_text_length(n_chars: int, limits: Limits, param: str) -> None:
    """Refuses text longer than --max-text-chars before it is tokenized or rendered (413): tokenizing megabytes
    takes seconds of a core and its answer megabytes of memory, for a prompt no context could hold."""
    if limits.max_text_chars is not None and n_chars > limits.max_text_chars:
        raise ApiError(
            413,
            f"'{param}' has {n_chars} characters of text; this server takes at most {limits.max_text_chars} per "
            "request (--max-text-chars)",
            "text_too_long",
            param,
        )


def messages_text_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in plain messages (their contents and the tool calls rendered into them)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


@dataclass
class ParsedRequest:
    """A validated body and what the handlers need from it."""

    body: ChatCompletionRequest | CompletionRequest
    sampling: SamplingParams
    stops: list[str]
    max_tokens: int | None  # None: fill what the context and the KV budget leave (capped by Limits.max_tokens)
    images: list[bytes] = field(default_factory=list)  # decoded image_url payloads, in order (chat only)
    logprobs: int | None = None  # None: no logprobs; else the alternatives to report per token


def sampling_params(body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """The body's sampling settings, validated (ApiError 400 on values the sampler refuses)."""
    params = SamplingParams(
        temperature=float(body.temperature),
        top_k=body.top_k,
        top_p=float(body.top_p),
        min_p=float(body.min_p),
        repeat_penalty=float(body.repeat_penalty),
        seed=body.seed,
        presence_penalty=float(body.presence_penalty),
        frequency_penalty=float(body.frequency_penalty),
        logit_bias=body.bias_by_id(),
    )
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_value") from None
    return params


Body = TypeVar("Body", bound=BaseModel)


def _not_a_json_number(name: str) -> Any:
    """Python's json reads NaN, Infinity and -Infinity, which JSON does not have (RFC 8259): refused by name."""
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number", "invalid_request")


def parse_body(raw: bytes, schema: type[Body], limits: Limits) -> Body:
    """Raw POST body -> a validated `schema` instance. Raises ApiError (413 oversized, 400 invalid)."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(
            413, f"the request body has {len(raw)} bytes; the limit is {limits.max_body_bytes}", "body_too_large"
        )
    try:
        obj = json.loads(raw, parse_constant=_not_a_json_number)
    except RecursionError:  # nesting deeper than Python's stack allows
        raise ApiError(400, "the request body is nested too deeply", "invalid_request") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_request") from None
    bad = lone_surrogate_at(obj)
    if bad is not None:
        raise ApiError(
            400, f"'{printable(bad)}' holds a lone UTF-16 surrogate: not valid Unicode text", "invalid_request", bad
        )
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise ApiError(400, message, "invalid_request", param) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", "invalid_request") from None


def parse_request(kind: Literal["chat", "completion"], raw: bytes, limits: Limits) -> ParsedRequest:
    """Raw POST body -> ParsedRequest. Raises ApiError (413 for an oversized body, 400 for anything invalid)."""
    body: ChatCompletionRequest | CompletionRequest = (
        parse_body(raw, ChatCompletionRequest, limits) if kind == "chat" else parse_body(raw, CompletionRequest, limits)
    )
    requested = body.effective_max_tokens()
    if requested is not None and requested > limits.max_tokens:
        param = (
            "max_completion_tokens" if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens else None
        )
        raise ApiError(
            400,
            f"max_tokens is {requested}; this server allows at most {limits.max_tokens} new tokens per request",
            "max_tokens_exceeded",
            param or "max_tokens",
        )
    try:
        logprobs = body.logprobs_top()
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_value", "top_logprobs") from None
    images: list[bytes] = []
    if isinstance(body, CompletionRequest):
        texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        check_text_length(sum(len(t) for t in texts), limits, "prompt")
    if isinstance(body, ChatCompletionRequest):
        urls: list[str] = []

        def collect(url: str) -> str:
            urls.append(url)
            return ""

        try:
            plain = body.plain_messages(collect)  # the text itself is rendered later; this checks every part
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_content", "messages") from None
        check_text_length(messages_text_chars(plain), limits, "messages")
        if len(urls) > limits.max_images:
            raise ApiError(
                400,
                f"the request has {len(urls)} images; this server takes at most {limits.max_images} per request",
                "too_many_images",
                "messages",
            )
        images = [decode_data_url(url) for url in urls]
    return ParsedRequest(body, sampling_params(body), body.stop_list(), requested, images, logprobs)
