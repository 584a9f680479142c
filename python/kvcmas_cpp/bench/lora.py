"""`kvcmas bench lora`: decode time per token with LoRA adapters against the base model, one run each (`--team`:
agents with different adapters sharing a context, bench/lora_team.py).

Random adapters of rank r on every linear layer (attention Q/K/V/O, feed-forward gate/up/down) are written as GGUF
LoRA files for the model (llama.cpp's layout), loaded beside it, and timed on the same greedy decode steps: one
sequence with no adapter, one with an adapter, then a batch of n sequences without adapters and the same batch with
n different adapters (one forward pass per step holding every sequence). The cases take turns step by step, so that
a loaded machine slows them alike; several models (`-m` repeated) are printed side by side.
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


class _Decoder:
    """One sequence per entry (its adapter or none), prefilled with the prompt; `step` runs one greedy decode step of
    all of them in one batch and returns its seconds."""

    def __init__(self, model: Any, adapters: list[str | None], prompt: list[int]) -> None:
        self.model = model
        self.seqs = [model.new_sequence() for _ in adapters]
        for seq, name in zip(self.seqs, adapters, strict=True):
            model.set_sequence_adapter(seq, name)
        self.logits = model.decode_batch([(s, prompt) for s in self.seqs])

    def step(self) -> float:
        feed = [(s, [int(np.argmax(lg))]) for s, lg in zip(self.seqs, self.logits, strict=True)]
        t0 = time.perf_counter()
        self.logits = self.model.decode_batch(feed)
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.seqs:
            s.close()


def bench_lora(model_path: str, rank: int, threads: int, prompt: int, gen: int, batch: int) -> list[dict[str, Any]]:
    """The four cases' median ms per decode step. The cases take turns step by step (after one untimed step each),
    so that load from other processes falls on all of them alike."""
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
    ]
    if batch > 1:
        cases += [
            (f"base, batch of {batch}", [None] * batch),
            (f"{batch} rank-{rank} adapters, batch of {batch}", names),
        ]
    decoders = [_Decoder(model, adapters, ids) for _, adapters in cases]
    try:
        times: list[list[float]] = [[] for _ in cases]
        for d in decoders:
            d.step()  # untimed: the first step after a prompt warms the decode path
        for _ in range(gen):
            for d, t in zip(decoders, times, strict=True):
                t.append(d.step())
    finally:
        for d in decoders:
            d.close()
    rows: list[dict[str, Any]] = [
        {"case": label, "ms_per_step": float(np.median(t)) * 1000.0, "min_ms_per_step": float(np.min(t)) * 1000.0}
        for (label, _), t in zip(cases, times, strict=True)
    ]
    for i in range(1, len(rows), 2):
        rows[i]["vs_base"] = rows[i]["ms_per_step"] / rows[i - 1]["ms_per_step"]
        rows[i]["min_vs_base"] = rows[i]["min_ms_per_step"] / rows[i - 1]["min_ms_per_step"]
    return rows


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
    results = []
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
