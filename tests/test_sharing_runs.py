"""Token-run matching: a run of a message's tokens equal to part of a span the session stores is read from that span's
rows (the part of an earlier reply a client passes on, a reply edited at its start, a paragraph whose boundary tokens
re-tokenize), with the span's correction restricted to those rows; shorter runs and other text are computed."""

from __future__ import annotations

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import MIN_PIECE_TOKENS, AgentSession
from kvcmas_cpp.idle_reads import IdleReads
from kvcmas_cpp.prefix_cache import PrefixCache
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing.runner import WorkflowRunner
from kvcmas_cpp.sharing.span import Span
from kvcmas_cpp.sharing.workflow import Workflow

TASK = (
    "The library has twelve study rooms on three floors. Members book a room for one to three hours, at most twice "
    "a week, up to fourteen days ahead; a booking nobody checks in to within fifteen minutes is released for "
    "walk-ins. Staff block rooms for events, see who booked which room, and export a weekly usage report."
)
REPLY = (
    "First, the booking rules need a clear limit on how far ahead members can book. Second, the staff need a "
    "simple way to block rooms for events without calling the developer. Third, the usage report should be "
    "exported every Monday morning as a plain spreadsheet file that anyone can open."
)
PLANNER = [{"role": "system", "content": "You are the planner."}, {"role": "user", "content": TASK}]


def _ids(model: kc.Model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special=False, parse_special=False)


def _common_run(a: list[int], b: list[int]) -> int:
    """Length of the longest contiguous run of ids both hold (dynamic programming: the reference, not the index)."""
    best, prev = 0, [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            if x == y:
                cur[j + 1] = prev[j] + 1
                best = max(best, cur[j + 1])
        prev = cur
    return best


def _kl(ref: np.ndarray, got: np.ndarray) -> float:
    p = ref.astype(np.float64) - np.logaddexp.reduce(ref.astype(np.float64))
    q = got.astype(np.float64) - np.logaddexp.reduce(got.astype(np.float64))
    return float(np.sum(np.exp(p) * (p - q)))


def _dense_logits(model: kc.Model, messages: list[dict[str, str]]) -> np.ndarray:
    with AgentSession(model, "nonshared") as ref, ref.prefill(messages) as p:
        return p.logits.copy()


def _team_with_reply(model: kc.Model, method: str, reply: str = REPLY) -> AgentSession:
    """A session whose planner read TASK and replied `reply` (registered as the client received it)."""
    team = AgentSession(model, method, calibration_dir=False, workflow=f"runs-{method}")
    with team.prefill(PLANNER) as p:
        team.finish(p, _ids(model, reply), reply)
    return team


@pytest.mark.parametrize("method", ["fullshared", "kvcmas"])
def test_the_middle_of_a_reply_reuses_exactly_its_rows(model: kc.Model, method: str) -> None:
    """The critic gets only the middle sentence of the planner's reply, inside its own text: that run comes from the
    reply's stored rows (span tokens = the run's length, less the method's exact head), the rest is computed, and
    the next-token distribution stays as close to the dense prompt's as reading the whole reply by reference."""
    middle = REPLY[REPLY.index("Second") : REPLY.index(" Third")]
    wrapped = f"One point of the plan:\n{middle}\nIs that enough?"
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": wrapped}]
    run = _common_run(_ids(model, wrapped), _ids(model, REPLY))
    assert run >= MIN_PIECE_TOKENS and run >= len(_ids(model, middle)) - 2  # at most its re-tokenized first token
    head = {"fullshared": 0, "kvcmas": 4}[method]
    whole = [msgs[0], {"role": "user", "content": f"One point of the plan:\n{REPLY}\nIs that enough?"}]
    with _team_with_reply(model, method) as team:
        with team.prefill(msgs) as p:
            s = p.stats
            assert s["mode"] == "reuse" and s["span_tokens"] == run - head, s
            assert s["computed_tokens"] + s["reused_tokens"] == s["prompt_tokens"]
            shared = [g for g in model.sequence_segments(p.seq.id) if g["shared"]]
            assert [g["n"] for g in shared][-1] == run - head  # one stored segment of the run's rows
            kl_run = _kl(_dense_logits(model, msgs), p.logits)
        with team.prefill(whole) as p:  # the whole reply by reference: the existing path, the reference bound
            assert p.stats["span_tokens"] >= len(_ids(model, REPLY)) - head
            kl_whole = _kl(_dense_logits(model, whole), p.logits)
    print(f"{method}: first-token KL to dense, run {kl_run:.4f}, whole reply {kl_whole:.4f}")
    assert kl_run < 0.1 and kl_run <= 2 * kl_whole + 0.02


def test_a_reply_edited_at_its_start_is_found_for_the_rest(model: kc.Model) -> None:
    edited = "To sum up: " + REPLY[REPLY.index("the booking") :]
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": edited}]
    run = _common_run(_ids(model, edited), _ids(model, REPLY))
    assert run >= len(_ids(model, REPLY)) - 4
    with _team_with_reply(model, "fullshared") as team, team.prefill(msgs) as p:
        assert p.stats["span_tokens"] == run
        assert model.detokenize(list(p.hop.prompt)) == model.apply_chat_template(msgs, add_generation_prompt=True)


def test_a_sentence_cut_out_of_a_reply_leaves_two_runs(model: kc.Model) -> None:
    """The middle sentence removed: the runs before and after the cut are both reused; where they meet, one token is
    computed (the method computes text between two spans)."""
    cut = REPLY[: REPLY.index(" Second")] + REPLY[REPLY.index(" Third") :]
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": cut}]
    cut_ids, reply_ids = _ids(model, cut), _ids(model, REPLY)
    before = next(i for i in range(len(cut_ids)) if cut_ids[i] != reply_ids[i])
    after = next(i for i in range(1, len(cut_ids)) if cut_ids[-i - 1] != reply_ids[-i - 1])
    # the cut text is one run of the reply's start and one of its end (they share the period where they meet)
    assert before + after >= len(cut_ids) and min(before, after) > MIN_PIECE_TOKENS
    with _team_with_reply(model, "fullshared") as team, team.prefill(msgs) as p:
        assert p.stats["span_tokens"] == len(cut_ids) - 1


def test_a_paragraph_whose_boundary_re_tokenizes_is_found(model: kc.Model) -> None:
    """The task came as a paragraph of a bigger message (stored after a newline); it comes back glued to other text,
    so its first token reads differently: the run from its second token on is reused."""
    first = [PLANNER[0], {"role": "user", "content": "Read this.\n\n" + TASK + "\n\nThen plan."}]
    glued = "Task: " + TASK + " Critique the plan."
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": glued}]
    task_ids, glued_ids = _ids(model, TASK), _ids(model, glued)
    assert not any(glued_ids[i : i + len(task_ids)] == task_ids for i in range(len(glued_ids)))  # not whole
    run = _common_run(glued_ids, task_ids)
    assert len(task_ids) - 3 <= run < len(task_ids)
    with AgentSession(model, "fullshared", calibration_dir=False) as team:
        with team.prefill(first) as p:
            team.finish(p, _ids(model, "Fine."), "Fine.")
        with team.prefill(msgs) as p:
            assert p.stats["span_tokens"] == run


def test_a_whole_message_wrapped_in_other_text_is_found_by_its_tokens(model: kc.Model) -> None:
    """The planner's whole user message comes back after a label: its text is found, but its first token reads
    differently there (no cut at token boundaries for the whole text), so the run from its next token on is read."""
    wrapped = "Task: " + TASK + "\n\nCheck the plan."
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": wrapped}]
    run = _common_run(_ids(model, wrapped), _ids(model, TASK))
    assert len(_ids(model, TASK)) - 3 <= run < len(_ids(model, TASK))
    with _team_with_reply(model, "fullshared") as team, team.prefill(msgs) as p:
        assert p.stats["span_tokens"] == run


def test_no_run_below_the_minimum_and_no_false_match(model: kc.Model) -> None:
    reply_ids = _ids(model, REPLY)
    start = next(i for i in range(2, len(reply_ids)) if model.detokenize(reply_ids[i : i + 1]).startswith(" "))
    with _team_with_reply(model, "fullshared") as team:
        for n, expect in ((MIN_PIECE_TOKENS - 1, 0), (MIN_PIECE_TOKENS, MIN_PIECE_TOKENS)):
            text = "Quartz zebra:" + model.detokenize(reply_ids[start : start + n]) + " -- quartz zebra."
            assert _common_run(_ids(model, text), reply_ids) == n  # the run is exactly n tokens
            msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": text}]
            with team.prefill(msgs) as p:
                assert p.stats["span_tokens"] == expect, (n, p.stats)
        # the same words in another order: no run of MIN_PIECE_TOKENS tokens in common, nothing reused
        shuffled = " ".join(reversed(REPLY.split()))
        assert _common_run(_ids(model, shuffled), reply_ids) < MIN_PIECE_TOKENS
        msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": shuffled}]
        with team.prefill(msgs) as p:
            assert p.stats["span_tokens"] == 0
        # another session (another tenant's, or another method's) holds none of this session's spans
        notes = [PLANNER[0], {"role": "user", "content": "Notes:\n" + REPLY}]
        with AgentSession(model, "fullshared", calibration_dir=False) as other, other.prefill(notes) as p:
            assert p.stats["span_tokens"] == 0
    with AgentSession(model, "nonshared") as team:  # nonshared never splits a message: the exact reference prompt
        with team.prefill(PLANNER) as p:
            team.finish(p, reply_ids, REPLY)
        msgs = [PLANNER[0], {"role": "user", "content": "Notes:\n" + REPLY[REPLY.index("Second") :]}]
        with team.prefill(msgs) as p:
            assert p.stats["span_tokens"] == 0
            assert list(p.hop.prompt) == model.tokenize(
                model.apply_chat_template(msgs, add_generation_prompt=True), add_special=True
            )


def test_runs_hold_nothing_once_their_prompt_is_done(model: kc.Model) -> None:
    """A run's placeholder lives while its prompt does (finished or closed unfinished), and its rows are the stored
    span's: the session's KV returns to what it was before the session."""
    idle = IdleReads.of(model)
    assert idle.wait(timeout=300)  # reads other tests' sessions left pending hold KV while the idle worker runs them
    PrefixCache.of(model).clear()
    before = model.kv_bytes_in_use
    middle = REPLY[REPLY.index("Second") : REPLY.index(" Third")]
    msgs = [{"role": "system", "content": "You are the critic."}, {"role": "user", "content": "See:\n" + middle}]
    with _team_with_reply(model, "kvcmas") as team:
        for finish in (False, True):
            with team.prefill(msgs) as p:
                assert p.runs and all(team._state.stored(ph) for ph in p.runs)
                held = list(p.runs)
                if finish:
                    team.finish(p, [int(np.argmax(p.logits))])
            assert not any(ph in team._state.spans for ph in held)
        team.run_training_reads()
    assert idle.wait(timeout=300)
    PrefixCache.of(model).clear()
    assert model.kv_bytes_in_use == before


@pytest.mark.parametrize("core_factors", [False, True])
def test_a_sub_run_reads_the_spans_correction_restricted_to_its_rows(model: kc.Model, core_factors: bool) -> None:
    """WorkflowRunner.sub_span: rows [first, first + n) of a corrected stored span, appended elsewhere, equal the
    same rows of the whole span appended with its correction (numpy factors, or a core KvCorrection, sliced)."""
    span = _ids(model, REPLY)
    runner = WorkflowRunner(model, Workflow("w", ()), kc.agents.MethodConfig("fullshared"))
    rng = np.random.default_rng(0)
    kd, n_all = runner.kd, len(span)
    factors: est.Factors = [None] + [
        tuple(rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((n_all, 3), (3, kd), (n_all, 3), (3, kd)))
        for _ in range(model.n_layer - 1)
    ]  # type: ignore[misc]
    first, n = 11, 20
    with model.new_sequence() as src, model.new_sequence() as whole, model.new_sequence() as part:
        src.append(_ids(model, "Earlier text. ") + span, logits="none")
        pos = len(src) - n_all
        corr = est.Correction(factors)
        kv_all = corr.kv_correction(n_all, kd, model.n_layer)
        b = Span("reply", span).with_rows(
            src.share(pos, n_all), est.Correction(kv=kv_all) if core_factors else corr, pos, src, pos
        )
        sub = runner.sub_span(b, first, n)
        assert sub.shared is not None and sub.shared.tokens == tuple(span[first : first + n])
        assert sub.frame0 == pos + first and sub.view_pos == pos + first
        lead = _ids(model, "Other words here.")
        whole.append(lead, logits="none")
        whole.append_shared(b.shared, kv_all)
        part.append(lead + span[:first], logits="none")
        assert sub.corr is not None and sub.corr.in_core == core_factors
        part.append_shared(sub.shared, sub.corr.kv_correction(n, kd, model.n_layer))
        k0, v0 = whole.kv(len(lead) + first, n)
        k1, v1 = part.kv(len(lead) + first, n)
        assert np.abs(k1 - k0).max() <= 1e-4 * np.abs(k0).max() and np.abs(v1 - v0).max() <= 1e-4 * np.abs(v0).max()
        assert np.abs(v1 - src.kv(pos + first, n)[1]).max() > 1e-3  # the correction is in them
        with pytest.raises(ValueError, match="outside the stored span"):
            runner.sub_span(b, n_all - 3, 4)
    runner.close()
