"""The evaluation harness behind `kvcmas bench agents --task ...` and `--concurrent ...`.

- accuracy: each method runs the task's team (3 role agents + decision agent, fully connected) on the same
  examples through the agent-session API, free-running (greedy); per method the task accuracy of the decision
  agent's answer, and fidelity against `nonshared`: replies identical, first-token top-1 agreement and KL on the
  hops whose prompt is still identical to nonshared's (once an upstream reply differs, later prompts differ too).
  Results go to a JSONL file one example at a time, so a long run can resume (`--resume`).
- concurrent: N workflows at once (threads, each its own session) per level and method: TTFT percentiles of later
  hops, throughput and peak KV bytes.
- cold start: fresh sessions of the GSM8K team over an N-token shared context, workflow after workflow from a fresh
  estimator: later-agent TTFT and first-token KL against nonshared while kvcmas calibrates (cold reuse vs dense)
  and after.
- plots (matplotlib, PNG): accuracy per method, TTFT vs shared length and KV memory vs agents from the speed part.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .agents import CALIBRATION_READS, AgentSession, Response
from .model import Model
from .sharing.runner import MethodConfig
from .tasks import Example, Task, get_task

SESSION_METHODS = ("nonshared", "fullshared", "kvcmas", "kvcomm")
CALIBRATION_OFFSET = {"gsm8k": 1000, "mmlu": 1000, "humaneval": None}  # None: the last problems of the set


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)


def _config(method: str, calibrate: int) -> MethodConfig | None:
    return MethodConfig("kvcmas", head=4, rank=8, calibrate=calibrate) if method == "kvcmas" else None


def run_workflow(
    model: Model, task: Task, method: str, question: str, max_tokens: int, calibrate: int = CALIBRATION_READS
) -> list[Response]:
    """One request of the task's team under a method; the estimator is shared by every request of the task."""
    wf = task.workflow()
    with AgentSession(model, method, workflow=f"bench-{task.name}", config=_config(method, calibrate)) as team:
        agents = [team.agent(a.name, system=a.role, template=a.user_template) for a in wf.agents]
        team.share(question)
        return [a.respond(max_tokens=max_tokens) for a in agents]


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
) -> dict[str, Any]:
    """Runs every method on examples [0, limit) and returns the per-method summary (see the module doc)."""
    for m in methods:
        if m not in SESSION_METHODS:
            raise ValueError(f"accuracy mode runs {', '.join(SESSION_METHODS)}; got {m!r}")
    if "nonshared" not in methods:
        methods = ["nonshared", *methods]
    task = get_task(task_name)
    examples = task.load(0, limit)
    done: dict[str, dict[str, Any]] = {}
    if out_path is not None and resume and out_path.is_file():
        for line in out_path.read_text().splitlines():
            if line.strip():
                old = json.loads(line)
                if set(methods) <= set(old["methods"]):
                    done[old["id"]] = old
    if calibrate:
        learned = [m for m in methods if m in ("kvcmas", "kvcomm")]
        train = calibration_examples(task, calibrate, limit)
        bar = _progress(len(train) * len(learned), "calibration")
        for m in learned:
            for ex in train:
                run_workflow(model, task, m, ex.question, max_tokens=16, calibrate=calibrate)
                bar.update()
        bar.close()
    records: list[dict[str, Any]] = []
    bar = _progress(len(examples), f"{task.name} x {len(methods)} methods")
    out = out_path.open("a") if out_path is not None else None
    try:
        for ex in examples:
            if ex.id in done:
                records.append(done[ex.id])
                bar.update()
                continue
            runs = {m: run_workflow(model, task, m, ex.question, max_tokens, calibrate) for m in methods}
            rec: dict[str, Any] = {"id": ex.id, "methods": methods, "per_method": {}}
            for m, rs in runs.items():
                rec["per_method"][m] = {
                    "correct": bool(task.score(ex, rs[-1].text)),
                    "answer": task.extract(rs[-1].text),
                    "hops": [r.stats.as_dict() for r in rs],
                    "fidelity": compare(runs["nonshared"], rs),
                }
            records.append(rec)
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            bar.update()
    finally:
        if out is not None:
            out.close()
        bar.close()
    return {"task": task.name, "examples": len(records), "summary": summarize(records, methods)}


def summarize(records: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for m in methods:
        per = [r["per_method"][m] for r in records]
        hops = [h for p in per for h in p["hops"][1:]]
        fid = [f for p in per for f in p["fidelity"][1:]]
        aligned = [f for f in fid if "kl" in f]
        rows.append(
            {
                "method": m,
                "accuracy": float(np.mean([p["correct"] for p in per])),
                "identical_replies": float(np.mean([f["identical"] for f in fid])),
                "aligned_hops": len(aligned),
                "first_token_top1": float(np.mean([f["top1"] for f in aligned])) if aligned else float("nan"),
                "first_token_kl": float(np.mean([f["kl"] for f in aligned])) if aligned else float("nan"),
                "later_ttft_ms": float(np.mean([h["ttft_ms"] for h in hops])),
                "computed_tokens": float(np.mean([h["computed_tokens"] for h in hops])),
                "kv_bytes_per_request": float(np.mean([sum(h["kv_bytes"] for h in p["hops"]) for p in per])),
                "corr_bytes_per_request": float(np.mean([sum(h["corr_bytes"] for h in p["hops"]) for p in per])),
                "reuse_share": float(np.mean([h["mode"] == "reuse" for h in hops])),
            }
        )
    base = float(rows[0]["later_ttft_ms"])
    for r in rows:
        r["later_ttft_speedup"] = base / max(float(r["later_ttft_ms"]), 1e-9)
    return rows


def concurrent(
    model: Model, methods: list[str], levels: list[int], max_tokens: int, calibrate: int
) -> list[dict[str, Any]]:
    """N GSM8K workflows at once per level and method (one session per thread)."""
    task = get_task("gsm8k")
    questions = [e.question for e in task.load(0, max(levels))]
    if calibrate and "kvcmas" in methods:
        for ex in calibration_examples(task, calibrate, max(levels)):
            run_workflow(model, task, "kvcmas", ex.question, max_tokens=16, calibrate=calibrate)
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


COLD_METHODS = {  # row name -> (session method, cold policy)
    "nonshared": ("nonshared", None),
    "fullshared": ("fullshared", None),
    "kvcmas": ("kvcmas", "reuse"),
    "kvcmas cold=dense": ("kvcmas", "dense"),
}


def cold_start(
    model: Model, shared_tokens: int, workflows: int, max_tokens: int, agents: int = 4
) -> list[dict[str, Any]]:
    """Per method (COLD_METHODS) and workflow: fresh sessions of the GSM8K team reading a new shared_tokens-token
    context, the kvcmas estimators fresh at the first workflow (and kept in memory only). Replies are nonshared's
    greedy ones, teacher-forced in the other methods, so every method's later agents see the same prompts: the
    first-token KL is against nonshared's logits for the very same prompt. TTFT is the wall time of an agent's
    prefill (its system prompt's, the first time, included); finish_ms is the work after the reply (cold reuse's
    training reads)."""
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
    bar = _progress(len(COLD_METHODS) * workflows, "cold start")
    for name, (method, cold) in COLD_METHODS.items():
        ridge = est.RidgeEstimator(rank=8) if method == "kvcmas" else None
        for w, ctx in enumerate(contexts):
            kw: dict[str, Any] = {"cold": cold, "estimator": ridge} if cold else {}
            ttft, kl, gates, finish_ms, cal = [], [], [], 0.0, 0
            with AgentSession(model, method, calibration_dir=False, **kw) as team:
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
                    t1 = time.perf_counter()
                    team.finish(p, forced[w][i])
                    finish_ms += (time.perf_counter() - t1) * 1000.0
                    gates.append(p.stats["gate"])
                    cal += p.stats["calibration_tokens"]
                    p.close()
            rows.append(
                {
                    "method": name,
                    "workflow": w + 1,
                    "shared_tokens": shared_tokens,
                    "later_ttft_ms": float(np.mean(ttft[1:])),
                    "first_ttft_ms": ttft[0],
                    "later_kl": float(np.mean(kl[1:])) if kl else 0.0,
                    "gates": gates[1:],
                    "finish_ms": finish_ms,
                    "calibration_tokens": cal,
                }
            )
            bar.update()
    bar.close()
    base = {r["workflow"]: r["later_ttft_ms"] for r in rows if r["method"] == "nonshared"}
    for r in rows:
        r["later_ttft_speedup"] = base[r["workflow"]] / max(r["later_ttft_ms"], 1e-9)
    return rows


def print_cold_start(rows: list[dict[str, Any]]) -> None:
    print(f"## cold start: fresh sessions over {rows[0]['shared_tokens']} shared tokens, fresh estimators (GSM8K team)")
    print(
        "| method | workflow | later-agent TTFT ms | speedup vs nonshared | first-token KL (later agents) | "
        "gates of later agents | work after replies ms | calibration rows |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['workflow']} | {r['later_ttft_ms']:.0f} | {r['later_ttft_speedup']:.2f}x | "
            f"{r['later_kl']:.3e} | {', '.join(sorted(set(r['gates'])))} | {r['finish_ms']:.0f} | "
            f"{r['calibration_tokens']} |"
        )


def print_accuracy(res: dict[str, Any]) -> None:
    print(f"## {res['task']}: {res['examples']} examples, free-running greedy; fidelity vs nonshared")
    print(
        "| method | accuracy | identical replies | first-token top-1 (aligned hops) | first-token KL | "
        "later-agent TTFT ms | speedup | computed tokens | KV MiB/request | correction MiB/request | reuse |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["summary"]:
        print(
            f"| {r['method']} | {100 * r['accuracy']:.1f}% | {100 * r['identical_replies']:.1f}% | "
            f"{100 * r['first_token_top1']:.1f}% ({r['aligned_hops']}) | {r['first_token_kl']:.2e} | "
            f"{r['later_ttft_ms']:.0f} | {r['later_ttft_speedup']:.2f}x | {r['computed_tokens']:.0f} | "
            f"{r['kv_bytes_per_request'] / 2**20:.1f} | {r['corr_bytes_per_request'] / 2**20:.2f} | "
            f"{100 * r['reuse_share']:.0f}% |"
        )


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
