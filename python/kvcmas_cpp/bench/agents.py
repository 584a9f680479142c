"""`kvcmas bench agents`: the multi-agent workflow under every sharing method in one run.

Three parts:
- speed and memory: a 4-agent workflow whose shared span (the question slot) holds N tokens of GSM8K text; later
  agents' TTFT, KV bytes of the request and correction bytes per method, against nonshared;
- correction state vs kvcomm: bytes of the persistent estimator state and per-hop corrections at SmolLM2's K/V width
  and at 1024 (Llama-3-8B's), measured on a few random-weight layers in numpy and scaled to the layer count;
- fidelity: N GSM8K questions teacher-forced on the nonshared run, first-token KL, top-1, teacher-forced top-1,
  K/V relative error per method, with the oracle row and the share of the fullshared-to-oracle gap each closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..arguments import non_negative_int, output_file, output_folder, positive_int, positive_int_list
from ..model import Model, resolve_model_path
from ..sharing.blas_threads import single_threaded_blas
from ..sharing.methods import LEARNING_METHODS, METHODS, parse_label
from ..sharing.runner import WorkflowRunner
from .sharing_fidelity import correction_state, fidelity, fit_runners
from .sharing_speed import llama_cpp_rows, speed_and_memory

DEFAULT_LIMIT = 50  # accuracy mode: examples a run evaluates unless --limit says otherwise


def _span_sizes(text: str) -> list[int]:
    return positive_int_list(text) if text.strip() else []  # empty: no speed part


def add_agents_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `kvcmas bench agents`."""
    p.add_argument("-m", "--model", default=None, help="GGUF file or model name (default: SmolLM2-135M)")
    p.add_argument(
        "--method",
        default="nonshared,fullshared,kvcmas,kvcomm",
        help=f"comma-separated methods among {', '.join(METHODS)}; METHOD@B: at recompute budget B (0..1), "
        "recompute@B: the selective-recompute-only baseline (docs/recompute.md); with --task also "
        "nonshared+kv-f16 and nonshared+act-f32: nonshared on f16 KV or exact activations, the numeric floor",
    )
    p.add_argument("--agents", type=int, default=4, help="agents per request, the decision agent included")
    p.add_argument(
        "--shared-tokens",
        type=_span_sizes,
        default=[256, 1024, 4096],
        help="comma-separated shared span sizes (speed part; empty: skip it)",
    )
    p.add_argument(
        "--decode",
        type=positive_int_list,
        default=[8],
        help="comma-separated tokens each agent generates in the speed part (a sweep)",
    )
    p.add_argument(
        "--questions", type=non_negative_int, default=30, help="GSM8K questions for the fidelity part (0: skip)"
    )
    p.add_argument(
        "--train", type=non_negative_int, default=50, help="GSM8K questions that fit / calibrate the estimators"
    )
    p.add_argument("--gen-tokens", type=positive_int, default=8, help="tokens per agent in the fidelity part")
    p.add_argument("--oracle-rank", type=positive_int, default=32, help="rank of the oracle row")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument(
        "--apply",
        choices=("auto", "fused", "materialize"),
        default="auto",
        help="speed part: how readers hold corrected spans (MethodConfig.apply; auto = copy only full-rank ones)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        choices=["llama-cpp"],
        help="speed part: also time llama.cpp (llama-cpp-python) prefilling what nonshared computes for each later "
        "agent, with the same cached prefix (it shares no KV across agents)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    g = p.add_argument_group("accuracy mode (--task): each method's team free-running on a benchmark")
    g.add_argument("--task", choices=("gsm8k", "mmlu", "humaneval"), default=None)
    g.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"examples of the task (default {DEFAULT_LIMIT}); with --report, only examples 0..N-1 of the file "
        "(default: all)",
    )
    g.add_argument("--max-tokens", type=int, default=128, help="tokens each agent may generate")
    g.add_argument("--calibrate", type=int, default=4, help="examples the learned methods calibrate on first")
    g.add_argument(
        "--calibrate-tokens",
        type=int,
        default=None,
        help="tokens each agent may generate in the calibration examples (default: --max-tokens, like the evaluated "
        "replies, which later agents read as spans)",
    )
    g.add_argument(
        "--out", type=output_file, default=None, help="JSONL file of per-example results (appended as they finish)"
    )
    g.add_argument("--resume", action="store_true", help="skip the examples already in --out")
    g.add_argument(
        "--report",
        action="store_true",
        help="print the table of what --out holds (the examples every method finished) and run nothing",
    )
    g = p.add_argument_group("cold-start mode (--cold-start N): fresh sessions and estimators, N shared tokens")
    g.add_argument("--cold-start", type=int, default=None, metavar="N", help="shared tokens of each workflow")
    g.add_argument(
        "--workflows",
        type=int,
        default=5,
        help="workflows per method (kvcmas calibrates on the first; its calibrate=4 row on the first 4)",
    )
    g.add_argument(
        "--cold-rows",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        default=None,
        help="comma-separated rows to run (default: all; nonshared always runs): nonshared, fullshared, kvcmas, "
        "'kvcmas read_rows=0', 'kvcmas reads=eager', 'kvcmas cold=dense'",
    )
    g.add_argument(
        "--read-rows-fidelity",
        action="store_true",
        help="instead of the rows: how close the maps fitted on a read's first 256, 512, 1024 or every row stay on "
        "the next context (held-out residual)",
    )
    g = p.add_argument_group("concurrent mode (--concurrent): N workflows at once")
    g.add_argument(
        "--concurrent", type=positive_int_list, default=None, help="comma-separated workflow counts, e.g. 1,2,4,8,16"
    )
    p.add_argument("--plot", type=output_folder, default=None, help="directory for PNG plots of the results")


def run_agents(args: argparse.Namespace) -> int:
    """Runs the three parts (or the accuracy / concurrent mode) and prints tables (or JSON)."""
    from .accuracy import NUMERIC_VARIANTS

    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        try:
            if m in NUMERIC_VARIANTS:
                if not args.task:
                    raise ValueError(f"{m!r} is a reference of the accuracy mode: it needs --task")
            else:
                parse_label(m)
        except ValueError as e:
            print(f"bench agents: {e}", file=sys.stderr)
            return 2
    if args.task or args.concurrent or args.cold_start or args.report:
        return _run_session_modes(args, methods)
    sizes, decodes = args.shared_tokens, args.decode
    if not sizes and args.questions == 0:
        raise ValueError("nothing to measure: --shared-tokens is empty (no speed part) and --questions is 0")
    learned = [m for m in methods if parse_label(m)[0] in LEARNING_METHODS]
    if (sizes or args.questions > 0) and learned and args.train < 1:
        print(f"bench agents: {', '.join(learned)} need fitted estimators (--train 1 or more)", file=sys.stderr)
        return 2
    path = resolve_model_path(args.model)
    n_ctx = max(sizes, default=0) + 1024
    model = Model(path, n_threads=args.threads, n_ctx=n_ctx, kv_budget=max(1 << 30, 16 * n_ctx * 30 * 2 * 192 * 4))
    t0 = time.perf_counter()
    result: dict[str, Any] = {"model": path, "methods": methods, "agents": args.agents}
    fitted: dict[str, WorkflowRunner] = {}
    if args.questions > 0:
        result["fidelity"], fitted = fidelity(
            model, methods, args.agents, args.questions, args.train, args.gen_tokens, args.oracle_rank
        )
    speed_methods = [m for m in methods if m != "oracle"]
    if sizes and learned and not fitted:  # speed only: measure the methods with the corrections they would apply
        fitted = fit_runners(model, learned, args.agents, args.train, args.gen_tokens, args.oracle_rank)
    with single_threaded_blas():
        result["speed"] = speed_and_memory(model, speed_methods, args.agents, sizes, decodes, fitted, args.apply)
    if "llama-cpp" in args.compare:
        result["speed"] += llama_cpp_rows(path, model, args.threads, result["speed"])
    kd = model.n_head_kv * model.head_dim
    result["correction_state"] = correction_state([kd, 1024], sizes, [model.n_layer, 32])
    result["seconds"] = time.perf_counter() - t0
    for r in fitted.values():
        r.close()
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    else:
        _print_tables(result)
    _plots(args, result)
    return 0


def _plots(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.plot:
        from .report import plot

        for path in plot(result, Path(args.plot)):
            print(f"plot: {path}", file=sys.stderr)


def _run_session_modes(args: argparse.Namespace, methods: list[str]) -> int:
    """Accuracy (--task) and concurrent (--concurrent) modes, through the agent-session API."""
    from .accuracy import accuracy, calibration_tokens, check_counts, report
    from .cold_start import cold_rows, cold_start, print_cold_start, print_read_rows_fidelity, read_rows_fidelity
    from .concurrency import concurrent
    from .report import print_accuracy, print_concurrent

    if args.report:
        if not (args.task and args.out) or args.concurrent or args.cold_start:
            raise ValueError("--report reads an accuracy run's file: it takes --task and --out, and no other mode")
        scores = report(args.task, methods, Path(args.out), args.limit)
        result: dict[str, Any] = {"methods": methods, "accuracy": scores}
        if args.json:
            print(json.dumps(result, indent=1, default=float))
        else:
            print_accuracy(result["accuracy"])
        _plots(args, result)
        return 0
    # bad counts are refused before the model loads
    check_counts(args.limit, args.max_tokens, args.calibrate)
    calibration_tokens(args.calibrate_tokens, args.max_tokens)
    cold = cold_rows(args.cold_rows)
    model = Model(resolve_model_path(args.model), n_threads=args.threads)
    result = {"model": model.path, "methods": methods}
    if args.task:
        out = Path(args.out) if args.out else None
        result["accuracy"] = accuracy(
            model,
            args.task,
            methods,
            DEFAULT_LIMIT if args.limit is None else args.limit,
            args.max_tokens,
            args.calibrate,
            out,
            args.resume,
            calibrate_tokens=args.calibrate_tokens,
        )
    if args.concurrent:
        levels = args.concurrent
        result["concurrent"] = concurrent(
            model, methods, levels, args.max_tokens, args.calibrate, calibrate_tokens=args.calibrate_tokens
        )
    if args.cold_start:
        if args.cold_start < 1 or args.workflows < 1:
            raise ValueError("--cold-start and --workflows take positive numbers")
        with single_threaded_blas():
            if args.read_rows_fidelity:
                result["read_rows_fidelity"] = read_rows_fidelity(model, args.cold_start)
            else:
                result["cold_start"] = cold_start(
                    model, args.cold_start, args.workflows, args.gen_tokens, args.agents, cold
                )
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    else:
        if "accuracy" in result:
            print_accuracy(result["accuracy"])
        if "concurrent" in result:
            print_concurrent(result["concurrent"])
        if "cold_start" in result:
            print_cold_start(result["cold_start"])
        if "read_rows_fidelity" in result:
            print_read_rows_fidelity(result["read_rows_fidelity"])
    _plots(args, result)
    return 0


def _print_tables(res: dict[str, Any]) -> None:
    print("## speed and memory (later agents = every agent after the first)")
    print(
        "| shared tokens | decode tokens | method | later-agent TTFT ms | speedup vs nonshared | "
        "computed tokens per agent | KV bytes (request) | vs nonshared | correction bytes | modes | copied rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["speed"]:
        speedup = r.get("later_ttft_speedup", 0)
        print(
            f"| {r['shared_tokens']} | {r['decode_tokens']} | {r['method']} | {r['later_ttft_ms']:.0f} | {speedup:.2f}x"
            f" | {r['computed_tokens']} | {r['kv_bytes'] / 2**20:.1f} MiB | {r.get('kv_vs_nonshared', 0):.2f} | "
            f"{r['corr_bytes'] / 2**20:.2f} MiB | {','.join(r['modes'])} | {r.get('materialized_tokens', '-')} |"
        )
    print("\n## correction state for one span read by 3 agents (kvcmas = ridge maps + per-hop factors)")
    print("| K/V width | layers | shared tokens | kvcomm | kvcmas-ref | kvcmas | kvcmas / kvcomm |")
    print("|---|---|---|---|---|---|---|")
    for r in res["correction_state"]:
        print(
            f"| {r['kd']} | {r['n_layer']} | {r['shared_tokens']} | {r['kvcomm_bytes'] / 2**20:.1f} MiB | "
            f"{r['kvcmas_ref_bytes'] / 2**20:.1f} MiB | "
            f"{(r['kvcmas_state_bytes'] + r['kvcmas_hop_corr_bytes']) / 2**20:.2f} MiB | "
            f"{r['kvcmas_vs_kvcomm']:.3f} |"
        )
    if "fidelity" in res:
        print("\n## fidelity vs nonshared (teacher-forced on its outputs)")
        print(
            "| method | agents | first-token KL | KL gap closed | top-1 | teacher-forced top-1 | K err | V err | "
            "computed tokens | reuse share | state bytes |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["fidelity"]:
            gap = f"{100 * r['kl_gap_closed']:.0f}%" if "kl_gap_closed" in r else "-"
            if "tf_top1_minus_fullshared" in r:
                lo, hi = r["tf_top1_minus_fullshared_ci95"]
                d = 100 * r["tf_top1_minus_fullshared"]
                gap += f" (tf top-1 vs fullshared {d:+.1f} pts, CI {100 * lo:+.1f}..{100 * hi:+.1f})"
            print(
                f"| {r['method']} | {r['agents']} | {r['kl']:.2e} | {gap} | {100 * r['top1']:.1f}% | "
                f"{100 * r['tf_top1']:.1f}% | {r['k_err']:.3f} | {r['v_err']:.3f} | {r['computed_tokens']:.1f} | "
                f"{100 * r['reuse_share']:.0f}% | {r['state_bytes'] / 2**20:.2f} MiB |"
            )
    print(f"\n{res['seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcmas bench agents", description=__doc__.splitlines()[0])
    add_agents_arguments(p)
    return run_agents(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
