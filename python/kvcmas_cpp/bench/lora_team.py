"""`kvcmas bench lora --team`: a team whose agents run with different LoRA adapters, sharing a context of N tokens,
under nonshared, fullshared and kvcmas in one run.

Three random adapters (bench.lora.write_random_adapter: random, not trained; they change the model's output as a
fine-tune would, which is what sharing across adapters has to correct) are loaded beside the model; four agents run
with adapters a, b, c, a over a shared context of N GSM8K tokens. kvcmas first calibrates its edges (each reader's,
from the view it reads, keyed on both adapters) on other contexts, untimed; then on each evaluation context:
nonshared generates the replies (the reference), fullshared and kvcmas are teacher-forced on them (so every method's
later prompts hold the same ids). Reported per method: the later agents' TTFT (the prompt's prefill, median) and
its speed-up over nonshared, and their first-token KL against nonshared (mean), with kvcmas' as a share of
fullshared's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..sharing.fidelity import kl_divergence
from .lora import write_random_adapter

ROLES = (
    ("Planner", "You plan the solution in short numbered steps."),
    ("Coder", "You write the arithmetic as Python expressions."),
    ("Critic", "You check the steps above and name the first wrong one."),
    ("Decider", "You give the final answer as a number."),
)
ADAPTERS = ("planner", "coder", "critic", "planner")  # per role: three adapters
METHODS = ("nonshared", "fullshared", "kvcmas")


def _contexts(model: Any, n_tokens: int, count: int, start: int) -> list[list[int]]:
    """`count` contexts of exactly n_tokens ids each, from consecutive GSM8K questions from line `start` on."""
    from ..sharing.workflow import load_gsm8k

    out: list[list[int]] = []
    line = start
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < n_tokens:
            ids += model.tokenize(load_gsm8k(line, 1)[0] + "\n", add_special=False)
            line += 1
        out.append(ids[:n_tokens])
    return out


def team_calls(
    team: Any, agents: list[Any], replies: list[list[int]] | None, gen: int
) -> list[tuple[np.ndarray, Any, list[int]]]:
    """Each agent of an AgentSession called in turn: (first-token logits, its ResponseStats, reply ids), the reply
    generated greedily (at most gen tokens) or, given `replies`, teacher-forced (every method's later prompts then
    hold the same ids)."""
    out = []
    for i, a in enumerate(agents):
        if replies is None:
            r = a.respond(max_tokens=gen)
            assert r.first_logits is not None
            out.append((r.first_logits, r.stats, r.ids))
            continue
        p = team.prefill_agent(a)
        try:
            logits = p.logits.copy()
            team.finish(p, replies[i])
            out.append((logits, team.stats_of(p), replies[i]))
        finally:
            team.release(p)
    return out


def _run(
    model: Any, method: str, context: list[int], replies: list[list[int]] | None, gen: int, **kw: Any
) -> list[tuple[np.ndarray, Any, list[int]]]:
    """team_calls of the bench's team over `context` in a fresh session."""
    from ..agents import AgentSession

    with AgentSession(model, method, calibration_dir=False, **kw) as team:
        agents = [
            team.agent(name, system=role, adapter=adapter)
            for (name, role), adapter in zip(ROLES, ADAPTERS, strict=True)
        ]
        team.share(context, label="Context")
        return team_calls(team, agents, replies, gen)


def bench_lora_team(
    model_path: str, rank: int, threads: int, shared_tokens: int, contexts: int, calibrate: int, gen: int
) -> dict[str, Any]:
    """The table's rows (one per method) and the run's settings."""
    from ..model import Model

    model = Model(model_path, n_threads=threads, n_ctx=shared_tokens + 1024)
    with tempfile.TemporaryDirectory(prefix="kvcmas-bench-lora-team-") as tmp:  # agents key maps by file content
        for i, name in enumerate(dict.fromkeys(ADAPTERS)):
            path = Path(tmp) / f"{name}.gguf"
            write_random_adapter(model_path, rank, path, seed=100 + i)
            model.load_adapter(path, name=name)
        return _bench(model, model_path, rank, threads, shared_tokens, contexts, calibrate, gen)


def _bench(
    model: Any, model_path: str, rank: int, threads: int, shared_tokens: int, contexts: int, calibrate: int, gen: int
) -> dict[str, Any]:
    workflow = f"bench-lora-team-{os.getpid()}"
    for context in _contexts(model, shared_tokens, calibrate, 1000):  # kvcmas learns its edges (untimed)
        _run(model, "kvcmas", context, None, gen, workflow=workflow, training_reads="eager")
    ttft: dict[str, list[float]] = {m: [] for m in METHODS}
    kl: dict[str, list[float]] = {m: [] for m in METHODS if m != "nonshared"}
    reused: dict[str, list[int]] = {m: [] for m in METHODS}
    gates: dict[str, set[str]] = {m: set() for m in METHODS}
    for context in _contexts(model, shared_tokens, contexts, 0):
        dense = _run(model, "nonshared", context, None, gen)
        replies = [ids for _, _, ids in dense]
        for method in METHODS:
            out = dense if method == "nonshared" else _run(model, method, context, replies, gen, workflow=workflow)
            for (ref, _, _), (logits, stats, _) in zip(dense[1:], out[1:], strict=True):
                ttft[method].append(stats.ttft_ms)
                reused[method].append(stats.span_tokens)
                gates[method].add(stats.gate)
                if method in kl:
                    kl[method].append(kl_divergence(ref, logits))
    base = float(np.median(ttft["nonshared"]))
    rows = []
    for method in METHODS:
        t = float(np.median(ttft[method]))
        row: dict[str, Any] = {
            "method": method,
            "later_ttft_ms": t,
            "speedup": base / t,
            "span_tokens": int(np.median(reused[method])),
            "gates": sorted(gates[method]),
        }
        if method in kl:
            row["kl"] = float(np.mean(kl[method]))
        rows.append(row)
    fs = next(r["kl"] for r in rows if r["method"] == "fullshared")
    for r in rows:
        if "kl" in r:
            r["kl_vs_fullshared"] = r["kl"] / fs if fs > 0 else float("nan")
    return {
        "model": model_path,
        "threads": threads,
        "rank": rank,
        "shared_tokens": shared_tokens,
        "contexts": contexts,
        "calibration_contexts": calibrate,
        "agents": [f"{name} ({adapter})" for (name, _), adapter in zip(ROLES, ADAPTERS, strict=True)],
        "rows": rows,
        "load_average": list(os.getloadavg()),  # the machine's load as the run ended (timings are wall clock)
    }


def print_team(result: dict[str, Any]) -> None:
    print(
        f"{os.path.basename(result['model'])}, {result['threads']} threads, {result['shared_tokens']} shared tokens, "
        f"{result['contexts']} contexts (kvcmas calibrated on {result['calibration_contexts']} others)"
    )
    print(f"agents: {', '.join(result['agents'])}; random rank-{result['rank']} adapters (not trained)")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in result['load_average'])}")
    print(
        f"{'method':<11} {'later TTFT ms':>13} {'vs nonshared':>12} {'span tokens':>11} {'1st-token KL':>12} "
        f"{'KL / fullshared':>15}  gates"
    )
    for r in result["rows"]:
        kl = f"{r['kl']:.5f}" if "kl" in r else "-"
        ratio = f"{r['kl_vs_fullshared']:.3f}" if "kl_vs_fullshared" in r else "-"
        print(
            f"{r['method']:<11} {r['later_ttft_ms']:>13.1f} {r['speedup']:>11.2f}x {r['span_tokens']:>11} {kl:>12} "
            f"{ratio:>15}  {', '.join(r['gates'])}"
        )
    km = next(r for r in result["rows"] if r["method"] == "kvcmas")
    ttft_ok, kl_ok = km["speedup"] >= 5.0, km.get("kl_vs_fullshared", 1.0) <= 1 / 3
    print(
        f"goal (kvcmas): TTFT >= 5x nonshared: {'met' if ttft_ok else 'not met'} ({km['speedup']:.2f}x); "
        f"KL <= 1/3 of fullshared's: {'met' if kl_ok else 'not met'} ({km.get('kl_vs_fullshared', float('nan')):.3f})"
    )
