"""Task accuracy of each sharing method (`kvcmas bench agents --task ...`): each method runs the task's team (3 role
agents + decision agent, fully connected) on the same examples through the agent-session API, free-running (greedy);
per method the task accuracy of the decision agent's answer, and fidelity against `nonshared`: replies identical,
first-token top-1 agreement and KL on the hops whose prompt is still identical to nonshared's (once an upstream reply
differs, later prompts differ too). Then each method's team is teacher-forced on nonshared's replies: teacher-forced
top-1 per hop. Both are also summarized per later reader (`per_reader`), which shows where a team loses its identical
replies. Accuracy differences against nonshared come with a paired 95% bootstrap interval and McNemar's exact test.
Methods may carry a recompute budget (`kvcmas@0.1`) or be the selective-recompute-only baseline (`recompute@0.1`).
The numeric references (NUMERIC_VARIANTS: `nonshared+kv-f16`, `nonshared+act-f32`) are nonshared on another valid
engine configuration: how far numerics alone, with nothing shared, move the same fidelity figures.
Results go to a JSONL file one example at a time, keyed by (example, method), so a long run can resume (`--resume`)
and new methods can be added to a finished run. Concurrency, cold start and the printed tables and plots are in
concurrency.py, cold_start.py and report.py."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..agents import CALIBRATION_READS, AgentSession, Response
from ..model import Model
from ..sharing import methods as registry
from ..sharing.fidelity import kl_divergence
from ..sharing.methods import LEARNING_METHODS, SESSION_METHODS, MethodConfig, parse_label
from .progress import progress_bar
from .tasks import Example, Task, get_task

CALIBRATION_OFFSET = {"gsm8k": 1000, "mmlu": 1000, "humaneval": None}  # None: the last problems of the set

# nonshared on a second engine configuration that is as valid as the default one, nothing shared: its row is the
# floor the fidelity figures have from numerics alone (label -> Model keyword arguments)
NUMERIC_VARIANTS: dict[str, dict[str, Any]] = {
    "nonshared+kv-f16": {"kv_type": "f16"},  # K/V rows stored in f16, llama.cpp's default cache type
    "nonshared+act-f32": {"activations": "f32"},  # exact f32 activations in the decode steps instead of q8
}


def _config(name: str, calibrate: int) -> MethodConfig | None:
    """A method that learns online calibrates on `calibrate` reads here; the others run their session config."""
    entry = registry.method(name)
    return entry.config(for_session=True, calibrate=calibrate) if entry.learns_online else None


def session_spec(label: str, calibrate: int) -> tuple[str, MethodConfig | None]:
    """The AgentSession method and config a method label names (a name, METHOD@B, recompute@B or a numeric
    reference of NUMERIC_VARIANTS)."""
    if label in NUMERIC_VARIANTS:
        return "nonshared", None
    name, budget, correct = parse_label(label)
    if name not in SESSION_METHODS:
        raise ValueError(f"accuracy mode runs {', '.join(SESSION_METHODS)} (and @budgets); got {label!r}")
    cfg = _config(name, calibrate)
    if budget is None:
        return name, cfg
    base = cfg or registry.method(name).config(for_session=True)
    return name, dataclasses.replace(base, recompute=budget, correct=correct)


def variant_models(model: Model, methods: Sequence[str]) -> dict[str, Model]:
    """The model each numeric reference among `methods` runs on: `model`'s file and threads, loaded again with the
    variant's configuration."""
    return {
        m: Model(model.path, n_threads=model.n_threads, n_ctx=model.n_ctx, **NUMERIC_VARIANTS[m])
        for m in methods
        if m in NUMERIC_VARIANTS
    }


def run_workflow(
    model: Model,
    task: Task,
    method: str,
    question: str,
    max_tokens: int,
    calibrate: int = CALIBRATION_READS,
    forced: Sequence[Sequence[int]] | None = None,
) -> list[Response] | list[float]:
    """One request of the task's team under a method label; the estimator is shared by every request of the task
    (and by every budget of a method). forced: per agent, the reply ids to teacher-force (nonshared's); then the
    result is each agent's teacher-forced top-1 agreement with them instead of its responses."""
    wf = task.workflow()
    name, cfg = session_spec(method, calibrate)
    # calibration_dir=False: what the learned methods use is fitted by this run's --calibrate examples, never maps an
    # earlier run (or the user's own sessions) left in the calibration directory
    with AgentSession(model, name, workflow=f"bench-{task.name}", config=cfg, calibration_dir=False) as team:
        agents = [team.agent(a.name, system=a.role, template=a.user_template) for a in wf.agents]
        team.share(question)
        if forced is None:
            return [a.respond(max_tokens=max_tokens) for a in agents]
        return [_teacher_forced(team, a, list(ids)) for a, ids in zip(agents, forced, strict=True)]


def _teacher_forced(team: AgentSession, agent: Any, ids: list[int]) -> float:
    """The agent's prompt under the method, then `ids` fed as its reply: the share of steps whose argmax is the next
    id (the reply becomes the span later agents read, as a generated one would)."""
    p = team.prefill_agent(agent)
    try:
        preds = [int(np.argmax(p.logits))]
        if len(ids) > 1:
            logits = p.seq.append(ids[:-1], logits="all")
            assert logits is not None
            preds += [int(x) for x in np.argmax(logits, axis=1)]
        team.finish(p, ids)
        return float(np.mean([a == b for a, b in zip(preds, ids, strict=False)])) if ids else 1.0
    finally:
        p.close()


def calibration_tokens(calibrate_tokens: int | None, max_tokens: int) -> int:
    """Reply tokens per agent in calibration examples: as many as the evaluated replies unless told otherwise, so
    the maps of the reply spans' edges are fitted on replies as long as the ones they will correct. A value given
    below 1 is refused (the CLI calls this before loading a model)."""
    if calibrate_tokens is not None and calibrate_tokens < 1:
        raise ValueError(
            "calibration examples need at least 1 reply token per agent: "
            f"--calibrate-tokens must be at least 1, got {calibrate_tokens}"
        )
    return max_tokens if calibrate_tokens is None else calibrate_tokens


def check_counts(limit: int | None, max_tokens: int, calibrate: int) -> None:
    """Refuses counts that would run nothing or calibrate on nothing (the CLI calls this before loading a model)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1 example, got {limit}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    if calibrate < 0:
        raise ValueError(f"--calibrate must be 0 or more examples, got {calibrate}")


def calibration_examples(task: Task, n: int, limit: int) -> list[Example]:
    """Examples the learned methods calibrate on, disjoint from the evaluated [0, limit)."""
    if n == 0:
        return []
    offset = CALIBRATION_OFFSET.get(task.name)
    if offset is None:
        total = task.size()
        offset = total - n
        if offset < limit:
            raise ValueError(f"{task.name}: {limit} evaluated + {n} calibration examples exceed the {total} available")
    return task.load(offset, n)


def compare(exact: Sequence[Response], other: Sequence[Response]) -> list[dict[str, Any]]:
    """Per hop: identical reply, and while every upstream reply is identical (same prompt), first-token top-1
    agreement and KL(exact || other)."""
    rows: list[dict[str, Any]] = []
    aligned = True
    for e, o in zip(exact, other, strict=True):
        row: dict[str, Any] = {"agent": o.agent, "identical": e.ids == o.ids, "aligned": aligned}
        if aligned and e.first_logits is not None and o.first_logits is not None:
            row["kl"] = kl_divergence(e.first_logits, o.first_logits)
            row["top1"] = bool(np.argmax(e.first_logits) == np.argmax(o.first_logits))
        aligned = aligned and e.ids == o.ids
        rows.append(row)
    return rows


def accuracy(
    model: Model,
    task_name: str,
    methods: list[str],
    limit: int,
    max_tokens: int,
    calibrate: int,
    out_path: Path | None,
    resume: bool,
    teacher_forced: bool = True,
    calibrate_tokens: int | None = None,
) -> dict[str, Any]:
    """Runs every method on examples [0, limit) and returns the per-method summary (see the module doc).
    calibrate_tokens: reply tokens per agent in the calibration examples (None: max_tokens)."""
    for m in methods:
        session_spec(m, calibrate)  # validates the label
    check_counts(limit, max_tokens, calibrate)
    n_calibration_tokens = calibration_tokens(calibrate_tokens, max_tokens)  # validated before any work
    if "nonshared" not in methods:
        methods = ["nonshared", *methods]
    task = get_task(task_name)
    examples = task.load(0, limit)
    models = variant_models(model, methods)
    done = _finished(out_path) if out_path is not None and resume and out_path.is_file() else {}
    if calibrate:
        learned = list(dict.fromkeys(session_spec(m, calibrate)[0] for m in methods))
        learned = [m for m in learned if m in LEARNING_METHODS]
        train = calibration_examples(task, calibrate, limit)
        bar = progress_bar(len(train) * len(learned), "calibration")
        for m in learned:
            for ex in train:
                run_workflow(model, task, m, ex.question, n_calibration_tokens, calibrate)
                bar.update()
        bar.close()
    records: list[dict[str, Any]] = []
    bar = progress_bar(len(examples), f"{task.name} x {len(methods)} methods")
    out = out_path.open("a") if out_path is not None else None
    try:
        for ex in examples:
            have = done.get(ex.id, {})
            missing = [m for m in methods if m not in have]
            if not missing:
                records.append({"id": ex.id, "per_method": {m: have[m] for m in methods}})
                bar.update()
                continue
            todo = ["nonshared", *[m for m in missing if m != "nonshared"]]  # the reference runs again (greedy)
            runs: dict[str, list[Response]] = {}
            for m in todo:
                runs[m] = run_workflow(models.get(m, model), task, m, ex.question, max_tokens, calibrate)  # type: ignore[assignment]
            forced = [r.ids for r in runs["nonshared"]]
            rec: dict[str, Any] = {"id": ex.id, "methods": todo, "per_method": {}}
            for m, rs in runs.items():
                tf: list[float] = [1.0] * len(rs)
                if teacher_forced and m != "nonshared":
                    tf = run_workflow(models.get(m, model), task, m, ex.question, max_tokens, calibrate, forced)  # type: ignore[assignment]
                rec["per_method"][m] = {
                    "correct": bool(task.score(ex, rs[-1].text)),
                    "answer": task.extract(rs[-1].text),
                    "hops": [r.stats.as_dict() for r in rs],
                    "fidelity": compare(runs["nonshared"], rs),
                    "tf_top1": tf,
                }
            _with_reference(rec["per_method"])
            records.append({"id": ex.id, "per_method": {**have, **rec["per_method"]}})
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            bar.update()
    finally:
        if out is not None:
            out.close()
        bar.close()
    return {"task": task.name, "examples": len(records), "summary": summarize(records, methods)}


def _finished(out_path: Path) -> dict[str, dict[str, Any]]:
    """An accuracy JSONL's results: example id -> method -> result (later lines win), in the file's order."""
    done: dict[str, dict[str, Any]] = {}
    for i, line in enumerate(out_path.read_text().splitlines()):
        if line.strip():
            try:
                old = json.loads(line)
                per_method = old["per_method"]
                done.setdefault(old["id"], {}).update(_with_reference(per_method))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{out_path}:{i + 1}: not a result line of the accuracy mode ({e!r})") from None
    return done


def report(task_name: str, methods: list[str], out_path: Path, limit: int | None = None) -> dict[str, Any]:
    """The summary of what an accuracy JSONL holds, running nothing: over the examples where every method (and the
    nonshared reference) has a result, so a run spread over days with --resume can be read at any point. limit:
    only examples [0, limit) of the task (the first problems of a longer run), None: all of them."""
    for m in methods:
        session_spec(m, 0)  # validates the label
    check_counts(limit, max_tokens=1, calibrate=0)  # only --limit applies to a report
    if "nonshared" not in methods:
        methods = ["nonshared", *methods]
    if not out_path.is_file():
        raise ValueError(f"{out_path}: no such results file")
    task = get_task(task_name)
    # the task's own examples only (ids are "<task>/<n>": gsm8k/0, mmlu/12, HumanEval/3), so the table's heading is true
    done = {k: v for k, v in _finished(out_path).items() if k.split("/")[0].lower() == task.name}
    if limit is not None:
        done = {k: v for k, v in done.items() if _example_number(k) < limit}
    complete = [k for k in done if all(m in done[k] for m in methods)]
    if not complete:
        have = sorted({m for k in done for m in done[k]})
        raise ValueError(
            f"{out_path}: no {task.name} example has results for all of {', '.join(methods)} "
            f"({len(done)} {task.name} examples; their methods: {', '.join(have) or 'none'})"
        )
    records = [{"id": k, "per_method": {m: done[k][m] for m in methods}} for k in complete]
    return {"task": task.name, "examples": len(records), "summary": summarize(records, methods)}


def _example_number(example_id: str) -> int:
    """n of an example id "<task>/<n>" (a malformed id sorts after every limit)."""
    n = example_id.rsplit("/", 1)[-1]
    return int(n) if n.isdigit() else sys.maxsize


def _later_ttft(result: dict[str, Any]) -> float:
    """The mean TTFT of a team run's later agents (every hop after the first)."""
    return float(np.mean([h["ttft_ms"] for h in result["hops"][1:]]))


def _with_reference(per_method: dict[str, Any]) -> dict[str, Any]:
    """Gives each method's result of one run of a question the later-agent TTFT of the nonshared reference that ran
    beside it (`reference_later_ttft_ms`), so speedups compare timings taken together even when --resume merges
    runs made on different days or under different load. Returns per_method (changed in place)."""
    ref = per_method.get("nonshared")
    if ref is not None:
        for result in per_method.values():
            result.setdefault("reference_later_ttft_ms", _later_ttft(ref))
    return per_method


def paired(base: Sequence[bool], other: Sequence[bool], n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Accuracy of `other` minus `base` over the same questions: the mean difference, its 95% paired bootstrap
    interval, McNemar's exact two-sided p-value, the discordant counts, and how many questions would make the
    interval's half-width 3 points at the observed spread of the per-question differences."""
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(other, dtype=np.float64)
    d = b - a
    n = len(d)
    rng = np.random.default_rng(seed)
    boots = d[rng.integers(0, n, size=(n_boot, n))].mean(axis=1) if n else np.zeros(1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    wins, losses = int(np.sum(d > 0)), int(np.sum(d < 0))
    k, m = min(wins, losses), wins + losses
    p = min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m) if m else 1.0
    sd = float(d.std(ddof=1)) if n > 1 else float("nan")
    need = math.ceil((1.96 * sd / 0.03) ** 2) if n > 1 and sd > 0 else None
    return {
        "diff": float(d.mean()) if n else float("nan"),
        "ci95": [float(lo), float(hi)],
        "mcnemar_p": p,
        "wins": wins,
        "losses": losses,
        "questions_for_3pt": need,
    }


def summarize(records: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base_correct = [r["per_method"]["nonshared"]["correct"] for r in records]
    for m in methods:
        per = [r["per_method"][m] for r in records]
        hops = [h for p in per for h in p["hops"][1:]]
        fid = [f for p in per for f in p["fidelity"][1:]]
        aligned = [f for f in fid if "kl" in f]
        readers = _per_reader(per)
        tf = [t for p in per if "tf_top1" in p for t in p["tf_top1"][1:]]
        rows.append(
            {
                "method": m,
                "accuracy": float(np.mean([p["correct"] for p in per])),
                "vs_nonshared": paired(base_correct, [p["correct"] for p in per]),
                "identical_replies": float(np.mean([f["identical"] for f in fid])),
                "unchanged_prompt_hops": sum(x["unchanged_prompt_hops"] for x in readers),
                "identical_with_unchanged_prompt": sum(x["identical_with_unchanged_prompt"] for x in readers),
                "aligned_hops": len(aligned),
                "first_token_top1": float(np.mean([f["top1"] for f in aligned])) if aligned else float("nan"),
                "first_token_kl": float(np.mean([f["kl"] for f in aligned])) if aligned else float("nan"),
                "tf_top1": float(np.mean(tf)) if tf else float("nan"),
                "later_ttft_ms": float(np.mean([h["ttft_ms"] for h in hops])),
                "computed_tokens": float(np.mean([h["computed_tokens"] for h in hops])),
                "recomputed_tokens": float(np.mean([h.get("recomputed_tokens", 0) for h in hops])),
                "kv_bytes_per_request": float(np.mean([sum(h["kv_bytes"] for h in p["hops"]) for p in per])),
                "corr_bytes_per_request": float(np.mean([sum(h["corr_bytes"] for h in p["hops"]) for p in per])),
                "reuse_share": float(np.mean([h["mode"] == "reuse" for h in hops])),
                "per_reader": readers,
            }
        )
    for r, m in zip(rows, methods, strict=True):  # against the nonshared runs that ran beside the method's
        base = float(np.mean([r_["per_method"][m]["reference_later_ttft_ms"] for r_ in records]))
        r["later_ttft_speedup"] = base / max(float(r["later_ttft_ms"]), 1e-9)
    return rows


def _per_reader(per: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per later reader (hop 1, 2, ...): its name, the hops whose upstream replies were all nonshared's, how many of
    them replied identically, and its teacher-forced top-1; where a team loses identical replies is read here."""
    readers: list[dict[str, Any]] = []
    for i in range(1, len(per[0]["hops"]) if per else 1):
        unchanged = [p["fidelity"][i]["identical"] for p in per if p["fidelity"][i]["aligned"]]
        tf = [p["tf_top1"][i] for p in per if "tf_top1" in p]
        readers.append(
            {
                "agent": per[0]["hops"][i]["agent"],
                "unchanged_prompt_hops": len(unchanged),
                "identical_with_unchanged_prompt": int(sum(unchanged)),
                "tf_top1": float(np.mean(tf)) if tf else float("nan"),
            }
        )
    return readers
