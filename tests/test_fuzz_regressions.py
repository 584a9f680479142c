"""Regression tests for what fuzzing (fuzz/, scripts/ci-fuzz.sh) found, and a replay of the seed corpora.

Each finding is pinned by an explicit test naming the input; saved crash inputs under fuzz/regressions/<target>/ and
the seed corpora under fuzz/corpus/<target>/ are also replayed through the fuzz targets' own checks (needs atheris,
which the targets import; skipped without it).
"""

from __future__ import annotations

import base64
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcmas_cpp._native import core
from kvcmas_cpp.chat import ChatTemplateError, render_chat
from kvcmas_cpp.tokenizer import Tokenizer

FUZZ_DIR = Path(__file__).resolve().parent.parent / "fuzz"
TARGETS = ("gguf", "tokenizer", "chat")


@pytest.fixture(scope="module")
def smollm2_tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(core.GgufFile(default_model_path).metadata())


# --- findings -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["\ud800", "ab\udcff", "ok \udfff then more", "\ud83d"])
@pytest.mark.parametrize("parse_special", [False, True])
def test_lone_surrogates_are_a_value_error(smollm2_tokenizer: Tokenizer, text: str, parse_special: bool) -> None:
    """fuzz_tokenizer, seed `invalid_utf8`: text with a lone surrogate (JSON "\\ud800" decodes to one) made the
    HF tokenizer raise TypeError("TextInputSequence must be str"); encode now refuses it with a ValueError."""
    with pytest.raises(ValueError, match="lone surrogate"):
        smollm2_tokenizer.encode(text, add_special=True, parse_special=parse_special)


def test_text_around_a_valid_surrogate_pair_still_encodes(smollm2_tokenizer: Tokenizer) -> None:
    """The surrogate check must not refuse characters outside the BMP (stored as one code point in Python)."""
    text = "emoji \U0001f600 and more"
    ids = smollm2_tokenizer.encode(text, add_special=False)
    assert smollm2_tokenizer.decode(ids) == text


def test_characters_without_byte_tokens_are_dropped_as_hf_does(
    smollm2_tokenizer: Tokenizer, default_model_path: Path, reference: Any
) -> None:
    """fuzz_tokenizer, fuzz/regressions/tokenizer/control_bytes_without_tokens: "\x04" vanished from the round trip.
    Not a bug: SmolLM2's byte-level vocabulary has no token for a few control bytes, and transformers (like
    llama.cpp) drops them too. Pinned so that the engine keeps agreeing with the reference on them."""
    text = "\x03\x00\x02\x00\x03\x04 a\x06b\x13c\x14d\x16e\x1df"
    ids = smollm2_tokenizer.encode(text, add_special=False)
    assert ids == reference.encode(default_model_path, text)
    assert smollm2_tokenizer.decode(ids) == "\x03\x00\x02\x00\x03 abcdef"


def test_lead_bytes_without_tokens_are_dropped_alone_as_hf_does(
    smollm2_tokenizer: Tokenizer, default_model_path: Path, reference: Any
) -> None:
    """fuzz_tokenizer, fuzz/regressions/tokenizer/lead_byte_without_token: U+5F1F7 (UTF-8 f1 9f 87 b7) came back as
    three U+FFFD. Not a bug in the engine but in the fuzz target's expectation: SmolLM2 has no token for the lead
    byte 0xf1, and transformers (like llama.cpp) drops that byte alone and keeps the character's other bytes."""
    text = "\x01 こ세요 \U0005f1f7 a\U00050000b\U000a1234\xc0y"
    ids = smollm2_tokenizer.encode(text, add_special=False)
    assert ids == reference.encode(default_model_path, text)
    assert smollm2_tokenizer.decode(ids) == "\x01 こ세요 \ufffd\ufffd\ufffd a\ufffd\ufffd\ufffdb\ufffd\ufffd\ufffd\xc0y"


@pytest.mark.parametrize(
    "template",
    [
        "{% continue %}",
        "{% if true %}{% break %}{% endif %}",
        "{% for m in messages %}{% macro f() %}{% continue %}{% endmacro %}{% endfor %}",
    ],
)
def test_loop_controls_outside_a_loop_are_a_template_error(template: str) -> None:
    """fuzz_chat, fuzz/regressions/chat/continue_outside_loop: jinja2 compiles `{% continue %}` outside a loop into
    Python that does not compile, and the SyntaxError escaped render_chat."""
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat(template, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
        "{% if 1 %}" * 3000 + "{% endif %}" * 3000,
        "{{ " + "-" * 50000 + "1 }}",
    ],
    ids=["parentheses", "blocks", "unary"],
)
def test_deeply_nested_templates_are_a_template_error(template: str) -> None:
    """Found while reducing the finding above: deep nesting exhausted jinja2's recursive parser and RecursionError
    escaped render_chat (a template comes from an untrusted model file)."""
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        render_chat(template, [{"role": "user", "content": "hi"}])


def test_compile_time_is_bounded() -> None:
    """fuzz_chat, fuzz/regressions/chat/slow_compile_unary_chain: jinja2's code generator takes about a second per
    190-deep unary chain (`x ++++...+ y`) and compiling was not under the time limit, so a template of many such
    expressions took minutes. Compiling now stops at max_seconds like rendering."""
    template = "".join(f"{{{{ x{i} " + "+" * 190 + " y }}" for i in range(50))
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="to compile"):
        render_chat(template, [{"role": "user", "content": "hi"}], max_seconds=0.3)
    assert time.monotonic() - start < 0.3 + 1.5


# A GGUF file whose general.architecture string is not UTF-8 ("\x94\x8fama"); the model loader quotes it in its error.
BAD_ARCH_GGUF = base64.b64decode(
    "R0dVRgMAAAAAAAAAAAAAAAIAAAAAAAAAFAAAAAAAAABnZW5lcmFsLmFyY2hpdGVjdHVyZQgAAAAFAAAAAAAAAJSPYW1hEQAAAAAAAABsbGFtYS5i"
    "bG9ja19jb3VudAQAAAABAAAABQAAAAAAAABhLmYzMgIAAAAEAAAAAAAAAAIAAAAAAAAAAAAAANzk3Nzc3Nzc3Nzc3Nzc3AAAAA=="
)


def test_error_messages_quoting_non_utf8_bytes_are_kvcmas_errors(tmp_path: Path) -> None:
    """fuzz_gguf: a metadata string need not be UTF-8, and Model's error quotes it."""
    path = tmp_path / "bad_arch.gguf"
    path.write_bytes(BAD_ARCH_GGUF)
    assert core.GgufFile(str(path)).string_bytes("general.architecture") == b"\x94\x8fama"
    with pytest.raises(core.KvcmasError, match="unsupported architecture"):
        core.Model(str(path), 1, 32, 1 << 20)


# --- replay of saved inputs -----------------------------------------------------------------------------------------


def _target(name: str) -> Callable[[bytes], None]:
    pytest.importorskip("atheris")
    if str(FUZZ_DIR) not in sys.path:
        sys.path.insert(0, str(FUZZ_DIR))
    return importlib.import_module(f"fuzz_{name}").test_one_input


def _inputs(name: str) -> list[Path]:
    return sorted(
        p for folder in ("corpus", "regressions") for p in (FUZZ_DIR / folder / name).glob("*") if p.is_file()
    )


@pytest.mark.parametrize("name", TARGETS)
def test_saved_inputs_pass_the_target_checks(name: str, default_model_path: Path) -> None:
    inputs = _inputs(name)
    assert inputs, f"no seed corpus in fuzz/corpus/{name}"
    check = _target(name)
    for path in inputs:
        check(path.read_bytes())
