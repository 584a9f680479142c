"""Units of the OpenAI surface: sampler parity (presence / frequency penalties, logit_bias, allowed masks, logprobs),
the tool-call parsers on well-formed and malformed output, and grammar-constrained decoding (llguidance)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.constrained import drive_randomly
from kvcmas_cpp.sampling import Sampler, SamplingParams, token_logprobs
from kvcmas_cpp.tools import (
    TOOLS_KEY,
    ToolCallStream,
    format_tool_call,
    model_messages,
    parse_tool_calls,
    render_tool_messages,
    tools_system_text,
)


# ------------------------------------------------------------------------------------------------ sampling
def test_presence_and_frequency_penalties_count_drawn_tokens() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.05, frequency_penalty=0.1))
    drawn = [s.sample(logits) for _ in range(4)]
    # 0 (3.0) -> 0 lowered to 2.85 < 2.9 -> 1 -> both lowered once: 0 at 2.85 > 1 at 2.75 -> 0 -> 0 at 2.75 vs 2.75
    assert drawn[:3] == [0, 1, 0]
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 0
    ids, probs = Sampler(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, presence_penalty=2)).distribution(
        logits
    )
    ref = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(probs, ref, rtol=1e-6)  # nothing drawn yet: no penalty


def test_logit_bias_and_allowed_mask() -> None:
    logits = np.array([1.0, 0.5, 0.2, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100})).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={3: 5})).sample(logits) == 3
    allowed = np.array([False, False, True, True])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert {s.sample(logits, allowed=allowed) for _ in range(50)} <= {2, 3}
    ids, probs = s.distribution(logits, allowed=allowed)
    assert probs[ids == 0].sum() == 0 and probs[ids == 2].sum() == pytest.approx(np.exp(0.2) / (np.exp(0.2) + 1))
    with pytest.raises(ValueError, match="allows no token"):
        s.sample(logits, allowed=np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match="outside"):
        Sampler(SamplingParams(logit_bias={9: 1.0})).sample(logits)
    for bad in ({"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"logit_bias": {0: 101}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]


def test_token_logprobs_is_log_softmax() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000).astype(np.float32) * 4
    lp = token_logprobs(x, 7, top_n=5)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert lp.logprob == pytest.approx(ref[7], abs=1e-9)
    assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in lp.top] == pytest.approx(list(np.sort(ref)[::-1][:5]))


# ------------------------------------------------------------------------------------------- tool-call parsers
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
            "Let me check.",
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome"})],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
            None,  # stopped before closing
            [("get_weather", {"city": "Oslo"})],
        ),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        ('```json\n[{"name": "get_time", "parameters": {"zone": "CET"}}]\n```', None, [("get_time", {"zone": "CET"})]),
        (
            '{"tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}',
            None,
            [("get_time", {})],
        ),
        ("The weather is nice.", "The weather is nice.", []),
    ],
)
def test_tool_call_parser_reads_well_formed_calls(text: str, content: str | None, calls: list[Any]) -> None:
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # unknown tool
        '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>',
        '{"name": "get_weather", "arguments": {"city": "Paris"}',  # truncated generic form
        '{"answer": 42}',  # JSON, but not a call
        "<tool_call",  # a partial tag at the end
        "",
    ],
)
def test_malformed_tool_calls_stay_plain_content(text: str) -> None:
    content, calls = parse_tool_calls(text, NAMES)
    assert calls == []
    assert content == (text or None)


def test_streamed_parsing_equals_whole_parsing_at_every_split() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "<tool_call>"}}\n</tool_call>'
    )
    whole_content, whole = parse_tool_calls(text, NAMES)
    for step in (1, 2, 3, 7, 13):
        stream = ToolCallStream(frozenset(NAMES))
        pieces: list[str] = []
        calls: list[dict[str, Any]] = []
        for i in range(0, len(text), step):
            c, new = stream.feed(text[i : i + step])
            pieces.append(c)
            calls += new
        c, new = stream.finish()
        pieces.append(c)
        calls += new
        assert "".join(pieces).strip() == whole_content
        assert [x["function"] for x in calls] == [x["function"] for x in whole]
    # content before the first call streams out before the call completes
    stream = ToolCallStream(frozenset(NAMES))
    assert stream.feed("Sure. <tool_")[0] == "Sure."


def test_tool_messages_render_as_spans() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    msgs = render_tool_messages(
        [
            {"role": "system", "content": "You are a clock."},
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        tools,
    )
    assert msgs[0] == {"role": "system", "content": "You are a clock.", TOOLS_KEY: tools}  # the template's to render
    assert msgs[2] == {"role": "assistant", "content": "", "tool_calls": calls}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
    # a template that does not render tool calls (ChatML) gets them as the text the model generated ...
    plain, listed = model_messages(msgs, None)
    assert listed is None and plain[0]["content"] == "You are a clock.\n\n" + tools_system_text(tools)
    assert plain[2] == {"role": "assistant", "content": format_tool_call("get_time", '{"zone": "UTC"}')}
    # ... and the call as written reads back as the same call
    assert parse_tool_calls(plain[2]["content"], NAMES)[1][0]["function"] == calls[0]["function"]
    # one that renders them (Qwen3's) gets transformers' shape: arguments as an object, the tools as `tools`
    native, listed = model_messages(msgs, "{{ tools }}{{ m.tool_calls }}")
    assert listed == tools and native[2]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


# A template that renders `tools` itself, in a format of its own (not Hermes): Llama 3.1-like JSON in the user turn.
NATIVE_TOOLS_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if tools and loop.last and message.role == 'user' %}{{- 'Functions:\\n' }}"
    "{%- for tool in tools %}{{- tool.function | tojson + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_tools_go_to_a_template_that_renders_them_else_into_the_system_prompt(default_model_path: Any) -> None:
    """Model.apply_chat_template (every path's renderer: Model.chat, AgentSession, the server): a template that reads
    `tools` gets them as its variable, rendered exactly as transformers renders that template; a template that
    ignores tools (SmolLM2's) gets Hermes' block appended to the system prompt, or a system message of its own."""
    import kvcmas_cpp as kc

    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "You are a clock."}, {"role": "user", "content": "time?"}]
    m = kc.Model(str(default_model_path), n_threads=1)
    plain = m.apply_chat_template(render_tool_messages(messages, tools))
    assert plain == m.apply_chat_template(
        [{"role": "system", "content": "You are a clock.\n\n" + tools_system_text(tools)}, messages[1]]
    )
    no_system = m.apply_chat_template(render_tool_messages(messages[1:], tools))
    assert no_system == m.apply_chat_template([{"role": "system", "content": tools_system_text(tools)}, messages[1]])
    m.tokenizer._chat_template = NATIVE_TOOLS_TEMPLATE  # the same model with a tool-aware template
    native = m.apply_chat_template(render_tool_messages(messages, tools))
    (want,), _ = chat_utils.render_jinja_template(
        [messages], chat_template=NATIVE_TOOLS_TEMPLATE, tools=tools, add_generation_prompt=True
    )
    assert native == want and "Functions:\n" in native and "<tools>" not in native
    # the sharing session renders the same prompt (the tools travel with its span-marked messages)
    from kvcmas_cpp.agents import AgentSession

    with AgentSession(m, "fullshared", calibration_dir=False) as session:
        p = session.prefill(render_tool_messages(messages, tools))
        try:
            assert m.detokenize(p.seq.tokens) == m.detokenize(m.tokenize(native))
        finally:
            p.close()


# ------------------------------------------------------------------------------------------ constrained decoding
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def tokenizer(model: Any) -> Any:
    pytest.importorskip("llguidance")
    return model.tokenizer


def test_json_schema_mask_keeps_random_draws_valid(tokenizer: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from kvcmas_cpp.constrained import Constraint, json_object_grammar, json_schema_grammar  # noqa: I001

    rng = np.random.default_rng(0)
    grammar = json_schema_grammar(BOUNDED)
    for _ in range(5):
        text = drive_randomly(Constraint(tokenizer, grammar), tokenizer, rng)
        jsonschema.validate(json.loads(text), BOUNDED)
    c = Constraint(tokenizer, json_object_grammar())
    first = [tokenizer.token_to_piece(int(t)) for t in np.flatnonzero(c.allowed())]
    assert first and all(p.startswith(b"{") for p in first)  # an object, nothing before it


def test_tool_call_grammar_and_fork(tokenizer: Any) -> None:
    from kvcmas_cpp.constrained import Constraint, tool_call_grammar

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": BOUNDED}}]
    c = Constraint(tokenizer, tool_call_grammar(tools, parallel=False))
    rng = np.random.default_rng(1)
    fork = c.fork()
    text = drive_randomly(c, tokenizer, rng)
    _, calls = parse_tool_calls(text, ["get_time"])
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_time", text
    assert not fork.finished and fork.allowed().sum() < 50  # the fork is still at the start: "<" of "<tool_call>"


SELF_LOOP = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}


def test_bad_schemas_are_refused(tokenizer: Any) -> None:
    from kvcmas_cpp.constrained import Constraint, ConstraintDeadEnd, GrammarError, json_schema_grammar

    for bad in ({"type": "strin"}, {"$ref": "#/nowhere"}):
        with pytest.raises(kc.KvcmasError) as info:  # what docs/python-api.md promises for a bad argument
            Constraint(tokenizer, json_schema_grammar(bad))
        assert isinstance(info.value, GrammarError)
    with pytest.raises(GrammarError):
        json_schema_grammar([1, 2])  # type: ignore[arg-type]
    # A schema with no value at all compiles, but no token can start it: refused up front, not while sampling.
    for bad in ({"$ref": "#"}, {"allOf": [{"$ref": "#"}]}):
        with pytest.raises(GrammarError, match="admits no output"):
            Constraint(tokenizer, json_schema_grammar(bad))
    # One whose required property only refers to itself starts ('{"a": ') and then has nowhere to go.
    c = Constraint(tokenizer, json_schema_grammar(SELF_LOOP))
    text = ""
    with pytest.raises(ConstraintDeadEnd, match="no token can continue") as dead_end:
        for _ in range(20):
            token = int(np.flatnonzero(c.allowed())[0])
            text += tokenizer.decode([token])
            c.accept(token)
    assert text.replace(" ", "") == '{"a":', text
    assert isinstance(dead_end.value, kc.KvcmasError)
    recursive_but_finite = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    assert Constraint(tokenizer, json_schema_grammar(recursive_but_finite)).allowed().any()


# ------------------------------------------------------------------------------------------ n > 1 in the scheduler
def test_n_choices_are_forks_of_one_prefill(model: Any) -> None:
    """The scheduler computes an n = 3 prompt once (one prefill call, whatever the choices) and every greedy choice
    equals Model.generate; with a seed the choices draw differently."""
    import threading

    from kvcmas_cpp.server.metrics import Metrics
    from kvcmas_cpp.server.scheduler import Delta, Done, Event, Job, Scheduler

    ids = model.tokenize("The three primary colors are")
    sched = Scheduler(model, "nonshared", 4, 1 << 30, 8, Metrics())
    prefills: list[int] = []
    real = sched.runner.plain.prefill_plan

    def counting(*args: Any, **kwargs: Any) -> Any:  # the real prefill, counted
        prefills.append(1)
        return real(*args, **kwargs)

    sched.runner.plain.prefill_plan = counting  # type: ignore[method-assign]
    try:
        for params, distinct in (
            (SamplingParams(temperature=0.0), False),
            (SamplingParams(temperature=1.0, seed=3), True),
        ):
            events: list[Event] = []
            done = threading.Event()

            def sink(e: Event, events: list[Event] = events, done: threading.Event = done) -> None:
                events.append(e)
                if sum(isinstance(x, Done) for x in events) == 3:
                    done.set()

            prefills.clear()
            sched.submit(Job("n3", ids, 8, params, [], sink, n=3, logprobs=1))
            assert done.wait(120)
            assert len(prefills) == 1
            texts = ["".join(e.text for e in events if isinstance(e, Delta) and e.index == i) for i in range(3)]
            lps = [
                [lp for e in events if isinstance(e, Delta) and e.index == i for lp in e.logprobs or []]
                for i in range(3)
            ]
            if not distinct:
                want = model.generate(ids, max_tokens=8, temperature=0)
                assert texts == [want.text] * 3
                assert [len(x) for x in lps] == [len(want.tokens)] * 3
            else:
                assert len(set(texts)) > 1
    finally:
        sched.stop()


def test_bench_constrained_reports_overhead_and_coverage(default_model_path: Any, capsys: Any) -> None:
    """`kvcmas bench constrained` runs end to end (few tokens): the mask's share of a decode step and the schema
    coverage table, llguidance compiling every schema but the if/then one it refuses by name."""
    import argparse

    from kvcmas_cpp.bench.constrained import add_constrained_arguments, run_constrained

    p = argparse.ArgumentParser()
    add_constrained_arguments(p)
    args = p.parse_args(["--model", str(default_model_path), "--tokens", "3", "--rounds", "1", "--threads", "2"])
    args.json = True
    assert run_constrained(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["decode"]["mask_ms_per_token"] < out["decode"]["engine_ms_per_token"]
    ll = {name: r["llguidance"] for name, r in out["coverage"].items()}
    assert [n for n, r in ll.items() if not r["ok"]] == ["if/then"] and "if" in ll["if/then"]["error"]
