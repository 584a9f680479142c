"""`kvcmas bench lora`: its arguments and its run (the decode cost in bench/lora.py, the team across adapters in
bench/lora_team.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..arguments import positive_int
from .lora import bench_lora


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        action="append",
        default=None,
        help="GGUF file or model name, repeatable: the models side by side ('default': the default model; "
        "none given: the default model)",
    )
    p.add_argument("--rank", type=positive_int, default=16, help="adapter rank (default 16)")
    p.add_argument("-t", "--threads", type=positive_int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--prompt", type=positive_int, default=64, help="prompt tokens before the timed steps")
    p.add_argument("--gen", type=positive_int, default=32, help="timed decode steps")
    p.add_argument("--batch", type=int, default=4, help="sequences of the batched rows (0 or 1: none)")
    p.add_argument("--json", action="store_true")
    team = p.add_argument_group("--team: four agents with three adapters sharing a context (bench/lora_team.py)")
    team.add_argument(
        "--team",
        action="store_true",
        help="later-agent TTFT and first-token KL of nonshared, fullshared and kvcmas across adapters",
    )
    team.add_argument("--shared-tokens", type=positive_int, default=2048, help="shared context tokens (default 2048)")
    team.add_argument("--contexts", type=positive_int, default=2, help="evaluation contexts (default 2)")
    team.add_argument("--calibrate", type=positive_int, default=2, help="contexts kvcmas calibrates on first")
    team.add_argument("--reply-tokens", type=positive_int, default=8, help="tokens per agent reply (default 8)")


def run_lora(args: argparse.Namespace) -> int:
    from ..model import resolve_model_path

    paths = [resolve_model_path(None if m == "default" else m) for m in (args.model or ["default"])]
    if args.team:
        from .lora_team import bench_lora_team, print_team

        for path in paths:
            result = bench_lora_team(
                path, args.rank, args.threads, args.shared_tokens, args.contexts, args.calibrate, args.reply_tokens
            )
            print(json.dumps(result)) if args.json else print_team(result)
        return 0
    results: list[dict[str, Any]] = []
    for path in paths:
        rows = bench_lora(path, args.rank, args.threads, args.prompt, args.gen, args.batch)
        results.append({"model": path, "rows": rows, "load_average": os.getloadavg()})
    if args.json:
        print(json.dumps({"threads": args.threads, "models": results}))
        return 0
    print(
        f"{args.threads} threads, {args.prompt}-token prompts, {args.gen} decode steps: ms per step, median and "
        "fastest (the fastest is the least disturbed by other load)"
    )
    head = f"{'case':<32}"
    for r in results:
        head += f" | {os.path.basename(r['model'])[:27]:<27} {'vs base':>7} {'fastest':>7} {'vs base':>7}"
    print(head)
    for i, row in enumerate(results[0]["rows"]):
        line = f"{row['case']:<32}"
        for r in results:
            c = r["rows"][i]
            ratio = f"{c['vs_base']:.2f}x" if "vs_base" in c else ""
            ratio_min = f"{c['min_vs_base']:.2f}x" if "min_vs_base" in c else ""
            line += f" | {c['ms_per_step']:>27.2f} {ratio:>7} {c['min_ms_per_step']:>7.2f} {ratio_min:>7}"
        print(line)
    loads = "; ".join(
        f"{os.path.basename(r['model'])}: " + " ".join(f"{x:.2f}" for x in r["load_average"]) for r in results
    )
    print(f"load average (1, 5, 15 min) after each model: {loads}")
    return 0
