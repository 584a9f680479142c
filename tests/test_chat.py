"""Chat-template rendering: equality with transformers on real templates, the ChatML fallback, message validation,
and hostile templates (sandbox escapes, runaway loops, huge output) failing fast with ChatTemplateError."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kvcmas_cpp._native import core
from kvcmas_cpp.chat import CHATML_TEMPLATE, ChatTemplateError, normalize_messages, render_chat

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = Path(os.environ.get("KVCMAS_VOCAB_DIR", REPO_ROOT / "models" / "generated" / "vocab"))

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Say 'ünïcode 🦙' and\nnewlines\n\n{{ not a template }}"},
    ],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "C"},
        {"role": "assistant", "content": "D"},
    ],
]


def _transformers_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = chat_utils.render_jinja_template([messages], chat_template=template, **kwargs)
    return rendered[0]


@pytest.fixture(scope="module")
def smollm2_template(default_model_path: Path) -> str:
    template = core.GgufFile(str(default_model_path)).metadata().get("tokenizer.chat_template")
    assert isinstance(template, str) and template
    return template


@pytest.fixture(scope="module")
def hf_smollm2(default_model_path: Path) -> Any:
    """transformers' tokenizer of the default model (the saved copy that tests/test_tokenizer.py caches, else
    converted from the GGUF file)."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cached = REPO_ROOT / "models" / "generated" / "hf-tokenizer-smollm2"
    stat = default_model_path.stat()
    stamp = f"{default_model_path.name} {stat.st_size} {stat.st_mtime_ns} transformers {transformers.__version__}\n"
    if (cached / "SOURCE").is_file() and (cached / "SOURCE").read_text() == stamp:
        return transformers.AutoTokenizer.from_pretrained(str(cached))
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


# --- equality with transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(
    smollm2_template: str, hf_smollm2: Any, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = render_chat(
        smollm2_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=hf_smollm2.bos_token or "",
        eos_token=hf_smollm2.eos_token or "",
    )
    assert ours == expected
    if messages[0]["role"] != "system":  # the template adds SmolLM2's default system prompt
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("name", ["qwen2", "qwen35", "phi-3", "command-r", "gemma-4"])
def test_vocab_templates_match_transformers(name: str) -> None:
    """Real templates from llama.cpp's vocab files (whitespace control, loops, namespaces, tojson...)."""
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `python models/fetch_vocab.py`")
    template = core.GgufFile(str(path)).metadata().get("tokenizer.chat_template")
    assert isinstance(template, str) and template
    for messages in CONVERSATIONS[:3]:
        for add_generation_prompt in (True, False):
            kwargs = {"add_generation_prompt": add_generation_prompt, "bos_token": "<s>", "eos_token": "</s>"}
            assert render_chat(template, messages, **kwargs) == _transformers_render(template, messages, **kwargs)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» <b>html</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# A Qwen2.5-style tool prompt: whitespace-trimming tags, a loop, and tojson.
TOOL_TEMPLATE = (
    "{%- if tools %}\n  {{- '<|im_start|>system\\n# Tools\\n<tools>' }}\n  {%- for tool in tools %}\n"
    "    {{- '\\n' }}{{- tool | tojson }}\n  {%- endfor %}\n  {{- '\\n</tools><|im_end|>\\n' }}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)


def test_tools_are_rendered_like_transformers() -> None:
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    ours = render_chat(TOOL_TEMPLATE, messages, tools=TOOLS)
    assert ours == _transformers_render(TOOL_TEMPLATE, messages, tools=TOOLS, add_generation_prompt=True)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in ours  # tojson keeps non-ASCII and does not escape HTML
    assert render_chat(TOOL_TEMPLATE, messages) == _transformers_render(
        TOOL_TEMPLATE, messages, add_generation_prompt=True
    )

    path = VOCAB_DIR / "ggml-vocab-gemma-4.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `python models/fetch_vocab.py`")
    gemma = core.GgufFile(str(path)).metadata()["tokenizer.chat_template"]
    ours = render_chat(gemma, messages, tools=TOOLS, bos_token="<bos>")
    assert "get_weather" in ours
    assert ours == _transformers_render(gemma, messages, tools=TOOLS, add_generation_prompt=True, bos_token="<bos>")


# --- behaviour --------------------------------------------------------------------------------------------------


def test_chatml_fallback() -> None:
    messages = CONVERSATIONS[1]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert render_chat(None, messages, add_generation_prompt=False) == expected
    assert render_chat("", messages) == expected + "<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, messages) == expected + "<|im_start|>assistant\n"


def test_helpers_and_variables() -> None:
    assert render_chat("{{ strftime_now('%Y-%m') }}", []) == datetime.now().strftime("%Y-%m")
    data = {"k": 'ünï <tag> & "q"'}
    assert render_chat("{{ x | tojson }}", [], x=data) == json.dumps(data, ensure_ascii=False)
    assert render_chat("{{ x | tojson(indent=2) }}", [], x=data) == json.dumps(data, ensure_ascii=False, indent=2)
    assert render_chat("{{ bos_token }}|{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>|</s>"
    assert render_chat("{% if tools is none %}none{% endif %}", []) == "none"
    # trim_blocks / lstrip_blocks, as transformers sets them
    assert render_chat("  {% if true %}\nA\n  {% endif %}\nB", []) == "A\nB"
    # namespace() works, loopcontrols are enabled
    template = "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i > 3 %}{% break %}{% endif %}"
    template += "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"
    assert render_chat(template, []) == "6"


def test_message_validation_and_text_parts() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "Hello, world"
    assert render_chat(None, [{"role": "user", "content": parts}], add_generation_prompt=False) == (
        "<|im_start|>user\nHello, world<|im_end|>\n"
    )
    normalized = normalize_messages([{"role": "assistant", "content": None, "tool_calls": None, "name": "bot"}])
    assert normalized == [{"role": "assistant", "content": "", "name": "bot"}]
    original = [{"role": "user", "content": parts}]
    render_chat(None, original)
    assert original[0]["content"] is parts  # the caller's messages are not modified
    bad_cases = [
        ({"content": "x"}, r"messages\[0\]\['role'\]"),
        ({"role": "", "content": "x"}, "role"),
        ({"role": "user", "content": 3}, r"messages\[0\]\['content'\]"),
        ({"role": "user", "content": [{"type": "image", "url": "x"}]}, r"\['content'\]\[0\]"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, r"\['content'\]\[0\]"),
        ("not a dict", r"messages\[0\]"),
    ]
    for message, pattern in bad_cases:
        with pytest.raises(ChatTemplateError, match=pattern):
            render_chat(None, [message])
    with pytest.raises(ChatTemplateError, match="list"):
        render_chat(None, "hello")  # type: ignore[arg-type]


def test_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="Only user and assistant roles"):
        render_chat("{{ raise_exception('Only user and assistant roles are supported') }}", [])
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render_chat("{{ 1 / 0 }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[5]['content'] + 'x' }}", [{"role": "user", "content": "x"}])


# name -> (template, a phrase the error must contain)
HOSTILE_TEMPLATES = {
    "dunder class": ("{{ messages.__class__ }}", "'__class__'"),
    "globals via function": ("{{ raise_exception.__globals__ }}", "'__globals__'"),
    "subclasses walk": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "'__class__'"),
    "cycler globals": ("{{ cycler.__init__.__globals__['os'] }}", "'__init__'"),
    "self globals": ("{{ self.__init__.__globals__ }}", "'__init__'"),
    "mutation": ("{% set _ = messages.append({'role': 'x'}) %}", "'append'"),
    "namespace dunder": ("{% set ns = namespace(__class__=1) %}", "underscore"),
    "format escape": ("{{ '{0.__class__}'.format(messages) }}", "'__class__'"),
    "huge repetition": ("{{ 'x' * 10000000000 }}", "repetition"),
    "huge power": ("{{ 10 ** 100000000 }}", "too large"),
    "huge output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "exceeds"),
    "runaway loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_fail_fast(name: str) -> None:
    template, phrase = HOSTILE_TEMPLATES[name]
    trace_before = sys.gettrace()
    messages = [{"role": "user", "content": "hi"}]
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=re.escape(phrase)):
        render_chat(template, messages, max_seconds=0.5)
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"{name}: took {elapsed:.1f} s"
    assert sys.gettrace() is trace_before  # the render-time guard is removed again
    assert messages == [{"role": "user", "content": "hi"}]


def test_default_time_limit_applies() -> None:
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than"):
        render_chat(HOSTILE_TEMPLATES["runaway loop"][0], [])
    assert time.monotonic() - t0 < 10.0


def test_time_limit_counts_the_threads_cpu_not_waiting() -> None:
    """A busy machine that starves the rendering thread (here: a context callable that sleeps, using no CPU) does
    not fail a legitimate template: the limit is the thread's CPU time, which a runaway loop still exhausts."""

    def nap() -> str:
        time.sleep(0.3)
        return "z"

    t0 = time.monotonic()
    template = "{{ nap() }}{{ nap() }}{{ nap() }}{% for i in range(3000) %}{% endfor %}"  # the loop: guard checks
    out = render_chat(template, [], nap=nap, max_seconds=0.5)
    assert out == "zzz" and time.monotonic() - t0 >= 0.9


def test_output_cap_is_configurable() -> None:
    template = "{% for i in range(100) %}{{ 'y' * 100 }}{% endfor %}"
    assert len(render_chat(template, [])) == 10_000
    with pytest.raises(ChatTemplateError, match="exceeds 5000"):
        render_chat(template, [], max_output_chars=5000)
