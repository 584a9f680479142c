"""Fuzz target: chat-template rendering (``kvcmas_cpp.chat.render_chat``) with mutated templates and messages.

Input layout: fields separated by NUL bytes, decoded as UTF-8 (invalid bytes replaced):
  byte 0 (flags) | template | role_1 | content_1 | role_2 | content_2 | ...
flags bit 0: add_generation_prompt; bit 1: content_1 given as a list of text parts; bit 2: a `tools` list is passed.
Allowed outcomes: a string no longer than the output cap, or ChatTemplateError. Any other exception is a finding;
so is a render that outlives its time limit by far (libFuzzer's -timeout catches hangs).

    python fuzz/fuzz_chat.py -max_total_time=45 -timeout=10 fuzz/corpus/chat
"""

from __future__ import annotations

import sys
import time

import _harness
import atheris

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["jinja2", "kvcmas_cpp", "markupsafe"]):
    import jinja2  # noqa: F401  (instrumented for coverage of the template compiler and runtime)

    from kvcmas_cpp.chat import ChatTemplateError, render_chat

MAX_CHARS = 1 << 16
MAX_SECONDS = 0.25
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_one_input(data: bytes) -> None:
    if not data:
        return
    flags = data[0]
    fields = data[1:].decode("utf-8", errors="replace").split("\0")
    template, rest = fields[0], fields[1:]
    messages: list[dict[str, object]] = []
    for i in range(0, len(rest) - 1, 2):
        messages.append({"role": rest[i], "content": rest[i + 1]})
    if messages and flags & 2:
        messages[0]["content"] = [{"type": "text", "text": messages[0]["content"]}]
    extra = {"tools": TOOLS} if flags & 4 else {}
    start = time.monotonic()
    try:
        out = render_chat(
            template,
            messages,
            add_generation_prompt=bool(flags & 1),
            bos_token="<s>",
            eos_token="</s>",
            max_output_chars=MAX_CHARS,
            max_seconds=MAX_SECONDS,
            **extra,
        )
    except ChatTemplateError:
        out = ""
    elapsed = time.monotonic() - start
    assert isinstance(out, str)
    assert len(out) <= MAX_CHARS, len(out)
    # The guard checks the clock every 256 traced steps; a single step that runs for long escapes it.
    assert elapsed < MAX_SECONDS + 2.0, f"render took {elapsed:.2f} s with a {MAX_SECONDS} s limit"


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
