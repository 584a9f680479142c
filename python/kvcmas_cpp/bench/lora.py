"""`kvcmas bench lora`: decode time per token with LoRA adapters against the base model, one run each (`--team`:
agents with different adapters sharing a context, bench/lora_team.py).

Random adapters of rank r on every linear layer (attention Q/K/V/O, feed-forward gate/up/down) are written as GGUF
LoRA files for the model (llama.cpp's layout), loaded beside it, and timed on the same greedy decode steps: one
sequence with no adapter, one with an adapter, then a batch of n sequences without adapters and the same batch with
n different adapters (one forward pass per step holding every sequence). The cases take turns step by step, so that
a loaded machine slows them alike; several models (`-m` repeated) are printed side by side.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

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
