"""The exact prefix cache (kvcmas_cpp.prefix_cache): an agent's template prefix is computed once per model (per
server), not once per session; hits are exact (the same logits as a fresh prefill, bit for bit, with f32
activations), partial matches reuse the common prefix, namespaces never see each other's entries, and the cache
gives way under a small KV budget without failing a request. Counters: rows served from the cache are
prefix_cached_tokens and cached_tokens; nothing else is."""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.server import ServerProcess
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.plan import MIN_CHUNK_ROWS
from kvcmas_cpp.prefix_cache import PrefixCache
from kvcmas_cpp.server.backend import prefill_segments

SYSTEM = (
    "You are a careful math expert on a team of agents. Solve the problem step by step, check every "
    "intermediate result, and give the final answer as a single number on the last line."
)
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns 12 dollars an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
]


@pytest.fixture(scope="module")
def model(exact_model: kc.Model) -> kc.Model:
    return exact_model  # exact: compared bit for bit


def fresh_logits(model: kc.Model, ids: list[int]) -> np.ndarray:
    """The next-token logits of a one-piece prefill of ids in a new sequence (no cache involved)."""
    with model.new_sequence() as seq:
        out = seq.append(ids, logits="last")
    assert out is not None
    return out


def fresh_kv(model: kc.Model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with model.new_sequence() as seq:
        seq.append(ids, logits="none")
        return seq.kv()


def test_second_session_gets_the_system_prompt_from_the_cache_exactly(model: kc.Model) -> None:
    ns = uuid.uuid4().hex  # this test's entries only
    stats = []
    for k, question in enumerate(QUESTIONS):  # two workflows (sessions) with the same role
        with AgentSession(model, "nonshared", workflow=f"wf-{k}", cache_namespace=ns, calibration_dir=False) as s:
            agent = s.agent("Solver", SYSTEM)
            s.share(question)
            with s.prefill_agent(agent) as p:
                stats.append(p.stats)
                n_prefix = p.prefix_rows
                assert n_prefix >= MIN_CHUNK_ROWS
                # the cached rows give the very logits a fresh prefill of the whole prompt gives
                assert np.array_equal(p.logits, fresh_logits(model, list(p.seq.tokens)))
    first, second = stats
    assert first["prefix_cached_tokens"] == 0 and first["reused_tokens"] == 0  # computed by this very call
    assert first["computed_tokens"] == first["prompt_tokens"]
    assert second["prefix_cached_tokens"] == n_prefix  # the whole template prefix, from the first session
    assert second["reused_tokens"] == n_prefix and second["span_tokens"] == 0
    assert second["computed_tokens"] == second["prompt_tokens"] - n_prefix
    assert second["kv_bytes"] == (second["computed_tokens"] + second["generated_tokens"]) * model.kv_row_bytes


def test_partial_match_reuses_the_common_prefix_exactly(model: kc.Model) -> None:
    cache, ns = PrefixCache.of(model), uuid.uuid4().hex
    head = model.tokenize(SYSTEM)
    one, two = (head + model.tokenize(" " + q, add_special=False) for q in QUESTIONS)
    common = next(i for i in range(min(len(one), len(two))) if one[i] != two[i])
    assert common >= len(head) and len(two) - common >= MIN_CHUNK_ROWS
    with cache.prefix(ns, one)[0]:
        pass  # stored: the cache keeps its own sequence
    seq, cached = cache.prefix(ns, two)
    with seq:
        assert cached == common and list(seq.tokens) == two
        k, v = seq.kv()
        k0, v0 = fresh_kv(model, two)
        assert np.array_equal(k, k0) and np.array_equal(v, v0)  # every row, cached or not, as a fresh prefill's
    # a prompt that continues a stored one by a few tokens recomputes enough rows to append them as a prefill
    longer = one + model.tokenize(" Think.", add_special=False)
    assert len(longer) - len(one) < MIN_CHUNK_ROWS
    p = prefill_segments(model, [longer], namespace=ns)
    with p.seq:
        assert p.stats["prefix_cached_tokens"] == p.stats["reused_tokens"] == len(longer) - MIN_CHUNK_ROWS
        assert p.stats["computed_tokens"] == MIN_CHUNK_ROWS
        assert np.array_equal(p.logits, fresh_logits(model, longer))
    # the same prompt again: all but the rows its logits need come from the cache, and match a fresh prefill
    p = prefill_segments(model, [longer], namespace=ns)
    with p.seq:
        assert p.stats["prefix_cached_tokens"] == len(longer) - MIN_CHUNK_ROWS
        assert np.array_equal(p.logits, fresh_logits(model, longer))


def test_short_keys_namespaces_and_no_false_matches(model: kc.Model) -> None:
    cache = PrefixCache.of(model)
    ns_a, ns_b = uuid.uuid4().hex, uuid.uuid4().hex
    short = model.tokenize("Be brief.")
    assert len(short) < MIN_CHUNK_ROWS
    for expected in (0, len(short)):  # a short key is computed as one piece, then served whole
        seq, cached = cache.prefix(ns_a, short)
        seq.close()
        assert cached == expected
    ids = model.tokenize(SYSTEM)
    cache.prefix(ns_a, ids)[0].close()
    assert cache.prefix(ns_a, ids)[1] == len(ids)
    seq, cached = cache.prefix(ns_b, ids)  # another namespace: nothing
    seq.close()
    assert cached == 0
    other = model.tokenize("You are a poet. " + SYSTEM)  # the same text after a different start: no match
    seq, cached = cache.prefix(ns_a, other)
    seq.close()
    assert cached == 0


def test_the_cache_stays_within_its_share_of_a_small_budget(default_model_path: Path) -> None:
    small = kc.Model(default_model_path, n_threads=2, kv_budget=24 << 20)
    cache = PrefixCache.of(small)
    assert cache.max_bytes == (24 << 20) // 4
    before = small.kv_bytes_in_use
    for i in range(12):  # distinct system prompts: far more than the cache's share
        with AgentSession(small, "nonshared", calibration_dir=False) as s:
            agent = s.agent(f"agent{i}", f"You are agent number {i}. " + SYSTEM)
            s.share(QUESTIONS[i % 2])
            r = agent.respond(max_tokens=2)
            assert r.stats.prefix_cached_tokens == 0
        assert cache.tokens * small.kv_row_bytes <= cache.max_bytes
    assert cache.evictions > 0 and 0 < cache.entries < 12
    while cache.evict_lru():
        pass
    assert cache.entries == 0 and small.kv_bytes_in_use == before  # evicting every entry frees every row


def test_the_cache_goes_with_its_model(default_model_path: Path) -> None:
    m = kc.Model(default_model_path, n_threads=1, n_ctx=128)
    PrefixCache.of(m).prefix("", m.tokenize(SYSTEM))[0].close()
    assert PrefixCache.of(m).entries == 1
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None  # entries refer to the model; nothing else keeps it (or them) alive


def test_tokens_count_the_distinct_rows_the_entries_hold(model: kc.Model) -> None:
    """An entry forked from another reads that one's rows: they count once, also after that entry is evicted (its
    rows live on in the entries forked from it), and only until no entry reads them."""
    cache, ns = PrefixCache(model, max_bytes=1 << 30), uuid.uuid4().hex
    head = model.tokenize(" ".join([SYSTEM] * 4))  # long enough for the engine's blocks to tell sharing apart
    a, b = (head + model.tokenize(" " + q, add_special=False) for q in QUESTIONS)
    n_head = len(head)
    kv0 = model.kv_bytes_in_use
    cache.prefix(ns, head)[0].close()
    cache.prefix(ns, a)[0].close()  # its first n_head rows are the head entry's
    cache.prefix(ns, b)[0].close()  # and so are these
    rows = n_head + (len(a) - n_head) + (len(b) - n_head)
    assert cache.entries == 3 and cache.tokens == rows  # counted once per entry, it would be rows + 2 * n_head
    # the engine agrees: the blocks in use are those of the distinct rows (whole blocks, a partly shared one each)
    block, block_rows = model.kv_block_bytes, model.kv_block_rows
    assert model.kv_bytes_in_use - kv0 <= (rows // block_rows + 4) * block < (rows + 2 * n_head) // block_rows * block
    for ids in (a, b):  # used since: the head entry is now the least recently used
        cache.reuse(ns, ids)[0].close()
    assert cache.evict_lru()  # the head entry: its rows live on in the two entries forked from it
    assert cache.entries == 2 and cache.tokens == rows
    assert cache.evict_lru()  # a's: the head's rows are read by b's entry alone now
    assert cache.entries == 1 and cache.tokens == len(b)
    assert cache.evict_lru() and cache.tokens == 0
    assert model.kv_bytes_in_use == kv0


def test_the_size_cap_counts_shared_rows_once(model: kc.Model) -> None:
    """Two entries that share a prefix (b forked from a) stay under a cap that fits their distinct rows, though
    their lengths add up to more; one row less and the least recently used one goes."""
    head = model.tokenize(" ".join([SYSTEM] * 2))
    a, b = (head + model.tokenize(" " + q, add_special=False) for q in QUESTIONS)
    for spare in (0, -1):
        ns = uuid.uuid4().hex
        probe = PrefixCache(model, max_bytes=1 << 30)  # how many rows b's entry reads from a's (its fork point)
        probe.prefix(ns, a)[0].close()
        seq, served = probe.prefix(ns, b)
        seq.close()
        probe.clear()
        distinct = len(a) + len(b) - served
        assert served > 0 and distinct < len(a) + len(b)
        cache = PrefixCache(model, max_bytes=(distinct + spare) * model.kv_row_bytes)
        cache.prefix(ns, a)[0].close()
        cache.prefix(ns, b)[0].close()
        if spare == 0:
            assert cache.entries == 2 and cache.evictions == 0 and cache.tokens == distinct
        else:  # a's entry (the least recently used) goes; its rows b reads stay with b
            assert cache.entries == 1 and cache.evictions == 1 and cache.tokens == len(b)
        assert cache.tokens * model.kv_row_bytes <= cache.max_bytes
        cache.clear()


# ------------------------------------------------------------------------------------------------- the server
KEYS = {"alice": "alice-key-prefix-0123", "bob": "bob-key-prefix-4567"}
BUDGET_MB = 48


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    srv = ServerProcess(
        str(default_model_path),
        "--api-key-file",
        str(keys),
        "--method",
        "fullshared",
        "--activations",
        "f32",
        "--kv-budget",
        f"{BUDGET_MB}M",
        "--no-calibration-dir",
    )
    yield srv
    srv.stop()


def post(srv: ServerProcess, tenant: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, _, out = srv.request("POST", path, body, {"Authorization": f"Bearer {KEYS[tenant]}"})
    assert status == 200, out
    return dict(out)


def metrics(srv: ServerProcess) -> dict[str, float]:
    return srv.metrics()  # keyless from loopback: the whole server's (a tenant's key sees its own requests only)


def agent_call(srv: ServerProcess, tenant: str, workflow: str, system: str, question: str) -> dict[str, Any]:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 3,
        "temperature": 0,
        "kvcmas": {"workflow": workflow},
    }
    return post(srv, tenant, "/v1/chat/completions", body)


def test_server_chat_system_prompt_once_per_server_and_never_across_tenants(server: ServerProcess) -> None:
    system = f"{SYSTEM} Team {uuid.uuid4().hex[:8]}."
    m0 = metrics(server)
    first = agent_call(server, "alice", "wf-a", system, QUESTIONS[0])
    second = agent_call(server, "alice", "wf-b", system, QUESTIONS[1])  # another workflow, the same role
    other = agent_call(server, "bob", "wf-b", system, QUESTIONS[1])  # another tenant: the same request
    k1, k2, kb = first["kvcmas"], second["kvcmas"], other["kvcmas"]
    assert k1["prefix_cached_tokens"] == 0 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert k2["prefix_cached_tokens"] > 20 and k2["span_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == k2["prefix_cached_tokens"]
    assert k2["computed_tokens"] == second["usage"]["prompt_tokens"] - k2["prefix_cached_tokens"]
    assert kb["prefix_cached_tokens"] == 0 and other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # computed from the cache or not, the answer is the same (f32 activations: the same logits)
    assert second["choices"][0]["message"]["content"] == other["choices"][0]["message"]["content"]
    m1 = metrics(server)
    assert (
        m1["kvcmas_prefix_cached_tokens_total"] - m0["kvcmas_prefix_cached_tokens_total"] == k2["prefix_cached_tokens"]
    )
    assert m1["kvcmas_prefix_cache_entries"] >= 2  # alice's and bob's, apart


def test_server_completions_reuse_a_prompt_prefix_within_a_tenant(server: ServerProcess) -> None:
    head = f"{SYSTEM} Ledger {uuid.uuid4().hex[:8]}.\n\nQuestion: "

    def complete(tenant: str, question: str, salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": head + question, "max_tokens": 3, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        return post(server, tenant, "/v1/completions", body)

    a1 = complete("alice", QUESTIONS[0])
    a2 = complete("alice", QUESTIONS[1])
    b2 = complete("bob", QUESTIONS[1])
    s2 = complete("alice", QUESTIONS[1], salt="other-salt")  # the same tenant, another cache_salt: apart too
    assert a1["kvcmas"]["prefix_cached_tokens"] == 0
    n_head = a2["kvcmas"]["prefix_cached_tokens"]
    assert n_head > 20 and a2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_head
    assert b2["kvcmas"]["prefix_cached_tokens"] == 0 and b2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert s2["kvcmas"]["prefix_cached_tokens"] == 0
    assert a2["choices"][0]["text"] == b2["choices"][0]["text"] == s2["choices"][0]["text"]


def test_server_evicts_the_cache_before_refusing_a_request(server: ServerProcess) -> None:
    for i in range(3):  # entries of this tenant
        agent_call(server, "alice", f"wf-evict-{i}", f"You are agent {i} of a new team. {SYSTEM}", QUESTIONS[0])
    before = metrics(server)
    assert before["kvcmas_prefix_cache_entries"] > 0
    # a request whose reservation needs the whole budget: everything the cache holds must make room for it
    prompt = "Count the clips."
    n_prompt = len(server_tokenizer().tokenize(prompt))
    block_rows = server_tokenizer().kv_block_rows
    blocks = (BUDGET_MB << 20) // server_tokenizer().kv_block_bytes - 1
    eos = server_tokenizer().tokenizer.eos_id
    body = {"prompt": prompt, "max_tokens": blocks * block_rows - n_prompt, "logit_bias": {str(eos): 100}}
    out = post(server, "bob", "/v1/completions", body)
    assert out["choices"][0]["finish_reason"] == "stop"
    after = metrics(server)
    assert after["kvcmas_prefix_cache_entries"] < before["kvcmas_prefix_cache_entries"]
    assert after["kvcmas_evictions_total"] > before["kvcmas_evictions_total"]
    # and the cache fills again afterwards
    agent_call(server, "alice", "wf-evict-again", SYSTEM, QUESTIONS[1])
    assert metrics(server)["kvcmas_prefix_cache_entries"] >= 1


def test_admission_reserves_only_the_rows_the_cache_does_not_serve(server: ServerProcess) -> None:
    """A completion whose prompt starts with a cached prefix reserves KV for the rest of its prompt and its tokens
    only: sized so that it fits beside the cached entry only that way, it is admitted without evicting the entry
    and reads it (reserving its whole prompt, admission had to evict the entry first: no rows from the cache)."""
    tok = server_tokenizer()
    head = f"{SYSTEM} Ledger {uuid.uuid4().hex[:8]}.\n\nQuestion: "
    first = post(server, "alice", "/v1/completions", {"prompt": head + QUESTIONS[0], "max_tokens": 1})
    n_entry = first["usage"]["prompt_tokens"]  # the entry this prompt left in the cache
    prompt = head + QUESTIONS[1]
    n_prompt = len(tok.tokenize(prompt))
    cached = len(tok.tokenize(head)) - 2  # about what the cache serves it (at least)
    block_rows, block = tok.kv_block_rows, tok.kv_block_bytes
    budget_blocks = (BUDGET_MB << 20) // block
    entry_blocks = -(-n_entry // block_rows)
    # its reservation: prompt rows to compute, max_tokens and one spare block, beside the entry (other entries go)
    max_tokens = (budget_blocks - entry_blocks - 2) * block_rows - (n_prompt - cached)
    full = -(-(n_prompt + max_tokens) // block_rows) + 1  # blocks a reservation of the whole prompt takes
    assert entry_blocks + full > budget_blocks  # that would not fit beside the entry
    eos = tok.tokenizer.eos_id
    body = {"prompt": prompt, "max_tokens": max_tokens, "logit_bias": {str(eos): 100}}
    out = post(server, "alice", "/v1/completions", body)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["kvcmas"]["prefix_cached_tokens"] >= cached > 20, out["kvcmas"]


_TOKENIZER: list[kc.Model] = []


def server_tokenizer() -> kc.Model:
    """A model like the server's (f32 rows) to count tokens and row bytes with."""
    if not _TOKENIZER:
        _TOKENIZER.append(kc.Model(kc.default_model_path(), n_threads=1, n_ctx=64))
    return _TOKENIZER[0]
