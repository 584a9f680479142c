"""kvcmas-server end to end: a real server process on a free port, real clients (the `openai` package, raw HTTP).

References are independent of the server: greedy text from the in-process engine (Model.chat / Model.generate),
the same request on the nonshared path, the same requests sent one at a time. One server serves most tests; a second
one, with an API key, a tiny KV budget and a short queue, covers 401, waiting for memory and 429.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.server import BLOCK_BYTES, ROLES, TASK, ServerProcess, chat, run_workflow
from kvcmas_cpp.sharing.methods import READ_ROWS

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(model_path: str, mmproj_path: str | None) -> Iterator[ServerProcess]:
    vision = ["--mmproj", mmproj_path] if mmproj_path else []
    # Small prefill chunks: every prompt here runs in several chunks with other requests' work between them, and the
    # outputs are still compared with one-piece references.
    # Exact activations: the server's outputs are compared with one-piece in-process references, and q8 activations
    # (the default) round appends of up to 16 rows differently from longer ones (tests/test_quant_q8.py covers q8).
    srv = ServerProcess(
        model_path, "--method", "kvcmas", "--parallel", "8", "--prefill-chunk", "16", "--activations", "f32", *vision
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(exact_model: kc.Model) -> kc.Model:
    """The in-process engine: the reference for greedy outputs (exact activations, as the server runs here)."""
    return exact_model


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model_id(client: Any) -> str:
    return str(client.models.list().data[0].id)


# ------------------------------------------------------------------------------------------- the openai client
def test_models_and_health(server: ServerProcess, client: Any, model_path: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [Path(model_path).name.removesuffix(".gguf")]
    assert client.models.retrieve(models[0].id).id == models[0].id
    status, _, body = server.request("GET", "/health")
    assert status == 200 and body["status"] == "ok"


def test_chat_matches_the_engine_stream_and_not(client: Any, engine: kc.Model) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    want = engine.chat(messages, max_tokens=12, temperature=0)
    model = _model_id(client)
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.usage.prompt_tokens == want.timings.prompt_tokens
    extra = got.model_extra
    assert extra["timings"]["predicted_n"] == len(want.tokens) and extra["timings"]["prompt_ms"] > 0
    assert extra["kvcmas"]["method"] in ("kvcmas", "nonshared")  # nonshared: agents module unavailable

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usages = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append((chunk.usage, chunk.choices))
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == want.text
    assert finish == want.finish_reason
    # one usage, in the last chunk, which has no choices (clients that add usages up, as LangChain does, doubled it)
    assert len(usages) == 1 and usages[0][1] == [] and usages[0][0].completion_tokens == len(want.tokens)


def test_completions_match_the_engine(client: Any, engine: kc.Model) -> None:
    prompt = "The three primary colors are"
    want = engine.generate(prompt, max_tokens=10, temperature=0)
    model = _model_id(client)
    got = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == len(engine.tokenize(prompt))
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    ids = engine.tokenize(prompt)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == want.text


def test_greedy_is_deterministic_and_stop_strings_cut(server: ServerProcess, engine: kc.Model) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    kv = {"method": "nonshared"}
    a = chat(server, messages, max_tokens=16, kvcmas=kv)["choices"][0]["message"]["content"]
    b = chat(server, messages, max_tokens=16, kvcmas=kv)["choices"][0]["message"]["content"]
    assert a == b and a
    word = a.split()[1] if len(a.split()) > 1 else a.split()[0]
    cut = chat(server, messages, max_tokens=16, stop=[word], kvcmas=kv)
    assert cut["choices"][0]["message"]["content"] == a[: a.index(word)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Tell me a word."}]
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 8, "kvcmas": {"method": "nonshared"}}
    a = chat(server, messages, **kw)["choices"][0]["message"]["content"]
    b = chat(server, messages, **kw)["choices"][0]["message"]["content"]
    assert a == b


# ------------------------------------------------------------------------------------------ sharing workflow


def test_four_agent_workflow_shares_spans(server: ServerProcess) -> None:
    plain = run_workflow(server, "wf-plain", "nonshared", max_tokens=8)
    shared = run_workflow(server, "wf-kv-0", None, max_tokens=8)
    # The first agent has nothing to reuse from other agents: its answer is exactly the nonshared one.
    assert shared[0]["choices"][0]["message"]["content"] == plain[0]["choices"][0]["message"]["content"]
    assert all(
        b["kvcmas"]["workflow"] == "wf-kv-0" and b["kvcmas"]["agent"] == f"agent{k}" for k, b in enumerate(shared)
    )
    for body in shared + plain:
        usage, k = body["usage"], body["kvcmas"]
        assert usage["prompt_tokens"] == k["reused_tokens"] + k["computed_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == k["reused_tokens"]
        assert k["reused_tokens"] == k["prefix_cached_tokens"] + k["span_tokens"]  # where the rows came from
    # a new session's first agent reads no other agent's span; its template prefix (system prompt), which the
    # nonshared workflow computed, comes from the server's prefix cache: that, and only that, counts as cached
    k0 = shared[0]["kvcmas"]
    assert k0["span_tokens"] == 0 and k0["prefix_cached_tokens"] > 0
    assert shared[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == k0["prefix_cached_tokens"]
    if shared[0]["kvcmas"]["method"] != "kvcmas":
        pytest.skip("kvcmas_cpp.agents is not available: the server runs every method nonshared")
    # kvcmas shares each edge uncorrected while it calibrates (the gate says so), then with its learned map. Every
    # workflow is a new session: what it reuses, its own first agent computed.
    last, i = shared, 0
    while any("calibrating" in str(b["kvcmas"]["gate"]) for b in last[1:]) and i < 14:
        i += 1
        last = run_workflow(server, f"wf-kv-{i}", None, max_tokens=8)
    task_tokens = len(server_tokens(TASK))
    for k in (1, 2, 3):  # later agents reuse most of the task message the first agent computed (tails exact)
        gained = last[k]["kvcmas"]["reused_tokens"] - plain[k]["kvcmas"]["reused_tokens"]
        assert gained >= task_tokens // 2, (k, last[k]["kvcmas"], plain[k]["kvcmas"])
        assert last[k]["kvcmas"]["computed_tokens"] < plain[k]["kvcmas"]["computed_tokens"]
        assert last[k]["kvcmas"]["gate"] == "reuse"
    # per request, kvcmas.recompute=1: the calibrated edges recompute every shared token, answers equal nonshared's
    exact = run_workflow(server, "wf-kv-exact", None, max_tokens=8, recompute=1.0)
    for k in (1, 2, 3):
        assert exact[k]["choices"][0]["message"]["content"] == plain[k]["choices"][0]["message"]["content"]
        assert exact[k]["kvcmas"]["gate"] == "reuse" and exact[k]["kvcmas"]["recomputed_tokens"] > 0
    metrics = server.metrics()
    assert metrics["kvcmas_reused_tokens_total"] >= 3 * (task_tokens // 2)
    assert metrics["kvcmas_span_tokens_total"] >= 3 * (task_tokens // 2)
    assert metrics["kvcmas_reused_tokens_total"] == (
        metrics["kvcmas_span_tokens_total"] + metrics["kvcmas_prefix_cached_tokens_total"]
    )
    assert metrics["kvcmas_estimator_bytes"] > 0  # the maps kvcmas learned (and reads of edges still calibrating)


def test_part_of_a_reply_passed_on_inside_a_message_is_reused(server: ServerProcess) -> None:
    """A client passes on only the second half of an earlier reply (cut at a stop string), wrapped in its own text:
    the server reads that run of tokens from the reply's stored rows, and counts only those rows as cached."""
    opts = {"workflow": "wf-runs", "method": "fullshared"}
    first = [{"role": "system", "content": ROLES[0]}, {"role": "user", "content": TASK}]
    body = chat(server, first, max_tokens=48, stop=["\n\n\n"], kvcmas={**opts, "agent": "planner"})
    reply = body["choices"][0]["message"]["content"]
    excerpt = reply[reply.index(" ", len(reply) // 2) :]  # from a word in its middle on, as received
    n_excerpt = len(server_tokens(excerpt))
    assert n_excerpt >= 20, reply  # long enough to be a run (MIN_PIECE_TOKENS = 16)
    wrapped = f"The planner ended with:\n{excerpt}\nCarry it out."
    msgs = [{"role": "system", "content": ROLES[1]}, {"role": "user", "content": wrapped}]
    k = chat(server, msgs, max_tokens=4, kvcmas={**opts, "agent": "solver"})
    usage, kv = k["usage"], k["kvcmas"]
    assert n_excerpt - 2 <= kv["span_tokens"] <= n_excerpt, (kv, n_excerpt, excerpt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == kv["reused_tokens"]
    assert kv["reused_tokens"] == kv["prefix_cached_tokens"] + kv["span_tokens"]
    status, _, _ = server.request("DELETE", "/v1/kvcmas/workflows/wf-runs")
    assert status == 200


def _stream_times(server: ServerProcess, body: dict[str, Any]) -> list[float]:
    """Streams a chat completion; returns the arrival time (time.perf_counter) of every content delta."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    times: list[float] = []
    for line in resp:
        text = line.decode().strip()
        if text.startswith("data: {") and json.loads(text[6:])["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
    conn.close()
    return times


def test_training_reads_run_after_the_reply_between_other_work(server: ServerProcess) -> None:
    """kvcmas under cold reuse (the default): a later agent's reply comes back before the training read it scheduled
    (the span's exact rows in its context) has run. The read then runs in small steps between other requests' decode
    steps, so a stream started meanwhile is never stalled for the whole read; and after CALIBRATION_READS workflows
    the reader's edge is calibrated."""
    from kvcmas_cpp.agents import CALIBRATION_READS

    writer = "You write notes for a training-read test. Summarize the items."
    reader = "You read notes for a training-read test. Find the largest number."
    items = [f"Item {i}: {i * 7} clips were sold on day {i}, then {i * 3} more were sold." for i in range(60)]
    long_context = "\n".join(items)
    n_long = len(server_tokens(long_context))
    assert n_long > 1000
    read_key = 'kvcmas_training_reads_total{outcome="done"}'
    deadline = time.monotonic() + 120  # earlier tests' reads, which step once a second while those tests run, end
    while server.metrics()["kvcmas_training_reads_pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(CALIBRATION_READS + 1):
        context = long_context if i == 0 else f"{TASK} (case {i})"
        opts = {"workflow": f"wf-read-{i}"}
        chat(
            server,
            [{"role": "system", "content": writer}, {"role": "user", "content": context}],
            max_tokens=4,
            kvcmas=opts,
        )
        done_before = server.metrics().get(read_key, 0)
        rows_before = server.metrics().get("kvcmas_calibration_tokens_total", 0)
        body = chat(
            server,
            [{"role": "system", "content": reader}, {"role": "user", "content": context}],
            max_tokens=4,
            kvcmas=opts,
        )
        t_reply = time.perf_counter()
        k = body["kvcmas"]
        if k["method"] != "kvcmas":
            pytest.skip("kvcmas_cpp.agents is not available: the server runs every method nonshared")
        if i == CALIBRATION_READS:  # calibrated: learned corrections, no training read any more
            assert k["gate"] == "reuse" and k["mode"] == "reuse" and k["calibration_tokens_scheduled"] == 0, k
            break
        assert k["gate"] == "calibrating -> reuse" and k["mode"] == "reuse", k
        if i == 0:
            # a bounded read (READ_ROWS): the context's first rows after its head, and the reader's own rows before
            scheduled = k["calibration_tokens_scheduled"]
            assert READ_ROWS < scheduled <= READ_ROWS + k["computed_tokens"] and k["span_tokens"] >= n_long - 8, k
            after = server.metrics()  # the reply came back with its read not run yet
            assert after["kvcmas_training_reads_pending"] == 1 and after.get(read_key, 0) == done_before
            stream = {
                "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
                "max_tokens": 24,
                "temperature": 0,
                "kvcmas": {"method": "nonshared"},
            }
            times = _stream_times(server, stream)
            assert len(times) >= 8
            still = server.metrics()["kvcmas_training_reads_pending"]
        deadline = time.monotonic() + 300
        while server.metrics()["kvcmas_training_reads_pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        m = server.metrics()
        assert m["kvcmas_training_reads_pending"] == 0 and m[read_key] == done_before + 1
        # the read ran: the rows the reply said it scheduled are the rows it computed
        assert m["kvcmas_calibration_tokens_total"] == rows_before + k["calibration_tokens_scheduled"]
        if i == 0:
            read_s = time.perf_counter() - t_reply
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            # the stream went on while the read ran (it was still pending when the stream ended), no gap between two
            # of its tokens held more than a small part of the read, and a read step came between its tokens at most
            # once a second (it came between every two, and a tester's streams ran 8x slower while a read was pending)
            assert still == 1 and max(gaps) < read_s / 4, (max(gaps), read_s)
            alone = _stream_times(server, stream)  # the same stream with no read pending
            base = float(np.median([b - a for a, b in zip(alone, alone[1:], strict=False)]))
            assert float(np.median(gaps)) < 2 * base + 0.01, (gaps, base)
    assert server.metrics().get('kvcmas_training_reads_total{outcome="dropped"}', 0) == 0


def test_a_training_read_ends_under_a_steady_stream_of_prefills(server: ServerProcess) -> None:
    """Training reads are the lowest-priority work, yet not starved: while other clients keep a prefill ready in
    every turn, a read still gets a step at least every READ_STARVE_S and ends while those prefills go on."""
    writer = "You write notes for a starvation test. Summarize the items."
    reader = "You read notes for a starvation test. Find the smallest number."
    context = "\n".join(f"Entry {i}: {i * 11} apples were picked in row {i}." for i in range(12))
    filler = " ".join(f"item {i}," for i in range(40))  # about 10 prefill chunks of 16 rows each
    stop = threading.Event()
    served = [0]

    def press(lane: int) -> None:  # a new prompt (no prefix-cache hit) as soon as the last one is answered
        n = 0
        while not stop.is_set():
            n += 1
            chat(
                server,
                [{"role": "user", "content": f"{lane}-{n} {filler}"}],
                max_tokens=1,
                kvcmas={"method": "nonshared"},
            )
            served[0] += 1

    lanes = [threading.Thread(target=press, args=(lane,)) for lane in range(3)]
    for t in lanes:
        t.start()
    try:
        while served[0] < 3:  # the pressure is on before the read exists
            time.sleep(0.05)
        opts = {"workflow": "wf-starve"}
        for system in (writer, reader):
            k = chat(
                server,
                [{"role": "system", "content": system}, {"role": "user", "content": context}],
                max_tokens=2,
                kvcmas=opts,
            )["kvcmas"]
        if k["method"] != "kvcmas":
            pytest.skip("kvcmas_cpp.agents is not available: the server runs every method nonshared")
        assert k["gate"] == "calibrating -> reuse" and k["calibration_tokens_scheduled"] > 100, k
        served_at_reply, deadline = served[0], time.monotonic() + 120
        while server.metrics()["kvcmas_training_reads_pending"] and time.monotonic() < deadline:
            time.sleep(0.1)
        pending = server.metrics()["kvcmas_training_reads_pending"]
        assert pending == 0 and all(t.is_alive() for t in lanes), (pending, served_at_reply, served[0])
    finally:
        stop.set()
        for t in lanes:
            t.join()
    assert server.metrics()['kvcmas_training_reads_total{outcome="done"}'] >= 1


_TOKENIZER: list[kc.Model] = []


def server_tokens(text: str) -> list[int]:
    return _TOKENIZER[0].tokenize(text, add_special=False)


@pytest.fixture(autouse=True, scope="module")
def _tokenizer(engine: kc.Model) -> None:
    _TOKENIZER.append(engine)


# ------------------------------------------------------------------------------------------------ concurrency
def test_sixteen_concurrent_clients_get_their_sequential_answers(server: ServerProcess) -> None:
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]

    def ask(i: int) -> dict[str, Any]:
        return chat(server, [{"role": "user", "content": prompts[i]}], max_tokens=8, kvcmas={"method": "nonshared"})

    sequential = [ask(i) for i in range(16)]
    most_active = 0
    done = threading.Event()

    def watch() -> None:  # how many requests the scheduler generates at once (one batched decode step for all)
        nonlocal most_active
        while not done.is_set():
            most_active = max(most_active, int(server.request("GET", "/health")[2]["active"]))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            concurrent = list(pool.map(ask, range(16)))
    finally:
        done.set()
        watcher.join()
    for s, c in zip(sequential, concurrent, strict=True):
        assert c["choices"][0]["message"]["content"] == s["choices"][0]["message"]["content"]
        assert c["usage"]["completion_tokens"] == s["usage"]["completion_tokens"]
        assert c["choices"][0]["finish_reason"] == s["choices"][0]["finish_reason"]
    assert most_active > 1


def test_cancelling_a_stream_frees_its_sequence(server: ServerProcess) -> None:
    options = {"method": "nonshared", "workflow": "wf-cancel"}
    messages = [{"role": "user", "content": "Write a very long story about a dragon."}]
    chat(server, messages, max_tokens=2, kvcmas=options)  # the session's prefix cache now exists
    before = server.metrics()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"messages": messages, "max_tokens": 400, "stream": True, "temperature": 0, "kvcmas": options}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # a few content chunks: the job is generating
        line = resp.fp.readline()
        seen += line.startswith(b"data: ")
    during = server.metrics()
    assert during["kvcmas_active_requests"] == 1
    assert during["kvcmas_kv_bytes"] > before["kvcmas_kv_bytes"]
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10
    after = server.metrics()
    while time.monotonic() < deadline and after["kvcmas_active_requests"] != 0:
        time.sleep(0.1)
        after = server.metrics()
    assert after["kvcmas_active_requests"] == 0
    assert after["kvcmas_engine_sequences"] == before["kvcmas_engine_sequences"]
    assert after["kvcmas_kv_bytes"] == before["kvcmas_kv_bytes"]
    assert after["kvcmas_cancelled_total"] == before["kvcmas_cancelled_total"] + 1
    assert after["kvcmas_generated_tokens_total"] == before["kvcmas_generated_tokens_total"]  # never finished
    assert server.request("DELETE", "/v1/kvcmas/workflows/wf-cancel")[0] == 200


def test_metrics_count_requests_and_ttft(server: ServerProcess) -> None:
    before = server.metrics()
    body = chat(server, [{"role": "user", "content": "Hi"}], max_tokens=4, kvcmas={"method": "nonshared"})
    after = server.metrics()
    key = 'kvcmas_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["kvcmas_ttft_seconds_count"] == before["kvcmas_ttft_seconds_count"] + 1
    generated = after["kvcmas_generated_tokens_total"] - before["kvcmas_generated_tokens_total"]
    assert generated == body["usage"]["completion_tokens"]
    assert after["kvcmas_prompt_tokens_total"] - before["kvcmas_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    # alone on the server: its prompt's chunks ran by themselves, then one decode pass per token after the first
    # (the last sampled token may be an end of generation that is not counted as generated)
    passes = {
        k: after[f'kvcmas_forward_passes_total{{kind="{k}"}}'] - before[f'kvcmas_forward_passes_total{{kind="{k}"}}']
        for k in ("prefill", "decode", "mixed")
    }
    assert passes["mixed"] == 0 and generated - 1 <= passes["decode"] <= generated, passes
    buckets = sorted(
        (float(k.split('le="')[1].split('"')[0]), v) for k, v in after.items() if k.startswith("kvcmas_ttft_seconds_b")
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == after["kvcmas_ttft_seconds_count"]
    assert after["kvcmas_kv_budget_bytes"] > 0 and after["kvcmas_kv_peak_bytes"] >= after["kvcmas_kv_bytes"]
    assert after["kvcmas_kv_allocated_bytes"] >= after["kvcmas_kv_bytes"]
    # idle, the server hands the finished request's free blocks back: the pool holds what is in use only
    deadline = time.monotonic() + 10
    while after["kvcmas_kv_allocated_bytes"] != after["kvcmas_kv_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = server.metrics()
    assert after["kvcmas_kv_allocated_bytes"] == after["kvcmas_kv_bytes"]
    assert after["kvcmas_kv_trimmed_bytes"] > 0


def _png(seed: int) -> bytes:
    """A small PNG of gradients (seed varies them)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.add.outer(np.arange(40), np.arange(60)) * (seed + 1)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([pixels, pixels[::-1], 255 - pixels], axis=-1)).save(buf, "PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_image_parts_become_image_embeddings(server: ServerProcess, engine: kc.Model, mmproj_path: str | None) -> None:
    if mmproj_path is None:
        pytest.skip("this kvcmas core has no vision encoder")
    from kvcmas_cpp.vision import VisionEncoder

    png = _png(0)
    url = _data_url(png)
    parts = [
        {"type": "text", "text": "Look: "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": " What is it?"},
    ]
    body = chat(server, [{"role": "user", "content": parts}], max_tokens=8)

    # The reference, as docs/vision.md builds it: text before the image, its embeddings, text after it.
    features = VisionEncoder(mmproj_path, n_threads=1).encode(png)
    before, after = engine.apply_chat_template([{"role": "user", "content": "Look: @IMG@ What is it?"}]).split("@IMG@")
    tok = engine.tokenizer
    prefix = tok.encode(before, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None:
        prefix = [tok.bos_id, *prefix]
    suffix = tok.encode(after, add_special=False, parse_special=True)
    with engine.new_sequence() as seq:
        seq.append(prefix, logits="none")
        seq.append_embeddings(features)
        want = engine.generate(suffix, max_tokens=8, temperature=0, sequence=seq)
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(prefix) + features.shape[0] + len(suffix)
    assert body["kvcmas"]["images"] == 1


def test_an_image_is_shared_across_agents(server: ServerProcess, mmproj_path: str | None) -> None:
    """Two agents read the same image (and text) in one workflow: through the sharing session, the second reuses the
    rows the first computed for it; the first agent's answer is exactly the nonshared one; the image is encoded
    once for all four requests."""
    if mmproj_path is None:
        pytest.skip("this kvcmas core has no vision encoder")
    from kvcmas_cpp.vision import VisionEncoder

    png = _png(3)  # an image no other test sends: nothing cached
    n_rows = VisionEncoder(mmproj_path, n_threads=1).encode(png).shape[0]
    question = [
        {"type": "text", "text": "Here is a picture: "},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "text", "text": " What do you see in it? Describe the colors."},
    ]
    encoded_before = server.metrics()["kvcmas_images_encoded_total"]
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for method in ("nonshared", "fullshared"):
        reply: list[dict[str, str]] = []
        for k, role in enumerate(ROLES[:2]):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": role},
                {"role": "user", "content": question},
            ]
            options = {"workflow": f"image-{method}", "agent": f"agent{k}", "method": method}
            out[method, k] = body = chat(server, messages + reply, max_tokens=8, kvcmas=options)
            assert body["kvcmas"]["method"] == method and body["kvcmas"]["images"] == 1
            reply = [{"role": "user", "content": body["choices"][0]["message"]["content"]}]
        server.request("DELETE", f"/v1/kvcmas/workflows/image-{method}")
    assert server.metrics()["kvcmas_images_encoded_total"] - encoded_before == 1
    first, plain_first = out["fullshared", 0], out["nonshared", 0]
    assert first["choices"][0]["message"]["content"] == plain_first["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens"] == plain_first["usage"]["prompt_tokens"] > n_rows
    second, plain_second = out["fullshared", 1], out["nonshared", 1]
    # the question span (text, the image's rows, text) comes from the first agent: all but its first few rows
    # (nonshared reuses only the agent's own cached system-prompt prefix)
    assert second["kvcmas"]["reused_tokens"] - plain_second["kvcmas"]["reused_tokens"] >= n_rows
    assert second["kvcmas"]["computed_tokens"] < plain_second["kvcmas"]["computed_tokens"] - n_rows
    assert second["usage"]["prompt_tokens"] == plain_second["usage"]["prompt_tokens"]


# --------------------------------------------------------------------------------------------------- bad input
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMAGE_HTTP = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
IMAGE_BAD_B64 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("empty messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("no messages", {"max_tokens": 2}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("temperature a string", {**GOOD, "temperature": "hot"}, "temperature"),
    ("temperature negative", {**GOOD, "temperature": -1}, "temperature"),
    ("top_p zero", {**GOOD, "top_p": 0}, "top_p"),
    ("max_tokens zero", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("max_tokens a float", {**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ("stream a string", {**GOOD, "stream": "yes"}, "stream"),
    ("n too many", {**GOOD, "n": 99}, "n"),
    ("seed negative", {**GOOD, "seed": -3}, "seed"),
    ("stop empty", {**GOOD, "stop": [""]}, "stop"),
    ("stop too many", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("unknown method", {**GOOD, "kvcmas": {"method": "magic"}}, "kvcmas.method"),
    ("unknown model", {**GOOD, "model": "gpt-9"}, "model"),
    ("too many tokens", {**GOOD, "max_tokens": 1_000_000}, "max_tokens"),
    ("image: not a data URL", {"messages": [{"role": "user", "content": [IMAGE_HTTP]}]}, None),
    ("image: not base64", {"messages": [{"role": "user", "content": [IMAGE_BAD_B64]}]}, None),
    ("image: not an image", {"messages": [{"role": "user", "content": [IMAGE_PART]}]}, None),
    ("body is a list", [GOOD], None),
]


@pytest.mark.parametrize("name,body,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_chat_requests_get_400_with_an_openai_error(
    server: ServerProcess, name: str, body: Any, param: str | None
) -> None:
    status, _, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 400, (name, out)
    err = out["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


def test_malformed_and_oversized_inputs(server: ServerProcess, engine: kc.Model) -> None:
    for raw in (b'{"messages": [', b"not json at all", b"", b"\xff\xfe"):
        status, _, out = server.request("POST", "/v1/chat/completions", raw=raw)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (raw, out)
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 lone surrogate"}]}),
        ("/v1/completions", {"prompt": "\udfff"}),
    ):
        raw = json.dumps(body).encode()  # json escapes the surrogate as \ud800: valid JSON, invalid text
        status, _, out = server.request("POST", path, raw=raw)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (path, out)
    long_text = "word " * (engine.n_ctx + 10)
    status, _, out = server.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}
    )
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    for body in ({"prompt": [engine.n_vocab + 5]}, {"prompt": ""}, {"prompt": 5}, {"prompt": ["a", "b"]}):
        status, _, out = server.request("POST", "/v1/completions", body)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (body, out)
    status, _, out = server.request("GET", "/v1/nothing-here")
    assert status == 404 and "error" in out
    status, _, out = server.request("GET", "/v1/chat/completions")
    assert status == 405 and "error" in out
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).models.retrieve("gpt-9")
    assert server.request("GET", "/health")[0] == 200  # still alive


# ----------------------------------------------------------------------------- key, KV budget, queue and 429
@pytest.fixture(scope="module")
def small_server(model_path: str) -> Iterator[ServerProcess]:
    # Room for one request of ~40 prompt + 48 new tokens at a time: others wait; beyond 2 waiting, 429.
    srv = ServerProcess(
        model_path,
        "--method",
        "nonshared",
        "--api-key",
        "sekrit",
        "--kv-budget",
        str(7 * BLOCK_BYTES),
        "--parallel",
        "4",
        "--max-queue",
        "2",
    )
    yield srv
    srv.stop()


AUTH = {"Authorization": "Bearer sekrit"}


def test_api_key_is_required(small_server: ServerProcess) -> None:
    assert small_server.request("GET", "/health")[0] == 200
    image = {"messages": [{"role": "user", "content": [IMAGE_PART]}]}  # no --mmproj: images are refused
    status, _, out = small_server.request("POST", "/v1/chat/completions", image, headers=AUTH)
    assert status == 400 and "--mmproj" in out["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        status, _, out = small_server.request("POST", "/v1/chat/completions", GOOD, headers=headers)
        assert status == 401 and out["error"]["type"] == "authentication_error", out
        assert small_server.request("GET", "/v1/models", headers=headers)[0] == 401
    bad = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="sekrit", max_retries=0)
    assert good.models.list().data


def test_tiny_kv_budget_queues_then_refuses_with_429(small_server: ServerProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a brave knight and a dragon."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    status, _, alone = small_server.request("POST", "/v1/chat/completions", body, headers=AUTH)
    assert status == 200, alone
    status, _, out = small_server.request("POST", "/v1/chat/completions", {**body, "max_tokens": 400}, headers=AUTH)
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"  # can never fit the budget

    n = 6
    start = threading.Barrier(n)

    def send(_: int) -> tuple[int, dict[str, str], Any]:
        start.wait()
        return small_server.request("POST", "/v1/chat/completions", body, headers=AUTH)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(send, range(n)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == n
    assert refused, "a queue of 2 with room for one running request must refuse some of 6 simultaneous requests"
    # The first request takes one of the 2 queue places until the engine thread admits it, so 2 or 3 get in
    # depending on when it does; at least the 2 that arrive first always do.
    assert len(ok) >= 2
    for _, headers, out in refused:
        assert int(headers["retry-after"]) >= 1
        assert out["error"]["type"] == "rate_limit_error"
    for _, _, out in ok:  # the queued ones ran later, one at a time, and are complete
        assert out["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    queued = [out["timings"]["queue_ms"] for _, _, out in ok]
    assert max(queued) > out["timings"]["predicted_ms"] * 0.5  # someone waited for memory behind a running one
    m = small_server.metrics()
    assert m["kvcmas_rejected_total"] == len(refused)
    assert m["kvcmas_kv_peak_bytes"] <= 7 * BLOCK_BYTES
    assert m["kvcmas_active_requests"] == 0
    # What is left is the default session's and the prefix cache's (the prompt's template prefix, kept for later
    # requests): ending the session frees every KV block but the cache entries' own.
    assert small_server.request("DELETE", "/v1/kvcmas/workflows/default", headers=AUTH)[0] == 200

    def beyond_cache() -> float:
        m = small_server.metrics()
        cache_blocks = math.ceil(m["kvcmas_prefix_cache_tokens"] / 32) + m["kvcmas_prefix_cache_entries"]
        return m["kvcmas_kv_bytes"] - cache_blocks * BLOCK_BYTES

    deadline = time.monotonic() + 10
    while beyond_cache() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert beyond_cache() <= 0


def test_tiny_kv_budget_evicts_stored_spans(small_server: ServerProcess) -> None:
    """A sharing workflow under a budget of 7 blocks: stored spans and prefix caches are evicted (least recently
    used first) to admit each hop; every hop still completes, and memory never exceeds the budget."""
    before = small_server.metrics()
    hops = run_workflow(small_server, "wf-tiny", "fullshared", max_tokens=16, headers=AUTH)
    assert all(h["choices"][0]["finish_reason"] in ("stop", "length") for h in hops)
    assert all(h["kvcmas"]["method"] == "fullshared" for h in hops) or hops[0]["kvcmas"]["method"] == "nonshared"
    m = small_server.metrics()
    assert m["kvcmas_kv_peak_bytes"] <= 7 * BLOCK_BYTES
    if hops[0]["kvcmas"]["method"] == "fullshared":
        assert m["kvcmas_evictions_total"] > before["kvcmas_evictions_total"]


def test_prefix_cache_evictions_count_in_kvcmas_evictions_total(small_server: ServerProcess) -> None:
    """The prefix cache evicts on its own once its entries pass a quarter of the KV budget (here 56 rows); those
    evictions (and the ones the scheduler asks of it) were never exported. Two plain completions of 40-odd prompt
    rows each: the second evicts the first (nothing else runs, the budget has room for both requests)."""
    before = small_server.metrics()
    prompts = [f"Story {i}: " + ROLES[i] + " " + TASK[:120] for i in range(2)]
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        status, _, out = small_server.request("POST", "/v1/completions", body, headers=AUTH)
        assert status == 200 and out["usage"]["prompt_tokens"] > 28, out
    after = small_server.metrics()
    dropped = before["kvcmas_prefix_cache_entries"] + len(prompts) - after["kvcmas_prefix_cache_entries"]
    assert dropped >= 1, (before, after)
    assert after["kvcmas_evictions_total"] - before["kvcmas_evictions_total"] >= dropped


def test_a_kv_refusal_states_what_the_request_needs(small_server: ServerProcess) -> None:
    """n = 16 choices of 20 tokens never fit 7 blocks: the refusal named only the first choice's need (less than
    what it said was free), not the other 15 choices' reservations that admission counts."""
    import re

    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 20, "n": 16}
    status, _, out = small_server.request("POST", "/v1/chat/completions", body, headers=AUTH)
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    said = re.fullmatch(
        r"the request needs (\d+) bytes of KV memory \(16 choices\) but only (\d+) of the budget \((\d+)\) are free",
        out["error"]["message"],
    )
    assert said is not None, out
    need, free, budget = map(int, said.groups())
    choice = 2 * BLOCK_BYTES  # 20 tokens: one block and the spare one
    assert budget == 7 * BLOCK_BYTES and need > free and need >= 16 * choice
