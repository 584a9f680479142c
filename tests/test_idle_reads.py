"""Training reads off the agents' path (AgentSession(training_reads="idle"), the default): a call never runs a pending
read, the reads run while no call is in flight or at close(), and they fit the maps eager reads fit."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp import idle_reads
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.idle_reads import IdleReads
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing import methods as registry
from kvcmas_cpp.sharing.workflow import load_gsm8k

ROLES = (
    ("Planner", "You are a careful planner. Break the problem into steps."),
    ("Solver", "You are a math expert. Solve the problem step by step."),
    ("Critic", "You are a strict critic. Check the solution for mistakes."),
)


@pytest.fixture
def never_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker waits for an idle spell no test reaches (idle() is False), until a test sets IDLE_S back."""
    monkeypatch.setattr(idle_reads, "IDLE_S", 3600.0)


def _context() -> str:
    return "\n".join(load_gsm8k(300, 4))


def _team(model: kc.Model, ridge: est.RidgeEstimator, **kw: object) -> tuple[AgentSession, list[kc.agents.Agent]]:
    team = AgentSession(model, "kvcmas", estimator=ridge, calibration_dir=False, **kw)  # type: ignore[arg-type]
    agents = [team.agent(n, system=r) for n, r in ROLES]
    team.share(_context(), label="Context")
    return team, agents


def _set_idle(model: kc.Model, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    monkeypatch.setattr(idle_reads, "IDLE_S", seconds)
    worker = IdleReads.of(model)
    with worker._cond:  # wake the worker, which waits for the idle spell it last computed
        worker._cond.notify_all()


def _maps(ridge: est.RidgeEstimator, edge: est.Edge) -> list[np.ndarray]:
    """An edge's fitted maps as the matrices they apply (the reduced-rank W and the means; V's signs cancel)."""
    out = []
    for pair in ridge.maps[edge]:
        for m in pair or ():
            out += [m.proj @ m.vt, m.mu_x, m.mu_y]
    return out


def test_a_call_never_runs_a_pending_read_and_the_reads_run_once_idle(
    model: kc.Model, never_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ridge = est.RidgeEstimator(rank=8)
    team, (planner, solver, critic) = _team(model, ridge)
    with team:
        first = planner.respond(max_tokens=6)
        solved = solver.respond(max_tokens=6)
        assert solved.stats.gate == "calibrating -> reuse" and solved.stats.calibration_tokens_scheduled > 0
        (read,) = team._reads
        checked = critic.respond(max_tokens=6)  # the solver's read is pending: the critic's call must not run it
        assert read.steps == 0 and not read.done, "a call ran a pending read"
        assert checked.stats.training_read_ms == 0 and checked.stats.ttft_ms > 0
        # the call computed its own rows only (its role and the exact head and tail), not the read's span
        assert checked.stats.computed_tokens < solved.stats.calibration_tokens_scheduled
        assert team.pending_training_reads == 2 and team.training_read_ms_total == 0
        assert not ridge.maps
        _set_idle(model, monkeypatch, 0.01)
        assert team.wait_training_reads(timeout=600)
        assert read.done and read.steps > 1 and team.pending_training_reads == 0
        assert team.training_read_ms_total >= read.ms > 0
        assert len(ridge.maps) >= 2  # the solver's and the critic's edges
    with AgentSession(model, "nonshared") as ref:  # the first agent is exact
        r_planner = ref.agent(ROLES[0][0], system=ROLES[0][1])
        ref.share(_context(), label="Context")
        exact = r_planner.respond(max_tokens=6)
    assert first.ids == exact.ids and first.first_logits is not None and exact.first_logits is not None
    np.testing.assert_array_equal(first.first_logits, exact.first_logits)


def test_idle_reads_fit_the_maps_eager_reads_fit(model: kc.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver's read run by the worker (in steps of READ_STEP_ROWS rows, after the critic's call) and the same
    read run eagerly (in one piece, at the start of the critic's call) give the solver's edges the same maps."""
    fitted = {}
    for policy in ("idle", "eager"):
        monkeypatch.setattr(idle_reads, "IDLE_S", 3600.0)
        ridge = est.RidgeEstimator(rank=8)
        team, (planner, solver, critic) = _team(model, ridge, training_reads=policy)
        with team:
            planner.respond(max_tokens=6)
            solver.respond(max_tokens=6)
            (read,) = team._reads
            edges = [part.edge for part in read.parts]
            eager = critic.respond(max_tokens=6)
            assert (eager.stats.training_read_ms > 0) == (policy == "eager") and read.done == (policy == "eager")
            if policy == "idle":
                _set_idle(model, monkeypatch, 0.01)
                assert team.wait_training_reads(timeout=600)
                assert read.steps > 2  # in pieces: prefill chunks, statistics batches, a fit per edge
            fitted[policy] = {edge: _maps(ridge, edge) for edge in edges}
    assert fitted["idle"].keys() == fitted["eager"].keys()
    for edge, maps in fitted["idle"].items():
        for a, b in zip(maps, fitted["eager"][edge], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * float(np.abs(b).max()))


def test_close_runs_the_reads_left_and_a_call_in_flight_holds_them_back(
    model: kc.Model, never_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ridge = est.RidgeEstimator(rank=8)
    team, (planner, solver, critic) = _team(model, ridge)
    planner.respond(max_tokens=6)
    solver.respond(max_tokens=6)
    (read,) = team._reads
    p = team.prefill_agent(critic)  # a call in flight (its reply not in yet)
    _set_idle(model, monkeypatch, 0.01)
    time.sleep(0.5)
    assert read.steps == 0  # the worker waits for the call to end
    team.finish(p, [int(t) for t in model.tokenize(" Looks right.", add_special=False)])
    p.close()
    _set_idle(model, monkeypatch, 3600.0)
    team.close()  # runs what is left, on this thread
    assert read.done and team.pending_training_reads == 0 and len(ridge.maps) >= 2
    assert team.training_read_ms_total > 0


def test_training_reads_setting_is_checked(model: kc.Model) -> None:
    with pytest.raises(ValueError, match="training_reads"):
        AgentSession(model, "kvcmas", training_reads="later", calibration_dir=False)  # type: ignore[arg-type]


def test_a_sampled_read_computes_the_exact_first_rows_of_a_long_span(model: kc.Model, never_idle: None) -> None:
    """MethodConfig.read_rows: the solver's read computes the context's exact rows up to its first read_rows rows
    after the head (nonshared's rows for the same prompt), appends the rest as the solver read it, and fits the edge
    on those rows; the next workflow reuses with the map."""
    cap = 32
    config = dataclasses.replace(registry.method("kvcmas", session=True).config(for_session=True), read_rows=cap)
    ridge = est.RidgeEstimator(rank=8)
    team, (planner, solver, _) = _team(model, ridge, config=config)
    with team:
        reply = planner.respond(max_tokens=6)
        solved = solver.respond(max_tokens=6)
        (read,) = team._reads
        context = next(part for part in read.parts if part.n == cap)
        assert context.chain is None  # its exact rows do not cover the span: the chain goes on from the view
        n_context = len(model.tokenize(_context(), add_special=False))
        assert read.rows < solved.stats.calibration_tokens_scheduled + 1 and read.rows < n_context
        computing = sum(-(-len(piece) // read.chunk) for piece in read.pieces if isinstance(piece, list))
        while read.steps < computing:
            read.step()
        exact_k, exact_v = read.source.kv(context.pos, cap)
        with AgentSession(model, "nonshared") as ref:
            r_planner, r_solver = (ref.agent(n, system=r) for n, r in ROLES[:2])
            ref.share(_context(), label="Context")
            assert r_planner.respond(max_tokens=6).ids == reply.ids
            with ref.prefill_agent(r_solver) as p:
                assert p.seq.tokens[: context.pos + cap] == read.source.tokens[: context.pos + cap]
                want_k, want_v = p.seq.kv(context.pos, cap)
        np.testing.assert_allclose(exact_k, want_k, rtol=1e-4, atol=1e-4 * float(np.abs(want_k).max()))
        np.testing.assert_allclose(exact_v, want_v, rtol=1e-4, atol=1e-4 * float(np.abs(want_v).max()))
        read.run()
        assert read.done and context.edge in read.fitted and context.edge in ridge.maps
    team, (planner, solver, _) = _team(model, ridge, config=config)
    with team:
        planner.respond(max_tokens=6)
        again = solver.respond(max_tokens=6).stats
        assert again.gate == "reuse" and again.corr_rank > 0 and again.calibration_tokens_scheduled == 0


def _computed_rows(monkeypatch: pytest.MonkeyPatch, read: object) -> list[int]:
    """Counts the rows the engine is asked to compute in a read's own sequence (KVSequence.append, still run)."""
    counted = [0]
    append = kc.model.KVSequence.append

    def counting(seq: kc.model.KVSequence, ids: object, *args: object, **kw: object) -> object:
        if seq is read.source:  # type: ignore[attr-defined]
            counted[0] += len(ids)  # type: ignore[arg-type]
        return append(seq, ids, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(kc.model.KVSequence, "append", counting)
    return counted


def _long_context(model: kc.Model, tokens: int) -> str:
    picked: list[str] = []
    for text in load_gsm8k(100, 1000):
        picked.append(text)
        if len(model.tokenize("\n".join(picked), add_special=False)) >= tokens:
            return "\n".join(picked)
    raise AssertionError("not enough GSM8K text")


def test_the_default_read_of_a_2k_context_computes_its_bound_and_reports_its_time(
    model: kc.Model, never_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default settings (issue 48): a 2K-token context's training read computes the context's exact rows only up to
    MethodConfig.read_rows after the head (counted as the engine is asked to compute them), appends the rest as the
    reader read it, reports its rows in calibration_tokens_scheduled, fits the edge on the rows computed, and
    training_read_ms_total is the time the read took."""
    config = registry.method("kvcmas", session=True).config(for_session=True)
    assert config.read_rows == registry.READ_ROWS > 0, "the default read is bounded"
    ridge = est.RidgeEstimator(rank=8)
    team = AgentSession(model, "kvcmas", estimator=ridge, calibration_dir=False)
    planner, solver = (team.agent(n, system=r) for n, r in ROLES[:2])
    team.share(_long_context(model, 2048), label="Context")
    with team:
        planner.respond(max_tokens=2)
        solved = solver.respond(max_tokens=2)
        (read,) = team._reads
        (context,) = read.parts  # the planner's one-token reply is within the exact head: no span of its own
        assert context.n == config.read_rows and context.chain is None
        by_reference = sum(len(piece[0]) for piece in read.pieces if isinstance(piece, tuple))
        assert by_reference > 1900 - config.read_rows  # the rest of the 2K span, as the solver read it
        counted = _computed_rows(monkeypatch, read)
        start = time.perf_counter()
        assert team.run_training_reads() == 1
        wall_ms = (time.perf_counter() - start) * 1000.0
        # what ran: the span's first read_rows rows after its head, and before them the solver's own rows up to the
        # span (its role's template after the prefix, the head), which its call computed too
        assert counted[0] == read.rows == solved.stats.calibration_tokens_scheduled
        assert config.read_rows < counted[0] <= config.read_rows + solved.stats.computed_tokens
        assert read.done and context.edge in ridge.maps
        assert 0.8 * wall_ms <= team.training_read_ms_total <= wall_ms
