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
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .arguments import non_negative_int, output_file, output_folder, positive_int, positive_int_list
from .model import Model, resolve_model_path
from .sharing import estimators as est
from .sharing._blas import single_threaded_blas
from .sharing.evaluate import build_runners, evaluate, question_ids
from .sharing.methods import METHODS, MethodConfig, labelled_config, parse_label
from .sharing.runner import WorkflowRunner
from .sharing.workflow import gsm8k_workflow, load_gsm8k

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
    g = p.add_argument_group("concurrent mode (--concurrent): N workflows at once")
    g.add_argument(
        "--concurrent", type=positive_int_list, default=None, help="comma-separated workflow counts, e.g. 1,2,4,8,16"
    )
    p.add_argument("--plot", type=output_folder, default=None, help="directory for PNG plots of the results")


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:  # tqdm is optional

        class _Null:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...

        return _Null()


def _shared_context(model: Model, n: int) -> list[list[int]]:
    """Two different n-token contexts made of consecutive GSM8K questions (one to warm up, one measured)."""
    texts = load_gsm8k(100, 400)
    ids: list[int] = []
    for t in texts:
        ids += question_ids(model, t + "\n")
        if len(ids) >= 2 * n:
            break
    if len(ids) < 2 * n:
        raise ValueError(f"not enough GSM8K text for two {n}-token contexts")
    return [ids[:n], ids[n : 2 * n]]


def speed_and_memory(
    model: Model,
    methods: list[str],
    agents: int,
    sizes: list[int],
    decodes: list[int],
    fitted: dict[str, WorkflowRunner],
    apply: str = "auto",
) -> list[dict[str, Any]]:
    """Per shared size, decode length and method: the measured request's hops (after one warm-up request)."""
    wf = gsm8k_workflow(agents)
    rows: list[dict[str, Any]] = []
    bar = _progress(len(sizes) * len(decodes) * len(methods) * 2, "speed")
    for n, decode in ((n, d) for n in sizes for d in decodes):
        contexts = _shared_context(model, n)
        for name in methods:
            cfg = labelled_config(name)
            cfg.apply = apply  # type: ignore[assignment]
            runner = WorkflowRunner(model, wf, cfg, fitted[name].estimator if name in fitted else None)
            for i, ctx in enumerate(contexts):
                res = runner.run(ctx, f"ctx-{n}-{i}", max_new_tokens=decode)
                bar.update()
                if i == len(contexts) - 1:
                    later = res.hops[1:]
                    rows.append(
                        {
                            "shared_tokens": n,
                            "decode_tokens": decode,
                            "method": name,
                            "first_ttft_ms": res.hops[0].ttft_ms,
                            "later_ttft_ms": float(np.mean([h.ttft_ms for h in later])),
                            "computed_tokens": [h.computed_tokens for h in res.hops],
                            "reused_tokens": [h.reused_tokens for h in res.hops],
                            "modes": [h.mode for h in res.hops],
                            "kv_bytes": int(sum(h.kv_bytes for h in res.hops)),
                            "kv_bytes_per_hop": [int(h.kv_bytes) for h in res.hops],
                            "corr_bytes": int(sum(h.corr_bytes for h in res.hops)),
                            "peak_bytes": int(res.hops[-1].peak_bytes),
                            "corr_rank": [h.corr_rank for h in res.hops],
                            "materialized_tokens": [h.materialized_tokens for h in res.hops],
                            "estimator_state_bytes": int(runner.estimator.state_bytes()),
                            "template_kv_bytes": int(runner.template_kv_bytes),
                        }
                    )
                res.close()
            runner.close()
    bar.close()
    base = {(r["shared_tokens"], r["decode_tokens"]): r for r in rows if r["method"] == "nonshared"}
    for r in rows:
        b = base.get((r["shared_tokens"], r["decode_tokens"]))
        if b is not None:
            r["later_ttft_speedup"] = b["later_ttft_ms"] / max(r["later_ttft_ms"], 1e-9)
            r["kv_vs_nonshared"] = r["kv_bytes"] / max(b["kv_bytes"], 1)
    return rows


def llama_cpp_rows(
    model_path: str, model: Model, threads: int | None, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """llama.cpp on the same team, per nonshared row: each hop keeps the prefix nonshared served from its prefix
    cache (llama.cpp's prompt cache keeps a common prefix too) and times the prefill of the rest plus the first
    token, as nonshared computes it (no engine shares KV across agents' prompts). KV: f16 rows (llama.cpp's
    default) of each hop's prompt and generated tokens."""
    from llama_cpp import Llama  # optional extra: pip install 'kvcmas_cpp[bench]'

    from .bench import _prompt_ids

    base = [r for r in rows if r["method"] == "nonshared"]
    if not base:
        raise ValueError("--compare llama-cpp times what nonshared computes: include nonshared in --method")
    n_threads = threads or os.cpu_count() or 1
    row_bytes = 2 * model.n_layer * 2 * model.n_head_kv * model._core.head_dim  # K and V, f16
    out: list[dict[str, Any]] = []
    for b in base:
        prompts = [c + r for c, r in zip(b["computed_tokens"], b["reused_tokens"], strict=True)]
        n_ctx = max(prompts) + b["decode_tokens"] + 8
        llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads, verbose=False)
        ids = _prompt_ids(llm.n_vocab(), max(prompts))
        n_vocab = llm.n_vocab()
        ttfts: list[float] = []
        for prompt, computed in zip(prompts, b["computed_tokens"], strict=True):
            llm.reset()
            llm.eval(ids[: prompt - computed])  # the cached prefix, not timed (nonshared's is not either)
            t0 = time.perf_counter()
            llm.eval(ids[prompt - computed : prompt])
            last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            int(np.argmax(last))
            ttfts.append(1000.0 * (time.perf_counter() - t0))
        del llm
        kv = [(p + b["decode_tokens"]) * row_bytes for p in prompts]
        later = float(np.mean(ttfts[1:])) if len(ttfts) > 1 else float("nan")
        out.append(
            {
                "shared_tokens": b["shared_tokens"],
                "decode_tokens": b["decode_tokens"],
                "method": "llama.cpp",
                "first_ttft_ms": ttfts[0],
                "later_ttft_ms": later,
                "computed_tokens": list(b["computed_tokens"]),
                "reused_tokens": [p - c for p, c in zip(prompts, b["computed_tokens"], strict=True)],
                "modes": ["dense"] * len(prompts),
                "kv_bytes": int(sum(kv)),
                "kv_bytes_per_hop": kv,
                "corr_bytes": 0,
                "later_ttft_speedup": b["later_ttft_ms"] / max(later, 1e-9),
                "kv_vs_nonshared": sum(kv) / max(b["kv_bytes"], 1),
            }
        )
    return out


def correction_state(
    kd_list: list[int],
    sizes: list[int],
    n_layer_list: list[int],
    readers: int = 3,
    layers_measured: int = 2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Bytes per method for one shared span read by `readers` agents, measured by building each estimator's state
    on `layers_measured` random layers of width kd (span of min(size, 256) rows), then scaled to the size and layer
    count (the state is linear in both). kvcomm: a pool of 20 full-rank anchors; kvcmas-ref: 10 anchors at rank 32
    (bases at rank 32); kvcmas: a ridge map per edge (rank 8 + offset) and the per-hop rank-9 factors."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for kd, n_layer in zip(kd_list, n_layer_list, strict=True):
        m_rows = 256
        ctxs = [
            est.EdgeContext(
                "user_question",
                r,
                "m",
                *(rng.standard_normal((layers_measured, m_rows, kd)).astype(np.float32) for _ in range(4)),
            )
            for r in range(1, readers + 1)
        ]
        ridge = est.RidgeEstimator(rank=8)
        for c in ctxs:
            ridge.add_example(c)
        ridge.fit()
        per_edge_map = ridge.state_bytes() / readers / (layers_measured - 1)  # layer 0 has no map
        anchors: dict[str, float] = {}
        for name, rank, pool in (("kvcomm", None, 20), ("kvcmas-ref", 32, 10)):
            a = est.AnchorEstimator(rank=rank, base_rank=rank, seed=seed)
            for c in ctxs:
                a.record(c, is_question=True)
            # one anchor's bytes per layer and row (factors at rank 32 hold r*kd besides the rows)
            one = a.state_bytes() / layers_measured
            anchors[name] = one * pool
        for n in sizes:
            scale_rows = n / m_rows
            kvcomm = anchors["kvcomm"] * scale_rows * n_layer
            # low-rank: S*r terms scale with rows, r*kd terms do not; measure both parts from the formula check
            ref_rows = 10 * (2 + 2 * readers) * (n * 32 + 32 * kd) * 4 * n_layer
            kvcmas_state = per_edge_map * readers * (n_layer - 1)
            kvcmas_hop = readers * (n_layer - 1) * 2 * (n * 9 + 9 * kd) * 4
            out.append(
                {
                    "kd": kd,
                    "n_layer": n_layer,
                    "shared_tokens": n,
                    "kvcomm_bytes": int(kvcomm),
                    "kvcmas_ref_bytes": int(ref_rows),
                    "kvcmas_state_bytes": int(kvcmas_state),
                    "kvcmas_hop_corr_bytes": int(kvcmas_hop),
                    "kvcmas_vs_kvcomm": (kvcmas_state + kvcmas_hop) / kvcomm,
                    "kvcmas_ref_vs_kvcomm": ref_rows / kvcomm,
                    "measured_kvcmas_ref_bytes_per_anchor_layer": anchors["kvcmas-ref"] / 10,
                }
            )
    return out


def fit_runners(
    model: Model, names: list[str], agents: int, n_train: int, gen_tokens: int, oracle_rank: int
) -> dict[str, WorkflowRunner]:
    """A runner per method label in `names` (not nonshared), the learned estimators fitted on GSM8K test lines
    40.. (n_train questions, gen_tokens per agent)."""
    wf = gsm8k_workflow(agents)
    configs = {"oracle": MethodConfig("oracle", rank=oracle_rank)}
    # labels with a budget on the ridge method read the base method's fitted estimator (fitted once); the others
    # (anchor pools learn online) get their own
    ridge_labels = [m for m in names if "@" in m and parse_label(m)[0] == "kvcmas"]
    fit = [m for m in names if m not in ridge_labels]
    if ridge_labels and "kvcmas" not in fit:
        fit.append("kvcmas")
    configs.update({m: labelled_config(m) for m in fit if "@" in m})
    train = load_gsm8k(40, n_train)
    learned = [m for m in fit if parse_label(m)[0] in ("kvcmas", "kvcmas-ref", "kvcomm")]
    bar = _progress(n_train * len(learned), "fit")
    built = build_runners(
        model, wf, fit, train, gen_tokens=gen_tokens, progress=lambda _n: bar.update(), configs=configs
    )
    bar.close()
    runners = {m: built[m] for m in names if m in built}
    for m in ridge_labels:
        runners[m] = WorkflowRunner(model, wf, labelled_config(m), built["kvcmas"].estimator)
    if "kvcmas" not in names:
        built["kvcmas"].close()
    return {m: runners[m] for m in names}


def fidelity(
    model: Model, methods: list[str], agents: int, n_questions: int, n_train: int, gen_tokens: int, oracle_rank: int
) -> tuple[list[dict[str, Any]], dict[str, WorkflowRunner]]:
    wf = gsm8k_workflow(agents)
    names = [m for m in methods if m != "nonshared"]
    if "oracle" not in names:
        names.append("oracle")
    runners = fit_runners(model, names, agents, n_train, gen_tokens, oracle_rank)
    bar = _progress(n_questions, "fidelity")
    ev = evaluate(model, wf, runners, load_gsm8k(10, n_questions), gen_tokens=gen_tokens, progress=lambda: bar.update())
    bar.close()
    rows: list[dict[str, Any]] = []
    for name in runners:
        for label, ag in (("later agents", None), *((f"agent {a}", [a]) for a in range(1, agents))):
            rows.append({"method": name, "agents": label, **ev.summary(name, ag)})
    if "fullshared" in runners:  # paired over the same questions: per-question mean over the later agents

        def per_question(name: str) -> np.ndarray:
            return np.array([np.mean([h.tf_top1 for h in q[1:]]) for q in ev.hops[name]])

        base = per_question("fullshared")
        for r in rows:
            if r["agents"] == "later agents":
                diff = per_question(r["method"]) - base
                half = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
                r["tf_top1_minus_fullshared"] = float(diff.mean())
                r["tf_top1_minus_fullshared_ci95"] = [float(diff.mean() - half), float(diff.mean() + half)]
    for r in rows:
        full = (
            next(x for x in rows if x["method"] == "fullshared" and x["agents"] == r["agents"])
            if "fullshared" in runners
            else None
        )
        orc = next(x for x in rows if x["method"] == "oracle" and x["agents"] == r["agents"])
        if full is not None and full["kl"] > orc["kl"]:
            r["kl_gap_closed"] = (full["kl"] - r["kl"]) / (full["kl"] - orc["kl"])
    return rows, runners


def run_agents(args: argparse.Namespace) -> int:
    """Runs the three parts (or the accuracy / concurrent mode) and prints tables (or JSON)."""
    from .bench_tasks import NUMERIC_VARIANTS

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
    learned = [m for m in methods if parse_label(m)[0] in ("kvcmas", "kvcmas-ref", "kvcomm")]
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
    kd = model.n_head_kv * model._core.head_dim
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
        from .bench_tasks import plot

        for path in plot(result, Path(args.plot)):
            print(f"plot: {path}", file=sys.stderr)


def _run_session_modes(args: argparse.Namespace, methods: list[str]) -> int:
    """Accuracy (--task) and concurrent (--concurrent) modes, through the agent-session API."""
    from . import bench_tasks as bt

    if args.report:
        if not (args.task and args.out) or args.concurrent or args.cold_start:
            raise ValueError("--report reads an accuracy run's file: it takes --task and --out, and no other mode")
        accuracy = bt.report(args.task, methods, Path(args.out), args.limit)
        result: dict[str, Any] = {"methods": methods, "accuracy": accuracy}
        if args.json:
            print(json.dumps(result, indent=1, default=float))
        else:
            bt.print_accuracy(result["accuracy"])
        _plots(args, result)
        return 0
    # bad counts are refused before the model loads
    bt.check_counts(args.limit, args.max_tokens, args.calibrate)
    bt.calibration_tokens(args.calibrate_tokens, args.max_tokens)
    model = Model(resolve_model_path(args.model), n_threads=args.threads)
    result = {"model": model.path, "methods": methods}
    if args.task:
        out = Path(args.out) if args.out else None
        result["accuracy"] = bt.accuracy(
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
        result["concurrent"] = bt.concurrent(
            model, methods, levels, args.max_tokens, args.calibrate, calibrate_tokens=args.calibrate_tokens
        )
    if args.cold_start:
        if args.cold_start < 1 or args.workflows < 1:
            raise ValueError("--cold-start and --workflows take positive numbers")
        with single_threaded_blas():
            result["cold_start"] = bt.cold_start(model, args.cold_start, args.workflows, args.gen_tokens, args.agents)
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    else:
        if "accuracy" in result:
            bt.print_accuracy(result["accuracy"])
        if "concurrent" in result:
            bt.print_concurrent(result["concurrent"])
        if "cold_start" in result:
            bt.print_cold_start(result["cold_start"])
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
