"""The agent-session API end to end on the default model: every method, stats, streaming, templates, sessions
running concurrently, memory release, and the server's message-level prefill."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import CALIBRATION_READS, AgentSession
from kvcmas_cpp.prefix_cache import PrefixCache
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing.methods import READ_ROWS

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
ROLES = (
    ("Math Solver", "You are a math expert. Solve the problem step by step."),
    ("Critic", "You are a careful critic. Check the other agents' reasoning."),
    ("Decision Maker", "You are the top decision-maker. Give the final answer."),
)


def kv_without_prefix_cache(model: kc.Model) -> int:
    """KV bytes in use once the model's prefix cache (which outlives sessions by design) is emptied."""
    PrefixCache.of(model).clear()
    return model.kv_bytes_in_use


def run_team(model: kc.Model, method: str, question: str = QUESTION, max_tokens: int = 8, **kw: object) -> list:
    with AgentSession(model, method=method, **kw) as team:  # type: ignore[arg-type]
        agents = [team.agent(name, system=role) for name, role in ROLES]
        team.share(question, label="Question")
        return [a.respond(max_tokens=max_tokens) for a in agents]


def check_stats(r: kc.agents.Response, row_bytes: int) -> None:
    s = r.stats
    assert s.prompt_tokens == s.computed_tokens + s.reused_tokens
    assert s.generated_tokens == len(r.ids) > 0
    assert s.kv_bytes == (s.computed_tokens + s.generated_tokens) * row_bytes
    assert s.ttft_ms > 0 and s.method in ("nonshared", "fullshared", "kvcmas", "kvcomm")


@pytest.mark.parametrize("method", ["nonshared", "fullshared", "kvcmas", "kvcomm"])
def test_a_prompt_without_shared_spans_counts_each_row_once(model: kc.Model, method: str) -> None:
    """An agent answering before anything is shared: its whole prompt is template prefix. The first call computes
    every row once (it used to compute the last row a second time and report 19 computed, -1 reused of 18), the
    same call again reuses all but the last row, and the reply is the model's own greedy answer to that prompt."""
    PrefixCache.of(model).clear()
    row_bytes = model.kv_row_bytes
    with AgentSession(model, method=method, calibration_dir=False, cache_namespace=f"no-spans-{method}") as team:
        solver = team.agent("Solver", system="You answer in one word.")
        first = solver.respond(max_tokens=6)
        check_stats(first, row_bytes)
        assert (first.stats.computed_tokens, first.stats.reused_tokens) == (first.stats.prompt_tokens, 0)
        team.reset()
        again = solver.respond(max_tokens=6)
        check_stats(again, row_bytes)
        s = again.stats
        assert (s.computed_tokens, s.prefix_cached_tokens, s.span_tokens) == (1, s.prompt_tokens - 1, 0)
        team.reset()
        with team.prefill_agent(solver) as p:
            prompt = list(p.hop.prompt)
    assert len(prompt) == first.stats.prompt_tokens
    assert first.ids == again.ids == model.generate(prompt, max_tokens=6, temperature=0.0).tokens


def test_respond_refuses_an_unknown_option_by_name(model: kc.Model) -> None:
    with AgentSession(model, "nonshared") as team:
        agent = team.agent("Solver")
        with pytest.raises(TypeError, match="'temprature'"):
            agent.respond(4, temprature=0.5)  # type: ignore[call-overload]


def test_every_method_answers_and_first_agent_is_exact(model: kc.Model) -> None:
    row_bytes = model.n_layer * 2 * model.n_head_kv * model.head_dim * 4
    base = kv_without_prefix_cache(model)
    dense = run_team(model, "nonshared")
    for method in ("fullshared", "kvcmas", "kvcomm"):
        out = run_team(model, method, workflow=f"test-{method}-exact")
        assert [r.agent for r in out] == [name for name, _ in ROLES]
        assert out[0].ids == dense[0].ids and out[0].text == dense[0].text  # the first agent computes exactly
        assert out[0].stats.mode == "source"
        for r in out:
            assert r.text.strip()
            check_stats(r, row_bytes)
    for r in dense:
        check_stats(r, row_bytes)
        assert r.stats.mode in ("source", "dense")
    assert kv_without_prefix_cache(model) == base  # closing a session frees every row


def test_sharing_reuses_the_question_and_replies(model: kc.Model) -> None:
    dense = run_team(model, "nonshared")
    shared = run_team(model, "fullshared")
    for d, s in zip(dense[1:], shared[1:], strict=True):
        assert s.stats.mode == "reuse"
        assert s.stats.prompt_tokens == d.stats.prompt_tokens  # the same prompt ids
        # the reader forwards only its own template text: question and relayed replies come by reference
        assert s.stats.reused_tokens >= d.stats.reused_tokens + len(model.tokenize(QUESTION, add_special=False))
        assert s.stats.computed_tokens < d.stats.computed_tokens


def test_gate_forced_dense_matches_nonshared(model: kc.Model) -> None:
    dense = run_team(model, "nonshared")
    cfg = kc.agents.MethodConfig("kvcmas", gate="dense")
    forced = run_team(model, "kvcmas", config=cfg, workflow="test-forced")
    assert [r.ids for r in forced] == [r.ids for r in dense]


@pytest.mark.parametrize("cold", ["dense", "reuse"])
def test_kvcmas_calibrates_online_then_reuses_with_corrections(model: kc.Model, cold: str) -> None:
    questions = [QUESTION, "Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?"]
    modes, gates, first = [], [], []
    for i in range(CALIBRATION_READS + 1):
        q = f"{questions[i % 2]} (case {i})"
        out = run_team(model, "kvcmas", question=q, workflow=f"test-cal-{cold}", cold=cold)
        modes.append([r.stats.mode for r in out])
        gates.append([r.stats.gate for r in out])
        first = out if i == 0 else first
    if cold == "dense":  # no map yet: later agents compute densely and learn
        assert modes[0][1:] == ["fallback", "fallback"] and gates[0][1] == "calibrating -> dense"
    else:  # no map yet: later agents share like fullshared, and learn from exact rows computed after their reply
        assert modes[0][1:] == ["reuse", "reuse"] and gates[0][1:] == ["calibrating -> reuse"] * 2
        cfg = kc.agents.MethodConfig("fullshared", head=4)  # kvcmas' exact head
        fs = run_team(model, "fullshared", question=f"{questions[0]} (case 0)", config=cfg)
        for r, f in zip(first[:2], fs[:2], strict=True):  # the first cold reader is fullshared's, bit for bit
            np.testing.assert_array_equal(r.first_logits, f.first_logits)
            assert r.ids == f.ids and r.stats.computed_tokens == f.stats.computed_tokens
        # the next one reads the question from the exact rows computed for the first reader's training read
        assert first[2].stats.computed_tokens == fs[2].stats.computed_tokens
        assert first[1].stats.calibration_tokens_scheduled > 0
    assert modes[-1][1:] == ["reuse", "reuse"] and gates[-1][1:] == ["reuse", "reuse"]
    last = out[1].stats
    assert last.corr_rank > 0 and last.corr_bytes > 0


def test_a_map_learned_for_one_base_never_corrects_an_agents_own_view(model: kc.Model) -> None:
    """The solver's edge from the planner's view of a context is fitted on one read of degenerate text. In a later
    session of the same workflow the solver reads a question from its own view (it answered it before): those rows
    are its own, so its second answer must match nonshared's. The edge used to ignore whose view was read, and the
    map learned from the planner's view corrected the solver's own rows (on a server, a repeated question got a
    different answer)."""
    roles = {"Planner": "You plan the work in short steps.", "Solver": ""}
    with AgentSession(model, "kvcmas", workflow="test-own-view", calibration_dir=False) as team:
        planner, solver = (team.agent(n, system=r) for n, r in roles.items())
        team.share("Alpha beta gamma delta epsilon. " * 30, label="Notes")
        planner.respond(max_tokens=4)
        assert solver.respond(max_tokens=4).stats.gate == "calibrating -> reuse"  # its read fits the edge
        team.run_training_reads()
    replies = {}
    for method in ("nonshared", "kvcmas"):
        with AgentSession(model, method, workflow="test-own-view", calibration_dir=False) as team:
            solver = team.agent("Solver", system="")
            team.share("What is the capital of France?", label="Notes")
            solver.respond(max_tokens=8)
            replies[method] = solver.respond(max_tokens=8)
    again = replies["kvcmas"]
    assert again.stats.mode == "reuse" and again.stats.span_tokens > 0
    ref = replies["nonshared"].first_logits
    assert ref is not None and again.first_logits is not None
    p = np.exp(ref - np.logaddexp.reduce(ref))
    kl = float(
        np.sum(p * ((ref - np.logaddexp.reduce(ref)) - (again.first_logits - np.logaddexp.reduce(again.first_logits))))
    )
    assert kl < 1e-3 and again.ids == replies["nonshared"].ids, (kl, again.text, replies["nonshared"].text)


def _pair(team: AgentSession) -> tuple[kc.agents.Agent, kc.agents.Agent]:
    return tuple(team.agent(n, system=r) for n, r in ROLES[:2])  # type: ignore[return-value]


def test_kvcmas_is_closer_to_exact_than_fullshared(model: kc.Model) -> None:
    """After calibration, the second agent reuses the question and the first agent's reply with corrections, and its
    first-token distribution (KL to the exact run) beats fullshared's on every question."""
    est_ridge = est.RidgeEstimator(rank=8)
    cfg = kc.agents.MethodConfig("kvcmas", head=4, rank=8, calibrate=CALIBRATION_READS)
    from kvcmas_cpp.sharing.workflow import load_gsm8k

    for q in load_gsm8k(100, CALIBRATION_READS):  # the same two-agent team: both of the reader's edges calibrate
        with AgentSession(model, "kvcmas", estimator=est_ridge, config=cfg) as team:
            a, b = _pair(team)
            team.share(q)
            a.respond(max_tokens=6)
            assert b.respond(max_tokens=1).stats.gate == "calibrating -> reuse"  # shared cold, and learned from
    assert len(est_ridge.maps) == 2
    kl: dict[str, list[float]] = {"fullshared": [], "kvcmas": []}
    for q in load_gsm8k(0, 3):
        logits = {}
        for method in ("nonshared", "fullshared", "kvcmas"):
            with AgentSession(
                model,
                method,
                estimator=est_ridge if method == "kvcmas" else None,
                config=cfg if method == "kvcmas" else None,
            ) as team:
                a, b = _pair(team)
                team.share(q)
                a.respond(max_tokens=6)
                p = team.prefill_agent(b)
                if method != "nonshared":
                    assert p.stats["mode"] == "reuse" and p.stats["reused_tokens"] > 0
                if method == "kvcmas":
                    assert p.stats["corr_rank"] > 0
                logits[method] = p.logits.astype(np.float64)
                p.close()
        ref = logits["nonshared"] - np.logaddexp.reduce(logits["nonshared"])
        for m in kl:
            lq = logits[m] - np.logaddexp.reduce(logits[m])
            kl[m].append(float(np.sum(np.exp(ref) * (ref - lq))))
    print("first-token KL per question:", kl)
    # on every question, and by the margin on the mean (kvcmas at most half of fullshared's KL)
    assert all(0 < k < f for k, f in zip(kl["kvcmas"], kl["fullshared"], strict=True))
    assert np.mean(kl["kvcmas"]) <= 0.5 * np.mean(kl["fullshared"])


def test_streaming_equals_the_whole_reply(model: kc.Model) -> None:
    whole = run_team(model, "fullshared", max_tokens=12)
    with AgentSession(model, "fullshared") as team:
        agents = [team.agent(n, system=r) for n, r in ROLES]
        team.share(QUESTION, label="Question")
        for a, ref in zip(agents, whole, strict=True):
            chunks = list(a.respond(max_tokens=12, stream=True))
            assert chunks[-1].response is not None and chunks[-1].finish_reason in ("stop", "length")
            assert "".join(c.text for c in chunks) == ref.text == chunks[-1].response.text


def test_templates_placeholders_and_errors(model: kc.Model) -> None:
    with AgentSession(model, "fullshared") as team:
        solver = team.agent("Solver", system="Solve.", template="Q:\n{user_question}\n\nSolve it.")
        checker = team.agent("Checker", system="Check.", template="Q:\n{user_question}\n\nAnswer:\n{agent_0_current}")
        early = team.agent("Early", template="{agent_1_current}\nOK?")
        with pytest.raises(ValueError, match="nobody has shared"):
            solver.respond(max_tokens=2)
        team.share(QUESTION)
        with pytest.raises(ValueError, match="agent_1_current"):
            early.respond(max_tokens=2)
        r0 = solver.respond(max_tokens=6)
        r1 = checker.respond(max_tokens=6)
        assert r1.stats.reused_tokens >= len(r0.ids) - 4
        with pytest.raises(ValueError, match="exists already"):
            team.agent("Solver")
        # a declaration that could only fail later, or never see the shared context, is refused when it is made
        for kwargs, says in (
            ({"system": 5}, "agent 'X': system must be a string, got int"),
            ({"template": b"{context}"}, "agent 'X': template must be a string, got bytes"),
            ({"template": "Read {contex} and answer."}, r"agent 'X': the template's \{contex\} is not a placeholder"),
            ({"template": "Answer {agent_0_current} as {answer}"}, r"\{answer\} is not a placeholder"),
            ({"template": "Just say hello."}, "agent 'X': the template reads nothing shared"),
        ):
            with pytest.raises(ValueError, match=says):
                team.agent("X", **kwargs)  # type: ignore[arg-type]
        assert "X" not in [a.name for a in team.agents]  # nothing half-declared
        team.agent("X", None, template='Reply as JSON {"a": 1} to:\n{context}')  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_tokens"):
            solver.respond(max_tokens=0)
        with pytest.raises(ValueError):
            solver.respond(max_tokens=2, temperature=-1.0)
        with pytest.raises(ValueError, match="empty"):
            team.share("")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            team.share([model.n_vocab + 5])
        n_items = len(team.context)
        with pytest.raises(ValueError, match="got bytes"):  # a Sequence[int], read as token ids before
            team.share(b"text read in binary mode")
        with pytest.raises(ValueError, match=r"token ids must be integers, got 2\.7"):  # was truncated to 2
            team.share([1, 2.7])
        with pytest.raises(ValueError, match="token ids are a list of ints, got int"):
            team.share(5)  # type: ignore[arg-type]
        assert len(team.context) == n_items  # nothing was added
    with pytest.raises(ValueError, match="unknown method"):
        AgentSession(model, "sometimes")


@pytest.mark.parametrize("method", ["nonshared", "kvcmas"])
def test_a_reply_ends_where_the_context_is_full(model: kc.Model, method: str) -> None:
    """respond(max_tokens past the context) ends the reply at the sequence's end with finish 'length' (it raised
    'context overflow' after generating every token, and the reply was lost); the reply still joins the context."""
    small = kc.Model(model.path, n_threads=2, n_ctx=48)
    with AgentSession(small, method, calibration_dir=False) as team:
        writer = team.agent("Writer", "Explain.")
        team.share("Explain in detail how a car engine works.")
        r = writer.respond(max_tokens=10**6, temperature=0)  # a greedy explanation outlasts the ~23 free rows
        assert r.finish_reason == "length" and r.stats.prompt_tokens + len(r.ids) == 48, (r.finish_reason, r.stats)
        assert team.context[-1][1] == r.text  # passed on to later agents like any reply
        with pytest.raises(ValueError, match="stop must be a string or a list of strings, got int"):
            writer.respond(max_tokens=2, stop=5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 2.5"):
            writer.respond(max_tokens=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["nonshared", "kvcmas"])
def test_a_prompt_past_the_context_is_refused_before_any_compute(model: kc.Model, method: str) -> None:
    """A shared context longer than n_ctx (8,192 tokens here) is refused by name and size before anything is computed
    (the core used to stop with 'context overflow: sequence N' after prefilling 7,692 of the tokens); the session
    still works after reset()."""
    with AgentSession(model, method, calibration_dir=False) as team:
        solver, checker = team.agent("Solver", "Solve."), team.agent("Checker", "Check.")
        team.share(QUESTION)
        solver.respond(max_tokens=2)
        team.share(" word" * (model.n_ctx + 100))
        before = model.n_sequences, model.kv_bytes_in_use
        start = time.perf_counter()
        with pytest.raises(ValueError, match=rf"agent 'Checker': its prompt is \d+ tokens.*n_ctx = {model.n_ctx}"):
            checker.respond(max_tokens=2)
        assert time.perf_counter() - start < 1.0  # nothing computed
        assert (model.n_sequences, model.kv_bytes_in_use) == before  # nothing left open
        team.reset()
        team.share(QUESTION)
        assert checker.respond(max_tokens=2).ids


def test_reset_and_fork_release_memory(model: kc.Model) -> None:
    base = kv_without_prefix_cache(model)
    team = AgentSession(model, "fullshared")
    a = team.agent("Solver", system="Solve.")
    team.share(QUESTION)
    r = a.respond(max_tokens=6)
    assert team.stored_bytes > 0 and model.kv_bytes_in_use > base
    other = team.fork()
    r2 = other.agents[0].respond(max_tokens=6)
    assert r2.ids == r.ids  # same shared context, same agent, greedy
    other.close()
    team.reset()
    assert team.context == []
    team.share(QUESTION)
    assert a.respond(max_tokens=6).ids == r.ids
    team.close()
    assert kv_without_prefix_cache(model) == base


def test_sessions_in_threads_match_sequential(model: kc.Model) -> None:
    questions = [
        QUESTION,
        "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts?",
        "James runs 3 sprints 3 times a week, 60 meters each. How many meters a week?",
    ]
    seq = {q: [r.ids for r in run_team(model, "fullshared", question=q)] for q in questions}
    got: dict[str, list] = {}
    errors: list[BaseException] = []

    def work(q: str) -> None:
        try:
            got[q] = [r.ids for r in run_team(model, "fullshared", question=q)]
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == seq


def test_sessions_from_asyncio_match_sequential(model: kc.Model) -> None:
    import asyncio

    questions = [QUESTION, "Weng earns $12 an hour for babysitting. How much did she earn for 50 minutes?"]
    seq = [[r.ids for r in run_team(model, "fullshared", question=q, max_tokens=5)] for q in questions]

    async def team(q: str) -> list[list[int]]:
        with AgentSession(model, "fullshared") as t:
            agents = [t.agent(n, system=r) for n, r in ROLES]
            t.share(q, label="Question")
            return [(await a.arespond(max_tokens=5)).ids for a in agents]

    async def main() -> list[list[list[int]]]:
        return list(await asyncio.gather(*(team(q) for q in questions)))

    assert asyncio.run(main()) == seq


def test_message_prefill_shares_spans_between_agents(model: kc.Model) -> None:
    """The server's path: the system prompt names the agent; message contents are spans keyed by their ids."""
    base = kv_without_prefix_cache(model)
    with AgentSession(model, "fullshared") as team:
        user = {"role": "user", "content": QUESTION}
        p1 = team.prefill([{"role": "system", "content": "You are agent one."}, user])
        assert p1.stats["mode"] == "source"
        gen = [int(np.argmax(p1.logits))]
        for _ in range(5):
            (lg,) = model.decode_batch([(p1.seq, gen[-1:])])
            gen.append(int(np.argmax(lg)))
        team.finish(p1, gen)
        reply = model.detokenize(gen)
        p1.close()
        p2 = team.prefill([{"role": "system", "content": "You are agent two, a critic."}, user])
        n_q = len(model.tokenize(QUESTION, add_special=False))
        assert p2.stats["mode"] == "reuse" and p2.stats["reused_tokens"] >= n_q
        with pytest.raises(ValueError, match="finished already"):
            team.finish(p2, [1])
            team.finish(p2, [1])
        p2.close()
        # the first agent's reply comes back as an assistant message: reused when its ids round-trip
        msgs = [{"role": "system", "content": "You are agent three."}, user, {"role": "assistant", "content": reply}]
        p3 = team.prefill(msgs)
        if model.tokenize(reply, add_special=False) == gen:
            assert p3.stats["reused_tokens"] >= n_q + len(gen) - 4
        p3.close()
        # no system prompt: the agent is "assistant", found again on the next call
        for _ in range(2):
            team.prefill([user]).close()
        assert [a.name for a in team.agents].count("assistant") == 1
        with pytest.raises(ValueError, match="string 'role' and 'content'"):
            team.prefill([{"role": "user", "content": 3}])
        assert team.evict_lru()
    assert kv_without_prefix_cache(model) == base


TASK_TEXT = (
    "The library has twelve study rooms on three floors. Members book a room for one to three hours, at most twice "
    "a week, up to fourteen days ahead; a booking nobody checks in to within fifteen minutes is released for "
    "walk-ins. Staff block rooms for events, see who booked which room, and export a weekly usage report. The "
    "service must run on old public computers in a plain browser and keep working when the network is down."
)


REPLY_WITH_SPACE = (
    "The plan misses two things: what the front desk does when the network is down, and who keeps the booking "
    "data once the developer has left. \n"
)


def _framed(header: str, context: list[str], footer: str = "Provide your complete response:") -> str:
    """A user message the way CrewAI writes one: the shared task and earlier replies inside its own text."""
    text = f"\nCurrent Task: {header}\n\n{TASK_TEXT}\n\nThis is the expected criteria for your answer.\n\n"
    if context:
        text += "This is the context you're working with:\n" + "\n\n----------\n\n".join(context) + "\n\n"
    return text + footer


def _reply(model: kc.Model, team: AgentSession, p: kc.agents.Prefilled, n: int = 24, text: str = "") -> str:
    """Greedy `n` tokens, registered as received stripped; or `text`'s tokens, as received (whitespace and all)."""
    if text:
        team.finish(p, model.tokenizer.encode(text, add_special=False, parse_special=False), text)
        p.close()
        return text
    gen = [int(np.argmax(p.logits))]
    for _ in range(n - 1):
        (lg,) = model.decode_batch([(p.seq, gen[-1:])])
        gen.append(int(np.argmax(lg)))
    text = model.detokenize(gen).strip()
    team.finish(p, gen, text)
    p.close()
    return text


def test_spans_are_found_inside_bigger_messages(model: kc.Model) -> None:
    """A later agent's message that frames the shared task and an earlier reply in its own text (a different
    header, the reply after other text) reads both from the stored spans; the first agent's prompt is the
    whole-message tokenization, and text that matches nothing is computed."""
    n_task = len(model.tokenize(TASK_TEXT, add_special=False))
    with AgentSession(model, "fullshared", workflow="test-inline") as team:
        first = [
            {"role": "system", "content": "You are the planner."},
            {"role": "user", "content": _framed("plan", [])},
        ]
        p1 = team.prefill(first)
        canonical = model.tokenize(model.apply_chat_template(first, add_generation_prompt=True), add_special=True)
        assert list(p1.hop.prompt) == canonical and p1.stats["reused_tokens"] == 0
        reply = _reply(model, team, p1)
        n_reply = len(model.tokenize(reply, add_special=False))
        second = [
            {"role": "system", "content": "You are the critic."},
            {"role": "user", "content": _framed("critique the plan", [reply])},
        ]
        p2 = team.prefill(second)
        # the task paragraph and the reply by reference
        assert p2.stats["mode"] == "reuse" and p2.stats["span_tokens"] >= n_task + n_reply
        assert model.detokenize(list(p2.hop.prompt)) == model.apply_chat_template(second, add_generation_prompt=True)
        # a reply that ends in whitespace, passed on as received: the whitespace then runs into the next blank lines
        reply2 = _reply(model, team, p2, text=REPLY_WITH_SPACE)
        third = [
            {"role": "system", "content": "You are the writer."},
            {"role": "user", "content": _framed("write it up", [reply, reply2])},
        ]
        p3 = team.prefill(third)
        n_reply2 = len(model.tokenize(reply2.strip(), add_special=False))
        assert p3.stats["span_tokens"] >= n_task + n_reply + n_reply2
        p3.close()
        # the task edited in its first words: the rest of it is found by its tokens (a sub-run of the stored span)
        edited = TASK_TEXT.replace("library", "museum")
        other = _framed("plan", []).replace(TASK_TEXT, edited)
        p4 = team.prefill([{"role": "system", "content": "You are the writer."}, {"role": "user", "content": other}])
        task_ids, edited_ids = (model.tokenize(t, add_special=False) for t in (TASK_TEXT, edited))
        common = next(i for i in range(1, len(task_ids)) if edited_ids[-i - 1] != task_ids[-i - 1])  # ids both end in
        assert common >= n_task - 4 and p4.stats["span_tokens"] == common
        p4.close()
        # another task in the same frame: nothing matches, nothing is reused
        other = _framed("plan", []).replace(TASK_TEXT, " ".join(reversed(TASK_TEXT.split())))
        p4 = team.prefill([{"role": "system", "content": "You are the writer."}, {"role": "user", "content": other}])
        assert p4.stats["span_tokens"] == 0
        p4.close()
        # client text that spells a special token is never parsed as one: that message stays one span
        tricky = _framed("plan <|im_end|>", [reply])
        p5 = team.prefill([{"role": "system", "content": "You are the critic."}, {"role": "user", "content": tricky}])
        content_ids = model.tokenizer.encode(tricky, add_special=False, parse_special=False)
        prompt = list(p5.hop.prompt)
        assert any(prompt[i : i + len(content_ids)] == content_ids for i in range(len(prompt)))
        p5.close()
    with AgentSession(model, "nonshared") as team:  # the reference: every message is one piece
        p = team.prefill(second)
        assert list(p.hop.prompt) == model.tokenize(
            model.apply_chat_template(second, add_generation_prompt=True), add_special=True
        )
        p.close()


@pytest.mark.parametrize("topology", ["full", "chain"])
def test_workflow_graphs_relay_outputs_in_order(model: kc.Model, topology: str) -> None:
    from kvcmas_cpp.sharing.workflow import PLACEHOLDER_RE, gsm8k_workflow

    wf = gsm8k_workflow(4, topology)
    reads = [PLACEHOLDER_RE.findall(a.user_template) for a in wf.agents]
    if topology == "full":
        assert reads == [["user_question"]] + [
            ["user_question"] + [f"agent_{j}_current" for j in range(i)] for i in (1, 2, 3)
        ]
    else:
        assert reads == [["user_question"]] + [["user_question", f"agent_{i - 1}_current"] for i in (1, 2, 3)]
    with AgentSession(model, "fullshared") as team:
        agents = [team.agent(a.name, system=a.role, template=a.user_template) for a in wf.agents]
        team.share(QUESTION)
        replies = []
        for i, a in enumerate(agents):
            p = team.prefill_agent(a)
            prompt = list(p.seq.tokens)
            p.close()
            named = [r.ids for j, r in enumerate(replies) if f"agent_{j}_current" in reads[i]]
            for j, r in enumerate(replies):  # each upstream reply the template names is in the prompt, as ids
                if f"agent_{j}_current" in reads[i]:
                    assert _contains(prompt, r.ids), (i, j)
                elif not any(_contains(n, r.ids) for n in named):  # (short greedy replies may repeat each other)
                    assert not _contains(prompt, r.ids), (i, j)
            replies.append(a.respond(max_tokens=5))


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[k : k + len(sub)] == sub for k in range(len(seq) - len(sub) + 1))


def test_input_vectors_in_the_shared_context_act_like_their_tokens(reference_models) -> None:
    """Token-embedding rows shared as input vectors (the path image features take) give the same replies as the
    tokens themselves, under every method; mixed vectors + text form one span that later agents reuse."""
    import gguf

    path = reference_models["F32"]
    model = kc.Model(path, n_threads=2)
    table = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    ids = model.tokenize(QUESTION, add_special=False)
    rows = np.asarray(table.data)[ids].astype(np.float32)
    head = 9
    for method in ("nonshared", "fullshared"):
        by_text = run_team(model, method)
        for kw in ({"embeddings": rows}, {"embeddings": rows[:head], "content": ids[head:]}):
            with AgentSession(model, method) as team:
                agents = [team.agent(n, system=r) for n, r in ROLES]
                team.share(label="Question", **kw)  # type: ignore[arg-type]
                got = [a.respond(max_tokens=8) for a in agents]
            assert [r.ids for r in got] == [r.ids for r in by_text], (method, list(kw))
            if method == "fullshared":
                assert got[1].stats.reused_tokens >= len(ids)  # the vector rows come by reference too
    with AgentSession(model, "fullshared") as team:
        with pytest.raises(ValueError, match="shape"):
            team.share(embeddings=np.zeros((2, 3), np.float32))
        with pytest.raises(ValueError, match="NaN"):
            team.share(embeddings=np.full((1, model.n_embd), np.nan, np.float32))
        with pytest.raises(ValueError, match="no vision encoder"):
            team.share(image=b"\x89PNG")
        team.share(embeddings=rows[:3], text="and some text")
        assert team.context[0][1].startswith("[3 input vectors]")


def test_an_image_in_the_shared_context(model: kc.Model, tmp_path: Path) -> None:
    """Issue 7: the image is encoded once; kvcmas' first agent equals nonshared; later agents reuse its rows."""
    import importlib.util

    if importlib.util.find_spec("skimage") is None:
        pytest.skip("scikit-image (photos) is not installed")
    import skimage

    from kvcmas_cpp.vision import VisionEncoder
    from kvcmas_cpp.vision.random_mmproj import write_random_mmproj

    mmproj = tmp_path / "mmproj.gguf"
    write_random_mmproj(mmproj, image_size=56, n_embd=64, n_ff=128, n_layer=2, n_head=4, n_embd_out=model.n_embd)
    photo = Path(skimage.__file__).parent / "data" / "astronaut.png"
    vision = VisionEncoder(mmproj, n_threads=2)
    cfg = kc.agents.MethodConfig("kvcmas", head=4, rank=8, calibrate=1)  # one read per edge teaches it
    ridge = est.RidgeEstimator(rank=8)
    replies = {}
    for run, method in enumerate(("nonshared", "kvcmas", "kvcmas")):
        kw = {"config": cfg, "estimator": ridge} if method == "kvcmas" else {}
        with AgentSession(model, method, vision=vision, **kw) as team:  # type: ignore[arg-type]
            agents = [team.agent(n, system=r) for n, r in ROLES]
            team.share(image=photo, text="What is in this picture?", label="Question")
            replies[run] = [a.respond(max_tokens=6) for a in agents]
    assert vision.encode_count == 1  # one encode, however many agents and sessions read it
    assert replies[1][0].ids == replies[0][0].ids == replies[2][0].ids  # the first agent is exact
    assert [r.stats.gate for r in replies[1][1:]] == ["calibrating -> reuse"] * 2  # cold reuse, and learning
    for r in replies[2][1:]:  # then the image rows come by reference, with the learned correction
        assert r.stats.mode == "reuse" and r.stats.reused_tokens >= vision.n_tokens and r.stats.corr_rank > 0
    with AgentSession(model, "fullshared", vision=vision) as team, pytest.raises(ValueError, match="image"):
        team.share(image=b"not an image at all")


def test_four_agents_over_a_2k_token_context_reuse_from_the_first_workflow_and_calibrate(model: kc.Model) -> None:
    """The README's session at the size users meet (issue 14): four agents with fixed roles, ~2K shared tokens, fresh
    sessions of one named workflow with default settings. Every later agent reads the context by reference from the
    very first workflow (cold reuse), its edges gather their reads in fixed memory, and once they hold
    CALIBRATION_READS reads the later agents reuse with learned corrections."""
    from kvcmas_cpp.agents import shared_estimator
    from kvcmas_cpp.sharing.workflow import load_gsm8k

    roles = (*ROLES, ("Programmer", "You are a programming expert. Check the arithmetic with code."))
    questions = load_gsm8k(600, 200)
    runs: list[list[kc.agents.Response]] = []
    walls: list[list[float]] = []  # ms each respond() call took, as its caller waited

    def timed(agent: kc.agents.Agent) -> kc.agents.Response:
        start = time.perf_counter()
        r = agent.respond(max_tokens=1)
        walls[-1].append((time.perf_counter() - start) * 1000.0)
        return r

    for i in range(CALIBRATION_READS + 1):
        picked = questions[i * 40 : i * 40 + 12]
        while len(model.tokenize("\n".join(picked), add_special=False)) < 2000:
            picked.append(questions[i * 40 + len(picked)])
        context = "\n".join(picked)
        with AgentSession(model, "kvcmas", workflow="test-2k") as team:
            agents = [team.agent(n, system=r) for n, r in roles]
            team.share(context, label="Context")
            walls.append([])
            runs.append([timed(a) for a in agents])
            ridge = shared_estimator(model, "kvcmas", "test-2k")[0]
            assert ridge.pending_bytes() + ridge.state_bytes() < 64 << 20
    n_ctx_tokens = len(model.tokenize(context, add_special=False))
    first = runs[0]
    assert first[0].stats.mode == "source" and first[0].stats.computed_tokens > n_ctx_tokens
    for r in first[1:]:  # the first workflow already reuses: a later agent computes its role and the exact head only
        assert r.stats.gate == "calibrating -> reuse" and r.stats.mode == "reuse", r.stats
        assert r.stats.span_tokens >= n_ctx_tokens - 8 and r.stats.computed_tokens < 100, r.stats
        # the exact rows, computed after the reply: the context's first READ_ROWS after its head (a bounded read)
        scheduled = r.stats.calibration_tokens_scheduled
        assert READ_ROWS < scheduled <= READ_ROWS + r.stats.computed_tokens < n_ctx_tokens, r.stats
    # the reply returns first, and the read it scheduled stays off the next agents' path (training_reads="idle":
    # back-to-back calls leave no idle spell, so close() runs them); a call used to run the last one's read first
    for r, wall in zip(first[1:], walls[0][1:], strict=True):
        assert r.stats.training_read_ms == 0 and r.stats.ttft_ms <= wall, (r.stats, wall)
    for run in runs[1:CALIBRATION_READS]:
        assert [r.stats.gate for r in run[1:]] == ["calibrating -> reuse"] * 3
    for r in runs[-1][1:]:  # calibrated: learned corrections, nothing computed for calibration any more
        assert r.stats.gate == "reuse" and r.stats.mode == "reuse" and r.stats.corr_rank > 0, r.stats
        assert r.stats.calibration_tokens_scheduled == 0 and r.stats.computed_tokens < 100, r.stats


@pytest.mark.slow
def test_a_session_over_an_8k_token_context_calibrates_then_reuses(model: kc.Model) -> None:
    """Default settings, a shared context of ~7.5K tokens: the reader's edge gathers its reads in fixed memory (the
    ridge statistics, not the spans' rows), gets its map, and the next workflow reuses the span with corrections."""
    from kvcmas_cpp.agents import shared_estimator
    from kvcmas_cpp.sharing.workflow import load_gsm8k

    questions = load_gsm8k(200, 400)
    stats = []
    for i in range(CALIBRATION_READS + 1):
        picked: list[str] = []  # ~7.5K tokens of questions (overlapping contexts, never the same one)
        while len(model.tokenize("\n".join(picked), add_special=False)) < 7500:
            picked += questions[i * 40 + len(picked) : i * 40 + len(picked) + 10]
        context = "\n".join(picked)
        with AgentSession(model, "kvcmas", workflow="test-8k") as team:
            a, b = _pair(team)
            team.share(context, label="Context")
            a.respond(max_tokens=1)
            stats.append(b.respond(max_tokens=1).stats)
            ridge = shared_estimator(model, "kvcmas", "test-8k")[0]
            assert ridge.pending_bytes() + ridge.state_bytes() < 64 << 20  # an edge's statistics (~17 MB) + maps
    assert 7000 < stats[0].prompt_tokens < model.n_ctx, stats[0]
    assert [s.gate for s in stats[:CALIBRATION_READS]] == ["calibrating -> reuse"] * CALIBRATION_READS
    last = stats[-1]
    assert last.gate == "reuse" and last.corr_rank > 0 and last.reused_tokens > 7000
