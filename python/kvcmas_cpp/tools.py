"""Tool calling: how tools and tool calls are written into a prompt, and how a model's output is read back as calls.

Format (the Hermes / Qwen2.5 one, which Qwen2.5's chat template writes itself): the tools are listed in the system
prompt inside `<tools></tools>`, and the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several blocks for parallel calls). The parser also reads a generic JSON form: an output that is just
`{"name": ..., "arguments": {...}}`, a list of those, or `{"tool_calls": [...]}` (what models without a tool format
tend to write, e.g. SmolLM2). Output that is not a well-formed call of a known tool stays plain content: a malformed
block is content, never an error.

Tool calls and results become ordinary messages with string contents (render_tool_messages): an assistant message's
calls are written as the `<tool_call>` text the model generated, and a `tool` message keeps its role, so both are
spans of the sharing session like any other content (a tool result read by several agents is one shared span).

The tool list itself goes to the model's chat template when the template renders `tools` (Qwen2.5, Llama 3.1,
Mistral, ...: each writes its own format); render_tool_messages only attaches it to the first message under
TOOLS_KEY, and Model.apply_chat_template, which knows the template, passes it on as the template's `tools` or, for
a template that ignores tools (SmolLM2, ChatML), appends tools_system_text to the system prompt (with_tools_text).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat import ChatTemplateError, normalize_messages

__all__ = [
    "TOOLS_KEY",
    "ToolCallStream",
    "format_tool_call",
    "parse_tool_calls",
    "render_tool_messages",
    "attached_tools",
    "template_renders_tools",
    "tools_system_text",
    "with_tools_text",
]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
TOOLS_KEY = "kvcmas_tools"  # the request's tool list, carried on its first message to the chat-template rendering
_TOOLS_VARIABLE = re.compile(r"\btools\b")


def tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool block appended to the system prompt (Qwen2.5's wording)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def format_tool_call(name: str, arguments: str) -> str:
    """A call as the model writes it (arguments: the JSON text of the arguments object, kept verbatim when it is
    valid JSON so that the text equals what was generated)."""
    try:
        json.loads(arguments)
        args = arguments
    except (TypeError, ValueError, RecursionError):
        args = json.dumps(arguments, ensure_ascii=False)  # not JSON: carried as a string
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def render_tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages with string contents for the chat template and the sharing session: an assistant message's
    tool_calls written as `<tool_call>` blocks after its text, `tool` messages kept as they are (role "tool", content
    the result), and the tool list attached to the first message under TOOLS_KEY (Model.apply_chat_template
    renders it). Malformed messages or tool_calls are a ChatTemplateError naming the message."""
    normalize_messages(messages)  # a bad shape is named here, before it is read as a dict
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        m = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id", TOOLS_KEY)}
        calls = msg.get("tool_calls") or []
        if calls:
            try:
                blocks = [format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            except (TypeError, KeyError):
                raise ChatTemplateError(
                    f"messages[{i}]['tool_calls'] must be a list of {{'function': {{'name': <str>, 'arguments': "
                    f"<str>}}}}, got {calls!r:.80}"
                ) from None
            text = str(msg.get("content") or "")
            m["content"] = "\n".join([text, *blocks] if text else blocks)
        out.append(m)
    if tools and out:
        out[0][TOOLS_KEY] = [dict(t) for t in tools]
    return out


def attached_tools(messages: Sequence[Any]) -> list[dict[str, Any]] | None:
    """The tool list render_tool_messages attached (TOOLS_KEY), or None."""
    return next((m[TOOLS_KEY] for m in messages if isinstance(m, dict) and m.get(TOOLS_KEY)), None)


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (then the tool list is its to format)."""
    return bool(template) and _TOOLS_VARIABLE.search(template or "") is not None


def with_tools_text(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For a template that ignores tools: tools_system_text appended to the system prompt (a system message is
    added when there is none)."""
    out = [dict(m) for m in messages]
    block = tools_system_text(tools)
    if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
        first = out[0]["content"]
        out[0] = {**out[0], "role": "system", "content": f"{first}\n\n{block}" if first else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _as_call(obj: Any, names: frozenset[str] | None) -> dict[str, Any] | None:
    """{"name", "arguments" | "parameters"} of a known tool, arguments an object (or its JSON text) -> a call."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):  # OpenAI's own shape
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return _call(name, args)


def _generic_calls(text: str, names: frozenset[str] | None) -> list[dict[str, Any]] | None:
    """The calls of an output that is only JSON (optionally in a ``` fence), or None."""
    s = text.strip()
    if s.startswith("```"):
        s = s.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):
        return None
    items = obj.get("tool_calls") if isinstance(obj, dict) and "tool_calls" in obj else obj
    items = items if isinstance(items, list) else [items]
    calls = [_as_call(item, names) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


@dataclass
class ToolCallStream:
    """Reads a model's output as it streams: text that is content goes out as soon as it cannot be the start of a
    call; each `<tool_call>` block comes out as a call when it closes (or as content when it is malformed); an
    output that starts as JSON is read whole at the end (the generic form).

    feed(text) and finish() return (content, calls): content to emit (may be "") and the completed calls (OpenAI
    tool_call dicts with id, type, function {name, arguments}). `names`: the tools that may be called (None: any).
    """

    names: frozenset[str] | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    _mode: str = "start"  # start (only whitespace so far), text, call (inside a block), json (whole output)
    _held: str = ""  # text not emitted yet

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        out: list[str] = []
        new: list[dict[str, Any]] = []
        while True:
            if self._mode == "start":
                stripped = self._held.lstrip()
                if not stripped:
                    break
                self._mode = "json" if stripped[0] in "{[`" else "text"
            if self._mode == "json":
                break
            if self._mode == "text":
                pos = self._held.find(OPEN)
                if pos < 0:
                    keep = _partial_suffix(self._held, OPEN)
                    emit = self._held[: len(self._held) - keep]
                    body = emit.rstrip()  # trailing whitespace waits: it may only separate calls
                    out.append(body)
                    self._held = emit[len(body) :] + self._held[len(self._held) - keep :]
                    break
                out.append(self._held[:pos].rstrip() if self.calls or new else self._held[:pos])
                self._held = self._held[pos:]
                self._mode = "call"
            if self._mode == "call":
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                block, self._held = self._held[: end + len(CLOSE)], self._held[end + len(CLOSE) :]
                call = self._block_call(block)
                if call is None:
                    out.append(block)
                else:
                    new.append(call)
                self._mode = "text"
        self.calls += new
        return "".join(out), new

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self._held = self._held, ""
        new: list[dict[str, Any]] = []
        content = held
        if self._mode == "json":
            calls = _generic_calls(held, self.names)
            if calls is not None:
                new, content = calls, ""
        elif self._mode == "call":  # the model stopped before closing the block
            call = self._block_call(held + CLOSE)
            if call is not None:
                new, content = [call], ""
        if self.calls or new:
            content = content.strip()
        self._mode = "text"
        self.calls += new
        return content, new

    def _block_call(self, block: str) -> dict[str, Any] | None:
        inner = block[len(OPEN) : -len(CLOSE)].strip()
        try:
            return _as_call(json.loads(inner), self.names)
        except (ValueError, RecursionError):
            return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_tool_calls(
    text: str, names: Sequence[str] | frozenset[str] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output -> (content or None, calls). Malformed calls stay in the content."""
    stream = ToolCallStream(frozenset(names) if names is not None else None)
    content, calls = stream.feed(text)
    tail, more = stream.finish()
    content = (content + tail).strip() if calls or more else content + tail
    return (content or None), calls + more
