"""The recompute dial (sharing/recompute.py): a share of each shared span recomputed in the reader's own context.

Budget 0 is the method unchanged, budget 1 is nonshared bit for bit, the rows recomputed are the ones the rule
picks, and the KV / computed-token accounting includes them."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.sharing import MethodConfig, WorkflowRunner, gsm8k_workflow, load_gsm8k
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing import recompute as rc
from kvcmas_cpp.sharing.evaluate import build_runners, question_ids

GEN = 4


@pytest.fixture(scope="module")
def model(sharing_model: kc.Model) -> kc.Model:
    return sharing_model


@pytest.fixture(scope="module")
def workflow():
    return gsm8k_workflow(4)


@pytest.fixture(scope="module")
def fitted(model, workflow) -> est.RidgeEstimator:
    """kvcmas' ridge maps fitted on 3 training questions (the rule scores rows from their corrections)."""
    runners = build_runners(
        model, workflow, ["kvcmas"], load_gsm8k(40, 3), gen_tokens=GEN, configs={"kvcmas": MethodConfig("kvcmas", 4)}
    )
    r = runners["kvcmas"]
    r.close()
    assert isinstance(r.estimator, est.RidgeEstimator) and r.estimator.maps
    return r.estimator


def _run(model, workflow, cfg, q, estimator=None):
    runner = WorkflowRunner(model, workflow, cfg, estimator)
    return runner, runner.run(question_ids(model, q), "msg", max_new_tokens=GEN)


def _own_rows(model, seq, pos: int, n: int) -> np.ndarray:
    """Mask over positions [pos, pos + n) of seq: True where the sequence holds rows it computed itself."""
    own = np.zeros(len(seq), bool)
    for s in model.sequence_segments(seq.id):
        if not s["shared"]:
            own[s["pos"] : s["pos"] + s["n"]] = True
    return own[pos : pos + n]


def test_the_rule_picks_the_blocks_with_the_largest_mean_score() -> None:
    scores = np.zeros(100)
    scores[40:48] = 5.0  # block 2 (rows 32..47): mean 2.5
    scores[70] = 100.0  # block 4 (rows 64..79): mean 6.25
    scores[99] = 1.0  # block 6 (rows 96..99, short): mean 0.25
    (mask,) = rc.select_rows([scores], 0.1, block=16)  # 10 rows wanted: one block of 16
    assert np.flatnonzero(mask).tolist() == list(range(64, 80))
    (mask,) = rc.select_rows([scores], 0.2, block=16)  # 20 rows: two blocks
    assert np.flatnonzero(mask).tolist() == list(range(32, 48)) + list(range(64, 80))
    assert not rc.select_rows([scores], 0.0)[0].any() and rc.select_rows([scores], 1.0)[0].all()
    (ties,) = rc.select_rows([np.ones(64)], 0.25, block=16)  # equal scores: the earliest block
    assert np.flatnonzero(ties).tolist() == list(range(16))
    assert rc.runs(np.array([1, 1, 0, 1], bool)) == [(0, 2, True), (2, 3, False), (3, 4, True)]
    with pytest.raises(ValueError, match="budget"):
        rc.select_rows([scores], 1.5)
    with pytest.raises(ValueError, match="recompute"):
        MethodConfig("kvcmas", recompute=-0.1)


def test_the_budget_is_the_hops_and_its_spans_compete_for_it() -> None:
    """One budget over all of a hop's spans: blocks of every span ranked together, a short span one block of its
    own, chosen only if it ranks; ceil(budget * all rows) is what is wanted, not ceil(budget * n) per span."""
    question = np.ones(160)  # 10 blocks of mean 1
    question[48:64] = 3.0  # block 3: mean 3
    reply_hot = np.full(12, 4.0)  # a relayed reply shorter than a block: one block, mean 4
    reply_cold = np.full(12, 0.5)  # another, mean 0.5
    spans = [question, reply_cold, reply_hot]
    masks = rc.select_rows(spans, 0.1, block=16)  # 184 rows: 19 wanted -> the hot reply (12), then block 3 (16)
    assert masks[2].all() and not masks[1].any()
    assert np.flatnonzero(masks[0]).tolist() == list(range(48, 64))
    masks = rc.select_rows(spans, 0.05, block=16)  # 10 wanted: the hot reply alone
    assert masks[2].all() and not masks[0].any() and not masks[1].any()
    # per span, the same budget would have recomputed a block of every span: 16 + 12 + 12 rows, not 12
    assert sum(int(rc.select_rows([s], 0.05, block=16)[0].sum()) for s in spans) == 40
    masks = rc.select_rows([np.ones(20), np.ones(20)], 0.5, block=16)  # ties: the earlier span's blocks first
    assert [m.tolist() for m in masks] == [[True] * 20, [False] * 20]
    assert all(m.all() for m in rc.select_rows(spans, 1.0)) and not any(m.any() for m in rc.select_rows(spans, 0.0))


def _factors(rng: np.random.Generator, n: int, kd: int, r: int, scale: float) -> est.Factors:
    return [None] + [
        tuple(scale * rng.standard_normal(s).astype(np.float32) for s in ((n, r), (r, kd), (n, r), (r, kd)))  # type: ignore[misc]
        for _ in range(2)
    ]


def _squared_rows(factors: est.Factors) -> list[np.ndarray]:
    """Per (layer, K/V) with a correction: each row's ‖ΔK[i]‖², the dense delta formed in float64."""
    out = []
    for f in factors:
        if f is not None:
            for a, b in ((f[0], f[1]), (f[2], f[3])):
                out.append(((a.astype(np.float64) @ b.astype(np.float64)) ** 2).sum(1))
    return out


def test_scores_are_the_normalised_deviation_of_the_correction() -> None:
    rng = np.random.default_rng(0)
    n, kd, r = 20, 12, 3
    factors = _factors(rng, n, kd, r, 1.0)
    want = sum(rows / rows.mean() for rows in _squared_rows(factors))
    for corr in (est.Correction(factors), est.Correction(factors).sliced(0, n, 3)):
        np.testing.assert_allclose(rc.deviation_scores([(corr, n)], 3)[0], want, rtol=1e-9)
    assert not rc.deviation_scores([(None, n)], 3)[0].any()
    # two spans: each layer's K and V normalised by the mean over both spans' rows, so the span whose correction is
    # three times larger scores nine times higher; a span without a correction scores zeros and counts in the mean
    other = _factors(rng, 8, kd, r, 3.0)
    a_rows, b_rows = _squared_rows(factors), _squared_rows(other)
    means = [(x.sum() + y.sum()) / (n + 8 + 5) for x, y in zip(a_rows, b_rows, strict=True)]
    got = rc.deviation_scores([(est.Correction(factors), n), (None, 5), (est.Correction(other), 8)], 3)
    np.testing.assert_allclose(got[0], sum(x / m for x, m in zip(a_rows, means, strict=True)), rtol=1e-9)
    np.testing.assert_allclose(got[2], sum(y / m for y, m in zip(b_rows, means, strict=True)), rtol=1e-9)
    assert not got[1].any() and got[2].mean() > 4 * got[0].mean()


def test_budget_zero_is_the_method_unchanged(model, workflow, fitted) -> None:
    """recompute=0 is today's path; a budget too small to choose a row runs the recompute path with nothing
    chosen: both equal the default kvcmas bit for bit."""
    q = load_gsm8k(0, 1)[0]
    base_runner, base = _run(model, workflow, MethodConfig("kvcmas", 4), q, fitted)
    for budget in (0.0, 1e-12):
        runner, res = _run(model, workflow, MethodConfig("kvcmas", 4, recompute=budget), q, fitted)
        for h, b in zip(res.hops, base.hops, strict=True):
            np.testing.assert_array_equal(h.first_logits, b.first_logits)
            assert h.generated == b.generated and h.recomputed_tokens == 0
            assert (h.computed_tokens, h.kv_bytes, h.corr_bytes) == (b.computed_tokens, b.kv_bytes, b.corr_bytes)
        assert any(h.mode == "reuse" and h.corr_rank > 0 for h in res.hops)
        res.close()
        runner.close()
    base.close()
    base_runner.close()


def test_budget_one_is_nonshared_bit_for_bit(model, workflow, fitted) -> None:
    q = load_gsm8k(1, 1)[0]
    exact_runner, exact = _run(model, workflow, MethodConfig("nonshared"), q)
    runner, res = _run(model, workflow, MethodConfig("kvcmas", 4, recompute=1.0), q, fitted)
    for a, (h, e) in enumerate(zip(res.hops, exact.hops, strict=True)):
        np.testing.assert_array_equal(h.first_logits, e.first_logits)
        assert h.generated == e.generated
        assert h.computed_tokens == e.computed_tokens and h.kv_bytes == e.kv_bytes
        n = len(res.prompt_ids[a])
        for x, y in zip(res.seqs[a].kv(0, n), exact.seqs[a].kv(0, n), strict=True):
            np.testing.assert_array_equal(x, y)
        if a:  # the reader ran the method's reuse path and recomputed every shared row
            assert h.mode == "reuse" and h.recomputed_tokens > 0 and h.corr_bytes == 0
    res.close()
    exact.close()
    runner.close()
    exact_runner.close()


@pytest.mark.parametrize("correct", [True, False])
def test_partial_budget_recomputes_the_chosen_rows_and_counts_them(model, workflow, fitted, correct) -> None:
    q = load_gsm8k(2, 1)[0]
    budget = 0.3
    before = model.kv_bytes_in_use
    base_runner, base = _run(model, workflow, MethodConfig("kvcmas", 4, correct=correct), q, fitted)
    runner = WorkflowRunner(model, workflow, MethodConfig("kvcmas", 4, recompute=budget, correct=correct), fitted)
    # the rule, applied independently to agent 1's question span: its correction as the estimator makes it
    ids = question_ids(model, q)
    res = runner.run(ids, "msg", max_new_tokens=GEN)
    hop = res.hops[1]
    pos, n_q = res.span_pos[1]["user_question"]
    n = n_q - 4  # after the exact head
    maps = fitted.core_maps(("user_question", 1))
    assert maps is not None
    view_pos = res.span_pos[0]["user_question"][0] + 4
    corr = model.ridge_correction(maps, res.seqs[0], view_pos, n, view_pos, None)
    (scores,) = rc.deviation_scores([(est.Correction(kv=corr), n)], model.n_layer)  # the hop's only shared span
    (want,) = rc.select_rows([scores], budget)
    assert 0 < want.sum() < n
    np.testing.assert_array_equal(_own_rows(model, res.seqs[1], pos + 4, n), want)
    # accounting: the recomputed rows are computed tokens, KV the hop holds, and part of its TTFT's work
    for h, b in zip(res.hops[1:], base.hops[1:], strict=True):
        assert h.mode == b.mode == "reuse"
        assert h.recomputed_tokens > 0 and h.computed_tokens == b.computed_tokens + h.recomputed_tokens
        assert h.reused_tokens == b.reused_tokens - h.recomputed_tokens
        assert h.kv_bytes >= b.kv_bytes
    assert hop.recomputed_tokens >= math.ceil(budget * n)
    assert (
        runner.template_kv_bytes
        + sum(h.kv_bytes for h in res.hops)
        + sum(h.kv_bytes for h in base.hops)
        + base_runner.template_kv_bytes
        == model.kv_bytes_in_use - before
    )
    # the reused rows carry the correction only when it is applied
    assert (hop.corr_bytes > 0) == correct
    for x in (res, base):
        x.close()
    runner.close()
    base_runner.close()


def test_a_later_hop_spends_one_budget_over_its_spans(model, workflow, fitted) -> None:
    """The last agent reads the question and two relayed replies: the rows it recomputes over all three spans are
    the hop's budget (at least ceil(budget * rows), less than one block more), counted as recomputed tokens, and at a
    small budget some span gets none (a per-span budget would give every span a block)."""
    q = load_gsm8k(4, 1)[0]
    budget, gen = 0.05, 28
    cfg = MethodConfig("kvcmas", 4, recompute=budget, apply="fused")  # no copied rows: own rows are computed ones
    runner = WorkflowRunner(model, workflow, cfg, fitted)
    res = runner.run(question_ids(model, q), "msg", max_new_tokens=gen)
    a = len(res.hops) - 1
    spans = {ph: (pos + 4, n - 4) for ph, (pos, n) in res.span_pos[a].items() if n > 4}
    assert len(spans) >= 3 and res.hops[a].mode == "reuse"
    own = {ph: _own_rows(model, res.seqs[a], pos, n) for ph, (pos, n) in spans.items()}
    total = sum(n for _, n in spans.values())
    recomputed = sum(int(m.sum()) for m in own.values())
    assert recomputed == res.hops[a].recomputed_tokens
    assert math.ceil(budget * total) <= recomputed < math.ceil(budget * total) + rc.DEFAULT_BLOCK
    assert any(not m.any() for m in own.values())
    res.close()
    runner.close()


def test_agent_session_budget_one_answers_like_nonshared(model) -> None:
    """AgentSession(recompute=1): later agents recompute every shared token and reply exactly like nonshared;
    prefill(recompute=...) sets one call's budget (the server's per-request kvcmas.recompute)."""
    from kvcmas_cpp.agents import AgentSession

    q = load_gsm8k(3, 1)[0]
    replies = {}
    for method, budget in (("nonshared", None), ("kvcmas", 1.0)):
        cfg = MethodConfig(method, 4) if method == "kvcmas" else None  # no calibration reads: reuse at once
        with AgentSession(model, method, workflow=f"recompute-{method}", config=cfg, recompute=budget) as team:
            agents = [team.agent(n, system=f"You are agent {n}.") for n in ("A", "B", "C")]
            team.share(q)
            replies[method] = [a.respond(max_tokens=6) for a in agents]
    for r0, r1 in zip(replies["nonshared"], replies["kvcmas"], strict=True):
        assert r0.ids == r1.ids
        np.testing.assert_array_equal(r0.first_logits, r1.first_logits)
    assert all(r.stats.recomputed_tokens > 0 for r in replies["kvcmas"][1:])

    cfg = MethodConfig("kvcmas", 4)
    with AgentSession(model, "kvcmas", workflow="recompute-override", config=cfg) as team:
        team.share(q)
        team.agent("A", system="You are agent A.").respond(max_tokens=2)
        msgs = [{"role": "system", "content": "You are agent B."}, {"role": "user", "content": q}]
        for budget, want in ((None, 0), (1.0, len(question_ids(model, q)) - 4)):
            p = team.prefill(msgs, recompute=budget)
            assert p.hop.mode == "reuse" and p.hop.recomputed_tokens == want
            p.close()
        assert team._runner.config.recompute == 0.0  # the override lasted one call


def test_server_request_field_is_validated() -> None:
    from pydantic import ValidationError

    from kvcmas_cpp.server.schemas import ChatCompletionRequest

    ok = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "kvcmas": {"recompute": 0.25}}
    )
    assert ok.kvcmas is not None and ok.kvcmas.recompute == 0.25
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "x"}], "kvcmas": {"recompute": bad}}
            )
