"""Tool calling: how tools and tool calls are written into a prompt, and how a model's output is read back as calls.

Each model family writes its calls its own way; the format is picked from the model's chat template
(tool_format_of, docs/openai-surface.md) and read as vLLM's per-family parsers read it:

- `hermes` (Qwen2.5, Qwen3, Hermes, SmolLM3, and the default for templates without a format of their own): one
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` block per call;
- `llama3` (Llama 3.1 / 3.2 / 3.3): the output is JSON `{"name": ..., "parameters": {...}}` (several separated by
  `;`), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (or the newer `[TOOL_CALLS]name[ARGS]{...}`);
- `phi4_mini` (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]`.

Every format also reads the generic JSON form: an output that is just `{"name": ..., "arguments": {...}}`, a list
of those, or `{"tool_calls": [...]}` (what models without a tool format tend to write, e.g. SmolLM2). Output that is
not a well-formed call of a known tool stays plain content: a malformed call is content, never an error.

Tool calls and results stay ordinary messages (render_tool_messages keeps an assistant message's tool_calls and a
tool message's tool_call_id, and attaches the request's tool list to the first message under TOOLS_KEY);
Model.apply_chat_template, which knows the template, gives them to a template that renders them (Qwen3, Llama 3,
Mistral: transformers' message shapes, arguments as objects), or writes the calls as the `<tool_call>` text the
model generated and the tool list into the system prompt (tools_system_text) for one that ignores them (SmolLM2,
ChatML). Tool results are message contents either way, so a result read by several agents is one shared span.
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
    "TOOL_FORMATS",
    "ToolCallStream",
    "ToolFormat",
    "attached_tools",
    "format_tool_call",
    "format_tool_calls",
    "model_messages",
    "parse_tool_calls",
    "render_tool_messages",
    "template_renders_tools",
    "tool_format_of",
    "tools_system_text",
    "with_tools_text",
]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
TOOLS_KEY = "kvcmas_tools"  # the request's tool list, carried on its first message to the chat-template rendering
_TOOLS_VARIABLE = re.compile(r"\btools\b")
_TOOL_CALLS_VARIABLE = re.compile(r"\btool_calls\b")


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls. open: the marker its calls start with; close: the marker that ends
    each call (hermes) or None (the calls run to the end of the output); args_key: what the format calls the
    arguments; separator: between parallel calls. A grammar that forces calls writes prefix, then the calls (each
    call_open + JSON + call_close) joined by separator, then suffix."""

    name: str
    open: str
    close: str | None
    args_key: str = "arguments"
    prefix: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = "\n"
    suffix: str = ""


HERMES = ToolFormat("hermes", OPEN, CLOSE, call_open=OPEN + "\n", call_close="\n" + CLOSE)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", None, args_key="parameters", separator="; ")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, prefix="[TOOL_CALLS][", separator=", ", suffix="]")
PHI4_MINI = ToolFormat("phi4_mini", "functools[", None, prefix="functools[", separator=", ", suffix="]")
TOOL_FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, PHI4_MINI)}


def tool_format_of(template: str | None) -> ToolFormat:
    """The tool-call format a chat template implies (its own markers, as llama.cpp detects them): `[TOOL_CALLS]`
    -> mistral; `<|python_tag|>`, or Llama 3's header tokens with its `"parameters"` call format -> llama3;
    Phi-4-mini's `<|tool|>` block -> phi4_mini; anything else (`<tool_call>` templates, ChatML, none) -> hermes."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return LLAMA3
    if "<|tool|>" in t and "<|/tool|>" in t:
        return PHI4_MINI
    return HERMES


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


def format_tool_call(name: str, arguments: str, fmt: ToolFormat | None = None) -> str:
    """A call as the model writes it, in fmt (hermes by default; arguments: the JSON text of the arguments object,
    kept verbatim when it is valid JSON so that the text equals what was generated)."""
    return format_tool_calls([(name, arguments)], fmt or HERMES)


def format_tool_calls(calls: Sequence[tuple[str, str]], fmt: ToolFormat) -> str:
    """(name, arguments JSON text) calls as the model family writes them: what its parser reads back and what a
    forced call's grammar produces."""
    written = []
    for name, arguments in calls:
        try:
            json.loads(arguments)
            args = arguments
        except (TypeError, ValueError, RecursionError):
            args = json.dumps(arguments, ensure_ascii=False)  # not JSON: carried as a string
        obj = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{fmt.args_key}": {args}}}'
        written.append(fmt.call_open + obj + fmt.call_close)
    return fmt.prefix + fmt.separator.join(written) + fmt.suffix


def render_tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for the chat template and the sharing session: copies, with an assistant message's tool_calls
    checked ({"function": {"name": <str>, "arguments": <str>}}), and the tool list attached to the first message
    under TOOLS_KEY (Model.apply_chat_template renders both, see model_messages). Malformed messages or tool_calls
    are a ChatTemplateError naming the message."""
    normalize_messages(messages)  # a bad shape is named here, before it is read as a dict
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        m = {k: v for k, v in msg.items() if k != TOOLS_KEY and v is not None}
        m.setdefault("content", "")  # an assistant message that only calls tools sends content None
        for c in msg.get("tool_calls") or []:
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
                raise ChatTemplateError(
                    f"messages[{i}]['tool_calls'] must be a list of {{'function': {{'name': <str>, 'arguments': "
                    f"<str>}}}}, got {msg.get('tool_calls')!r:.80}"
                )
        out.append(m)
    if tools and out:
        out[0][TOOLS_KEY] = [dict(t) for t in tools]
    return out


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the object transformers' templates expect (OpenAI sends its JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
    return arguments


def model_messages(
    messages: Sequence[Mapping[str, Any]], template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """render_tool_messages' output as the template takes it -> (messages, the `tools` variable or None).

    A template that renders tool calls (reads `tool_calls`) gets them as transformers passes them: arguments as
    objects, as vLLM converts them. One that does not gets the calls written into the assistant's content as the
    model generated them, in its family's format (format_tool_calls). Tools go to a template that reads `tools` as
    that variable, to Phi-4-mini's as the system message's `tools` JSON text (its model card's convention), and
    otherwise into the system prompt (with_tools_text)."""
    tools = attached_tools(messages)
    fmt = tool_format_of(template)
    native_calls = _TOOL_CALLS_VARIABLE.search(template or "") is not None
    out: list[dict[str, Any]] = []
    for msg in messages:
        m = {k: v for k, v in msg.items() if k != TOOLS_KEY}
        calls = m.get("tool_calls")
        if calls and native_calls:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
                for c in calls
            ]
        elif calls:
            del m["tool_calls"]
            written = format_tool_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls], fmt)
            text = str(m.get("content") or "")
            m["content"] = f"{text}\n{written}" if text else written
        out.append(m)
    if tools is None:
        return out, None
    if fmt is PHI4_MINI:
        listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "tools": listed}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": listed})
        return out, None
    if template_renders_tools(template):
        return out, tools
    return with_tools_text(out, tools), None


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


_DECODER = json.JSONDecoder()


def _json_calls(text: str, names: frozenset[str] | None) -> list[dict[str, Any]] | None:
    """The calls of a text that is only JSON values separated by whitespace, `;` or `,` (each a call, a list of
    calls or {"tool_calls": [...]}), optionally in a ``` fence; None unless every value is a call."""
    s = text.strip()
    if s.startswith("```"):
        s = s.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    calls: list[dict[str, Any]] = []
    pos = 0
    while pos < len(s):
        try:
            obj, pos = _DECODER.raw_decode(s, pos)
        except (ValueError, RecursionError):
            return None
        items = obj.get("tool_calls") if isinstance(obj, dict) and "tool_calls" in obj else obj
        for item in items if isinstance(items, list) else [items]:
            call = _as_call(item, names)
            if call is None:
                return None
            calls.append(call)
        while pos < len(s) and s[pos] in " \t\r\n;,":
            pos += 1
    return calls or None


_MISTRAL_ARGS = "[ARGS]"


def _tail_calls(fmt: ToolFormat, tail: str, names: frozenset[str] | None) -> list[dict[str, Any]] | None:
    """The calls written after a format's opening marker (to the end of the output), or None when malformed."""
    if fmt is PHI4_MINI:
        return _json_calls("[" + tail, names)
    if fmt is MISTRAL and _MISTRAL_ARGS in tail and not tail.lstrip().startswith(("[", "{")):
        calls: list[dict[str, Any]] = []  # the newer form: name[ARGS]{...}, one per [TOOL_CALLS]
        for part in tail.split(fmt.open):
            name, sep, args = part.partition(_MISTRAL_ARGS)
            call = _as_call({"name": name.strip(), "arguments": args.strip()}, names) if sep else None
            if call is None:
                return None
            calls.append(call)
        return calls
    return _json_calls(tail, names)


@dataclass
class ToolCallStream:
    """Reads a model's output as it streams: text that is content goes out as soon as it cannot be the start of a
    call; a hermes `<tool_call>` block comes out as a call when it closes (or as content when it is malformed);
    the calls after another format's marker (`[TOOL_CALLS]`, `<|python_tag|>`, `functools[`), and an output that
    starts as JSON (the generic form, Llama 3's calls), are read whole at the end.

    feed(text) and finish() return (content, calls): content to emit (may be "") and the completed calls (OpenAI
    tool_call dicts with id, type, function {name, arguments}). `names`: the tools that may be called (None: any).
    `fmt`: the model family's ToolFormat (tool_format_of).
    """

    names: frozenset[str] | None = None
    fmt: ToolFormat = HERMES
    calls: list[dict[str, Any]] = field(default_factory=list)
    _mode: str = "start"  # start (only whitespace so far), text, call (inside a block), json / tail (read at the end)
    _held: str = ""  # text not emitted yet

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        out: list[str] = []
        new: list[dict[str, Any]] = []
        while True:
            if self._mode == "start":
                stripped = self._held.lstrip()
                if not stripped or (len(stripped) < len(self.fmt.open) and self.fmt.open.startswith(stripped)):
                    break  # only whitespace, or maybe the format's marker: wait
                self._mode = "json" if stripped[0] in "{[`" and not stripped.startswith(self.fmt.open) else "text"
            if self._mode in ("json", "tail"):
                break
            if self._mode == "text":
                pos = self._held.find(self.fmt.open)
                if pos < 0:
                    keep = partial_marker(self._held, self.fmt.open)
                    emit = self._held[: len(self._held) - keep]
                    body = emit.rstrip()  # trailing whitespace waits: it may only separate calls
                    out.append(body)
                    self._held = emit[len(body) :] + self._held[len(self._held) - keep :]
                    break
                out.append(self._held[:pos].rstrip() if self.calls or new else self._held[:pos])
                self._held = self._held[pos:]
                self._mode = "call" if self.fmt.close is not None else "tail"
            if self._mode == "call":
                assert self.fmt.close is not None
                end = self._held.find(self.fmt.close)
                if end < 0:
                    break
                block, self._held = self._held[: end + len(self.fmt.close)], self._held[end + len(self.fmt.close) :]
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
            calls = _json_calls(held, self.names)
            if calls is not None:
                new, content = calls, ""
        elif self._mode == "tail":
            calls = _tail_calls(self.fmt, held[len(self.fmt.open) :], self.names)
            if calls is not None:
                new, content = calls, ""
        elif self._mode == "call":  # the model stopped before closing the block
            assert self.fmt.close is not None
            call = self._block_call(held + self.fmt.close)
            if call is not None:
                new, content = [call], ""
        if self.calls or new:
            content = content.strip()
        self._mode = "text"
        self.calls += new
        return content, new

    def _block_call(self, block: str) -> dict[str, Any] | None:
        assert self.fmt.close is not None
        inner = block[len(self.fmt.open) : -len(self.fmt.close)].strip()
        try:
            return _as_call(json.loads(inner), self.names)
        except (ValueError, RecursionError):
            return None


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (what a stream holds back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_tool_calls(
    text: str, names: Sequence[str] | frozenset[str] | None = None, fmt: ToolFormat = HERMES
) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output -> (content or None, calls), in the family format fmt. Malformed calls stay in the content."""
    stream = ToolCallStream(frozenset(names) if names is not None else None, fmt)
    content, calls = stream.feed(text)
    tail, more = stream.finish()
    content = (content + tail).strip() if calls or more else content + tail
    return (content or None), calls + more
