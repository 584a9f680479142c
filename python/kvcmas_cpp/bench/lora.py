"""`kvcmas bench lora`: decode time per token with LoRA adapters against the base model, one run each (`--team`:
agents with different adapters sharing a context, bench/lora_team.py).

Random adapters of rank r on every linear layer (attention Q/K/V/O, feed-forward gate/up/down) are written as GGUF
LoRA files for the model (llama.cpp's layout), loaded beside it, and timed on the same greedy decode steps: one
sequence with no adapter, one with an adapter, then a batch of n sequences without adapters and the same batch with
n different adapters (one forward pass per step holding every sequence).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import positive_int

# The matrices an adapter may adapt in each layer (GGUF names under blk.<il>.).
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def write_random_adapter(model_path: str, rank: int, out: Path, seed: int, alpha: float = 16.0) -> None:
    """A GGUF LoRA file of rank `rank` on every target of every layer of the model, random A and B (small enough
    that the logits stay finite and the update is not negligible)."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(model_path, "r")
    arch = reader.fields["general.architecture"].contents()
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(out, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS and parts[3] == "weight":
            n_in, n_out = (int(d) for d in t.shape[:2])  # GGUF order
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * 0.02).astype(np.float32)
            writer.add_tensor(t.name + ".lora_a", a)
            writer.add_tensor(t.name + ".lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _decode_ms_per_token(model: Any, adapters: list[str | None], prompt: list[int], gen: int) -> float:
    """Prefills one sequence per entry (its adapter or none), then times `gen` greedy decode steps of all of them
    in one batch per step (after one untimed step); the median step's ms (steady against other load)."""
    seqs = [model.new_sequence() for _ in adapters]
    try:
        for seq, name in zip(seqs, adapters, strict=True):
            model.set_sequence_adapter(seq, name)
        logits = model.decode_batch([(s, prompt) for s in seqs])

        def step() -> list[Any]:
            return model.decode_batch([(s, [int(np.argmax(lg))]) for s, lg in zip(seqs, logits, strict=True)])

        logits = step()  # untimed: the first step after a prompt warms the decode path
        times = []
        for _ in range(gen):
            t0 = time.perf_counter()
            logits = step()
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1000.0
    finally:
        for s in seqs:
            s.close()


def bench_lora(model_path: str, rank: int, threads: int, prompt: int, gen: int, batch: int) -> list[dict[str, Any]]:
    from ..model import Model

    model = Model(model_path, n_threads=threads)
    ids = [int(t) for t in np.random.default_rng(0).integers(100, model.n_vocab - 100, prompt)]
    with tempfile.TemporaryDirectory(prefix="kvcmas-bench-lora-") as tmp:
        for i in range(max(1, batch)):
            path = Path(tmp) / f"lora{i}.gguf"
            write_random_adapter(model_path, rank, path, seed=i)
            model.load_adapter(path, name=f"lora{i}")
    names: list[str | None] = [f"lora{i}" for i in range(max(1, batch))]
    cases: list[tuple[str, list[str | None]]] = [
        ("base, 1 sequence", [None]),
        (f"rank-{rank} adapter, 1 sequence", names[:1]),
        (f"base, batch of {batch}", [None] * batch),
        (f"{batch} rank-{rank} adapters, batch of {batch}", names[:batch]),
    ]
    rows: list[dict[str, Any]] = []
    for label, adapters in cases:
        if batch <= 1 and "batch" in label:
            continue
        rows.append({"case": label, "ms_per_step": _decode_ms_per_token(model, adapters, ids, gen)})
    for i in range(1, len(rows), 2):
        rows[i]["vs_base"] = rows[i]["ms_per_step"] / rows[i - 1]["ms_per_step"]
    return rows


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the default model)")
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

    path = resolve_model_path(args.model)
    if args.team:
        from .lora_team import bench_lora_team, print_team

        result = bench_lora_team(
            path, args.rank, args.threads, args.shared_tokens, args.contexts, args.calibrate, args.reply_tokens
        )
        print(json.dumps(result)) if args.json else print_team(result)
        return 0
    rows = bench_lora(path, args.rank, args.threads, args.prompt, args.gen, args.batch)
    if args.json:
        print(json.dumps({"model": path, "threads": args.threads, "rows": rows}))
        return 0
    print(f"{os.path.basename(path)}, {args.threads} threads, {args.prompt}-token prompts, {args.gen} decode steps")
    print(f"{'case':<40} {'ms / decode step (median)':>25} {'vs base':>8}")
    for r in rows:
        ratio = f"{r['vs_base']:.2f}x" if "vs_base" in r else ""
        print(f"{r['case']:<40} {r['ms_per_step']:>25.2f} {ratio:>8}")
    return 0
