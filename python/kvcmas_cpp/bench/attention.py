"""`kvcmas bench attention`: the corrected attention kernel, fused vs materialized, per shape.

A reader of a shared span of n rows with a rank-r correction can either keep the factors and apply them inside
attention (fused: scores gain (q·Bᵀ)·Aᵀ, outputs (p·A)·B; per-agent memory n·r·2 + r·kd·2 floats) or materialize
its own corrected copy of the span once (K + A_k B_k, V + A_v B_v; per-agent memory n·kd·2 rows) and attend over
it like over any rows. Both run the engine's kernel (`_testing.attend_test`, one query of all heads, one thread); the
table gives time per decode-step attention call, the one-time cost of materializing, and the memory per agent, so
the crossover (if any) is visible. The runner chooses per span (`MethodConfig.apply`, default 'auto'): fused, whose
memory stays O(n·r), unless the factors would take at least the copy's bytes (full-rank corrections).

The kernel is reached through kvcmas_cpp._testing, built with KVCMAS_TESTING_MODULE=ON (scripts/setup.sh --bench).
"""

from __future__ import annotations

import argparse
import json
import time
from types import ModuleType
from typing import Any

import numpy as np

from .._native import testing_module
from ..arguments import positive_int, positive_int_list
from ..errors import CommandError


def add_attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spans", type=positive_int_list, default=[256, 1024, 4096], help="comma-separated shared span lengths"
    )
    p.add_argument("--ranks", type=positive_int_list, default=[8, 32, 128], help="comma-separated correction ranks")
    p.add_argument("--kv-type", default="f32,f16", help="comma-separated row types")
    p.add_argument("--heads", type=positive_int, default=9, help="query heads (default: SmolLM2-135M's 9)")
    p.add_argument("--kv-heads", type=positive_int, default=3, help="KV heads (default 3)")
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--repeat", type=positive_int, default=30, help="calls per measurement (best of 3 rounds)")
    p.add_argument("--json", action="store_true")


def _time(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best


def measure(
    kernels: ModuleType,
    n: int,
    rank: int,
    kv_type: str,
    n_head: int,
    n_head_kv: int,
    hd: int,
    repeat: int,
    seed: int = 0,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    kd = n_head_kv * hd
    q = rng.standard_normal((n_head, hd), dtype=np.float32)
    k = rng.standard_normal((n, kd), dtype=np.float32)
    v = rng.standard_normal((n, kd), dtype=np.float32)
    a_k, a_v = (rng.standard_normal((n, rank), dtype=np.float32) * 0.1 for _ in range(2))
    b_k, b_v = (rng.standard_normal((rank, kd), dtype=np.float32) * 0.1 for _ in range(2))

    def rows(x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).view(np.uint16) if kv_type == "f16" else x

    fused_run = {"k": rows(k), "v": rows(v), "shift": 7, "a_k": a_k, "b_k": b_k, "a_v": a_v, "b_v": b_v}
    t0 = time.perf_counter()
    k_mat, v_mat = k + a_k @ b_k, v + a_v @ b_v
    mat_run = {"k": rows(np.ascontiguousarray(k_mat)), "v": rows(np.ascontiguousarray(v_mat)), "shift": 7}
    materialize_ms = (time.perf_counter() - t0) * 1000.0

    def call(run: dict[str, Any]) -> np.ndarray:
        return kernels.attend_test(q, [run], n_head_kv, hd, False, 10000.0, n, kv_type)

    fused_out, mat_out = call(fused_run), call(mat_run)
    rel = float(np.abs(fused_out - mat_out).max() / max(np.abs(mat_out).max(), 1e-30))
    fused_s, mat_s = _time(lambda: call(fused_run), repeat), _time(lambda: call(mat_run), repeat)
    row_bytes = 2 if kv_type == "f16" else 4
    return {
        "span": n,
        "rank": rank,
        "kv_type": kv_type,
        "fused_us": fused_s * 1e6,
        "materialized_us": mat_s * 1e6,
        "fused_vs_materialized": fused_s / mat_s,
        "materialize_once_ms": materialize_ms,
        "fused_bytes_per_agent": (2 * n * rank + 2 * rank * kd) * 4,
        "materialized_bytes_per_agent": 2 * n * kd * row_bytes,
        "max_rel_diff": rel,
    }


def run_attention(args: argparse.Namespace) -> int:
    spans, ranks = args.spans, args.ranks
    types = [x.strip() for x in args.kv_type.split(",") if x.strip()]
    try:
        kernels = testing_module()
    except ImportError as e:
        raise CommandError(f"bench attention needs {e}") from e
    rows = [
        measure(kernels, n, r, t, args.heads, args.kv_heads, args.head_dim, args.repeat)
        for t in types
        for n in spans
        for r in ranks
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"## attention over a corrected shared span ({args.heads} heads, {args.kv_heads} KV heads, d={args.head_dim})"
    )
    print(
        "| rows | span | rank | fused µs | materialized µs | fused / materialized | materialize once ms | "
        "memory per agent: fused | materialized | max rel diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kv_type']} | {r['span']} | {r['rank']} | {r['fused_us']:.0f} | {r['materialized_us']:.0f} | "
            f"{r['fused_vs_materialized']:.2f} | {r['materialize_once_ms']:.2f} | "
            f"{r['fused_bytes_per_agent'] / 2**10:.0f} KiB | {r['materialized_bytes_per_agent'] / 2**10:.0f} KiB | "
            f"{r['max_rel_diff']:.1e} |"
        )
    return 0
