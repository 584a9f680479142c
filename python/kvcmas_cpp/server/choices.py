"""One choice of a chat or text completion, assembled from the scheduler's events in OpenAI's shapes: its text, its
logprobs (chat: {"content": [...]}, completions: tokens / token_logprobs / top_logprobs / text_offset) and, for chat
replies, the reasoning of a thinking model (`reasoning_content`, kvcmas_cpp.reasoning.ReasoningStream) and the tool
calls of requests with tools (kvcmas_cpp.tools.ToolCallStream, in the model family's format), streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..reasoning import ReasoningStream
from ..sampling import TokenLogprob, chat_logprobs
from ..tokenizer import Tokenizer
from ..tools import HERMES, ToolCallStream, ToolFormat
from .jobs import Delta, Done


@dataclass(frozen=True)
class ReplyFormat:
    """How a chat reply is read. tools: the functions whose calls are parsed (None: no tool-call parsing);
    tool_format: the model family's call format; reasoning: split `<think>` text off as reasoning_content; opened:
    the prompt opened the reasoning block (the reply starts in it)."""

    tools: frozenset[str] | None = None
    tool_format: ToolFormat = HERMES
    reasoning: bool = False
    opened: bool = False


def _piece(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tok.token_to_piece(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def completion_logprobs(tok: Tokenizer, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's (legacy) completions logprobs object; offset: the text offset of the first token."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text, _ = _piece(tok, lp.token)
        tokens.append(text)
        values.append(lp.logprob)
        top: dict[str, float] = {}
        for token, value in lp.top:
            top.setdefault(_piece(tok, token)[0], value)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class Choice:
    """What one choice produced so far. kind: "chat" or "completion"; reply: how a chat reply is read (None: plain
    text); echo: the prompt text a completion repeats."""

    def __init__(self, index: int, kind: str, tok: Tokenizer, reply: ReplyFormat | None, echo: str = "") -> None:
        self.index = index
        self.kind = kind
        self.tok = tok
        reply = reply or ReplyFormat()
        self.tools = ToolCallStream(reply.tools, reply.tool_format) if reply.tools is not None else None
        self.reasoning = ReasoningStream(reply.opened) if reply.reasoning else None
        self.reasoning_text: list[str] = []
        self.text: list[str] = [echo] if echo else []
        self.logprobs: list[TokenLogprob] | None = None
        self.offset = len(echo)
        self.echo_len = len(echo)
        self.done: Done | None = None
        self.tool_calls: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------------------ stream
    def on_delta(self, ev: Delta) -> list[dict[str, Any]]:
        """The stream choice objects ({"index", "delta" | "text", "logprobs", "finish_reason"}) for this event."""
        lp = None
        if ev.logprobs is not None:
            self.logprobs = (self.logprobs or []) + ev.logprobs
            lp = self._format_logprobs(ev.logprobs)
        self.offset += len(ev.text)
        if self.kind == "completion":
            self.text.append(ev.text)
            return [self._stream_choice(ev.text, lp, None)]
        if self.tools is None and self.reasoning is None:
            self.text.append(ev.text)
            return [self._stream_choice({"content": ev.text}, lp, None)]
        reasoning, text = self.reasoning.feed(ev.text) if self.reasoning is not None else ("", ev.text)
        content, calls = self.tools.feed(text) if self.tools is not None else (text, [])
        return self._reply_events(reasoning, content, calls, lp)

    def on_done(self, ev: Done) -> list[dict[str, Any]]:
        """The last stream choice objects: what the parsers still held, then the finish reason."""
        self.done = ev
        out: list[dict[str, Any]] = []
        if self.reasoning is not None or self.tools is not None:
            reasoning, text = self.reasoning.finish() if self.reasoning is not None else ("", "")
            content, calls = self.tools.feed(text) if self.tools is not None else (text, [])
            if self.tools is not None:
                tail, more = self.tools.finish()
                content, calls = content + tail, calls + more
            out = [c for c in self._reply_events(reasoning, content, calls, None) if c["delta"]]
        empty: dict[str, Any] | str = {} if self.kind == "chat" else ""
        out.append(self._stream_choice(empty, None, self.finish_reason))
        return out

    def _reply_events(self, reasoning: str, content: str, calls: list[dict[str, Any]], lp: Any) -> list[dict[str, Any]]:
        out = []
        if reasoning:
            self.reasoning_text.append(reasoning)
            out.append(self._stream_choice({"reasoning_content": reasoning}, lp, None))
            lp = None
        if content or lp is not None:
            self.text.append(content)
            out.append(self._stream_choice({"content": content} if content else {}, lp, None))
        for call in calls:
            k = len(self.tool_calls)
            self.tool_calls.append(call)
            out.append(self._stream_choice({"tool_calls": [{"index": k, **call}]}, None, None))
        return out

    def _stream_choice(self, delta: dict[str, Any] | str, lp: Any, finish: str | None) -> dict[str, Any]:
        key = "delta" if self.kind == "chat" else "text"
        return {"index": self.index, key: delta, "logprobs": lp, "finish_reason": finish}

    def _format_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": chat_logprobs(self.tok, lps), "refusal": None}
        return completion_logprobs(self.tok, lps, self.offset)

    # ------------------------------------------------------------------------------------------------- whole
    @property
    def finish_reason(self) -> str:
        assert self.done is not None
        # cut by max_tokens stays "length" (a later call may be cut off), as OpenAI reports it
        return "tool_calls" if self.tool_calls and self.done.finish_reason == "stop" else self.done.finish_reason

    def final(self) -> dict[str, Any]:
        """The non-streamed choice object (after on_done)."""
        lp = None
        if self.logprobs is not None:
            lp = (
                {"content": chat_logprobs(self.tok, self.logprobs), "refusal": None}
                if self.kind == "chat"
                else completion_logprobs(self.tok, self.logprobs, self.echo_len)
            )
        text = "".join(self.text)
        if self.kind == "completion":
            return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": self.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_text:
            message["reasoning_content"] = "".join(self.reasoning_text)
        if self.tool_calls:
            message["content"] = text.strip() or None
            message["tool_calls"] = self.tool_calls
        return {"index": self.index, "message": message, "logprobs": lp, "finish_reason": self.finish_reason}
