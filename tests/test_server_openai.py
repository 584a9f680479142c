"""The OpenAI surface agent frameworks rely on, end to end: a real kvcmas-server process and the real `openai`
client. Unsupported fields are refused by name; tools, structured output, logprobs, sampling parity, n > 1, the
llama.cpp-style utility endpoints and /v1/responses are checked against independent references (the in-process
engine, jsonschema, numpy softmax)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.server import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(default_model_path: Any) -> Iterator[ServerProcess]:
    # Exact activations: outputs and logprobs are compared with the in-process engine's one-piece prefill, and q8
    # activations round a short prompt piece differently from a long one (docs/quant-kernels.md).
    srv = ServerProcess(str(default_model_path), "--method", "kvcmas", "--parallel", "4", "--activations", "f32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


@pytest.fixture(scope="module")
def engine(default_model_path: Any) -> kc.Model:
    """The in-process engine: reference logits and greedy outputs."""
    return kc.Model(str(default_model_path), n_threads=1, activations="f32")


def prompt_ids(engine: kc.Model, messages: list[dict[str, Any]]) -> list[int]:
    """The rendered chat prompt's ids, as Model.chat and the server build them."""
    tok = engine.tokenizer
    ids = tok.encode(engine.apply_chat_template(messages), add_special=False, parse_special=True)
    return [tok.bos_id, *ids] if tok.add_bos and tok.bos_id is not None and ids[:1] != [tok.bos_id] else ids


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


HELLO = [{"role": "user", "content": "Say hello."}]


# ------------------------------------------------------------------------------------------- no silent drops
@pytest.mark.parametrize(
    "field,value",
    [
        ("web_search_options", {}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "high"),
        ("functions", [{"name": "f"}]),
    ],
)
def test_unsupported_fields_are_refused_by_name(client: Any, model: str, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=HELLO, max_tokens=2, extra_body={field: value})
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == field and field in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unsupported_fields_deep_in_the_body_are_refused(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}], "max_tokens": 2}
    status, _, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "messages.0.audio", out
    status, _, out = server.request("POST", "/v1/completions", {"prompt": "hi", "suffix": "x"})
    assert status == 400 and out["error"]["param"] == "suffix", out


def test_kvcmas_options_on_completions_are_refused(server: ServerProcess) -> None:
    """A completion has no sharing session: its `kvcmas` options were dropped (200, method nonshared)."""
    body = {"prompt": "hi", "max_tokens": 2, "kvcmas": {"workflow": "wf", "agent": "a", "method": "fullshared"}}
    status, _, out = server.request("POST", "/v1/completions", body)
    assert status == 400 and out["error"]["param"] == "kvcmas", out
    assert out["error"]["message"].startswith("'kvcmas': not supported on /v1/completions: "), out


@pytest.mark.parametrize(
    "path,fields,param,says",
    [
        # unions (int | float, str | list[str], ...): one error, named by the client's parameter, listing its forms
        ("chat", {"temperature": "0.5"}, "temperature", "Input should be a number"),
        ("chat", {"kvcmas": {"recompute": "0.5"}}, "kvcmas.recompute", "Input should be a number"),
        ("chat", {"stop": 5}, "stop", "Input should be a string or a list of strings"),
        (
            "completions",
            {"prompt": [[1, 2], [3]]},
            "prompt",
            "Input should be a string, a list of strings or a list of integers",
        ),
        ("chat", {"tool_choice": 5}, "tool_choice", "Input should be one of 'none', 'auto', 'required' or an object"),
        # ... or the error inside the one form the value has
        ("chat", {"stop": ["x", 1]}, "stop.1", "Input should be a valid string"),
        ("chat", {"tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
        ("chat", {"model": 5}, "model", "Input should be a valid string"),  # named like a union tag, still itself
        ("chat", {"kvcmas": {"agent": ""}}, "kvcmas.agent", "String should have at least 1 character"),
        ("chat", {"kvcmas": {"workflow": ""}}, "kvcmas.workflow", "String should have at least 1 character"),
        # siblings stay two problems
        ("chat", {"kvcmas": {"workflow": 5, "agent": 6}}, "kvcmas.workflow", "Input should be a valid string"),
    ],
)
def test_a_wrong_value_is_named_by_its_parameter(
    server: ServerProcess, path: str, fields: dict[str, Any], param: str, says: str
) -> None:
    body = {"messages": HELLO} if path == "chat" else {"prompt": "Say hello."}
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    status, _, out = server.request("POST", url, {**body, "max_tokens": 2, **fields})
    more = " (and 1 more problem)" if len(fields.get("kvcmas", {})) == 2 else ""
    assert status == 400 and out["error"] == {
        "message": f"'{param}': {says}{more}",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_request",
    }, out


def test_an_unknown_logit_bias_token_is_named(server: ServerProcess, engine: kc.Model) -> None:
    body = {"messages": HELLO, "max_tokens": 2, "logit_bias": {"999999999": 1}}
    status, _, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "logit_bias", out
    assert out["error"]["message"] == f"logit_bias: token id 999999999 is outside [0, {engine.n_vocab})", out


@pytest.mark.parametrize("key", ["\u00b2", "\u2460", "\u0663", "+3", " 3", "3.0"])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_refused(server: ServerProcess, key: str) -> None:
    """'²' and '①' pass str.isdigit() but not int() (was a 500); '٣' (Arabic-Indic three) was read as token 3."""
    body = {"messages": HELLO, "max_tokens": 2, "logit_bias": {key: 5}}
    status, _, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "logit_bias", out
    assert "token ids written as strings" in out["error"]["message"], out


def test_completions_max_tokens_null_is_the_default_16(server: ServerProcess, engine: kc.Model) -> None:
    """null was read as 'no limit' (fill the context, up to --max-tokens-limit): 4096 tokens instead of 16."""
    eos = engine.tokenizer.eos_id
    body = {"prompt": "Once upon a time", "max_tokens": None, "temperature": 0, "logit_bias": {str(eos): -100}}
    status, _, out = server.request("POST", "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 16, out["usage"]
    assert out["choices"][0]["finish_reason"] == "length"


# Optional fields sent as null, as OpenAI's clients do for what they leave alone: each is its default.
NULLABLE = {
    "chat": (
        *("model", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"),
        *("stop", "n", "presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options"),
        *("logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format"),
        *("cache_salt", "kvcmas", "user", "metadata", "store", "service_tier", "prompt_cache_key"),
    ),
    "completions": (
        *("model", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stop", "n", "logprobs"),
        *("presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options", "echo", "user"),
    ),
    "responses": (
        *("model", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "temperature", "top_p"),
        *("seed", "stream", "include", "truncation", "reasoning", "kvcmas", "user", "metadata", "store"),
    ),
}


@pytest.mark.parametrize("path", sorted(NULLABLE))
def test_null_is_an_optional_fields_default(server: ServerProcess, path: str) -> None:
    body: dict[str, Any] = {
        "chat": {"messages": HELLO, "max_tokens": 2},
        "completions": {"prompt": "Say hello.", "max_tokens": 2},
        "responses": {"input": "Say hello.", "max_output_tokens": 2},
    }[path]
    url = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}[path]
    status, headers, out = server.request("POST", url, {**body, **dict.fromkeys(NULLABLE[path])})
    assert status == 200, out
    assert headers["content-type"] == "application/json"  # stream: null is not streamed
    assert len(out.get("choices", [None])) == 1 and out["usage"]  # n: null is one choice
    # a required field stays required: null is still an error that says what it should be
    required = {"chat": "messages", "completions": "prompt", "responses": "input"}[path]
    status, _, out = server.request("POST", url, {**body, required: None})
    assert status == 400 and out["error"]["param"] == required, out


def test_harmless_fields_and_message_names_are_accepted(client: Any, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello.", "name": "planner"}],
        max_tokens=3,
        temperature=0,
        user="u-1",
        metadata={"run": "7"},
        store=False,
        service_tier="auto",
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"},
    )
    assert out.choices[0].message.content


# ------------------------------------------------------------------------------------ logprobs and sampling parity
def test_chat_logprobs_agree_with_the_engine_streamed_and_not(client: Any, model: str, engine: kc.Model) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    want = engine.chat(messages, max_tokens=8, temperature=0)
    content = out.choices[0].logprobs.content
    assert len(content) == len(want.tokens) == out.usage.completion_tokens
    ids = prompt_ids(engine, messages)
    rows = engine.logits(ids + want.tokens)[len(ids) - 1 : -1]
    total = 0.0
    for entry, token, row in zip(content, want.tokens, rows, strict=True):
        ref = log_softmax(row)
        assert entry.logprob == pytest.approx(ref[token], abs=2e-3)
        assert bytes(entry.bytes) == engine.tokenizer.token_to_piece(token)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the most likely token
        assert entry.top_logprobs[2].logprob == pytest.approx(np.sort(ref)[-3], abs=2e-3)
        total += float(ref[token])
    assert sum(e.logprob for e in content) == pytest.approx(total, abs=1e-2)
    assert "".join(e.token for e in content) == out.choices[0].message.content
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    parts = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in parts] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completion_logprobs(client: Any, model: str, engine: kc.Model) -> None:
    out = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ids = engine.tokenize("The capital of France is")
    want = engine.generate(ids, max_tokens=5, temperature=0)
    rows = engine.logits(ids + want.tokens)[len(ids) - 1 : -1]
    for value, token, row in zip(lp.token_logprobs, want.tokens, rows, strict=True):
        assert value == pytest.approx(log_softmax(row)[token], abs=2e-3)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    echoed = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The capital of France is" + out.choices[0].text
    # OpenAI answers echo + logprobs with the prompt's logprobs as well, which scoring harnesses read: refused, not
    # answered with the generated tokens' alone (a harness would misalign them with the prompt)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="The capital", max_tokens=1, echo=True, logprobs=1)
    assert e.value.body["param"] == "logprobs" and "prompt's token logprobs" in e.value.body["message"], e.value.body


def test_logit_bias_moves_the_choice(client: Any, model: str, engine: kc.Model) -> None:
    prompt = "One, two, three,"
    ids = engine.tokenize(prompt)
    row = engine.logits(ids)[-1]
    order = np.argsort(-row)
    best, second, unlikely = int(order[0]), int(order[1]), int(order[5000])

    def first_token_text(bias: dict[str, int]) -> str:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias=bias)
        return str(out.choices[0].text)

    piece = engine.tokenizer.token_to_piece
    assert first_token_text({}) == piece(best).decode()
    assert first_token_text({str(best): -100}) == piece(second).decode()
    assert first_token_text({str(unlikely): 100}) == piece(unlikely).decode(errors="replace")


def test_presence_and_frequency_penalties_follow_openais_formula(client: Any, model: str, engine: kc.Model) -> None:
    """Greedy decoding under logit[j] -= presence * (c_j > 0) + frequency * c_j (c_j: times j was generated)."""
    prompt = "1, 2, 3, 4,"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    changed = 0
    for presence, frequency in ((0.0, 1.5), (1.8, 0.0), (-1.0, 0.5)):
        ids = engine.tokenize(prompt)
        counts: dict[int, int] = {}
        tokens: list[int] = []
        with engine.new_sequence() as seq:
            row = seq.append(ids, logits="last")
            for _ in range(12):
                x = row.astype(np.float64)
                for t, c in counts.items():
                    x[t] -= presence + frequency * c
                t = int(np.argmax(x))
                if t in engine.tokenizer.eog_ids:
                    break
                tokens.append(t)
                counts[t] = counts.get(t, 0) + 1
                row = seq.append([t], logits="last")
        out = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        assert out.choices[0].text == engine.detokenize(tokens)
        changed += out.choices[0].text != plain.choices[0].text
    assert changed  # (frequency 1.5 turns "5, 6, 7, 8," into "5, 6, 7, and so on")


def test_n_choices_fork_one_prefill(server: ServerProcess, client: Any, model: str) -> None:
    messages = [{"role": "user", "content": "Write a word that starts with b."}]
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    before = server.metrics()
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=3)
    after = server.metrics()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert {c.message.content for c in out.choices} == {greedy.choices[0].message.content}
    assert out.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert out.usage.completion_tokens == 3 * greedy.usage.completion_tokens
    # the prompt counted (and at most computed) once, three completions generated
    assert after["kvcmas_prompt_tokens_total"] - before["kvcmas_prompt_tokens_total"] == greedy.usage.prompt_tokens
    generated = after["kvcmas_generated_tokens_total"] - before["kvcmas_generated_tokens_total"]
    assert generated == 3 * greedy.usage.completion_tokens
    sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert len({c.message.content for c in sampled.choices}) > 1  # seeds 5, 6, 7: different draws
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=1.0, seed=5, n=3, stream=True
        )
    )
    texts = ["", "", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sampled.choices]
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == 3


# ---------------------------------------------------------------------------------------------------- tools
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _valid_call(call: Any, tools: list[dict[str, Any]]) -> dict[str, Any]:
    jsonschema = pytest.importorskip("jsonschema")
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec["parameters"])
    assert call.type == "function" and call.id.startswith("call_")
    return dict(args)


def test_forced_tool_call_is_schema_valid(client: Any, model: str) -> None:
    tools = [WEATHER, TIME]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        parallel = choice == "required"  # the named call: one call, ended by the grammar
        out = client.chat.completions.create(
            model=model,
            messages=ASK_WEATHER,
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            temperature=0,
            max_tokens=60,
        )
        c = out.choices[0]
        assert c.message.tool_calls, c
        # parallel calls may go on until max_tokens cuts one ("length"); the complete ones are returned
        assert c.finish_reason == ("tool_calls" if isinstance(choice, dict) else c.finish_reason), c
        assert c.finish_reason in ("tool_calls", "length")
        for call in c.message.tool_calls:
            _valid_call(call, tools)
        if isinstance(choice, dict):
            assert {call.function.name for call in c.message.tool_calls} == {"get_time"}


def test_streamed_tool_calls_reassemble_to_the_same_call(client: Any, model: str) -> None:
    kw: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 40}
    kw["parallel_tool_calls"] = False
    whole = client.chat.completions.create(model=model, messages=ASK_WEATHER, **kw)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=ASK_WEATHER, stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    want = [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == want


def test_parallel_tool_calls_false_gives_one_call(client: Any, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather in Paris, London and Rome?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert len(out.choices[0].message.tool_calls) == 1


def test_tool_round_trip_and_the_result_is_a_shared_span(client: Any, model: str) -> None:
    first = client.chat.completions.create(
        model=model,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=40,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    result = "Paris: 18 degrees celsius, light rain, wind 12 km/h from the west, humidity 81 percent. " * 2
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    final = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None
    # Two agents of one workflow read the same tool result: the second reuses its span.
    opts = {"kvcmas": {"workflow": "tool-sharing", "method": "fullshared"}}
    for i, system in enumerate(("You are a travel agent.", "You are a weather reporter.")):
        out = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, *history],
            temperature=0,
            max_tokens=4,
            extra_body=opts,
        )
        reused = out.model_extra["kvcmas"]["reused_tokens"]
        if i == 1:
            assert reused >= 60, out.model_extra["kvcmas"]


# --------------------------------------------------------------------------------------------- structured output
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
}


def test_json_schema_output_validates_over_twenty_seeds(client: Any, model: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts: list[str] = []
    for seed in (1, 100):  # 2 x 10 choices: seeds 1..10 and 100..109 (forks of one prefill each)
        out = client.chat.completions.create(
            model=model, messages=messages, response_format=fmt, temperature=1.0, seed=seed, n=10, max_tokens=60
        )
        texts += [c.message.content for c in out.choices]
        assert all(c.finish_reason == "stop" for c in out.choices)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1
    streamed = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, temperature=1.0, seed=1, max_tokens=60, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == texts[0]


def test_json_object_and_bad_schemas(client: Any, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert out.choices[0].message.content.startswith("{")
    for fmt in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},  # no finite value
        {"type": "json_schema"},
        {"type": "yaml"},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=HELLO, response_format=fmt, max_tokens=2)
        assert e.value.body["param"].startswith("response_format"), e.value.body
    # A schema whose required property only refers to itself starts, then has nowhere to go: the request's fault (400
    # invalid_schema), not a 500 from the sampler.
    self_loop = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": self_loop}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=HELLO, response_format=fmt, max_tokens=20)
    assert e.value.body["code"] == "invalid_schema" and "dead end" in e.value.body["message"], e.value.body
    stream = client.chat.completions.create(
        model=model, messages=HELLO, response_format=fmt, max_tokens=20, stream=True
    )
    with pytest.raises(openai.APIError, match="dead end"):  # the stream's error event, after the first bytes
        list(stream)


# ------------------------------------------------------------------------------------------ utility endpoints
def test_tokenize_detokenize_round_trip(server: ServerProcess, engine: kc.Model) -> None:
    text = "Héllo, wörld! <|im_start|> 你好 🙂"
    status, _, out = server.request("POST", "/tokenize", {"content": text})
    assert status == 200 and out["tokens"] == engine.tokenize(text, add_special=False)
    status, _, back = server.request("POST", "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["content"] == text
    status, _, pieces = server.request("POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == out["tokens"]
    joined = b"".join(
        p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces["tokens"]
    )
    assert joined.decode() == text
    _, _, plain = server.request("POST", "/tokenize", {"content": "<|im_start|>", "parse_special": False})
    assert len(plain["tokens"]) > 1  # the text, not the special token
    for path, body in (("/detokenize", {"tokens": [engine.n_vocab]}), ("/tokenize", {"text": "x"})):
        status, _, err = server.request("POST", path, body)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", err


def test_apply_template_and_props(server: ServerProcess, engine: kc.Model, default_model_path: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, _, out = server.request("POST", "/apply-template", {"messages": messages})
    assert status == 200 and out["prompt"] == engine.apply_chat_template(messages)
    status, _, out = server.request("POST", "/apply-template", {"messages": messages, "tools": [WEATHER]})
    assert status == 200 and "<tools>" in out["prompt"] and '"get_weather"' in out["prompt"]
    status, _, props = server.request("GET", "/props")
    assert status == 200
    # the file's name: where it lives on the server is not the client's business
    assert props["model_path"] == Path(default_model_path).name and props["n_ctx"] == engine.n_ctx
    assert props["method"] == "kvcmas" and props["total_slots"] == 4
    assert props["chat_template"] == engine.tokenizer.chat_template
    assert props["backends"][0]["name"] == "cpu" and props["build_info"].startswith("kvcmas ")


# ---------------------------------------------------------------------------------------------- /v1/responses
RESP_WEATHER = {"type": "function", "strict": True, **{k: v for k, v in WEATHER["function"].items()}}


def test_responses_text_matches_chat(client: Any, model: str) -> None:
    out = client.responses.create(
        model=model, instructions="Be brief.", input="Name a color.", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
        max_tokens=8,
        temperature=0,
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.output_text == chat.choices[0].message.content
    assert (
        out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == chat.usage.completion_tokens
    )
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(
        client.responses.create(
            model=model,
            instructions="Be brief.",
            input="Name a color.",
            max_output_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{out.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output[0].content[0].text == out.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # text cut off by max_output_tokens is an incomplete item, streamed or not (it said completed)
    cut = {"model": model, "input": "Count from one to twenty in words.", "max_output_tokens": 2, "temperature": 0}
    whole, last = client.responses.create(**cut), list(client.responses.create(**cut, stream=True))[-1].response
    assert whole.status == last.status == "incomplete" and whole.output_text == last.output_text != ""
    assert whole.output[-1].status == last.output[-1].status == "incomplete"


def test_responses_agents_sdk_shape_with_function_tools(client: Any, model: str) -> None:
    """The request the OpenAI Agents SDK sends: input items, function tools (flat, strict), include=[]."""
    request: dict[str, Any] = {
        "model": model,
        "instructions": "You are a weather agent. Use the tools.",
        "input": [{"content": "What is the weather in Paris?", "role": "user"}],
        "tools": [RESP_WEATHER],
        "include": [],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 40,
    }
    out = client.responses.create(**request)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    streamed = list(client.responses.create(**request, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(calls[0].name, calls[0].arguments)]
    # the round trip: the call and its output go back as input items
    follow = client.responses.create(
        **{
            **request,
            "tool_choice": "none",
            "max_output_tokens": 8,
            "input": [
                *request["input"],
                {
                    "type": "function_call",
                    "call_id": calls[0].call_id,
                    "name": "get_weather",
                    "arguments": calls[0].arguments,
                },
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 degrees celsius."},
            ],
        }
    )
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]
    for bad in (
        {"previous_response_id": "resp_x"},
        {"include": ["reasoning.encrypted_content"]},
        {"tools": [{"type": "web_search"}]},
    ):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=model, input="hi", max_output_tokens=2, extra_body=bad)


# ------------------------------------------------------------------------------ the Python API, one implementation
LONG_NAME = "n" * 65


@pytest.mark.parametrize(
    "path,fields,param,says",
    [
        # answered through the chat path, whose errors named its own parameters
        ("completions", {"prompt": [1] * 9000}, "prompt", "the prompt has 9000 tokens; the context holds"),
        ("responses", {"input": "hello " * 9000}, "input", "the prompt has "),
        ("responses", {"input": []}, "input", "'input': List should have at least 1 item"),
        (
            "responses",
            {"text": {"format": {"type": "json_schema", "name": LONG_NAME, "schema": {}}}},
            "text.format.name",
            "'text.format.name': String should have at most 64 characters",
        ),
        ("responses", {"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name", "'tools.0.name': "),
        ("responses", {"max_output_tokens": 99999}, "max_output_tokens", "max_output_tokens is 99999; this server"),
        # what is not supported, said plainly (was 'input.0.MessageItem.content.list[InputText].0.text': Field required)
        (
            "responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input",
            "'input': item 0, part 0 (type 'input_image') is not supported: parts are input_text or output_text",
        ),
        (
            "responses",
            {"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
            "input",
            "'input': item 0 (type 'web_search_call') is not supported: input takes message, function_call, "
            "function_call_output, reasoning items",
        ),
    ],
)
def test_an_error_names_the_field_the_client_sent(
    server: ServerProcess, path: str, fields: dict[str, Any], param: str, says: str
) -> None:
    body = {"prompt": "Hi."} if path == "completions" else {"input": "Hi."}
    status, _, out = server.request(
        "POST", f"/v1/{path}", {**body, "max_tokens" if path == "completions" else "max_output_tokens": 2, **fields}
    )
    assert status == 400 and out["error"]["param"] == param, out
    assert out["error"]["message"].startswith(says), out


def test_responses_function_call_output_may_be_text_parts(client: Any, model: str) -> None:
    """OpenAI's function_call_output.output is a string or a list of content parts: the parts' text is the result."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}
    items: list[Any] = [{"role": "user", "content": "Weather in Paris?"}, call]
    text = {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}
    parts = {**text, "output": [{"type": "input_text", "text": "sunny, "}, {"type": "input_text", "text": "21 C"}]}
    as_text = client.responses.create(model=model, input=[*items, text], max_output_tokens=6, temperature=0)
    as_parts = client.responses.create(model=model, input=[*items, parts], max_output_tokens=6, temperature=0)
    assert as_parts.output_text == as_text.output_text
    assert as_parts.usage.input_tokens == as_text.usage.input_tokens


def test_model_chat_gives_what_the_server_gives(client: Any, model: str, engine: kc.Model) -> None:
    kw: dict[str, Any] = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    got = engine.chat(ASK_WEATHER, max_tokens=40, temperature=0, **kw)
    want = client.chat.completions.create(model=model, messages=ASK_WEATHER, max_tokens=40, temperature=0, **kw)
    assert got.finish_reason == "tool_calls" and got.tool_calls is not None
    assert [c["function"] for c in got.tool_calls] == [
        c.function.model_dump() for c in want.choices[0].message.tool_calls
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    got = engine.chat(messages, response_format=fmt, max_tokens=60, temperature=0, logprobs=True, top_logprobs=2)
    want = client.chat.completions.create(
        model=model, messages=messages, response_format=fmt, max_tokens=60, temperature=0, logprobs=True, top_logprobs=2
    )
    assert got.text == want.choices[0].message.content
    assert got.logprobs is not None
    assert [e["token"] for e in got.logprobs] == [e.token for e in want.choices[0].logprobs.content]
    assert [e["logprob"] for e in got.logprobs] == pytest.approx(
        [e.logprob for e in want.choices[0].logprobs.content], abs=2e-3
    )


def test_agent_respond_with_tools_and_structured_output(default_model_path: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from kvcmas_cpp.agents import AgentSession
    from kvcmas_cpp.tools import tools_system_text

    m = kc.Model(str(default_model_path), n_threads=1)
    with AgentSession(m, method="fullshared") as session:
        session.share("What is the weather like in Paris today?")
        caller = session.agent("caller", "You are a weather agent.\n\n" + tools_system_text([WEATHER]))
        reply = caller.respond(40, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, logprobs=True)
        assert reply.finish_reason == "tool_calls" and reply.tool_calls and len(reply.tool_calls) == 1
        jsonschema.validate(json.loads(reply.tool_calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
        assert reply.logprobs is not None and len(reply.logprobs) == len(reply.ids)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        person = session.agent("writer", "You write JSON.").respond(60, response_format=fmt)
        jsonschema.validate(json.loads(person.text), PERSON)


def test_responses_items_come_in_the_order_they_were_generated() -> None:
    """A forced call, then a second block cut off by max_output_tokens: the stream gives the call first and then the
    cut text; the whole response must list them in that order too (it put the text first), the text item marked
    incomplete with the response."""
    from kvcmas_cpp.server.responses import _Translator
    from kvcmas_cpp.server.responses_request import ResponsesRequest

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = {
        "choices": [{"message": {"content": '<tool_call>\n{"name":', "tool_calls": [call]}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 40, "total_tokens": 49},
    }
    out = _Translator(ResponsesRequest(input="hi"), "m", len).from_completion(chat)
    assert [(i["type"], i["status"]) for i in out["output"]] == [
        ("function_call", "completed"),
        ("message", "incomplete"),
    ]
    chat["choices"][0]["message"]["content"] = "Let me check."  # text the model wrote before its call
    out = _Translator(ResponsesRequest(input="hi"), "m", len).from_completion(chat)
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    # a thinking model's reasoning comes first; cut off inside it, the reasoning item is the incomplete one
    chat["choices"][0]["message"] = {"content": "", "reasoning_content": "The user wants Paris."}
    out = _Translator(ResponsesRequest(input="hi"), "m", len).from_completion(chat)
    assert [(i["type"], i["status"]) for i in out["output"]] == [("reasoning", "incomplete")]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user wants Paris."}]
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == len("The user wants Paris.")


def test_responses_reasoning_items_sent_back_are_the_turns_reasoning() -> None:
    """A reasoning item in input is the reasoning_content of the assistant turn after it (a message or calls); one
    with no assistant turn after it (a user item follows) is dropped; summary text stands in for absent content."""
    from kvcmas_cpp.server.responses_request import ResponsesRequest

    think = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather?"}, think, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Say it."}]},
        {"role": "assistant", "content": "Sunny."},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "orphan"}]},
        {"role": "user", "content": "Thanks."},
    ]}).chat_body()  # fmt: skip
    assert [(m["role"], m.get("reasoning_content")) for m in body["messages"]] == [
        ("user", None), ("assistant", "Hm."), ("tool", None), ("assistant", "Say it."), ("user", None),
    ]  # fmt: skip


def test_responses_take_a_cache_salt_as_chat_does(client: Any, model: str) -> None:
    """A Responses client isolates its cached KV with cache_salt as a chat client can (it was a 400): the same input
    again under its salt reuses rows, under another salt nothing."""
    request = {"model": model, "instructions": "You are terse. " * 8, "input": "Name a fruit.", "max_output_tokens": 2}

    def cached(salt: str) -> int:
        out = client.responses.create(**request, extra_body={"cache_salt": salt})
        return int(out.usage.input_tokens_details.cached_tokens)

    assert cached("salt-one") == 0
    assert cached("salt-one") > 0
    assert cached("salt-two") == 0
