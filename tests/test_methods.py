"""The method registry (sharing.methods): one entry per method, read by the runner, AgentSession and the server; and
the estimator protocol the runner drives without checking classes."""

from __future__ import annotations

import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import AgentSession
from kvcmas_cpp.sharing import estimators as est
from kvcmas_cpp.sharing import methods

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)


def test_the_registry_holds_the_methods_and_their_defaults() -> None:
    assert methods.METHODS == ("nonshared", "fullshared", "kvcmas", "kvcmas-ref", "kvcomm", "oracle")
    assert methods.names(session=True) == ("nonshared", "fullshared", "kvcmas", "kvcmas-ref", "kvcomm")  # no oracle
    assert methods.SERVED_METHODS == ("nonshared", "fullshared", "kvcmas")
    kv = methods.default_config("kvcmas")
    assert (kv.head, kv.rank, kv.calibrate) == (4, 8, 0)  # benchmarks fit offline
    session = methods.REGISTRY["kvcmas"].config(for_session=True)
    assert (session.head, session.rank, session.calibrate) == (4, 8, methods.CALIBRATION_READS)
    assert methods.default_config("kvcomm").rank == 0 and methods.default_config("oracle").rank == 32
    with pytest.raises(ValueError, match="choose from nonshared, fullshared, kvcmas$"):
        methods.method("kvcomm", served=True)


def test_the_benchmarks_take_their_method_configs_from_the_registry() -> None:
    """`kvcmas bench accuracy` and the demo read a method's config from its entry (learns_online: it calibrates on
    the benchmark's reads), not from its name."""
    from kvcmas_cpp.bench.accuracy import session_spec

    name, cfg = session_spec("kvcmas", 3)
    assert name == "kvcmas" and cfg == methods.MethodConfig(
        "kvcmas", head=4, rank=8, calibrate=3, read_rows=methods.READ_ROWS
    )  # the session default: bounded training reads
    assert session_spec("fullshared", 3) == ("fullshared", None)  # its session config, nothing to calibrate
    assert session_spec("kvcomm@0.5", 3)[1] == methods.MethodConfig("kvcomm", rank=0, recompute=0.5)
    assert session_spec("recompute@0.25", 3)[1] == methods.MethodConfig(
        "kvcmas", head=4, rank=8, calibrate=3, recompute=0.25, correct=False, read_rows=methods.READ_ROWS
    )
    assert [n for n, m in methods.REGISTRY.items() if m.learns_online] == ["kvcmas"]


def test_the_server_schema_takes_the_served_methods() -> None:
    from kvcmas_cpp.server.schemas import KvcmasOptions

    assert KvcmasOptions(method="fullshared").method == "fullshared"
    with pytest.raises(ValueError, match="the server runs nonshared, fullshared, kvcmas"):
        KvcmasOptions(method="kvcomm")


class _Asked(est.Estimator):
    """fullshared's estimator that records what the runner asks it (the protocol's calls)."""

    name = "asked"

    def __init__(self) -> None:
        self.asked: list[str] = []

    def decide(self, reader: int | str, phs: list[str], message: str) -> str | None:
        self.asked.append("decide")
        return None


def test_a_new_method_is_one_registry_entry(model: kc.Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering a method (its config defaults and estimator factory) is all AgentSession needs: the runner uses
    the entry's config and estimator, and asks the estimator through the protocol only."""
    made: list[_Asked] = []

    def factory(m: kc.Model, workflow: str, config: methods.MethodConfig) -> est.Estimator:
        made.append(_Asked())
        return made[-1]

    entry = methods.Method("asked", factory, defaults={"head": 2})
    monkeypatch.setitem(methods.REGISTRY, "asked", entry)
    with AgentSession(model, "asked", workflow="test-registry", calibration_dir=False) as team:
        a = team.agent("Solver", system="You are a math expert.")
        b = team.agent("Critic", system="You are a careful critic.")
        team.share(QUESTION, label="Question")
        a.respond(max_tokens=4)
        r = b.respond(max_tokens=1)
        assert team._runner.config.head == 2 and team._runner.estimator is made[0]
    assert r.stats.mode == "reuse" and r.stats.span_tokens > 0  # shared like fullshared, with a 2-token head
    assert made[0].asked == ["decide"]  # the later agent's hop asked it whether to go dense
    monkeypatch.delitem(methods.REGISTRY, "asked")
    with pytest.raises(ValueError, match="unknown method 'asked'"):
        AgentSession(model, "asked")
