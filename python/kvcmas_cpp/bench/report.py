"""The printed tables of the task benchmarks (accuracy, concurrency) and their plots (matplotlib, PNG): accuracy per
method, TTFT vs shared length and KV memory vs agents from the speed part, and accuracy/TTFT Pareto fronts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


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
