"""kvcmas-server's scheduler in-process: chunked prefill computes what a one-piece prefill computes (logits and KV
rows, bit for bit, plain prompts, image embeddings and agent sessions alike), the shortest prompt is prefilled first
even when a long one is half done, generating jobs keep decoding during a long prefill, and an idle scheduler hands
free KV blocks back.

References: the same prompt appended in one piece in a fresh sequence, and greedy generation by Model.generate.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.plan import MIN_CHUNK_ROWS, ChunkExecutor, chunk_bounds
from kvcmas_cpp.sampling import SamplingParams
from kvcmas_cpp.server.backend import prefill_segments
from kvcmas_cpp.server.metrics import Metrics
from kvcmas_cpp.server.scheduler import (
    PREFILL_AGING_ROWS_PER_S,
    Delta,
    Done,
    Event,
    Failed,
    Job,
    Namespace,
    Scheduler,
    SessionKey,
    prefill_rank,
)

TEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Weng earns $12 an hour for babysitting. Yesterday, she just did "
    "50 minutes of babysitting. How much did she earn? Betty is saving money for a new wallet which costs $100. "
)


def _one_piece(model: kc.Model, segments: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Logits after the prompt and its K, V rows, the prompt appended one segment at a time."""
    with model.new_sequence() as seq:
        logits = None
        for i, seg in enumerate(segments):
            last = i == len(segments) - 1
            if isinstance(seg, np.ndarray):
                logits = seq.append_embeddings(seg, logits=last)
            else:
                logits = seq.append(seg, logits="last" if last else "none")
        k, v = seq.kv()
        assert logits is not None
        return logits, k, v


class CountingExecutor(ChunkExecutor):
    """Appends each chunk by itself (ChunkExecutor) and records the chunks' lengths."""

    def __init__(self) -> None:
        self.chunks: list[int] = []

    def append(self, seq: kc.KVSequence, chunk: Any, logits: Any) -> np.ndarray | None:
        self.chunks.append(len(chunk))
        return super().append(seq, chunk, logits)


def test_chunk_bounds_cover_the_append_without_small_chunks() -> None:
    for n in (1, 15, 16, 17, 100, 128, 129, 140, 144, 1000):
        for chunk in (1, 16, 50, 128):
            bounds = chunk_bounds(n, chunk)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a < b and (i == 0 or bounds[i - 1][1] == a) for i, (a, b) in enumerate(bounds))
            # no chunk in the engine's decode-kernel range, unless the append is that short
            assert all(b - a >= MIN_CHUNK_ROWS for a, b in bounds) or bounds == [(0, n)]
            assert all(b - a < max(chunk, MIN_CHUNK_ROWS) * 2 for a, b in bounds)


def test_chunked_prefill_equals_one_piece(model: kc.Model) -> None:
    ids = model.tokenize(TEXT)
    rng = np.random.default_rng(0)
    image = (rng.standard_normal((21, model.n_embd)) * 0.02).astype(np.float32)  # stands in for an image's rows
    for segments in ([ids], [ids[:40], image, ids[40:]]):
        want_logits, want_k, want_v = _one_piece(model, segments)
        executor = CountingExecutor()
        p = prefill_segments(model, segments, executor, chunk_tokens=16)
        try:
            k, v = p.seq.kv()
            assert np.array_equal(p.logits, want_logits)
            assert np.array_equal(k, want_k) and np.array_equal(v, want_v)
            want_chunks = [b - a for s in segments for a, b in chunk_bounds(len(s), 16)]
            assert executor.chunks == want_chunks  # every row went through the executor, in chunk_bounds' chunks
            assert p.stats["prompt_tokens"] == sum(len(s) for s in segments)
        finally:
            p.close()


@pytest.mark.parametrize("method", ["nonshared", "fullshared"])
def test_chunked_session_prefill_equals_one_piece(model: kc.Model, method: str) -> None:
    """An agent session's hops (the first computes everything, a later one reuses spans and computes the rest) give
    the same logits and rows whether their appends run in chunks or in one piece."""
    roles = ["You are a planner.", "You are a solver."]
    executor = CountingExecutor()
    with AgentSession(model, method=method) as whole, AgentSession(model, method=method) as chunked:
        reply: list[str] = []
        for hop, role in enumerate(roles):
            messages = [{"role": "system", "content": role}, {"role": "user", "content": TEXT}]
            messages += [{"role": "user", "content": r} for r in reply]
            a = whole.prefill(messages, agent=f"agent{hop}")
            b = chunked.prefill(messages, agent=f"agent{hop}", chunks=executor, chunk_tokens=8)
            try:
                assert a.hop.mode == b.hop.mode
                assert np.array_equal(a.logits, b.logits)
                ka, va = a.seq.kv()
                kb, vb = b.seq.kv()
                assert np.array_equal(ka, kb) and np.array_equal(va, vb)
                out = _greedy(model, a.seq, a.logits, 6)
                for t in out[:-1]:  # the same decode steps (one row per call) as in _greedy
                    model.decode_batch([(b.seq, [t])])
                whole.finish(a, out)
                chunked.finish(b, out)
                reply.append(model.detokenize(out))
            finally:
                a.close()
                b.close()
        assert len(executor.chunks) > 1  # the first hop's prompt (> 8 rows) ran in chunks
        if method == "fullshared":
            assert chunked.reusable_tokens(messages) > 0


def _greedy(model: kc.Model, seq: kc.KVSequence, logits: np.ndarray, n: int) -> list[int]:
    out = [int(np.argmax(logits))]
    while len(out) < n:
        out.append(int(np.argmax(model.decode_batch([(seq, [out[-1]])])[0])))
    return out


def test_a_reply_sent_back_as_text_is_its_span(model: kc.Model) -> None:
    """A client sends an agent's reply back as text. When the generated tokens are not the text's canonical
    tokenization, the session still recognises the reply by its text and reuses its rows."""
    tok = model.tokenizer
    out = [*tok.encode("They sold 48", False), *tok.encode(" cl", False), *tok.encode("ips in April.", False)]
    text = model.detokenize(out)
    assert tok.encode(text, False) != out  # the precondition: re-tokenizing the text gives other ids
    with AgentSession(model, method="fullshared") as team:
        first = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": TEXT}]
        p = team.prefill(first, agent="planner")
        team.finish(p, out)
        p.close()
        second = [{"role": "system", "content": "You are a checker."}, {"role": "user", "content": TEXT}]
        second.append({"role": "user", "content": text})
        assert team.reusable_tokens(second) >= len(out)
        q = team.prefill(second, agent="checker")
        try:
            assert q.hop.mode == "reuse"
            assert "agent_0_current" in q.pos_map and q.pos_map["agent_0_current"][1] == len(out)
            assert [it.ph for it in team._items].count("agent_0_current") == 1 and len(team._items) == 2
        finally:
            q.close()


class Recorder:
    """A job's events in arrival order, with a global sequence number to compare jobs."""

    counter = 0
    lock = threading.Lock()

    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        with Recorder.lock:
            Recorder.counter += 1
            self.events.append((Recorder.counter, event))
        if isinstance(event, (Done, Failed)):
            self.done.set()

    def first(self) -> int:
        return next(n for n, e in self.events if isinstance(e, Delta))

    def text(self) -> str:
        return "".join(e.text for _, e in self.events if isinstance(e, Delta))

    def tokens(self) -> list[int]:
        return [e.token for _, e in self.events if isinstance(e, Delta) and e.token is not None]


def _job(name: str, ids: list[int], max_tokens: int) -> tuple[Job, Recorder]:
    rec = Recorder()
    return Job(name, ids, max_tokens, SamplingParams(temperature=0.0), [], rec), rec


def test_shortest_prefill_first_and_decoding_goes_on(model: kc.Model) -> None:
    """A long prompt is being prefilled in chunks; a short prompt that arrives meanwhile gets its first token before
    the long one, and a job that was already generating keeps getting tokens. Every output equals greedy
    generation of its prompt alone."""
    long_ids = model.tokenize(TEXT * 5)
    short_ids = model.tokenize("Say hello.")
    gen_ids = model.tokenize("Count from one to ten:")
    sched = Scheduler(model, "nonshared", 4, 1 << 30, 8, Metrics(), prefill_chunk=16)
    try:
        gen_job, gen = _job("generating", gen_ids, 40)
        sched.submit(gen_job)
        while not gen.events:
            time.sleep(0.005)
        long_job, long = _job("long", long_ids, 4)
        sched.submit(long_job)
        deadline = time.monotonic() + 60
        while not long_job.prefilling and time.monotonic() < deadline:
            time.sleep(0.001)
        assert long_job.prefilling, "the long prefill never started"
        short_job, short = _job("short", short_ids, 4)
        sched.submit(short_job)
        for rec in (gen, long, short):
            assert rec.done.wait(120)
        assert short.first() < long.first()  # overtook the long prefill that was already running
        # the generating job got tokens while the long prompt was being prefilled
        during = [n for n, e in gen.events if isinstance(e, Delta) and n < long.first()]
        assert len(during) > 1
        done = [e for _, e in long.events if isinstance(e, Done)][0]
        assert done.stats["interleaved_ms"] > 0 and done.stats["engine_ms"] > 0
        for ids, rec, n in ((long_ids, long, 4), (short_ids, short, 4), (gen_ids, gen, 40)):
            want = model.generate(ids, max_tokens=n, temperature=0)
            assert rec.text() == want.text
    finally:
        sched.stop()


def test_prefill_order_is_shortest_first_without_starving_long_prompts() -> None:
    now = 1000.0
    fresh_short, fresh_long, old_long = (_job(name, [1], 1)[0] for name in ("short", "long", "old"))
    fresh_short.remaining, fresh_long.remaining, old_long.remaining = 40, 500, 500
    fresh_short.t_arrival = fresh_long.t_arrival = now
    assert prefill_rank(fresh_short, now) < prefill_rank(fresh_long, now)
    # a long prompt that has waited long enough goes before a fresh short one
    old_long.t_arrival = now - (500 - 40) / PREFILL_AGING_ROWS_PER_S - 0.5
    assert prefill_rank(old_long, now) < prefill_rank(fresh_short, now)
    # the same rows left: the one that has waited longer first
    assert prefill_rank(old_long, now) < prefill_rank(fresh_long, now)


def test_idle_scheduler_trims_free_kv_blocks(model: kc.Model) -> None:
    if not hasattr(model, "kv_trim"):
        pytest.skip("this kvcmas core cannot trim its KV pool")
    sched = Scheduler(model, "nonshared", 2, 1 << 30, 8, Metrics())
    try:
        job, rec = _job("one", model.tokenize(TEXT), 8)
        sched.submit(job)
        assert rec.done.wait(60)
        deadline = time.monotonic() + 10
        while sched.trimmed_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sched.trimmed_bytes > 0  # the finished job's blocks went back to the system
        assert model.kv_bytes_allocated == model.kv_bytes_in_use
    finally:
        sched.stop()


def _beside(sched: Scheduler, generating: list[list[int]], n: int, late: Job) -> list[Recorder]:
    """Jobs with these prompts generate (n tokens each, greedy) on sched; once each has its first token, `late` is
    submitted; returns when all are done, with the generating jobs' recorders."""
    gens = [_job(f"gen{i}", ids, n) for i, ids in enumerate(generating)]
    for job, _ in gens:
        sched.submit(job)
    while not all(rec.events for _, rec in gens):
        time.sleep(0.002)
    sched.submit(late)
    for rec in (late.sink, *(r for _, r in gens)):
        assert isinstance(rec, Recorder) and rec.done.wait(120)
    return [r for _, r in gens]


def test_a_decode_row_in_a_prefill_batch_matches_it_alone(model: kc.Model) -> None:
    """What a mixed step computes: a prompt chunk and another sequence's decode token in one forward pass. The
    chunk's logits are bit for bit those of the chunk alone; the decode row runs with the chunk's (prefill) kernels,
    so it may differ from a decode step alone in the last bits: the same greedy token, logits within 1e-2."""
    ids = model.tokenize(TEXT * 2)
    with model.new_sequence() as gen, model.new_sequence() as long:
        gen.append(ids[:40], logits="none")
        long.append(ids[:30], logits="none")
        chunk = ids[60:188]
        with gen.fork() as g, long.fork() as lg:
            alone = model.decode_batch([(g, [ids[40]])])[0]
            chunk_alone = lg.append(chunk, logits="last")
        with gen.fork() as g, long.fork() as lg:
            want = np.zeros(len(chunk) + 1, dtype=np.uint8)
            want[-2:] = 1
            rows = model._decode([lg.id] * len(chunk) + [g.id], [*chunk, ids[40]], want)
        assert np.array_equal(rows[0], chunk_alone)
        assert int(np.argmax(rows[1])) == int(np.argmax(alone))
        assert float(np.abs(rows[1] - alone).max()) < 1e-2


def test_prompt_chunks_and_decode_tokens_share_forward_passes(model: kc.Model) -> None:
    """Two jobs generate while a long prompt is prefilled in chunks: each chunk runs in the same engine call as the
    generating jobs' next tokens (fewer engine calls than chunks plus decode steps), the forward-pass counters say
    so truly, and every output equals greedy generation of its prompt alone."""
    long_ids = model.tokenize(TEXT * 5)
    gen_prompts = [model.tokenize("Count from one to ten:"), model.tokenize("List the days of the week:")]
    chunk = 32
    metrics = Metrics()
    sched = Scheduler(model, "nonshared", 4, 1 << 30, 8, metrics, prefill_chunk=chunk)
    calls: list[tuple[int, int]] = []  # per engine call: rows, distinct sequences
    real = model._decode

    def counting(seqs: Any, tokens: Any, want: Any) -> np.ndarray:  # the real engine call, recorded
        calls.append((len(seqs), len(set(seqs))))
        return real(seqs, tokens, want)

    model._decode = counting  # type: ignore[method-assign]
    long_job, long = _job("long", long_ids, 4)
    try:
        gens = _beside(sched, gen_prompts, 40, long_job)
    finally:
        del model._decode
        sched.stop()
    passes = metrics.forward_passes
    assert len(calls) == sum(passes.values())  # the counters count every engine call the scheduler made
    # prompt chunks (several rows of one sequence) that ran with decode rows of other sequences: the long prompt's
    # chunks while the others were generating
    mixed = [c for c in calls if c[0] > c[1] > 1]
    assert passes["mixed"] == len(mixed) >= len(chunk_bounds(len(long_ids), chunk)) // 2
    n_chunks = sum(len(chunk_bounds(len(ids), chunk)) for ids in (long_ids, *gen_prompts))
    decode_rows = sum(len(r.tokens()) - 1 for r in (*gens, long))
    assert passes["prefill"] + passes["mixed"] == n_chunks
    assert len(calls) < n_chunks + passes["decode"] + passes["mixed"]  # separate passes would need this many
    assert sum(c[0] for c in calls) == sum(len(ids) for ids in (long_ids, *gen_prompts)) + decode_rows
    for ids, rec, n in ((long_ids, long, 4), *((ids, r, 40) for ids, r in zip(gen_prompts, gens, strict=True))):
        assert rec.text() == model.generate(ids, max_tokens=n, temperature=0).text


def _session_run(model: kc.Model, generating: list[list[int]]) -> tuple[list[int], list[list[int]], dict[str, int]]:
    """A sharing session's long prompt (fullshared, its first hop: every row computed through the session's chunked
    sequence) prefilled while jobs with these prompts generate, on a fresh scheduler: the session job's tokens, the
    generating jobs' tokens and the forward passes by kind."""
    messages = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": TEXT * 4}]
    ids = model.tokenize(model.apply_chat_template(messages))
    metrics = Metrics()
    sched = Scheduler(model, "fullshared", 4, 1 << 30, 8, metrics, prefill_chunk=32)
    rec = Recorder()
    key = SessionKey(Namespace("tenant"), "wf", "fullshared")
    hop = Job("hop", ids, 6, SamplingParams(temperature=0.0), [], rec, messages=messages, session_key=key)
    try:
        gens = _beside(sched, generating, 30, hop)
        assert not any(isinstance(e, Failed) for _, e in rec.events)
        return rec.tokens(), [r.tokens() for r in gens], dict(metrics.forward_passes)
    finally:
        sched.stop()


def test_a_session_prefill_runs_in_mixed_steps_with_the_same_output(model: kc.Model) -> None:
    """The sharing methods' chunked appends (AgentSession's chunked sequence) run in mixed steps too: a session's
    prompt prefilled while two jobs generate gives the same greedy tokens as that prompt alone on the server, and so
    do the generating jobs (as Model.generate)."""
    generating = [model.tokenize("Count from one to ten:"), model.tokenize("List the days of the week:")]
    alone, _, passes_alone = _session_run(model, [])
    assert passes_alone["mixed"] == 0
    mixed, gen_tokens, passes = _session_run(model, generating)
    assert passes["mixed"] >= 4  # the session prompt's chunks (about 10 of 32 rows) ran with decode rows
    assert mixed == alone
    for ids, got in zip(generating, gen_tokens, strict=True):
        assert model.detokenize(got) == model.generate(ids, max_tokens=30, temperature=0).text


def _session_job(name: str, model: kc.Model, messages: list[dict[str, Any]], key: SessionKey) -> tuple[Job, Recorder]:
    rec = Recorder()
    ids = model.tokenize(model.apply_chat_template(messages))
    return Job(name, ids, 4, SamplingParams(temperature=0.0), [], rec, messages=messages, session_key=key), rec


def _alone(model: kc.Model, *hops: tuple[list[dict[str, Any]], SessionKey]) -> list[str]:
    """Each hop's greedy text on a fresh scheduler, the hops one after the other."""
    sched = Scheduler(model, "fullshared", 4, 1 << 30, 8, Metrics(), prefill_chunk=16)
    try:
        texts = []
        for i, (messages, key) in enumerate(hops):
            job, rec = _session_job(f"alone{i}", model, messages, key)
            sched.submit(job)
            assert rec.done.wait(120)
            texts.append(rec.text())
        return texts
    finally:
        sched.stop()


def test_session_prefills_take_turns_as_plans_without_nesting(model: kc.Model) -> None:
    """Two sharing sessions of one tenant (one shared estimator): a long prompt's prefill is in flight when a short
    one arrives. The short one takes its steps between the long one's chunks and gets its first token first, no
    prefill step ever runs inside another (the scheduler drives each prefill's plan a chunk per turn), and each
    output equals its prompt's alone."""
    tenant = Namespace("tenant")
    long_msgs = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": TEXT * 5}]
    short_msgs = [{"role": "system", "content": "You are a checker."}, {"role": "user", "content": "Say hello."}]
    long_key, short_key = SessionKey(tenant, "wf-long", "fullshared"), SessionKey(tenant, "wf-short", "fullshared")
    want = _alone(model, (long_msgs, long_key), (short_msgs, short_key))
    sched = Scheduler(model, "fullshared", 4, 1 << 30, 8, Metrics(), prefill_chunk=16)
    order: list[str] = []
    depth = [0, 0]  # now, most
    real = sched._prefill_step

    def tracked(job: Job) -> None:  # the real step, its nesting and its job recorded
        depth[0] += 1
        depth[1] = max(depth)
        order.append(job.id)
        try:
            real(job)
        finally:
            depth[0] -= 1

    sched._prefill_step = tracked  # type: ignore[method-assign]
    try:
        long_job, long = _session_job("long", model, long_msgs, long_key)
        sched.submit(long_job)
        deadline = time.monotonic() + 60
        while long_job.chunks_run < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert long_job.chunks_run >= 2, "the long prefill never got going"
        short_job, short = _session_job("short", model, short_msgs, short_key)
        sched.submit(short_job)
        assert long.done.wait(120) and short.done.wait(120)
    finally:
        sched.stop()
    assert depth[1] == 1
    first_short, last_short = order.index("short"), len(order) - 1 - order[::-1].index("short")
    assert "long" in order[:first_short] and "long" in order[last_short + 1 :]  # the short one ran while in flight
    assert short.first() < long.first()
    assert [long.text(), short.text()] == want


def test_a_cancelled_session_prefill_frees_its_rows_and_its_session(model: kc.Model) -> None:
    """A client goes away while its sharing session's prompt is half prefilled: the scheduler closes that prefill's
    plan, so the KV it had allocated is freed at once, the session's lock is free, and the same prompt sent again
    gives the output it gives on a scheduler that never saw the cancelled one."""
    key = SessionKey(Namespace("tenant"), "wf", "fullshared")
    first = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": "Say hello."}]
    second = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": TEXT * 5}]
    want = _alone(model, (first, key), (second, key))
    sched = Scheduler(model, "fullshared", 4, 1 << 30, 8, Metrics(), prefill_chunk=16)
    try:
        job, rec = _session_job("first", model, first, key)
        sched.submit(job)
        assert rec.done.wait(120)
        before = model.kv_bytes_in_use
        job, rec = _session_job("cancelled", model, second, key)
        sched.submit(job)
        deadline = time.monotonic() + 60
        while job.chunks_run < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.chunks_run >= 3 and job.prefilled is None, "the prefill was not caught in flight"
        sched.cancel(job)
        while job.session is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert job.session is None and job.plan is None
        assert job.remaining > 0  # it stopped part-way
        assert model.kv_bytes_in_use == before
        session = sched.sessions.by_key[key].backend.session  # type: ignore[attr-defined]
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(session.reusable_tokens(second)))
        reader.start()
        reader.join(30)
        assert got, "the session's lock is still held by the cancelled prefill"
        job, rec = _session_job("again", model, second, key)
        sched.submit(job)
        assert rec.done.wait(120)
        assert [e for _, e in rec.events if isinstance(e, Failed)] == []
    finally:
        sched.stop()
    assert rec.text() == want[1]


def test_a_refused_chunk_fails_its_session_prefill_and_frees_what_it_held(
    model: kc.Model, default_model_path: Path
) -> None:
    """The engine runs out of KV memory in the middle of a sharing session's prefill (its KV budget is smaller than
    the scheduler's): the refused chunk is thrown into the prefill's plan, which frees the rows it had computed; the
    request fails with 503 and the session serves the next prompt as a scheduler that never saw the failure does."""
    key = SessionKey(Namespace("tenant"), "wf", "fullshared")
    first = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": "Say hello."}]
    long = [{"role": "system", "content": "You are a planner."}, {"role": "user", "content": TEXT * 5}]
    again = [*first, {"role": "user", "content": "Now say goodbye."}]
    want = _alone(model, (first, key), (again, key))
    small = kc.Model(str(default_model_path), n_threads=2, kv_budget=300 * model.kv_row_bytes)
    sched = Scheduler(small, "fullshared", 4, 1 << 30, 8, Metrics(), prefill_chunk=16)
    try:
        job, rec = _session_job("first", small, first, key)
        sched.submit(job)
        assert rec.done.wait(120) and rec.text() == want[0]
        before = small.kv_bytes_in_use
        job, rec = _session_job("long", small, long, key)
        sched.submit(job)
        assert rec.done.wait(120)
        failed = [e for _, e in rec.events if isinstance(e, Failed)]
        assert failed and failed[0].status == 503, rec.events
        assert job.chunks_run > 2  # it was refused part-way, after chunks that fitted
        assert small.kv_bytes_in_use == before
        job, rec = _session_job("again", small, again, key)
        sched.submit(job)
        assert rec.done.wait(120)
        assert rec.text() == want[1]
    finally:
        sched.stop()
