"""Sharing KV across LoRA adapters (issue 49, item 4): agents of one session run with their own adapters (random
PEFT adapters of rank 8 on every linear layer of the default model, converted by convert-lora), and read each
other's spans by reference through the method.

References: the nonshared session with the same adapters (every agent computes its whole prompt with its own
adapter), which the first agent and the recompute dial at 1 must equal bit for bit; the engine's rows computed with
the reader's adapter for what a training read computes; fullshared's first-token KL for what kvcmas' corrections
must beat.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.adapters import UnknownAdapterError
from kvcmas_cpp.agents import AgentSession, shared_estimator
from kvcmas_cpp.bench.lora_team import team_calls
from kvcmas_cpp.sharing.adapter_views import file_digest
from kvcmas_cpp.sharing.methods import MethodConfig
from kvcmas_cpp.sharing.training_read import canonical
from kvcmas_cpp.sharing.workflow import load_gsm8k

pytest.importorskip("peft")
pytest.importorskip("gguf")
from helpers.lora import ALL_LINEAR, random_peft_adapter  # noqa: E402
from kvcmas_convert.lora import convert_lora  # noqa: E402

# adapter name -> seed; rank 8 on every linear layer, alpha 4 (scale 0.5: the adapted model still answers, and its
# first-token KL to the base is ~0.03 on a chat prompt: adapters that matter, not noise)
ADAPTERS = {"planner": 11, "coder": 12, "critic": 13}
RANK, ALPHA = 8, 4
# a 4-agent team with three adapters (the last agent runs the base model: a view of adapter None)
TEAM = (
    ("Planner", "You plan the solution in short numbered steps.", "planner"),
    ("Coder", "You write the arithmetic as Python expressions.", "coder"),
    ("Critic", "You check the steps above and name the first wrong one.", "critic"),
    ("Decider", "You give the final answer as a number.", None),
)
GEN = 6  # tokens per reply
HEAD = 4  # span tokens a kvcmas reader forwards exactly (the session default)


@pytest.fixture(scope="module")
def adapter_files(reference, reference_models, default_model_path: Path, tmp_path_factory) -> dict[str, Path]:
    base = reference.model(str(reference_models["F32"]))
    root = tmp_path_factory.mktemp("lora-sharing")
    out = {}
    for name, seed in ADAPTERS.items():
        folder = root / name
        random_peft_adapter(base, folder, ALL_LINEAR, RANK, ALPHA, seed)
        out[name] = root / f"{name}.gguf"
        convert_lora(folder, default_model_path, out[name])
    return out


@pytest.fixture(scope="module")
def model(default_model_path: Path, adapter_files: dict[str, Path]) -> kc.Model:
    m = kc.Model(default_model_path, n_threads=2, n_ctx=1024, kv_budget=256 << 20)
    for name, path in adapter_files.items():
        m.load_adapter(path, name=name)
    return m


def contexts(start: int, count: int, n_questions: int = 6) -> list[str]:
    qs = load_gsm8k(start, count * n_questions)
    return ["\n".join(qs[i * n_questions : (i + 1) * n_questions]) for i in range(count)]


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    p = ref.astype(np.float64) - np.logaddexp.reduce(ref.astype(np.float64))
    q = got.astype(np.float64) - np.logaddexp.reduce(got.astype(np.float64))
    return float(np.sum(np.exp(p) * (p - q)))


def declare(team: AgentSession, adapters: bool = True) -> list[kc.agents.Agent]:
    return [team.agent(name, system=role, adapter=adapter if adapters else None) for name, role, adapter in TEAM]


def run_team(
    model: kc.Model,
    method: str,
    context: str,
    replies: list[list[int]] | None = None,
    adapters: bool = True,
    **kw: object,
) -> list[tuple[np.ndarray, kc.agents.ResponseStats, list[int]]]:
    """Each agent's (first-token logits, stats, reply ids) over `context`: generated (greedy) or, given `replies`,
    teacher-forced (so every method's later prompts hold the same ids). adapters=False: the team on the base
    model."""
    kw.setdefault("calibration_dir", False)
    with AgentSession(model, method, **kw) as team:  # type: ignore[arg-type]
        agents = declare(team, adapters)
        team.share(context, label="Context")
        return team_calls(team, agents, replies, GEN)


def test_first_agent_is_exact_and_later_agents_read_by_reference(model: kc.Model) -> None:
    context = contexts(0, 1)[0]
    n_ctx = len(model.tokenize(context, add_special=False))
    row_bytes = model.kv_row_bytes
    dense = run_team(model, "nonshared", context)
    for method in ("fullshared", "kvcmas"):
        out = run_team(model, method, context, workflow=f"lshare-first-{method}")
        logits, stats, ids = out[0]
        np.testing.assert_array_equal(logits, dense[0][0])  # the first agent computes exactly, with its adapter
        assert ids == dense[0][2] and stats.mode == "source"
        for (_, s, _), (_, d, _) in zip(out[1:], dense[1:], strict=True):
            # the context comes by reference (whatever adapter computed it); the reader computes its own text only
            assert s.mode == "reuse" and s.span_tokens >= n_ctx - HEAD, s
            assert s.prompt_tokens == d.prompt_tokens == s.computed_tokens + s.reused_tokens
            assert s.computed_tokens < 80 < n_ctx <= d.computed_tokens
            # the counters are the engine's rows: what the call computed and generated is all the KV it holds
            assert s.kv_bytes == (s.computed_tokens + s.generated_tokens) * row_bytes
        assert [s.mode for _, s, _ in dense] == ["source", "dense", "dense", "dense"]


def test_adapters_change_what_agents_compute(model: kc.Model) -> None:
    """The reference itself: each agent's adapter changes its first token's distribution (else nothing below would
    test an adapter), and the team's spans are read across adapters."""
    context = contexts(0, 1)[0]
    with_adapters = run_team(model, "nonshared", context)
    without = run_team(model, "nonshared", context, [r for _, _, r in with_adapters], adapters=False)
    for (a, _, _), (b, _, _), (_, _, adapter) in zip(with_adapters, without, TEAM, strict=False):
        if adapter is not None:
            assert kl(b, a) > 1e-3


@pytest.fixture(scope="module")
def calibrated(model: kc.Model) -> str:
    """A kvcmas workflow whose edges (every reader's, from the view it reads, with both adapters) hold their reads:
    two cold-reuse workflows over other contexts."""
    workflow = "lshare-kl"
    for context in contexts(20, 2):
        out = run_team(model, "kvcmas", context, workflow=workflow, training_reads="eager")
        assert all(s.mode == "reuse" for _, s, _ in out[1:])
    return workflow


def test_kvcmas_first_token_kl_is_below_fullshared(model: kc.Model, calibrated: str) -> None:
    """Later agents' first-token KL against nonshared (same adapters, teacher-forced replies) under fullshared and
    calibrated kvcmas, on contexts the estimator never saw: kvcmas' corrections, learned per pair of adapters, must
    bring it below fullshared's."""
    table: dict[str, list[list[float]]] = {"fullshared": [], "kvcmas": []}
    for context in contexts(40, 2):
        dense = run_team(model, "nonshared", context)
        replies = [ids for _, _, ids in dense]
        for method in table:
            wf = calibrated if method == "kvcmas" else "lshare-kl-fs"
            out = run_team(model, method, context, replies, workflow=wf)
            if method == "kvcmas":
                assert all(s.gate == "reuse" and s.corr_rank > 0 for _, s, _ in out[1:]), [s for _, s, _ in out]
            assert all(s.mode == "reuse" for _, s, _ in out[1:])
            table[method].append([kl(d[0], o[0]) for d, o in zip(dense[1:], out[1:], strict=True)])
    means = {m: float(np.mean(v)) for m, v in table.items()}
    print("\nfirst-token KL vs nonshared, later agents (Coder, Critic, Decider) per context:")
    for m, rows in table.items():
        print(
            f"  {m:<10} mean {means[m]:.5f}  " + "  ".join("[" + ", ".join(f"{x:.5f}" for x in r) + "]" for r in rows)
        )
    assert 0 < means["kvcmas"] < means["fullshared"]


def test_a_map_learned_for_one_pair_of_adapters_never_serves_another(model: kc.Model, adapter_files, tmp_path) -> None:
    """The reader's edge from a planner-adapter view is fitted for the coder adapter; the same reader (role, system
    prompt) with the critic adapter, the base model, or the coder adapter at another scale must calibrate its own:
    if the edge ignored the adapter, the coder's map would correct them. Maps persist keyed by the adapter file's
    content: another model instance that loads the coder file under another name loads and uses them."""
    context, other = contexts(60, 2)
    workflow = "lshare-edges"

    def reader_gate(m: kc.Model, adapter: str | None, scale: float = 1.0, ctx: str = other) -> kc.agents.ResponseStats:
        with AgentSession(m, "kvcmas", workflow=workflow, calibration_dir=tmp_path, training_reads="manual") as team:
            writer = team.agent("Writer", system="You summarise the text.", adapter="planner")
            reader = team.agent("Reader", system="You answer the question.", adapter=adapter, adapter_scale=scale)
            team.share(ctx, label="Context")
            writer.respond(max_tokens=GEN)
            stats = reader.respond(max_tokens=GEN).stats
            team.run_training_reads()
            return stats

    assert reader_gate(model, "coder", ctx=context).gate == "calibrating -> reuse"  # its read fits (planner -> coder)
    fitted = reader_gate(model, "coder")
    assert fitted.gate == "reuse" and fitted.corr_rank > 0
    for adapter, scale in (("critic", 1.0), (None, 1.0), ("coder", 0.5)):
        assert reader_gate(model, adapter, scale).gate == "calibrating -> reuse", (adapter, scale)
    ridge = shared_estimator(model, "kvcmas", workflow)[0]
    planner, coder = (file_digest(str(adapter_files[n])) for n in ("planner", "coder"))
    readers = [reader for _, reader in ridge.maps]
    assert any(f"lora:{coder}*1<-" in r and f"+lora:{planner}*1" in r for r in readers), readers

    again = kc.Model(model.path, n_threads=2, n_ctx=1024, kv_budget=256 << 20)  # another pool: maps from disk
    again.load_adapter(adapter_files["planner"], name="plans")
    again.load_adapter(adapter_files["coder"], name="codes")
    again.load_adapter(adapter_files["planner"], name="planner")
    loaded = reader_gate(again, "codes")
    assert loaded.gate == "reuse" and loaded.corr_rank > 0


def test_recompute_dial_one_is_nonshared_with_adapters(model: kc.Model) -> None:
    """recompute=1: every later agent recomputes the shared rows in its own context, with its own adapter, and
    answers exactly as nonshared does."""
    context = contexts(80, 1)[0]
    dense = run_team(model, "nonshared", context)
    cfg = MethodConfig("kvcmas", 4)  # no calibration reads: reuse at once
    full = run_team(model, "kvcmas", context, workflow="lshare-dial", config=cfg, recompute=1.0)
    for (a, _, ids_a), (b, _, ids_b) in zip(dense, full, strict=True):
        np.testing.assert_array_equal(a, b)
        assert ids_a == ids_b
    assert all(s.recomputed_tokens > 0 for _, s, _ in full[1:])


def test_a_training_read_computes_the_readers_own_rows(model: kc.Model) -> None:
    """Under cold reuse the reader's training read computes the span's exact rows after the reader's template prefix:
    with the reader's adapter, the rows nonshared's reader holds (not the writer's), compared in the span's frame."""
    context = contexts(100, 1)[0]
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for method in ("nonshared", "kvcmas"):
        with AgentSession(
            model, method, workflow="lshare-read", calibration_dir=False, training_reads="manual"
        ) as team:
            writer, reader = declare(team)[:2]
            team.share(context, label="Context")
            writer.respond(max_tokens=GEN)
            if method == "nonshared":
                p = team.prefill_agent(reader)
                pos, n = p.pos_map["user_question"]
                rows["reader"] = canonical(model, p.seq, pos + HEAD, n - HEAD)
                p.close()
                continue
            assert team._runner.config.head == HEAD
            view = team._state.spans["user_question"]  # the writer's rows
            assert view.view_agent == writer.index
            rows["writer"] = canonical(model, view.view, view.view_pos, n - HEAD)
            assert reader.respond(max_tokens=GEN).stats.gate == "calibrating -> reuse"
            assert team.run_training_reads() == 1
            span = team._state.spans["user_question"]  # the chain goes on from the read's exact rows
            assert span.view_agent == reader.index and span.view is not view.view
            rows["read"] = canonical(model, span.view, span.view_pos, n - HEAD)
    for i in (0, 1):  # K, V
        err_read = float(np.abs(rows["read"][i] - rows["reader"][i]).max())
        err_writer = float(np.abs(rows["writer"][i] - rows["reader"][i]).max())
        assert err_read < 0.05 * err_writer, (i, err_read, err_writer)


def test_bad_adapter_arguments_are_clear_errors(model: kc.Model, adapter_files, tmp_path: Path) -> None:
    with AgentSession(model, "kvcmas", calibration_dir=False) as team:
        with pytest.raises(UnknownAdapterError, match="'reviewer'.*loaded: 'planner'"):
            team.agent("A", system="x", adapter="reviewer")
        for scale in (float("nan"), "1", True):
            with pytest.raises(ValueError, match="adapter_scale"):
                team.agent("A", system="x", adapter="planner", adapter_scale=scale)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="adapter must be the name"):
            team.agent("A", system="x", adapter=3)  # type: ignore[arg-type]
        assert team.agents == []  # nothing declared
        copy = tmp_path / "gone.gguf"
        copy.write_bytes(adapter_files["critic"].read_bytes())
        model.load_adapter(copy, name="gone")
        copy.unlink()  # its maps are keyed by the file's content, which can no longer be read
        try:
            with pytest.raises(ValueError, match="'gone': its file .*gone.gguf cannot be read"):
                team.agent("A", system="x", adapter="gone")
        finally:
            model.unload_adapter("gone")
        assert team.agents == []  # nothing declared
        a = team.agent("A", system="x", adapter="critic", adapter_scale=0.5)
        assert (a.adapter, a.adapter_scale) == ("critic", 0.5) and "critic" in repr(a)
        with team.fork() as other:  # a fork's agents keep their adapters (and so their edges)
            assert [(b.adapter, b.adapter_scale) for b in other.agents] == [("critic", 0.5)]
            assert other._identities == team._identities


# ------------------------------------------------------------------------------------------- bench and example


def test_bench_lora_team_reports_every_method(default_model_path: Path) -> None:
    """`kvcmas bench lora --team` at a small size: one row per method, the speed-ups are nonshared's TTFT over each
    row's, kvcmas reads calibrated spans with corrections, and its KL share is its KL over fullshared's."""
    from kvcmas_cpp.bench.lora_team import bench_lora_team

    result = bench_lora_team(str(default_model_path), 8, 2, 192, 1, 1, 2)
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["nonshared", "fullshared", "kvcmas"]
    base = rows["nonshared"]["later_ttft_ms"]
    for r in rows.values():
        assert r["speedup"] == pytest.approx(base / r["later_ttft_ms"])
    assert rows["nonshared"]["span_tokens"] == 0 and rows["nonshared"]["gates"] == ["n/a"]
    assert rows["fullshared"]["span_tokens"] >= 192 and rows["kvcmas"]["span_tokens"] >= 192 - HEAD
    assert rows["kvcmas"]["gates"] == ["reuse"] and rows["fullshared"]["kl"] > 0
    assert rows["kvcmas"]["kl_vs_fullshared"] == pytest.approx(rows["kvcmas"]["kl"] / rows["fullshared"]["kl"])
    assert len(result["load_average"]) == 3


@pytest.mark.slow
def test_the_lora_team_example_runs_offline_and_reuses() -> None:
    """examples/lora_team.py with its random adapters: it says they are random; in the second round the later agents
    read the task by reference with learned corrections."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "lora_team.py"), "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr
    assert "RANDOM LoRA adapters" in run.stdout
    calls = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [c["round"] for c in calls] == [1, 1, 1, 2, 2, 2]
    assert calls[0]["mode"] == "source" and calls[0]["adapter"] == "planner-random"
    for c in calls[4:]:
        assert c["mode"] == "reuse" and c["gate"] == "reuse" and c["corr_rank"] > 0 and c["span_tokens"] > 300, c
