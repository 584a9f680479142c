"""Prefill plans (kvcmas_cpp.plan): a prompt's computation as a generator of appends that its driver runs.

Real engine, real sessions. References: the same prompts run one after the other with AgentSession.prefill (a plan
driven to its end), and the engine's own memory counter for what a closed plan leaves behind.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.plan import Append, ChunkExecutor, Plan, chunk_bounds, run_plan
from kvcmas_cpp.server.backend import plan_segments

CONTEXT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Weng earns $12 an hour for babysitting. Yesterday, she just did "
    "50 minutes of babysitting. How much did she earn? "
)
REPLY = "In April she sold 48 clips and in May half as many, 24, so 72 clips in all."


def _hop(role: str, *contents: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": role}, *({"role": "user", "content": c} for c in contents)]


def _team(model: kc.Model, workflow: str) -> AgentSession:
    """A fullshared session whose first agent has read the context and replied: a later agent's prompt reuses both
    spans and computes the rest."""
    team = AgentSession(model, "fullshared", workflow=workflow)
    with team.prefill(_hop("You are a planner.", CONTEXT)) as p:
        team.finish(p, model.tokenize(REPLY))
    return team


def test_run_plan_chunks_each_append_and_throws_its_error_into_the_plan(model: kc.Model) -> None:
    """run_plan runs each append in chunk_bounds' chunks, sends the plan the last chunk's logits (those of a
    one-piece append), and throws a failed append's error into the plan at its yield, where the plan may go on."""
    ids = model.tokenize(CONTEXT)
    chunks: list[int] = []

    class Counting(ChunkExecutor):
        def append(self, seq: kc.KVSequence, chunk: Any, logits: Any) -> np.ndarray | None:
            chunks.append(len(chunk))
            return super().append(seq, chunk, logits)

    def plan(seq: kc.KVSequence) -> Plan[tuple[np.ndarray | None, str]]:
        try:
            yield Append(seq, [model.n_vocab + 5], "none")  # the engine refuses an id outside the vocabulary
        except Exception as e:
            caught = type(e).__name__
        else:
            caught = "nothing"
        logits = yield Append(seq, ids, "last")
        return logits, caught

    with model.new_sequence() as seq, model.new_sequence() as ref:
        logits, caught = run_plan(plan(seq), Counting(), chunk_tokens=20)
        want = ref.append(ids, logits="last")
        assert caught != "nothing"
        assert chunks[-len(chunk_bounds(len(ids), 20)) :] == [b - a for a, b in chunk_bounds(len(ids), 20)]
        assert logits is not None and np.array_equal(logits, want)
        assert seq.tokens == ids


def test_session_plans_interleaved_on_one_thread_equal_running_them_in_turn(model: kc.Model) -> None:
    """Two sessions of one workflow kind (one shared estimator) and a plain prompt: their plans advanced append by
    append in turn on one thread, as a server's scheduler does, give bit for bit the logits and rows each gives
    run alone."""
    later = _hop("You are a checker.", CONTEXT, REPLY, "Check the planner's answer.")
    plain_ids = model.tokenize(CONTEXT * 2)
    with _team(model, "w") as ref, ref.prefill(later) as p:
        want_logits, want_k = p.logits.copy(), p.seq.kv()[0].copy()
        assert p.hop.mode == "reuse"
    with model.new_sequence() as s:
        want_plain = s.append(plain_ids, logits="last")
    with _team(model, "w") as one, _team(model, "w") as two:
        plans: list[Plan[Any]] = [
            one.prefill_plan(later),
            two.prefill_plan(later),
            plan_segments(model, [plain_ids]),
        ]
        sent: list[Any] = [None] * len(plans)
        results: list[Any] = [None] * len(plans)
        steps = 0
        while any(r is None for r in results):
            for i, plan in enumerate(plans):
                if results[i] is not None:
                    continue
                try:
                    step = plan.send(sent[i])
                except StopIteration as done:
                    results[i] = done.value
                    continue
                steps += 1
                bounds = chunk_bounds(len(step.rows), 16)
                for k, (a, b) in enumerate(bounds):  # this append in chunks of 16 rows
                    out = ChunkExecutor().append(
                        step.seq, step.rows[a:b], step.logits if k == len(bounds) - 1 else "none"
                    )
                sent[i] = out
        try:
            assert steps >= 3
            for p in results[:2]:
                assert p.hop.mode == "reuse"
                assert np.array_equal(p.logits, want_logits)
                assert np.array_equal(p.seq.kv()[0], want_k)
            assert np.array_equal(results[2].logits, want_plain)
        finally:
            for r in results:
                r.close()


def test_a_plan_closed_part_way_frees_its_rows_and_its_session(model: kc.Model) -> None:
    """A session's plan closed after its first append (a client gone in the middle of its prefill): the KV it had
    allocated is freed, the session's lock is free for another thread, and the same prompt prefilled next gives the
    logits a session that never saw the closed plan gives."""
    later = _hop("You are a checker.", CONTEXT, REPLY, CONTEXT + " Check every number.")
    with _team(model, "closed") as ref, ref.prefill(later) as p:
        want = p.logits.copy()
    with _team(model, "closed") as team:
        with team.prefill(later) as p:  # the agent's prefix is in the prefix cache from here on
            pass
        before = model.kv_bytes_in_use
        plan = team.prefill_plan(later)
        step = plan.send(None)
        ChunkExecutor().append(step.seq, step.rows, step.logits)
        assert model.kv_bytes_in_use > before
        plan.close()
        assert model.kv_bytes_in_use == before
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(team.reusable_tokens(later)))
        reader.start()
        reader.join(30)
        assert got and got[0] > 0, "the session's lock was still held by the closed plan"
        with team.prefill(later) as p:
            assert np.array_equal(p.logits, want)


@pytest.mark.parametrize("recompute", [0.0, 0.5])
def test_a_reusing_hop_computes_all_its_rows_in_one_append(model: kc.Model, recompute: float) -> None:
    """A later agent's rows between the spans it reuses (heads, template text, recomputed rows) are reserved in place
    and computed in one append at the end: its plan yields one Append to its sequence holding every computed row, so
    a scheduler runs them in as few passes as its chunk size allows, not one or more per span."""
    with _team(model, f"one-pass-{recompute}") as team:
        appends: list[Append] = []
        plan = team.prefill_plan(_hop("You are a checker.", CONTEXT, REPLY), recompute=recompute)
        sent: np.ndarray | None = None
        try:
            while True:
                step = plan.send(sent)
                appends.append(step)
                sent = ChunkExecutor().append(step.seq, step.rows, step.logits)
        except StopIteration as done:
            p = done.value
        with p:
            assert p.hop.mode == "reuse" and p.hop.reused_tokens > 0
            assert (p.hop.recomputed_tokens > 0) == (recompute > 0)
            mine = [a for a in appends if a.seq is p.seq]  # the others computed the new agent's prefix (cached)
            assert len(mine) == 1 and len(mine[0].rows) == p.hop.computed_tokens
            assert p.seq.reserved == 0 and len(p.seq) == p.hop.prompt_tokens
            assert any(s["shared"] for s in model.sequence_segments(p.seq.id))
