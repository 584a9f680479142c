"""Chat-template rendering in a Jinja sandbox.

Chat templates come from model files, which are untrusted input: they are rendered with
``jinja2.sandbox.ImmutableSandboxedEnvironment`` (no access to private / dunder attributes, no mutation of the
passed-in objects), with a cap on the output size and on the render time, the latter enforced by a trace hook that
stops templates that loop for too long. Environment settings follow transformers' ``apply_chat_template``
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from types import FrameType
from typing import Any, NoReturn

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ._native import KvcmasError

__all__ = [
    "CHATML_TEMPLATE",
    "MAX_OUTPUT_CHARS",
    "MAX_RENDER_SECONDS",
    "RESERVED_TEMPLATE_VARIABLES",
    "TEMPLATE_KWARGS_KEY",
    "ChatTemplateError",
    "normalize_messages",
    "render_chat",
]

# Used when a model has no tokenizer.chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MAX_OUTPUT_CHARS = 1 << 20  # 1 Mi characters: far beyond any real prompt, small enough to fail fast
MAX_RENDER_SECONDS = 2.0
MAX_TEMPLATE_CHARS = 1 << 20

# What the renderer itself sets: a caller's template variables (chat_template_kwargs) may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    [
        "messages",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "tools",
        "documents",
        "max_output_chars",
        "max_seconds",
        "template",
    ]
)

# A request's template variables, carried on its first message to every rendering of it (Model.apply_chat_template).
TEMPLATE_KWARGS_KEY = "kvcmas_template_kwargs"

_VALID_ROLES_HINT = "e.g. 'system', 'user', 'assistant', 'tool'"


class ChatTemplateError(KvcmasError):
    """The chat template is invalid, fails, is hostile (sandbox violation, runaway loop, huge output), or the messages
    are malformed (a KvcmasError, as every bad file or argument is)."""


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


class _OutputTooLarge(Exception):
    pass


class _RenderTimeout(BaseException):
    """Raised by the trace hook; a BaseException so that jinja2's own `except Exception` blocks cannot swallow it
    (a trace function that raises is also removed, so a swallowed timeout would never fire again)."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' tojson: keeps non-ASCII characters and is not HTML-escaped (templates are not HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_MAX_REPEAT_ITEMS = 1 << 20  # `"x" * n` / `[x] * n` results above this are refused before allocating
_MAX_POWER_BITS = 1 << 16


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus checks on `*` and `**`, which could otherwise allocate gigabytes in a single operation."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(count, int)
                    and len(seq) * count > _MAX_REPEAT_ITEMS
                ):
                    raise SecurityError(f"repetition would create {len(seq) * count} items")
        elif (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right * math.log2(abs(left)) > _MAX_POWER_BITS
        ):
            raise SecurityError(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # Jinja would return a silent Undefined (rendering as ""); a template probing internals is hostile: fail.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed names (as transformers does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (same signature trick as jinja2's Namespace)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _ChatEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        undefined=jinja2.Undefined,
        extensions=["jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


_ENV = _make_environment()
_COMPILED: dict[str, jinja2.Template] = {}
_COMPILED_LOCK = threading.Lock()


def _compile(template: str, max_seconds: float) -> jinja2.Template:
    with _COMPILED_LOCK:
        compiled = _COMPILED.get(template)
    if compiled is not None:
        return compiled
    # Compiling is bounded like rendering: jinja2's code generator takes seconds on one deeply nested expression
    # (`x ++++...+ y`), and a template can hold thousands of them.
    guard = _Guard(time.thread_time() + max_seconds, max_chars=0)
    previous_trace = sys.gettrace()
    sys.settrace(guard.trace)
    try:
        compiled = _ENV.from_string(template)
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template took longer than {max_seconds:g} s to compile") from None
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    except SyntaxError as e:  # jinja2 lets `{% break %}` / `{% continue %}` outside a loop through to Python's compiler
        raise ChatTemplateError(f"chat template syntax error: {e.msg}") from None
    except (RecursionError, MemoryError):  # deeply nested expressions or blocks exhaust the parser
        raise ChatTemplateError("chat template is nested too deeply to compile") from None
    finally:
        sys.settrace(previous_trace)
    with _COMPILED_LOCK:
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        _COMPILED[template] = compiled
    return compiled


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validates chat messages and returns copies with string content.

    Each message needs a non-empty string ``role`` and a ``content`` that is a string, None (treated as ""), or a
    list of ``{"type": "text", "text": ...}`` parts (joined without separator). Other keys (``tool_calls``,
    ``name``...) are passed through unless they are None. Raises ChatTemplateError naming the message index and
    the problem.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(
                f"messages[{i}]['role'] must be a non-empty string ({_VALID_ROLES_HINT}), got {role!r}"
            )
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts: list[str] = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}]['content'][{j}] must be {{'type': 'text', 'text': <str>}}, got {part!r:.80}"
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ChatTemplateError(
                f"messages[{i}]['content'] must be a string or a list of text parts, got {type(content).__name__}"
            )
        # Like transformers, keys set to None (e.g. tool_calls=None from OpenAI-style clients) are left out, so that
        # `is defined` tests in templates behave.
        copy = {key: value for key, value in message.items() if value is not None}
        copy["content"] = text
        out.append(copy)
    return out


_TEMPLATE_FILENAME = "<template>"  # what jinja2 names the code compiled by Environment.from_string


class _Guard:
    """Render-time and output-size limits.

    The time limit is checked by a per-thread trace hook while rendering: on every function call, and on every line
    of the compiled template itself (a template loop is a Python loop in that code, and may call nothing), so a
    runaway template is stopped within a few hundred steps of the deadline. Jinja's own runtime code is not traced
    line by line, which keeps the overhead low. The deadline is in the thread's CPU time (time.thread_time), not
    wall time: a runaway template burns CPU and is stopped, while a legitimate one on a busy machine, whose thread
    waits for a core, is not failed.
    """

    def __init__(self, deadline: float, max_chars: int) -> None:
        self.deadline = deadline
        self.max_chars = max_chars
        self.chars = 0
        self._counter = 0

    def _tick(self) -> None:
        self._counter += 1
        if self._counter & 0xFF == 0 and time.thread_time() > self.deadline:
            raise _RenderTimeout

    def trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        """Global trace function: sees each call; returns the line tracer for template code only."""
        self._tick()
        return self._trace_template_lines if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    def _trace_template_lines(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        self._tick()
        return self._trace_template_lines

    def count(self, piece: str) -> None:
        self.chars += len(piece)
        if self.chars > self.max_chars:
            raise _OutputTooLarge


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    max_output_chars: int = MAX_OUTPUT_CHARS,
    max_seconds: float = MAX_RENDER_SECONDS,
    **extra: Any,
) -> str:
    """Renders ``messages`` with a Jinja chat template (ChatML when ``template`` is None or empty).

    The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any ``extra``
    variables (e.g. ``tools``, ``date_string``). Raises ChatTemplateError for malformed messages, template syntax
    errors, ``raise_exception(...)`` calls, sandbox violations, output above ``max_output_chars`` and compiles or
    renders that each take more than ``max_seconds`` of the calling thread's CPU time.
    """
    if template is None or template == "":
        template = CHATML_TEMPLATE
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(
            f"chat template is {len(template)} characters, more than the {MAX_TEMPLATE_CHARS} allowed"
        )
    msgs = normalize_messages(messages)
    compiled = _compile(template, max_seconds)
    context: dict[str, Any] = {"tools": None, "documents": None}  # transformers passes these explicitly
    context.update(extra)
    context.update(
        messages=msgs, add_generation_prompt=bool(add_generation_prompt), bos_token=bos_token, eos_token=eos_token
    )

    guard = _Guard(time.thread_time() + max_seconds, max_output_chars)
    pieces: list[str] = []
    previous_trace = sys.gettrace()
    sys.settrace(guard.trace)
    try:
        for piece in compiled.generate(context):
            guard.count(piece)
            pieces.append(piece)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an error: {e}") from None
    except _RenderTimeout:
        raise ChatTemplateError(f"chat template took longer than {max_seconds:g} s to render (runaway loop?)") from None
    except _OutputTooLarge:
        raise ChatTemplateError(f"chat template output exceeds {max_output_chars} characters") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template violates the sandbox: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    except (MemoryError, RecursionError) as e:
        raise ChatTemplateError(f"chat template exhausted resources: {type(e).__name__}") from None
    except Exception as e:  # errors from the template's own expressions (TypeError, ZeroDivisionError, ...)
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous_trace)
    return "".join(pieces)
