"""Reasoning ("thinking") in a reply, returned apart from the answer as `reasoning_content`, the way llama.cpp
(`--reasoning-format deepseek`, its default) and vLLM's reasoning parsers (qwen3, deepseek_r1) return it.

Models that think (Qwen3, SmolLM3, QwQ, DeepSeek-R1 and its distills) write their reasoning between `<think>` and
`</think>` before the answer; their chat templates say so (they contain `<think>`), which is how a model is known to
think (thinks). Two cases:

- the reply opens the block itself (Qwen3 with thinking on): reasoning is what stands between `<think>` and
  `</think>` at the start of the reply; a reply that does not start with `<think>` is all content (Qwen3 with
  `enable_thinking: false`, whose template writes an empty block into the prompt);
- the prompt opened the block (the generation prompt ends with `<think>`: DeepSeek-R1, Qwen3's thinking-only
  releases): the reply starts inside it, and everything up to `</think>` is reasoning.

A block that never closes (the reply was cut off) is all reasoning. The reasoning is returned without the blank
lines around it, the content without the blank lines after `</think>`. ReasoningStream splits a streamed reply
into the same two parts as split_reasoning does the whole one, at any split of the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tools import partial_marker

__all__ = ["THINK_CLOSE", "THINK_OPEN", "ReasoningStream", "opens_thinking", "split_reasoning", "thinks"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template belongs to a model that writes `<think>` blocks."""
    return THINK_OPEN in (template or "")


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (the reply starts as reasoning)."""
    start = prompt.rfind(THINK_OPEN)
    return start >= 0 and prompt.rfind(THINK_CLOSE) < start and not prompt[start + len(THINK_OPEN) :].strip()


@dataclass
class ReasoningStream:
    """Splits a reply as it streams. feed(text) and finish() return (reasoning, content): the text of each to emit
    now (either may be ""). opened: the prompt opened the `<think>` block (opens_thinking)."""

    opened: bool = False

    def __post_init__(self) -> None:
        # start: nothing but whitespace yet; lead: in the block, before its first non-blank text; reasoning; after:
        # past `</think>`, before the answer's first non-blank text; content
        self._mode = "lead" if self.opened else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._held, self._mode = stripped[len(THINK_OPEN) :], "lead"
                elif not stripped or THINK_OPEN.startswith(stripped):
                    break  # blank, or maybe the opening tag: wait
                else:
                    self._mode = "content"
            if self._mode in ("lead", "reasoning"):
                end = self._held.find(THINK_CLOSE)
                done = end >= 0
                body = self._held[:end] if done else self._held
                keep = 0 if done else partial_marker(body, THINK_CLOSE)
                emit = body[: len(body) - keep]
                if self._mode == "lead":
                    emit = emit.lstrip()
                    if emit:
                        self._mode = "reasoning"
                if done:
                    reasoning.append(emit.rstrip())
                    self._held, self._mode = self._held[end + len(THINK_CLOSE) :], "after"
                else:
                    trimmed = emit.rstrip()  # blank lines wait: they may be the last before `</think>`
                    reasoning.append(trimmed)
                    self._held = emit[len(trimmed) :] + body[len(body) - keep :]
                    break
            if self._mode == "after":
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._mode = "content"
            if self._mode == "content":
                content.append(self._held)
                self._held = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held: a reply that never left the block leaves its blank tail out; one that was only
        blank (or a partial `<think>`) is content."""
        held, self._held = self._held, ""
        if self._mode == "start":
            return "", held
        if self._mode in ("lead", "reasoning", "after"):
            return "", ""
        return "", held


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole reply -> (reasoning or None, content)."""
    stream = ReasoningStream(opened)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2
