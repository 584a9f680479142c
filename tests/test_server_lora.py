"""LoRA adapters on the server (issue 49, item 3): `kvcmas-server --lora`, a request's adapter by `"model"` (vLLM)
or by llama.cpp's `"lora"` field, /v1/models and /lora-adapters, tenant limits, and the prefix cache keyed on the
adapter.

Two random adapters of the default model at f32 are made here (tests/helpers/lora.py). The reference is the Python
API on the same file and settings: Model.chat / generate(adapter=, adapter_scale=) (itself checked against
transformers + peft in test_lora.py): greedy tokens equal, logprobs within float noise.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.lora import ALL_LINEAR, ATTENTION, make_lora_gguf
from helpers.server import ServerProcess
from kvcmas_cpp.prefix_cache import PrefixCache
from kvcmas_cpp.server.app import Server, ServerConfig
from kvcmas_cpp.server.http_guard import Tenants

pytest.importorskip("gguf")
pytest.importorskip("safetensors")

OPS = {"Authorization": "Bearer ops-key"}  # may use every adapter
ALICE = {"Authorization": "Bearer alice-key"}  # limited to critic
MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = (
    "A planner splits the task into steps, a coder writes each step, and a critic reads the code and names the "
    "first wrong line. The critic says:"
)
MAX_TOKENS = 8
LOGPROB_TOL = 2e-3  # the server's decode rows may be batched with other work (last bits differ)


@pytest.fixture(scope="module")
def f32_path(reference_models) -> Path:
    return reference_models["F32"]


@pytest.fixture(scope="module")
def lora_files(f32_path: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-lora")
    return {
        "critic": make_lora_gguf(root / "critic-r4.gguf", f32_path, ATTENTION, 4, 8.0, seed=1),
        "coder": make_lora_gguf(root / "coder.gguf", f32_path, ALL_LINEAR, 8, 16.0, seed=2),
    }


@pytest.fixture(scope="module")
def engine(f32_path: Path, lora_files: dict[str, Path]) -> kc.Model:
    """The reference: the same file and settings in this process, with both adapters."""
    model = kc.Model(f32_path, n_threads=2, activations="f32")
    model.load_adapter(lora_files["critic"], name="critic")
    model.load_adapter(lora_files["coder"])  # named by its stem, as the server's `--lora PATH`
    return model


@pytest.fixture(scope="module")
def server(f32_path: Path, lora_files: dict[str, Path], tmp_path_factory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("ops ops-key\nalice alice-key adapters=critic\n")
    proc = ServerProcess(
        str(f32_path),
        "--activations",
        "f32",
        "--lora",
        f"critic={lora_files['critic']}",
        "--lora",
        str(lora_files["coder"]),
        "--api-key-file",
        str(keys),
        "-np",
        "4",
    )
    yield proc
    proc.stop()


def _chat(server: ServerProcess, headers: dict[str, str] = OPS, **fields: Any) -> tuple[int, Any]:
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, **fields}
    status, _, out = server.request("POST", "/v1/chat/completions", body, headers=headers)
    return status, out


def _chat_answer(out: dict[str, Any]) -> tuple[str, list[str], np.ndarray]:
    entries = out["choices"][0]["logprobs"]["content"]
    return (
        out["choices"][0]["message"]["content"],
        [e["token"] for e in entries],
        np.array([e["logprob"] for e in entries]),
    )


def _reference_chat(engine: kc.Model, adapter: str | None, scale: float = 1.0) -> tuple[str, list[str], np.ndarray]:
    kw: dict[str, Any] = {} if adapter is None else {"adapter": adapter, "adapter_scale": scale}
    ref = engine.chat(MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, **kw)
    entries = ref.logprobs or []
    return ref.text, [e["token"] for e in entries], np.array([e["logprob"] for e in entries])


def _assert_same(got: tuple[str, list[str], np.ndarray], ref: tuple[str, list[str], np.ndarray]) -> None:
    assert got[0] == ref[0] and got[1] == ref[1], (got, ref)
    np.testing.assert_allclose(got[2], ref[2], atol=LOGPROB_TOL)


def _completion(server: ServerProcess, headers: dict[str, str] = OPS, **fields: Any) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    status, _, out = server.request("POST", "/v1/completions", body, headers=headers)
    return status, out


def _reference_completion(engine: kc.Model, adapter: str | None, scale: float = 1.0) -> str:
    kw: dict[str, Any] = {} if adapter is None else {"adapter": adapter, "adapter_scale": scale}
    return engine.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **kw).text  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------- listing


def test_models_and_lora_adapters_list_the_adapters_with_their_parent(server: ServerProcess) -> None:
    status, _, out = server.request("GET", "/v1/models", headers=OPS)
    assert status == 200
    base = out["data"][0]["id"]
    assert [m["id"] for m in out["data"]] == [base, "critic", "coder"]
    assert all(m["parent"] == base and m["root"].endswith(".gguf") for m in out["data"][1:])
    status, _, listed = server.request("GET", "/lora-adapters", headers=OPS)
    assert status == 200 and [(a["id"], a["name"]) for a in listed] == [(0, "critic"), (1, "coder")]
    assert server.request("GET", "/v1/models/coder", headers=OPS)[2]["parent"] == base
    # a tenant limited to critic sees only it, and coder is not found for it
    assert [m["id"] for m in server.request("GET", "/v1/models", headers=ALICE)[2]["data"]] == [base, "critic"]
    assert [a["name"] for a in server.request("GET", "/lora-adapters", headers=ALICE)[2]] == ["critic"]
    assert server.request("GET", "/v1/models/coder", headers=ALICE)[0] == 404


# --------------------------------------------------------------------------------------------- answers


@pytest.mark.slow
def test_model_field_runs_the_adapter_as_the_python_api_does(server: ServerProcess, engine: kc.Model) -> None:
    base = _reference_chat(engine, None)
    for name in ("critic", "coder"):
        status, out = _chat(server, model=name)
        assert status == 200, out
        assert out["model"] == name and out["kvcmas"]["adapter"] == name
        got = _chat_answer(out)
        _assert_same(got, _reference_chat(engine, name))
        assert got[1] != base[1]  # the adapter changes the answer
    status, out = _chat(server)
    assert status == 200 and out["model"] != "critic"
    _assert_same(_chat_answer(out), base)


@pytest.mark.slow
def test_streamed_chat_and_responses_run_the_adapter(server: ServerProcess, engine: kc.Model) -> None:
    ref_text = _reference_chat(engine, "critic")[0]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "model": "critic"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json", **OPS})
    raw = conn.getresponse().read().decode()
    conn.close()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ref_text and all(c["model"] == "critic" for c in chunks)
    body = {"input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS, "temperature": 0, "model": "critic"}
    status, _, out = server.request("POST", "/v1/responses", body, headers=OPS)
    assert status == 200, out
    assert out["model"] == "critic" and out["output"][0]["content"][0]["text"] == ref_text
    body = {**body, "model": None, "lora": [{"id": 0, "scale": 1.0}]}  # llama.cpp's field on /v1/responses
    status, _, out = server.request("POST", "/v1/responses", body, headers=OPS)
    assert status == 200 and out["output"][0]["content"][0]["text"] == ref_text
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "model": "coder"}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **OPS})
    raw = conn.getresponse().read().decode()
    conn.close()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == _reference_completion(engine, "coder") and all(c["model"] == "coder" for c in chunks)


@pytest.mark.slow
def test_lora_field_at_half_scale_equals_adapter_scale_half(server: ServerProcess, engine: kc.Model) -> None:
    status, out = _chat(server, lora=[{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}])
    assert status == 200, out
    half = _chat_answer(out)
    _assert_same(half, _reference_chat(engine, "critic", 0.5))
    assert half[1] != _reference_chat(engine, "critic", 1.0)[1]  # the scale matters
    status, out = _completion(server, lora=[{"id": 1, "scale": 0.5}])
    assert status == 200 and out["choices"][0]["text"] == _reference_completion(engine, "coder", 0.5)


@pytest.mark.slow
def test_base_and_two_adapters_at_once_each_get_their_alone_answer(server: ServerProcess, engine: kc.Model) -> None:
    picks: list[str | None] = [None, "critic", "coder", "critic"]
    refs = {p: _reference_chat(engine, p) for p in set(picks)}
    with concurrent.futures.ThreadPoolExecutor(len(picks)) as pool:
        futures = [pool.submit(_chat, server, **({} if p is None else {"model": p})) for p in picks]
        results = [f.result() for f in futures]
    for p, (status, out) in zip(picks, results, strict=True):
        assert status == 200, out
        _assert_same(_chat_answer(out), refs[p])


def _model_counts(server: ServerProcess, headers: dict[str, str] = OPS) -> dict[tuple[str, str], float]:
    """/metrics' per-model counters as a tenant sees its own: (metric, model) -> value."""
    status, _, text = server.request("GET", "/metrics", headers=headers)
    assert status == 200
    found = re.findall(r'^(kvcmas_model_\w+)\{model="([^"]+)"\} (\S+)$', text, re.M)
    return {(name, model): float(v) for name, model, v in found}


def test_metrics_count_each_adapters_generations_and_tokens(server: ServerProcess) -> None:
    """Per-adapter metrics: a chat with the critic adapter and a completion with the base model add their usage to
    their own model's counters (the base under the server's model id) and to no other; another tenant's view of
    itself does not move."""
    before, alice_before = _model_counts(server), _model_counts(server, ALICE)
    status, chat = _chat(server, model="critic")
    assert status == 200, chat
    status, plain = _completion(server)
    assert status == 200, plain
    after = _model_counts(server)
    base = plain["model"]

    def added(metric: str, model: str) -> float:
        key = (f"kvcmas_model_{metric}_total", model)
        return after.get(key, 0) - before.get(key, 0)

    for model, usage in (("critic", chat["usage"]), (base, plain["usage"])):
        assert added("generations", model) == 1, model
        assert added("prompt_tokens", model) == usage["prompt_tokens"], model
        assert added("generated_tokens", model) == usage["completion_tokens"], model
        assert added("reused_tokens", model) == usage["prompt_tokens_details"]["cached_tokens"], model
    assert added("generations", "coder") == 0
    assert chat["model"] == "critic" and base != "critic"
    assert _model_counts(server, ALICE) == alice_before


def test_agents_with_different_adapters_share_a_workflows_context(server: ServerProcess, engine: kc.Model) -> None:
    """Issue 49 item 4 on the server: agents told apart by role and adapter in one kvcmas workflow. The first agent
    (critic) computes the shared context exactly, so its answer is Model.chat's with its adapter; the coder agent
    and a base-model agent then read the context's rows by reference (sharing/adapter_views.py keys their edges on
    both adapters)."""
    context = " ".join(
        f"Step {i}: the coder writes function f{i} and the critic checks its loop bounds." for i in range(24)
    )
    options = {"kvcmas": {"workflow": "lora-team", "method": "kvcmas"}}
    replies = {}
    for role, model in (("critic", "critic"), ("coder", "coder"), ("reviewer", None)):
        messages = [{"role": "system", "content": f"You are the {role}."}, {"role": "user", "content": context}]
        status, _, out = server.request(
            "POST",
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, **options}
            | ({} if model is None else {"model": model}),
            headers=OPS,
        )
        assert status == 200, out
        assert out["kvcmas"]["method"] == "kvcmas" and out["kvcmas"].get("adapter") == model
        replies[role] = (messages, out)
    messages, first = replies["critic"]
    assert first["kvcmas"]["reused_tokens"] == 0
    ref = engine.chat(messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, adapter="critic")
    _assert_same(
        _chat_answer(first),
        (ref.text, [e["token"] for e in ref.logprobs or []], np.array([e["logprob"] for e in ref.logprobs or []])),
    )
    n_context = len(engine.tokenize(context, add_special=False))
    for role in ("coder", "reviewer"):  # the context's rows, less the method's exact head, by reference
        reused = replies[role][1]["kvcmas"]["reused_tokens"]
        assert n_context // 2 < reused <= n_context, (role, reused, n_context)


@pytest.mark.slow
def test_the_prefix_cache_never_serves_one_adapters_rows_to_another(server: ServerProcess, engine: kc.Model) -> None:
    salt = {"cache_salt": "prefix-cache-test"}
    for _ in range(2):  # the second base request is served by the cache
        status, out = _completion(server, **salt)
        assert status == 200 and out["choices"][0]["text"] == _reference_completion(engine, None)
    assert out["kvcmas"]["prefix_cached_tokens"] > 0
    for name in ("critic", "coder"):
        status, out = _completion(server, model=name, **salt)  # same prompt: the base rows must not serve it
        assert status == 200 and out["kvcmas"]["prefix_cached_tokens"] == 0
        assert out["choices"][0]["text"] == _reference_completion(engine, name)
    status, out = _completion(server, model="critic", **salt)  # its own rows do
    assert out["kvcmas"]["prefix_cached_tokens"] > 0
    assert out["choices"][0]["text"] == _reference_completion(engine, "critic")
    status, out = _completion(server, lora=[{"id": 0, "scale": 0.5}], **salt)  # another scale: other rows
    assert out["kvcmas"]["prefix_cached_tokens"] == 0
    assert out["choices"][0]["text"] == _reference_completion(engine, "critic", 0.5)


def test_prefix_cache_entries_are_keyed_by_adapter_and_scale(engine: kc.Model) -> None:
    cache = PrefixCache(engine)
    ids = engine.tokenize(PROMPT)
    critic = (engine.adapters["critic"].id, 1.0)
    seq, m = cache.prefix("ns", ids)  # base rows, stored
    seq.close()
    assert m == 0 and cache.cached_rows("ns", ids + [1] * 16) > 0
    assert cache.cached_rows("ns", ids + [1] * 16, critic) == 0
    assert cache.cached_rows("ns", ids + [1] * 16, (critic[0], 0.5)) == 0
    seq, m = cache.prefix("ns", ids, critic)
    assert m == 0 and seq.adapter == critic  # computed with the adapter, not read from the base entry
    np.testing.assert_array_equal(seq.append([ids[-1]], logits="last"), _next_of(engine, ids, "critic"))
    seq.close()
    assert cache.cached_rows("ns", ids + [1] * 16, critic) > 0
    cache.clear()


def _next_of(engine: kc.Model, ids: list[int], adapter: str) -> np.ndarray:
    with engine.new_sequence() as seq:
        engine.set_sequence_adapter(seq, adapter)
        seq.append(ids, logits="none")
        return seq.append([ids[-1]], logits="last")


# --------------------------------------------------------------------------------------------- refusals


def test_unknown_adapters_conflicts_and_tenant_limits_are_clear_errors(server: ServerProcess) -> None:
    status, out = _chat(server, model="planner")
    assert status == 404 and "planner" in out["error"]["message"] and out["error"]["code"] == "model_not_found"
    status, out = _completion(server, lora=[{"id": 7, "scale": 1.0}])
    assert status == 404 and "7" in out["error"]["message"] and out["error"]["param"] == "lora"
    status, out = _chat(server, lora=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}])
    assert status == 400 and "one adapter" in out["error"]["message"]
    status, out = _chat(server, model="coder", lora=[{"id": 0, "scale": 1.0}])
    assert status == 400 and "critic" in out["error"]["message"]
    status, out = _chat(server, ALICE, model="coder")
    assert status == 403 and "coder" in out["error"]["message"] and "critic" in out["error"]["message"]
    status, out = _completion(server, ALICE, lora=[{"id": 1, "scale": 1.0}])
    assert status == 403 and "coder" in out["error"]["message"]
    status, out = _completion(server, ALICE, model="critic", max_tokens=2)
    assert status == 200 and out["model"] == "critic"


def test_tenant_adapter_limits_in_the_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("a ka adapters=x,y\nb kb\nc kc adapters=\n")
    assert Tenants(key_file=str(keys)).adapters == {"a": frozenset({"x", "y"}), "c": frozenset()}
    for bad in ("ka adapters=x\n", "a ka kb adapters=x\n", "a ka adapters=x more\n"):
        keys.write_text(bad)
        with pytest.raises(ValueError, match="line 1"):
            Tenants(key_file=str(keys))


def test_bad_lora_flags_refuse_to_start(f32_path: Path, lora_files: dict[str, Path], tmp_path: Path) -> None:
    model = kc.Model(f32_path, n_threads=1, activations="f32")
    with pytest.raises(ValueError, match="no such file"):
        Server(ServerConfig(str(f32_path), loras=(f"x={tmp_path / 'missing.gguf'}",)), model)
    with pytest.raises(ValueError, match="--lora"):  # the base model itself is not a LoRA file
        Server(ServerConfig(str(f32_path), loras=(f"x={f32_path}",)), model)
    assert model.adapters == {}
    keys = tmp_path / "keys.txt"
    keys.write_text("bob bob-key adapters=critic,nope\n")
    with pytest.raises(ValueError, match="'nope'"):
        Server(ServerConfig(str(f32_path), api_key_file=str(keys), loras=(f"critic={lora_files['critic']}",)), model)
