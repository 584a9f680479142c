"""Throughput of the CPU matmul kernels on SmolLM2-135M shapes (a tuning aid, not a test).

Prints GFLOP/s for prefill-shaped products (n_tok x n_in x n_out, default 512 x 576 x 1536) and GB/s of weight
bytes streamed for decode-shaped ones (--decode-tokens rows, default 1; all 30 layers' worth of distinct weight
matrices so that the weights come from memory as in a real decode step, not from cache).

With --threads 1 the figures use the thread's CPU time, so they hold on a busy machine; with more threads they are
wall-clock and need a quiet one.

Run: PYTHONPATH=python [KVCMAS_CORE_PATH=...] python bench/kernels_bench.py [--threads 2] [--types f16,q8_0,q4_1]

--qwen-1.5b instead times the matrices of a Qwen2.5-1.5B Q4_K_M file one by one with 8-bit activations (the engine's
default): decode GB/s per matrix over enough distinct copies to stream ~160 MB (the output matrix alone is 191 MB),
and prefill GMAC/s of 128 tokens through the integer GEMM, for each of --activations (q8,q8-fast: the two-pass and
the one-pass kernels side by side; --no-decode skips the decode figures).
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from kvcmas_cpp._native import core, testing_module

testing = testing_module()  # matmul_bench: built with KVCMAS_TESTING_MODULE=ON (developer cmake builds)

TYPES = {
    "f32": QT.F32,
    "f16": QT.F16,
    "bf16": QT.BF16,
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1,
    "q5_0": QT.Q5_0,
    "q5_1": QT.Q5_1,
    "q4_k": QT.Q4_K,
    "q5_k": QT.Q5_K,
    "q6_k": QT.Q6_K,
}
K_QUANTS = {QT.Q4_K, QT.Q5_K, QT.Q6_K}


def make_weight(qtype: QT, n_out: int, n_in: int, rng: np.random.Generator) -> bytes:
    """Random weight bytes of the given type (valid blocks with small scales for the K-quants)."""
    if qtype in K_QUANTS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = n_out * n_in // block
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        scale = rng.uniform(-0.01, 0.01, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        if qtype == QT.Q6_K:
            raw[:, -2:] = scale
        else:
            raw[:, 0:2] = scale
            raw[:, 2:4] = np.abs(scale.view(np.float16)).view(np.uint8).reshape(n_blocks, 2)
        return raw.tobytes()
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qtype).tobytes()


def pick(times: tuple[float, float], threads: int) -> float:
    """Wall time, or with one thread the CPU time (robust against other processes on a busy machine)."""
    return times[1] if threads == 1 else times[0]


def bench_prefill(qtype: QT, n_tok: int, n_in: int, n_out: int, threads: int, rng: np.random.Generator) -> float:
    """GFLOP/s of one prefill-shaped product (best of several)."""
    w = make_weight(qtype, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    sec = pick(testing.matmul_bench(int(qtype), [w], n_in, n_out, x, threads, 8), threads)
    return 2.0 * n_tok * n_in * n_out / sec / 1e9


def bench_decode(
    qtype: QT, n_in: int, n_out: int, threads: int, rng: np.random.Generator, n_tok: int = 1, copies: int = 30
) -> float:
    """GB/s of weight bytes read by n_tok-token products over `copies` distinct matrices (one decode step)."""
    weights = [make_weight(qtype, n_out, n_in, rng) for _ in range(copies)]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    sec = pick(testing.matmul_bench(int(qtype), weights, n_in, n_out, x, threads, 20), threads)
    return len(weights[0]) * copies / sec / 1e9


# (name, type, n_in, n_out) of one layer of a Qwen2.5-1.5B Q4_K_M file, and its tied output matrix.
QWEN_1_5B_MATRICES = [
    ("attn_q / attn_output", "q4_k", 1536, 1536),
    ("attn_k", "q4_k", 1536, 256),
    ("attn_v", "q6_k", 1536, 256),
    ("ffn_gate / ffn_up", "q4_k", 1536, 8960),
    ("ffn_down", "q6_k", 8960, 1536),
    ("output (tied token_embd)", "q6_k", 1536, 151936),
]


def bench_qwen_matrices(
    threads: int, rng: np.random.Generator, activations: list[str], decode: bool = True, repeats: int = 2
) -> None:
    """Per-matrix decode GB/s (8-bit activations) and 128-token prefill GMAC/s with each of `activations`."""
    cols = " | ".join(
        [f"decode GB/s {a}" for a in activations] + [f"prefill GMAC/s {a} (128 tokens)" for a in activations]
    )
    print(f"| matrix | type | n_in x n_out | {cols} |")
    print("|---|---|---|" + "---|" * 2 * len(activations))
    for what, name, n_in, n_out in QWEN_1_5B_MATRICES:
        qtype = TYPES[name]
        w = make_weight(qtype, n_out, n_in, rng)
        dec = [float("nan")] * len(activations)
        if decode:
            copies = max(1, int(160e6 // len(w)))
            weights = [w] + [make_weight(qtype, n_out, n_in, rng) for _ in range(copies - 1)]
            x1 = rng.standard_normal((1, n_in)).astype(np.float32)
            for i, act in enumerate(activations):
                sec = pick(testing.matmul_bench(int(qtype), weights, n_in, n_out, x1, threads, 6, act), threads)
                dec[i] = len(w) * copies / sec / 1e9
        x = rng.standard_normal((128, n_in)).astype(np.float32)
        gmac = []
        for act in activations:
            sec = pick(testing.matmul_bench(int(qtype), [w], n_in, n_out, x, threads, repeats, act), threads)
            gmac.append(f"{128 * n_in * n_out / sec / 1e9:.1f}")
        figures = " | ".join([f"{v:.1f}" for v in dec] + gmac)
        print(f"| {what} | {name.upper()} | {n_in} x {n_out} | {figures} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="f16,q8_0,q4_1,q4_k,q6_k")
    parser.add_argument("--n-tok", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=1, help="rows per decode-shaped product")
    parser.add_argument("--qwen-1.5b", dest="qwen", action="store_true", help="per-matrix figures of Qwen2.5-1.5B")
    parser.add_argument(
        "--activations", default="q8", help="--qwen-1.5b: prefill activations to time, comma-separated (q8,q8-fast)"
    )
    parser.add_argument("--no-decode", action="store_true", help="--qwen-1.5b: prefill figures only")
    parser.add_argument("--repeats", type=int, default=2, help="--qwen-1.5b: best of this many prefill runs")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"cpu features: {core.cpu_features()}, threads: {args.threads}")
    if args.qwen:
        bench_qwen_matrices(args.threads, rng, args.activations.split(","), not args.no_decode, args.repeats)
        return
    for name in args.types.split(","):
        qtype = TYPES[name]
        # K-quant rows must be whole 256-blocks (SmolLM2's 576 is not; its K-quant files fall back to other types)
        shapes = [(768, 1536), (1536, 768), (768, 768)] if qtype in K_QUANTS else [(576, 1536), (1536, 576), (576, 576)]
        t0 = time.perf_counter()
        pre = [bench_prefill(qtype, args.n_tok, n_in, n_out, args.threads, rng) for n_in, n_out in shapes]
        dec = [bench_decode(qtype, n_in, n_out, args.threads, rng, args.decode_tokens) for n_in, n_out in shapes[:2]]
        pre_s = "  ".join(f"{n_in}x{n_out}: {g:6.1f}" for (n_in, n_out), g in zip(shapes, pre, strict=True))
        dec_s = "  ".join(f"{n_in}x{n_out}: {g:5.1f}" for (n_in, n_out), g in zip(shapes[:2], dec, strict=True))
        print(f"{name:5s} prefill GFLOP/s [{pre_s}]  decode GB/s [{dec_s}]  ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
