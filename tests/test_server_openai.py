"""The OpenAI surface agent frameworks rely on, end to end: a real kvcmas-server process and the real `openai`
client. Unsupported fields are refused by name; tools, structured output, logprobs, sampling parity, n > 1, the
llama.cpp-style utility endpoints and /v1/responses are checked against independent references (the in-process
engine, jsonschema, numpy softmax)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from test_server import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(default_model_path: Any) -> Iterator[ServerProcess]:
    srv = ServerProcess(str(default_model_path), "--method", "kvcmas", "--parallel", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)


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
