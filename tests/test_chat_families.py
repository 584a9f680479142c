"""The chat formats of the model families agent teams run (Qwen3, Gemma 3, Phi-4-mini, Llama 3.2, Mistral, and a
DeepSeek-R1 template that opens its `<think>` block in the prompt): their real chat templates
(tests/data/chat_templates, sources in SOURCES.md) rendered by kvcmas exactly as transformers' apply_chat_template
renders them (system, multi-turn, tools and tool results, thinking on and off); each family's tool calls parsed
as vLLM's per-family parsers read them, streamed and whole; a thinking model's reasoning returned apart; and the
server end to end (a real kvcmas-server process with --chat-template-file, the default model's weights, calls
forced by constrained decoding in each family's format)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvcmas_cpp as kc
from helpers.constrained import drive_randomly
from helpers.server import ServerProcess
from kvcmas_cpp.reasoning import ReasoningStream, opens_thinking, split_reasoning, thinks
from kvcmas_cpp.tools import (
    TOOL_FORMATS,
    ToolCallStream,
    format_tool_calls,
    parse_tool_calls,
    render_tool_messages,
    tool_format_of,
)

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
FAMILIES = ("qwen3", "gemma3", "phi4-mini", "llama3.2", "mistral-small-3.1", "deepseek-r1-distill-qwen")


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def model(default_model_path: Path) -> Iterator[kc.Model]:
    m = kc.Model(str(default_model_path), n_threads=1, activations="f32")
    own = m.tokenizer.chat_template
    yield m
    m.tokenizer.chat_template = own


def kvcmas_render(m: kc.Model, name: str, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> str:
    """kvcmas' path for an OpenAI request: render_tool_messages, then Model.apply_chat_template."""
    m.tokenizer.chat_template = template(name)
    return m.apply_chat_template(render_tool_messages(messages, tools), True, kwargs or None)


def transformers_render(m: kc.Model, name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tok = m.tokenizer
    kwargs.setdefault("add_generation_prompt", True)
    (out,), _ = chat_utils.render_jinja_template(
        [messages],
        chat_template=template(name),
        bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
        eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        **kwargs,
    )
    return str(out)


SYSTEM = {"role": "system", "content": "You are a terse travel agent."}
PLAIN = [
    [{"role": "user", "content": "Hello!"}],
    [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Say 'ünïcode' and\nnewlines {{ not a template }}"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone.",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]
NAMES = ["get_time", "get_weather"]
ZONE = TOOLS[0]["function"]["parameters"]
CALL_ID = "call9f3a2b7c1d"  # Mistral's template wants ids of at least 9 characters


def tool_chat(args_as_object: bool) -> list[dict[str, Any]]:
    """A tool round trip as an OpenAI client sends it (arguments as JSON text, content None), or as transformers'
    templates take it (arguments as an object, content "")."""
    args: Any = {"zone": "Asia/Tokyo"} if args_as_object else '{"zone": "Asia/Tokyo"}'
    call = {"id": CALL_ID, "type": "function", "function": {"name": "get_time", "arguments": args}}
    return [
        SYSTEM,
        {"role": "user", "content": "What time is it in Tokyo?"},
        {"role": "assistant", "content": "" if args_as_object else None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "09:30"},
    ]


# ------------------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("conversation", range(len(PLAIN)))
def test_plain_chats_render_as_transformers_renders_them(model: kc.Model, name: str, conversation: int) -> None:
    messages = PLAIN[conversation]
    assert kvcmas_render(model, name, messages) == transformers_render(model, name, messages)


def test_gemma_folds_the_system_prompt_into_the_first_user_turn(model: kc.Model) -> None:
    out = kvcmas_render(model, "gemma3", PLAIN[2])
    assert "<start_of_turn>system" not in out
    assert out.startswith(f"{model.tokenizer.token_text(model.tokenizer.bos_id)}<start_of_turn>user\n")
    assert "<start_of_turn>user\nYou are a terse travel agent.\n\nHi<end_of_turn>\n<start_of_turn>model\n" in out
    assert out.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("conversation", range(len(PLAIN)))
def test_qwen3_thinking_switch_renders_as_transformers(model: kc.Model, conversation: int, thinking: Any) -> None:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = PLAIN[conversation]
    out = kvcmas_render(model, "qwen3", messages, **kwargs)
    assert out == transformers_render(model, "qwen3", messages, **kwargs)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if thinking is False else "assistant\n")


def test_qwen3_history_keeps_only_the_last_turns_reasoning(model: kc.Model) -> None:
    """Earlier reasoning, given as reasoning_content or inside the content, is rendered as the template decides."""
    for earlier in (
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 and 2 make 4."},
        {"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\nIt is 4."},
    ):
        messages = [PLAIN[1][0], PLAIN[1][1], earlier, {"role": "user", "content": "And 3+3?"}]
        out = kvcmas_render(model, "qwen3", messages)
        assert out == transformers_render(model, "qwen3", messages)
        assert "2 and 2 make 4." not in out and "<|im_start|>assistant\nIt is 4.<|im_end|>" in out
        last = [*messages[:3]]
        out = kvcmas_render(model, "qwen3", last)
        assert out == transformers_render(model, "qwen3", last) and "<think>\n2 and 2 make 4.\n</think>" in out


@pytest.mark.parametrize("name", ["qwen3", "llama3.2", "mistral-small-3.1"])
def test_tools_and_tool_calls_render_as_transformers(model: kc.Model, name: str) -> None:
    """Templates that render tools and tool calls themselves get them in transformers' shapes: the OpenAI request
    (arguments as JSON text) renders as transformers renders the same chat (arguments as an object)."""
    ours = kvcmas_render(model, name, tool_chat(False), TOOLS)
    assert ours == transformers_render(model, name, tool_chat(True), tools=TOOLS)
    assert "get_weather" in ours and "09:30" in ours
    first = tool_chat(False)[:2]
    assert kvcmas_render(model, name, first, TOOLS) == transformers_render(model, name, first, tools=TOOLS)


@pytest.mark.parametrize("name", ["qwen3", "llama3.2", "mistral-small-3.1", "phi4-mini"])
def test_a_sharing_session_renders_the_same_prompt(model: kc.Model, name: str) -> None:
    """The sharing session (the server's chat path) renders a tool round trip, with its template variables, as
    Model.apply_chat_template does: tool_calls, tool_call_id and chat_template_kwargs travel with its messages."""
    from kvcmas_cpp.agents import AgentSession
    from kvcmas_cpp.chat import TEMPLATE_KWARGS_KEY

    messages = render_tool_messages(tool_chat(False), TOOLS)
    messages[0][TEMPLATE_KWARGS_KEY] = {"enable_thinking": False}
    model.tokenizer.chat_template = template(name)
    want = model.apply_chat_template(messages)
    if name == "qwen3":
        assert want == transformers_render(model, name, tool_chat(True), tools=TOOLS, enable_thinking=False)
        assert want.endswith("<think>\n\n</think>\n\n")
    with AgentSession(model, "fullshared", calibration_dir=False) as session:
        p = session.prefill(messages)
        try:
            assert model.detokenize(p.seq.tokens) == model.detokenize(model.tokenize(want))
        finally:
            p.close()


def test_phi4_mini_takes_its_tools_in_the_system_message(model: kc.Model) -> None:
    """Phi-4-mini's template reads the tools as the system message's `tools` JSON text and has no tool-call
    syntax of its own: the tools go there, and an earlier call is written as the model writes it (functools)."""
    listed = json.dumps([t["function"] for t in TOOLS], ensure_ascii=False)
    want = tool_chat(False)
    want[0] = {**SYSTEM, "tools": listed}
    want[2] = {"role": "assistant", "content": 'functools[{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]'}
    ours = kvcmas_render(model, "phi4-mini", tool_chat(False), TOOLS)
    assert ours == transformers_render(model, "phi4-mini", want)
    assert f"<|system|>{SYSTEM['content']}<|tool|>{listed}<|/tool|><|end|>" in ours


def test_family_of_each_template() -> None:
    formats = {name: tool_format_of(template(name)).name for name in FAMILIES}
    assert formats == {
        "qwen3": "hermes",
        "gemma3": "hermes",  # no tool syntax of its own: the Hermes prompt and blocks
        "phi4-mini": "phi4_mini",
        "llama3.2": "llama3",
        "mistral-small-3.1": "mistral",
        "deepseek-r1-distill-qwen": "hermes",
    }
    assert {name for name in FAMILIES if thinks(template(name))} == {"qwen3", "deepseek-r1-distill-qwen"}


def test_which_prompts_open_a_reasoning_block(model: kc.Model) -> None:
    prompt = kvcmas_render(model, "deepseek-r1-distill-qwen", PLAIN[1])
    assert opens_thinking(prompt)
    assert not opens_thinking(kvcmas_render(model, "qwen3", PLAIN[1]))
    assert not opens_thinking(kvcmas_render(model, "qwen3", PLAIN[1], enable_thinking=False))
    # Model.chat returns the reply of an opened block as reasoning (this model never closes it)
    raw = model.generate(prompt, max_tokens=8, temperature=0)
    model.tokenizer.chat_template = template("deepseek-r1-distill-qwen")
    out = model.chat(PLAIN[1], max_tokens=8, temperature=0)
    assert isinstance(raw, kc.Completion) and isinstance(out, kc.Completion)
    assert (out.reasoning_content, out.text) == (raw.text.strip(), "")
    model.tokenizer.chat_template = template("qwen3")
    out = model.chat(PLAIN[1], max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
    raw = model.generate(kvcmas_render(model, "qwen3", PLAIN[1], enable_thinking=False), max_tokens=8, temperature=0)
    assert isinstance(raw, kc.Completion) and isinstance(out, kc.Completion)
    assert (out.reasoning_content, out.text) == (None, raw.text)


# -------------------------------------------------------------------------------------------- parsers
def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


TOKYO = ("get_time", {"zone": "Asia/Tokyo"})
PARIS = ("get_weather", {"city": "Paris"})
# (format, model output, content, calls): outputs written as each family writes them
OUTPUTS = [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>', None, [TOKYO]),
    (
        "hermes",
        'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Checking.",
        [TOKYO, PARIS],
    ),
    ("llama3", '{"name": "get_time", "parameters": {"zone": "Asia/Tokyo"}}', None, [TOKYO]),
    (
        "llama3",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "Asia/Tokyo"}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [TOKYO, PARIS],
    ),
    ("llama3", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama3", "<|python_tag|>brave_search.call(query='x')", "<|python_tag|>brave_search.call(query='x')", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}, "id": "9f3a2b7c1"}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [TOKYO, PARIS],
    ),
    (
        "mistral",
        'Let me look.[TOOL_CALLS]get_time[ARGS]{"zone": "Asia/Tokyo"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        "Let me look.",
        [TOKYO, PARIS],
    ),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": ', None, []),  # cut off: content
    ("phi4_mini", 'functools[{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]', None, [TOKYO]),
    (
        "phi4_mini",
        'functools[{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}, '
        '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [TOKYO, PARIS],
    ),
    ("phi4_mini", 'functools[{"name": "launch", "arguments": {}}]', None, []),  # unknown tool: content
]


@pytest.mark.parametrize("case", range(len(OUTPUTS)))
def test_family_parsers_streamed_and_whole(case: int) -> None:
    fmt_name, text, content, calls = OUTPUTS[case]
    fmt = TOOL_FORMATS[fmt_name]
    got_content, got = parse_tool_calls(text, NAMES, fmt)
    assert _calls(got) == calls
    assert got_content == (content if calls else text)
    for step in (1, 2, 3, 5, 11):  # streamed in pieces: the same content and calls, the content as it comes
        stream = ToolCallStream(frozenset(NAMES), fmt)
        pieces, streamed = [], []
        for i in range(0, len(text), step):
            c, new = stream.feed(text[i : i + step])
            pieces.append(c)
            streamed += new
        c, new = stream.finish()
        pieces += [c]
        streamed += new
        assert _calls(streamed) == calls
        assert ("".join(pieces).strip() if calls else "".join(pieces)) == (got_content or "")


@pytest.mark.parametrize("name", ["qwen3", "llama3.2", "mistral-small-3.1"])
def test_a_call_as_the_template_writes_it_parses_back(model: kc.Model, name: str) -> None:
    """The family's own rendering of an assistant tool call (transformers, the real template) is what its parser
    reads: the model is trained on that text."""
    asked = tool_chat(True)[:2]
    turn = tool_chat(True)[:3]
    before = transformers_render(model, name, asked, tools=TOOLS)
    after = transformers_render(model, name, turn, tools=TOOLS, add_generation_prompt=False)
    assert after.startswith(before)
    reply = after[len(before) :]
    for end in ("<|im_end|>", "<|eot_id|>", model.tokenizer.token_text(model.tokenizer.eos_id)):
        reply = reply.split(end)[0]
    _, text = split_reasoning(reply)  # Qwen3 writes an empty block before the last turn's answer
    content, calls = parse_tool_calls(text, NAMES, tool_format_of(template(name)))
    assert content is None and _calls(calls) == [TOKYO], reply


@pytest.mark.parametrize(
    "text,opened,reasoning,content",
    [
        ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "The user wants 2+2.", "It is 4."),
        ("It is 4.", False, None, "It is 4."),
        ("<think>\nStill thinking when cut off", False, "Still thinking when cut off", ""),
        ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.", "It is 4."),
        ("Never closed", True, "Never closed", ""),
        ("<think>\n\n</think>\n\nIt is 4.", False, None, "It is 4."),
        ("<thin", False, None, "<thin"),
    ],
)
def test_reasoning_split_streamed_and_whole(text: str, opened: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, opened) == (reasoning, content)
    for step in (1, 2, 4, 7):
        stream = ReasoningStream(opened)
        r_parts, c_parts = [], []
        for i in range(0, len(text), step):
            r, c = stream.feed(text[i : i + step])
            r_parts.append(r)
            c_parts.append(c)
        r, c = stream.finish()
        assert ("".join([*r_parts, r]) or None, "".join([*c_parts, c])) == (reasoning, content)


# Replies as the families write them, thinking included, and what the server returns for each
REPLIES = [
    (
        "qwen3",
        "<think>\nThe user wants the time in Tokyo.\nI should call get_time.\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>',
        "The user wants the time in Tokyo.\nI should call get_time.",
        None,
        [TOKYO],
    ),
    ("qwen3", "<think>\nEasy.\n</think>\n\nIt is 09:30 in Tokyo.", "Easy.", "It is 09:30 in Tokyo.", []),
    ("qwen3", "It is 09:30 in Tokyo.", None, "It is 09:30 in Tokyo.", []),
    ("deepseek-r1-distill-qwen", "Tokyo is UTC+9.\n</think>\n\nIt is 09:30.", "Tokyo is UTC+9.", "It is 09:30.", []),
    (
        "llama3.2",
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "Asia/Tokyo"}}',
        None,
        None,
        [TOKYO],
    ),
    (
        "mistral-small-3.1",
        'Checking.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]',
        None,
        "Checking.",
        [TOKYO],
    ),
    ("phi4-mini", 'functools[{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}]', None, None, [TOKYO]),
]


@pytest.mark.parametrize("case", range(len(REPLIES)))
def test_server_choice_reads_each_familys_reply(model: kc.Model, case: int) -> None:
    """The server's reply assembly (server.choices.Choice, with the reply format output_plan picks for the
    template) on real text of each family: the message's reasoning_content, content and tool_calls, and the same
    from the stream's deltas at every chunking."""
    from kvcmas_cpp.server.choices import Choice, ReplyFormat
    from kvcmas_cpp.server.scheduler import Delta, Done

    name, text, reasoning, content, calls = REPLIES[case]
    prompt = kvcmas_render(model, name, ASK, TOOLS)
    fmt = ReplyFormat(frozenset(NAMES), tool_format_of(template(name)), thinks(template(name)), opens_thinking(prompt))
    for step in (len(text), 1, 3, 8):
        choice = Choice(0, "chat", model.tokenizer, fmt)
        chunks = [c for i in range(0, len(text), step) for c in choice.on_delta(Delta(text[i : i + step]))]
        chunks += choice.on_done(Done("stop", {}))
        deltas = [c["delta"] for c in chunks]
        streamed = "".join(d.get("reasoning_content", "") for d in deltas)
        assert (streamed or None, "".join(d.get("content") or "" for d in deltas) or None) == (reasoning, content)
        got = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
        assert [c["index"] for c in got] == list(range(len(calls)))
        final = choice.final()
        message = final["message"]
        assert message.get("reasoning_content") == reasoning and (message["content"] or None) == content
        assert _calls(message.get("tool_calls") or []) == calls
        assert final["finish_reason"] == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("fmt_name", sorted(TOOL_FORMATS))
def test_forced_calls_follow_each_familys_format(model: kc.Model, fmt_name: str) -> None:
    """The grammar of a forced call writes the family's format (random draws under the mask), which the family's
    parser reads back, the same text format_tool_calls writes."""
    pytest.importorskip("llguidance")
    import numpy as np

    from kvcmas_cpp.constrained import Constraint, tool_call_grammar

    fmt = TOOL_FORMATS[fmt_name]
    tok = model.tokenizer
    zone = {"type": "string", "enum": ["UTC", "Asia/Tokyo"]}  # random draws would write an endless free string
    bounded = [
        {"type": "function", "function": {**TOOLS[0]["function"], "parameters": {**ZONE, "properties": {"zone": zone}}}}
    ]
    text = drive_randomly(Constraint(tok, tool_call_grammar(bounded, False, fmt)), tok, np.random.default_rng(3))
    content, calls = parse_tool_calls(text, NAMES, fmt)
    assert content is None and len(calls) == 1, text
    call = calls[0]["function"]
    assert text == format_tool_calls([(call["name"], call["arguments"])], fmt)
    think = drive_randomly(
        Constraint(tok, tool_call_grammar(bounded, False, fmt, "</think>\n\n")), tok, np.random.default_rng(4)
    )
    assert think.startswith("</think>\n\n" + fmt.prefix + fmt.call_open), think


def test_a_marker_that_is_one_special_token_is_forced_as_that_token(model: kc.Model) -> None:
    """Mistral's `[TOOL_CALLS]` is one control token of its vocabulary, and the model writes it as that token: the
    grammar forces the token, not the marker's text in pieces. Shown with a control token of the default vocabulary
    (`<|im_start|>`) as a format's marker."""
    pytest.importorskip("llguidance")
    import dataclasses

    import numpy as np

    from kvcmas_cpp.constrained import Constraint, tool_call_grammar

    tok = model.tokenizer
    (marker,) = tok.encode("<|im_start|>", add_special=False, parse_special=True)
    assert tok.is_special(marker)
    fmt = dataclasses.replace(TOOL_FORMATS["mistral"], open="<|im_start|>", prefix="<|im_start|>[")
    allowed = Constraint(tok, tool_call_grammar(TOOLS[:1], False, fmt, tok=tok)).allowed()
    assert list(np.flatnonzero(allowed)) == [marker]
    spelled = Constraint(tok, tool_call_grammar(TOOLS[:1], False, fmt)).allowed()  # no tokenizer: the text
    assert not spelled[marker] and spelled.any()


# -------------------------------------------------------------------------------------------- server
# qwen3 (hermes, chat_template_kwargs) and the R1 template (reasoning) by default; the other formats' servers are
# slow tests (their grammars and parsers are checked above without a server)
@pytest.fixture(
    scope="module",
    params=[
        "qwen3",
        "deepseek-r1-distill-qwen",
        pytest.param("llama3.2", marks=pytest.mark.slow),
        pytest.param("mistral-small-3.1", marks=pytest.mark.slow),
        pytest.param("phi4-mini", marks=pytest.mark.slow),
    ],
)
def family_server(request: Any, default_model_path: Path) -> Iterator[tuple[str, ServerProcess]]:
    name = request.param
    srv = ServerProcess(
        str(default_model_path), "--chat-template-file", str(TEMPLATES / f"{name}.jinja"), "--activations", "f32"
    )
    yield name, srv
    srv.stop()


def _chat(srv: ServerProcess, **body: Any) -> dict[str, Any]:
    status, _, out = srv.request("POST", "/v1/chat/completions", {"temperature": 0, **body})
    assert status == 200, out
    return dict(out)


def _stream(srv: ServerProcess, **body: Any) -> tuple[str, str, list[dict[str, str]], str | None]:
    """(reasoning, content, calls, finish_reason) of a streamed reply, reassembled from its deltas."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({"temperature": 0, "stream": True, **body}),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for line in resp.read().decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice["delta"]
            finish = choice["finish_reason"] or finish
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for d in delta.get("tool_calls") or []:
                slot = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                slot["name"] += d["function"].get("name") or ""
                slot["arguments"] += d["function"].get("arguments") or ""
    conn.close()
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def _greedy(model: kc.Model, name: str, messages: list[dict[str, Any]], max_tokens: int, **kwargs: Any) -> str:
    """The engine's greedy reply to the prompt transformers renders (the reference text), tokenized as a sharing
    session tokenizes it: the one message's content apart from the template text around it (so that the turn
    markers of templates foreign to the default vocabulary end where the content starts)."""
    prompt = transformers_render(model, name, messages, **kwargs)
    (content,) = [m["content"] for m in messages]
    before, after = prompt.split(content)
    tok = model.tokenizer
    ids = tok.encode(before, add_special=True, parse_special=True)
    ids += tok.encode(content, add_special=False, parse_special=False)
    ids += tok.encode(after, add_special=False, parse_special=True)
    out = model.generate(ids, max_tokens=max_tokens, temperature=0)
    assert isinstance(out, kc.Completion)
    return out.text


ASK = [{"role": "user", "content": "What time is it in Tokyo?"}]


def test_server_replies_in_each_familys_format(family_server: tuple[str, ServerProcess], model: kc.Model) -> None:
    """Per family, through the real server: the prompt (/apply-template, chat_template_kwargs included) is
    transformers' rendering; a thinking model's reasoning comes back as reasoning_content, streamed and not; a
    forced call is written in the family's format and returned as the same OpenAI tool call, streamed and not."""
    jsonschema = pytest.importorskip("jsonschema")
    name, srv = family_server
    kwargs = {"enable_thinking": False} if name == "qwen3" else {}
    body: dict[str, Any] = {"messages": ASK, "chat_template_kwargs": kwargs} if kwargs else {"messages": ASK}
    status, _, out = srv.request("POST", "/apply-template", body)
    assert status == 200 and out["prompt"] == transformers_render(model, name, ASK, **kwargs), out

    reply = _greedy(model, name, ASK, 10, **kwargs)
    whole = _chat(srv, max_tokens=10, **body)["choices"][0]["message"]
    reasoning, content, _, _ = _stream(srv, max_tokens=10, **body)
    if name == "deepseek-r1-distill-qwen":  # the prompt opened the block and the model never closes it
        assert whole.get("reasoning_content") == reply.strip() and whole["content"] == "", whole
        assert (reasoning, content) == (reply.strip(), "")
    else:
        assert "reasoning_content" not in whole and whole["content"] == reply
        assert (reasoning, content) == ("", reply)

    forced = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60, **body}
    message = _chat(srv, **forced)["choices"][0]["message"]
    assert message["content"] is None and message.get("reasoning_content") is None, message
    (call,) = message["tool_calls"]
    spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec["parameters"])
    reasoning, content, calls, finish = _stream(srv, **forced)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert calls == [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}]
    # the raw reply is the family's own syntax: the engine under the same template and grammar (Model.chat)
    model.tokenizer.chat_template = template(name)
    raw = "".join(
        c.text
        for c in model.chat(
            ASK,
            stream=True,
            max_tokens=60,
            temperature=0,
            chat_template_kwargs=kwargs or None,
            **{k: forced[k] for k in ("tools", "tool_choice", "parallel_tool_calls")},
        )
    )
    fmt = tool_format_of(template(name))
    think = "</think>\n\n" if name == "deepseek-r1-distill-qwen" else ""
    assert raw == think + format_tool_calls([(call["function"]["name"], call["function"]["arguments"])], fmt), raw


def test_chat_template_kwargs_may_not_replace_what_the_server_sets(family_server: tuple[str, ServerProcess]) -> None:
    _, srv = family_server
    body = {"messages": ASK, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}
    status, _, out = srv.request("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "chat_template_kwargs", out


def test_responses_return_reasoning_items(family_server: tuple[str, ServerProcess]) -> None:
    """/v1/responses through the openai client: a thinking model's reasoning is a `reasoning` item (one
    `reasoning_text` part) before the answer, streamed as response.reasoning_text.delta events, equal to the chat
    path's reasoning_content; sent back as input it is the assistant turn's reasoning_content again."""
    openai = pytest.importorskip("openai")
    name, srv = family_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model_id = client.models.list().data[0].id
    request: dict[str, Any] = {"model": model_id, "input": ASK[0]["content"], "max_output_tokens": 10, "temperature": 0}
    chat = _chat(srv, messages=ASK, max_tokens=10)["choices"][0]["message"]
    out = client.responses.create(**request)
    reasoning = [item for item in out.output if item.type == "reasoning"]
    assert bool(chat.get("reasoning_content")) == (name == "deepseek-r1-distill-qwen")  # its prompt opens the block
    if chat.get("reasoning_content"):
        (item,) = reasoning
        assert out.output[0] is item and item.id.startswith("rs_") and item.summary == []
        assert [(p.type, p.text) for p in item.content or []] == [("reasoning_text", chat["reasoning_content"])]
        assert 0 < out.usage.output_tokens_details.reasoning_tokens <= out.usage.output_tokens
    else:
        assert not reasoning and out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.output_text == (chat["content"] or "")

    events = list(client.responses.create(**request, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == (chat.get("reasoning_content") or "")
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump(exclude={"id"}) for i in done] == [i.model_dump(exclude={"id"}) for i in out.output]
    if reasoning:
        kinds = [e.type for e in events if e.type.startswith(("response.reasoning_text", "response.content_part"))]
        assert kinds[0] == "response.content_part.added" and kinds[-2:] == [
            "response.reasoning_text.done",
            "response.content_part.done",
        ]
        assert events[-1].response.output[0].content[0].text == chat["reasoning_content"]

    # the round trip: the output items go back as input; the reply equals chat's with reasoning_content
    follow_up = {"role": "user", "content": "And in Paris?"}
    turn = [i.model_dump(exclude_none=True) for i in out.output]
    again = client.responses.create(**{**request, "input": [ASK[0], *turn, follow_up]})
    assistant = {"role": "assistant", "content": chat["content"] or ""}
    if chat.get("reasoning_content"):
        assistant["reasoning_content"] = chat["reasoning_content"]
    want = _chat(srv, messages=[*ASK, assistant, follow_up], max_tokens=10)["choices"][0]["message"]
    assert again.output_text == (want["content"] or "")
    assert [p.text for i in again.output if i.type == "reasoning" for p in i.content or []] == (
        [want["reasoning_content"]] if want.get("reasoning_content") else []
    )
