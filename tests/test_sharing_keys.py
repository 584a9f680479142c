"""What agent sessions key and count: estimator edges by the agents (not their arrival order), replies by the text
the client received, cached tokens only for rows earlier calls computed, KV bytes in the cache's row type."""

from __future__ import annotations

import numpy as np

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession, agent_identity
from kvcmas_cpp.sharing import estimators as est

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
SOLVER = ("Solver", "You are a math expert. Solve the problem step by step.")
CRITIC = ("Critic", "You are a careful critic. Check the other agents' reasoning.")


def _greedy(model: kc.Model, p: kc.agents.Prefilled, n: int) -> list[int]:
    gen = [int(np.argmax(p.logits))]
    for _ in range(n - 1):
        (lg,) = model.decode_batch([(p.seq, gen[-1:])])
        gen.append(int(np.argmax(lg)))
    return gen


def test_cached_tokens_are_only_rows_earlier_calls_computed(model: kc.Model) -> None:
    user = {"role": "user", "content": QUESTION}
    n_q = len(model.tokenize(QUESTION, add_special=False))
    with AgentSession(model, "fullshared") as team:
        one = [{"role": "system", "content": "You are agent one."}, user]
        with team.prefill(one) as p:
            s = p.stats  # everything computed here, the agent's prompt prefix included
            assert s["prefix_cached_tokens"] == 0 and s["span_tokens"] == 0 and s["reused_tokens"] == 0
            assert s["computed_tokens"] == s["prompt_tokens"] and s["dense_reason"] == "no match"
            team.finish(p, _greedy(model, p, 4))
        with team.prefill([{"role": "system", "content": "You are agent two."}, user]) as p:
            s = p.stats  # its prefix is new (computed now); the question comes from agent one's rows
            assert s["prefix_cached_tokens"] == 0 and s["span_tokens"] >= n_q
            assert s["reused_tokens"] == s["span_tokens"] and s["dense_reason"] is None
            assert s["computed_tokens"] + s["reused_tokens"] == s["prompt_tokens"]
        with team.prefill(one) as p:  # agent one again: its prefix comes from the cache, exactly
            s = p.stats
            assert s["prefix_cached_tokens"] > 0 and s["span_tokens"] >= n_q
            assert s["reused_tokens"] == s["prefix_cached_tokens"] + s["span_tokens"]
            assert s["kv_bytes"] == s["computed_tokens"] * model.kv_row_bytes


def test_a_reply_cut_by_a_stop_string_comes_back_trimmed_and_still_matches(model: kc.Model) -> None:
    user = {"role": "user", "content": QUESTION}
    with AgentSession(model, "fullshared") as team:
        with team.prefill([{"role": "system", "content": "You are agent one."}, user]) as p1:
            gen = _greedy(model, p1, 12)
            received = model.detokenize(gen[:7])  # a stop string began right after token 7: the client got this
            team.finish(p1, gen, text=received)
            assert p1.hop.generated == gen[:7]  # the span holds what the client received
        back = "\n  " + received.strip() + "  \n"  # the client trims it and wraps it in whitespace
        msgs = [{"role": "system", "content": "You are agent two."}, user, {"role": "user", "content": back}]
        assert model.tokenize(back, add_special=False) != gen[:7]  # the ids alone would not match
        with team.prefill(msgs) as p2:
            n_q = len(model.tokenize(QUESTION, add_special=False))
            assert p2.stats["span_tokens"] >= n_q + 7  # question and reply by reference
            tokens = list(p2.seq.tokens)
            start = next(i for i in range(len(tokens)) if tokens[i : i + 7] == gen[:7])
            assert tokens[start + 7 : start + 12] != gen[7:12]  # nothing the client did not receive


def test_edges_follow_the_agents_not_their_arrival_order(model: kc.Model) -> None:
    """A map learned for the critic reading the question and the solver's reply (from the solver's views) applies
    when the same agents arrive in another order (and another agent comes first); edges are named by role and
    identity."""
    ridge = est.RidgeEstimator(rank=8)
    cfg = kc.agents.MethodConfig("kvcmas", head=4, rank=8, calibrate=1)
    kw = {"estimator": ridge, "config": cfg, "calibration_dir": False}
    with AgentSession(model, "kvcmas", **kw) as team:  # type: ignore[arg-type]
        solver, critic = team.agent(*SOLVER), team.agent(*CRITIC)
        team.share(QUESTION, label="Question")
        solver.respond(max_tokens=8)
        assert critic.respond(max_tokens=1).stats.gate == "calibrating -> reuse"
    solver_id = agent_identity(SOLVER[1])
    reader = f"{agent_identity(CRITIC[1])}<-{solver_id}"  # the critic reading the solver's view of each span
    assert set(ridge.maps) == {("context:Question", reader), (f"reply:{solver_id}", reader)}
    with AgentSession(model, "kvcmas", **kw) as team:  # type: ignore[arg-type]
        team.agent("Bystander", system="You watch.")
        critic, solver = team.agent(*CRITIC), team.agent(*SOLVER)  # other indices than before
        team.share("Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?", label="Question")
        solver.respond(max_tokens=8)
        s = critic.respond(max_tokens=1).stats
        assert s.gate == "reuse" and s.corr_rank > 0


def test_kv_bytes_count_half_rows_with_an_f16_cache(default_model_path: str) -> None:
    f32 = kc.Model(default_model_path, n_threads=2)
    f16 = kc.Model(default_model_path, n_threads=2, kv_type="f16")
    assert f16.kv_row_bytes * 2 == f32.kv_row_bytes
    for m, element in ((f32, 4), (f16, 2)):
        # the core's figures against the model file's shape: K and V rows of n_head_kv * head_dim, every layer
        arch = m.metadata["general.architecture"]
        head_dim = m.metadata.get(f"{arch}.attention.key_length", m.n_embd // m.n_head)
        assert m.kv_row_bytes == m.n_layer * 2 * m.n_head_kv * head_dim * element
        assert m.kv_block_bytes == m.kv_block_rows * m.kv_row_bytes
        base = m.kv_bytes_in_use
        for n in (64, 70):  # two whole blocks; then a third block, partly filled, is allocated whole
            with m.new_sequence() as s:
                s.append(list(range(100, 100 + n)), logits="none")
                blocks = -(-n // m.kv_block_rows)
                assert m.kv_bytes_in_use - base == blocks * m.kv_block_rows * m.kv_row_bytes  # the engine's own
        with AgentSession(m, "fullshared") as team:
            a, b = team.agent(*SOLVER), team.agent(*CRITIC)
            team.share(QUESTION)
            for r in (a.respond(max_tokens=4), b.respond(max_tokens=4)):
                assert r.stats.kv_bytes == (r.stats.computed_tokens + r.stats.generated_tokens) * m.kv_row_bytes


def test_a_new_message_that_starts_with_stored_text_shares_its_new_rest(model: kc.Model) -> None:
    """Two workflows' documents open with the same header, then differ; no blank lines. The second document's
    header comes from the first one's rows (a run), and its new rest must become a span too, computed by the first
    agent and reused by the next: it stayed literal text that every later agent computed again, under a 'reuse'
    gate (a tester's skeptic computed 658 of 696 prompt tokens)."""
    header = "Incident report, filed by the operations desk of the northern depot, for review by all agents. "
    docs = [header + QUESTION, header + "Weng earns $12 an hour for babysitting. How much did she earn in total " * 3]
    with AgentSession(model, "kvcmas", calibration_dir=False) as team:
        for doc in docs:
            for _, role in (SOLVER, CRITIC):
                msgs = [{"role": "system", "content": role}, {"role": "user", "content": doc}]
                with team.prefill(msgs) as p:
                    team.finish(p, _greedy(model, p, 4))
                    stats = p.stats
        rest = len(model.tokenize(docs[1][len(header) :], add_special=False))
        assert stats["mode"] == "reuse" and stats["span_tokens"] >= rest, stats
