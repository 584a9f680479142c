"""The evaluation harness behind `kvcmas bench agents --task ...` and `--concurrent ...`.

- accuracy: each method runs the task's team (3 role agents + decision agent, fully connected) on the same
  examples through the agent-session API, free-running (greedy); per method the task accuracy of the decision
  agent's answer, and fidelity against `nonshared`: replies identical, first-token top-1 agreement and KL on the
  hops whose prompt is still identical to nonshared's (once an upstream reply differs, later prompts differ too).
  Then each method's team is teacher-forced on nonshared's replies: teacher-forced top-1 per hop. Both are also
  summarized per later reader (`per_reader`), which shows where a team loses its identical replies. Accuracy differences
  against nonshared come with a paired 95% bootstrap interval and McNemar's exact test. Methods may carry a
  recompute budget (`kvcmas@0.1`) or be the selective-recompute-only baseline (`recompute@0.1`). The numeric
  references (NUMERIC_VARIANTS: `nonshared+kv-f16`, `nonshared+act-f32`) are nonshared on another valid engine
  configuration: how far numerics alone, with nothing shared, move the same fidelity figures.
  Results go to a JSONL file one example at a time, keyed by (example, method), so a long run can resume
  (`--resume`) and new methods can be added to a finished run.
- concurrent: N workflows at once (threads, each its own session) per level and method: TTFT percentiles of later
  hops, throughput and peak KV bytes.
- cold start: fresh sessions of the GSM8K team over an N-token shared context, workflow after workflow from a fresh
  estimator: later-agent TTFT and first-token KL against nonshared while kvcmas calibrates (cold reuse vs dense)
  and after.
- plots (matplotlib, PNG): accuracy per method, TTFT vs shared length and KV memory vs agents from the speed part.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .agents import CALIBRATION_READS, AgentSession, Response
from .model import Model
from .sharing import methods as registry
from .sharing.methods import SESSION_METHODS, MethodConfig, parse_label
from .tasks import Example, Task, get_task

CALIBRATION_OFFSET = {"gsm8k": 1000, "mmlu": 1000, "humaneval": None}  # None: the last problems of the set

# nonshared on a second engine configuration that is as valid as the default one, nothing shared: its row is the
# floor the fidelity figures have from numerics alone (label -> Model keyword arguments)
NUMERIC_VARIANTS: dict[str, dict[str, Any]] = {
    "nonshared+kv-f16": {"kv_type": "f16"},  # K/V rows stored in f16, llama.cpp's default cache type
    "nonshared+act-f32": {"activations": "f32"},  # exact f32 activations in the decode steps instead of q8
}


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def _config(method: str, calibrate: int) -> MethodConfig | None:
    return MethodConfig("kvcmas", head=4, rank=8, calibrate=calibrate) if method == "kvcmas" else None


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
    base = cfg or (MethodConfig(name, rank=0) if name == "kvcomm" else MethodConfig(name))
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


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def compare(exact: Sequence[Response], other: Sequence[Response]) -> list[dict[str, Any]]:
    """Per hop: identical reply, and while every upstream reply is identical (same prompt), first-token top-1
    agreement and KL(exact || other)."""
    rows: list[dict[str, Any]] = []
    aligned = True
    for e, o in zip(exact, other, strict=True):
        row: dict[str, Any] = {"agent": o.agent, "identical": e.ids == o.ids, "aligned": aligned}
        if aligned and e.first_logits is not None and o.first_logits is not None:
            p, q = _log_softmax(e.first_logits), _log_softmax(o.first_logits)
            row["kl"] = float(np.sum(np.exp(p) * (p - q)))
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
        learned = [m for m in learned if m in ("kvcmas", "kvcmas-ref", "kvcomm")]
        train = calibration_examples(task, calibrate, limit)
        bar = _progress(len(train) * len(learned), "calibration")
        for m in learned:
            for ex in train:
                run_workflow(model, task, m, ex.question, n_calibration_tokens, calibrate)
                bar.update()
        bar.close()
    records: list[dict[str, Any]] = []
    bar = _progress(len(examples), f"{task.name} x {len(methods)} methods")
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


def concurrent(
    model: Model,
    methods: list[str],
    levels: list[int],
    max_tokens: int,
    calibrate: int,
    calibrate_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """N GSM8K workflows at once per level and method (one session per thread); calibrate_tokens as in accuracy."""
    n_calibration_tokens = calibration_tokens(calibrate_tokens, max_tokens)
    task = get_task("gsm8k")
    questions = [e.question for e in task.load(0, max(levels))]
    if calibrate and "kvcmas" in methods:
        for ex in calibration_examples(task, calibrate, max(levels)):
            run_workflow(model, task, "kvcmas", ex.question, n_calibration_tokens, calibrate)
    rows: list[dict[str, Any]] = []
    bar = _progress(len(levels) * len(methods), "concurrent")
    for n in levels:
        for m in methods:
            results: list[list[Response]] = []
            errors: list[BaseException] = []
            peak = [model.kv_bytes_in_use]
            stop = threading.Event()

            def watch(peak: list[int] = peak, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], model.kv_bytes_in_use)
                    time.sleep(0.005)

            def work(q: str, m: str = m, results: list = results, errors: list = errors) -> None:
                try:
                    results.append(run_workflow(model, task, m, q, max_tokens, calibrate))
                except BaseException as e:  # noqa: BLE001 - reported after join
                    errors.append(e)

            base = model.kv_bytes_in_use
            watcher = threading.Thread(target=watch)
            watcher.start()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=work, args=(q,)) for q in questions[:n]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            stop.set()
            watcher.join()
            if errors:
                raise errors[0]
            later = np.array([r.stats.ttft_ms for rs in results for r in rs[1:]])
            generated = sum(r.stats.generated_tokens for rs in results for r in rs)
            rows.append(
                {
                    "workflows": n,
                    "method": m,
                    "ttft_p50_ms": float(np.percentile(later, 50)),
                    "ttft_p90_ms": float(np.percentile(later, 90)),
                    "ttft_p99_ms": float(np.percentile(later, 99)),
                    "workflows_per_s": n / wall,
                    "generated_tokens_per_s": generated / wall,
                    "peak_kv_bytes": int(peak[0] - base),
                    "wall_s": wall,
                }
            )
            bar.update()
    bar.close()
    return rows


# row name -> (session method, cold policy, when reads run, MethodConfig overrides; None: the defaults)
ColdMethod = tuple[str, str | None, str | None, dict[str, Any] | None]
COLD_METHODS: dict[str, ColdMethod] = {
    "nonshared": ("nonshared", None, None, None),
    "fullshared": ("fullshared", None, None, None),
    "kvcmas": ("kvcmas", "reuse", "idle", None),  # the defaults: reads off the agents' path (idle, close())
    "kvcmas reads=eager": ("kvcmas", "reuse", "eager", None),  # reads on the next call's path (the old default)
    "kvcmas cold=dense": ("kvcmas", "dense", "idle", None),
}


def cold_start(
    model: Model,
    shared_tokens: int,
    workflows: int,
    max_tokens: int,
    agents: int = 4,
    methods: dict[str, ColdMethod] | None = None,
) -> list[dict[str, Any]]:
    """Per method (COLD_METHODS) and workflow: a fresh session of the GSM8K team reading a new shared_tokens-token
    context, its agents called one after another as a program would, then closed; the kvcmas estimators fresh at the
    first workflow (in memory only); methods: rows to run instead of COLD_METHODS (nonshared first). Replies are
    nonshared's greedy ones, teacher-forced in the other methods, so every method's later agents see the same prompts:
    first-token KL and top-1 are against nonshared's logits for the very same prompt. An agent's TTFT is the caller's
    wait for its prompt (prefill_agent: its own prefill, and under reads=eager the reads it runs first); engine_ms
    is every piece of engine work the workflow took: the calls' prefills and replies (nonshared's token-by-token
    decoding left out, the others' teacher-forced rows counted), close() (it runs what reads are left) and the
    training reads an idle worker ran between them (training_read_ms: the reads wherever they ran)."""
    from .sharing import estimators as est
    from .sharing.workflow import gsm8k_workflow, load_gsm8k

    wf = gsm8k_workflow(agents)
    texts = load_gsm8k(100, 1000)
    contexts: list[str] = []
    picked: list[str] = []
    for t in texts:
        picked.append(t)
        if len(model.tokenize("\n".join(picked), add_special=False)) >= shared_tokens:
            contexts.append("\n".join(picked))
            picked = []
            if len(contexts) == workflows:
                break
    if len(contexts) < workflows:
        raise ValueError(f"not enough GSM8K text for {workflows} contexts of {shared_tokens} tokens")
    eog = model.tokenizer.eog_ids
    forced: list[list[list[int]]] = []  # per workflow, per agent: nonshared's reply
    reference: list[list[np.ndarray]] = []  # per workflow, per agent: nonshared's first-token logits
    rows: list[dict[str, Any]] = []
    methods = COLD_METHODS if methods is None else methods
    bar = _progress(len(methods) * workflows, "cold start")
    ridges = {name: est.RidgeEstimator(rank=8) for name, spec in methods.items() if spec[0] == "kvcmas"}
    # workflow by workflow, every method in turn: a machine whose load drifts slows every row alike
    for w, ctx in enumerate(contexts):
        for name, (method, cold, when, overrides) in methods.items():
            ridge = ridges.get(name)
            config = None
            if method == "kvcmas":
                base = registry.method("kvcmas", session=True).config(for_session=True)
                config = dataclasses.replace(base, **(overrides or {}))
            kw: dict[str, Any] = {}
            if cold:
                kw = {"cold": cold, "estimator": ridge, "config": config, "training_reads": when}
            ttft: list[float] = []
            kl: list[float] = []
            top1: list[bool] = []
            gates: list[str] = []
            calls_ms, reads_on_calls, cal = 0.0, 0.0, 0
            t_start = time.perf_counter()
            team = AgentSession(model, method, calibration_dir=False, **kw)
            members = [team.agent(a.name, system=a.role, template=a.user_template) for a in wf.agents]
            team.share(ctx)
            for i, ag in enumerate(members):
                t0 = time.perf_counter()
                p = team.prefill_agent(ag)
                ttft.append((time.perf_counter() - t0) * 1000.0)
                if method == "nonshared":
                    ids = [int(np.argmax(p.logits))]
                    while len(ids) < max_tokens and ids[-1] not in eog:
                        (lg,) = model.decode_batch([(p.seq, ids[-1:])])
                        ids.append(int(np.argmax(lg)))
                    if i == 0:
                        forced.append([])
                        reference.append([])
                    forced[w].append(ids)
                    reference[w].append(p.logits.astype(np.float64))
                else:
                    ref = reference[w][i] - np.logaddexp.reduce(reference[w][i])
                    q = p.logits.astype(np.float64)
                    kl.append(float(np.sum(np.exp(ref) * (ref - (q - np.logaddexp.reduce(q))))))
                    top1.append(bool(np.argmax(q) == np.argmax(ref)))
                t1 = time.perf_counter()
                team.finish(p, forced[w][i])
                p.close()
                calls_ms += ttft[-1] + (time.perf_counter() - t1) * 1000.0
                stats = p.stats
                gates.append(stats["gate"])
                cal += stats["calibration_tokens_scheduled"]
                reads_on_calls += stats["training_read_ms"]
            read_ms_before_close = team.training_read_ms_total
            t2 = time.perf_counter()
            team.close()
            close_ms = (time.perf_counter() - t2) * 1000.0
            workflow_ms = (time.perf_counter() - t_start) * 1000.0
            read_ms = team.training_read_ms_total
            rows.append(
                {
                    "method": name,
                    "workflow": w + 1,
                    "shared_tokens": shared_tokens,
                    "later_ttft_ms": float(np.mean(ttft[1:])),
                    "first_ttft_ms": ttft[0],
                    "later_ttft_each_ms": ttft[1:],
                    "later_kl": float(np.mean(kl[1:])) if kl else 0.0,
                    "later_top1": float(np.mean(top1[1:])) if top1 else 1.0,
                    "first_identical": bool(top1[0] and kl[0] == 0.0) if kl else True,
                    "gates": gates[1:],
                    "training_read_ms": read_ms,
                    "training_read_ms_on_calls": reads_on_calls,
                    # reads run by the idle worker between the calls (not inside any timed call or close())
                    "training_read_ms_idle": max(read_ms_before_close - reads_on_calls, 0.0),
                    "close_ms": close_ms,
                    "engine_ms": calls_ms + close_ms + max(read_ms_before_close - reads_on_calls, 0.0),
                    "workflow_ms": workflow_ms,
                    "calibration_tokens": cal,
                }
            )
            bar.update()
    bar.close()
    order = list(methods)
    rows.sort(key=lambda r: (order.index(r["method"]), r["workflow"]))
    by_workflow = {r["workflow"]: r for r in rows if r["method"] == "nonshared"}
    for r in rows:
        b = by_workflow[r["workflow"]]
        r["later_ttft_speedup"] = b["later_ttft_ms"] / max(r["later_ttft_ms"], 1e-9)
        r["engine_vs_nonshared"] = r["engine_ms"] / max(b["engine_ms"], 1e-9)
    return rows


def cold_start_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: engine time and training reads over all its workflows, against nonshared's engine time."""
    out: list[dict[str, Any]] = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        out.append(
            {
                "method": m,
                "workflows": len(mine),
                "engine_ms": sum(r["engine_ms"] for r in mine),
                "training_read_ms": sum(r["training_read_ms"] for r in mine),
                "workflow_ms": sum(r["workflow_ms"] for r in mine),
            }
        )
    base = next((t["engine_ms"] for t in out if t["method"] == "nonshared"), None)
    for t in out:
        t["engine_vs_nonshared"] = t["engine_ms"] / base if base else float("nan")
    return out


def print_cold_start(rows: list[dict[str, Any]]) -> None:
    print(f"## cold start: fresh sessions over {rows[0]['shared_tokens']} shared tokens, fresh estimators (GSM8K team)")
    print(
        "| method | workflow | later-agent TTFT ms (caller's wait) | speedup vs nonshared | first-token KL (later "
        "agents) | top-1 | gates of later agents | training reads ms (on calls) | engine ms | vs nonshared | "
        "calibration rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['workflow']} | {r['later_ttft_ms']:.0f} | {r['later_ttft_speedup']:.2f}x | "
            f"{r['later_kl']:.3e} | {100 * r['later_top1']:.0f}% | {', '.join(sorted(set(r['gates'])))} | "
            f"{r['training_read_ms']:.0f} ({r['training_read_ms_on_calls']:.0f}) | {r['engine_ms']:.0f} | "
            f"{r['engine_vs_nonshared']:.2f}x | {r['calibration_tokens']} |"
        )
    print("\n| method | workflows | engine s (calls, reads, close) | vs nonshared | training reads s |")
    print("|---|---|---|---|---|")
    for t in cold_start_totals(rows):
        print(
            f"| {t['method']} | {t['workflows']} | {t['engine_ms'] / 1000:.1f} | {t['engine_vs_nonshared']:.2f}x | "
            f"{t['training_read_ms'] / 1000:.1f} |"
        )


def print_accuracy(res: dict[str, Any]) -> None:
    n = res["examples"]
    print(f"## {res['task']}: {n} examples, free-running greedy; fidelity vs nonshared")
    print(
        "| method | accuracy | vs nonshared (95% CI, McNemar p) | identical replies "
        "| identical, prompt still identical | first-token top-1 (aligned hops) | first-token KL "
        "| teacher-forced top-1 | later-agent TTFT ms | speedup | computed (recomputed) tokens "
        "| KV MiB/request | correction MiB/request | reuse |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["summary"]:
        v = r["vs_nonshared"]
        lo, hi = v["ci95"]
        same, hops = r["identical_with_unchanged_prompt"], r["unchanged_prompt_hops"]
        print(
            f"| {r['method']} | {100 * r['accuracy']:.1f}% | {100 * v['diff']:+.1f} pts "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}], p={v['mcnemar_p']:.2f} | {100 * r['identical_replies']:.1f}% | "
            f"{100 * same / max(hops, 1):.1f}% ({same} of {hops}) | "
            f"{100 * r['first_token_top1']:.1f}% ({r['aligned_hops']}) | {r['first_token_kl']:.2e} | "
            f"{100 * r['tf_top1']:.1f}% | {r['later_ttft_ms']:.0f} | {r['later_ttft_speedup']:.2f}x | "
            f"{r['computed_tokens']:.0f} ({r['recomputed_tokens']:.0f}) | {r['kv_bytes_per_request'] / 2**20:.1f} | "
            f"{r['corr_bytes_per_request'] / 2**20:.2f} | {100 * r['reuse_share']:.0f}% |"
        )
    print("\nPer later reader: identical replies where its prompt was still nonshared's; teacher-forced top-1.")
    for r in res["summary"][1:]:
        readers = "; ".join(
            f"{x['agent']} {x['identical_with_unchanged_prompt']} of {x['unchanged_prompt_hops']}, "
            f"{100 * x['tf_top1']:.2f}%"
            for x in r["per_reader"]
        )
        print(f"- {r['method']}: {readers}")
    spreads = [r["vs_nonshared"]["questions_for_3pt"] for r in res["summary"][1:]]
    spreads = [x for x in spreads if x is not None]
    if spreads:
        print(
            f"\nQuestions for a 95% interval of +-3 points at the observed per-question spread: {min(spreads)} to "
            f"{max(spreads)} (this run: {n}); a 3-point difference is "
            f"{'visible' if n >= max(spreads) else 'NOT visible'} at this sample size."
        )
    else:
        print("\nNo method's answers differed from nonshared's on this sample: the interval is a point at 0.")


def print_concurrent(rows: list[dict[str, Any]]) -> None:
    print("## concurrent workflows (4 agents each; TTFT of later hops)")
    print("| workflows | method | TTFT p50 ms | p90 | p99 | workflows/s | generated tok/s | peak KV MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workflows']} | {r['method']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['workflows_per_s']:.2f} | {r['generated_tokens_per_s']:.1f} | "
            f"{r['peak_kv_bytes'] / 2**20:.1f} |"
        )


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG plots of whatever parts the result holds; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    if "speed" in result:
        rows = result["speed"]
        fig, ax = plt.subplots(figsize=(6, 4))
        d0 = min(r.get("decode_tokens", 0) for r in rows)
        rows = [r for r in rows if r.get("decode_tokens", 0) == d0]
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["shared_tokens"], r["later_ttft_ms"]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set(xlabel="shared tokens", ylabel="later-agent TTFT (ms)", title="TTFT vs shared length", xscale="log")
        ax.legend()
        save(fig, "ttft_vs_shared_length.png")
        n_max = max(r["shared_tokens"] for r in rows)
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in rows:
            if r["shared_tokens"] == n_max and "kv_bytes_per_hop" in r:
                cum = np.cumsum(r["kv_bytes_per_hop"]) / 2**20
                ax.plot(range(1, len(cum) + 1), cum, marker="o", label=r["method"])
        ax.set(xlabel="agents", ylabel="KV MiB (request)", title=f"KV memory vs agents ({n_max} shared tokens)")
        ax.legend()
        save(fig, "memory_vs_agents.png")
    if "accuracy" in result:
        acc = result["accuracy"]
        fig, ax = plt.subplots(figsize=(6, 4))
        names = [r["method"] for r in acc["summary"]]
        ax.bar(names, [100 * r["accuracy"] for r in acc["summary"]], color="tab:blue", label="accuracy")
        ax.plot(
            names,
            [100 * r["identical_replies"] for r in acc["summary"]],
            "o",
            color="tab:red",
            label="replies identical to nonshared",
        )
        ax.set(ylabel="%", title=f"{acc['task']}: {acc['examples']} examples", ylim=(0, 100))
        ax.legend()
        save(fig, f"accuracy_{acc['task']}.png")
    if "accuracy" in result:
        acc = result["accuracy"]
        front = [
            (r["method"], r["later_ttft_ms"], r["first_token_kl"], r["tf_top1"], r["identical_replies"])
            for r in acc["summary"]
        ]
        save(_pareto(plt, front, f"{acc['task']}, {acc['examples']} examples"), f"pareto_{acc['task']}.png")
    if "speed" in result and "fidelity" in result:
        n_max = max(r["shared_tokens"] for r in result["speed"])
        ttft = {r["method"]: r["later_ttft_ms"] for r in result["speed"] if r["shared_tokens"] == n_max}
        fid = {r["method"]: r for r in result["fidelity"] if r["agents"] == "later agents"}
        front = [(m, t, fid[m]["kl"], fid[m]["tf_top1"], None) for m, t in ttft.items() if m in fid]
        if "nonshared" in ttft:
            front.insert(0, ("nonshared", ttft["nonshared"], 0.0, 1.0, None))
        save(_pareto(plt, front, f"teacher-forced GSM8K, TTFT at {n_max} shared tokens"), "pareto.png")
    if "concurrent" in result:
        rows = result["concurrent"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["workflows"], r["ttft_p50_ms"]) for r in rows if r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set(xlabel="concurrent workflows", ylabel="later-hop TTFT p50 (ms)", title="TTFT under concurrency")
        ax.legend()
        save(fig, "concurrent_ttft.png")
    return written


def _pareto(plt: Any, pts: list[tuple[Any, ...]], title: str) -> Any:
    """Later-agent TTFT against first-token KL, teacher-forced top-1 and identical replies: one point per method
    label, the budgets of one method (METHOD@B, with the method itself at 0) joined by a line."""
    metrics = [("first-token KL vs nonshared (0 at 1e-8)", 2), ("teacher-forced top-1", 3), ("identical replies", 4)]
    metrics = [(name, i) for name, i in metrics if any(p[i] is not None for p in pts)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    series: dict[str, list[tuple[float, tuple[Any, ...]]]] = {}
    for p in pts:
        base, _, budget = p[0].partition("@")
        series.setdefault(base, []).append((float(budget) if budget else 0.0, p))
    for ax, (name, i) in zip(axes[0], metrics, strict=True):
        for base, items in series.items():
            items.sort(key=lambda x: x[0])
            xs = [p[1] for _, p in items if p[i] is not None]
            ys = [max(float(p[i]), 1e-8) if i == 2 else 100 * float(p[i]) for _, p in items if p[i] is not None]
            ax.plot(xs, ys, marker="o", label=base)
            for _, p in items:
                if p[i] is not None and "@" in p[0]:
                    ax.annotate(p[0].partition("@")[2], (p[1], ys[[q for _, q in items if q[i] is not None].index(p)]))
        ax.set(xlabel="later-agent TTFT (ms)", ylabel=name if i == 2 else f"{name} (%)", title=title)
        if i == 2:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    return fig
