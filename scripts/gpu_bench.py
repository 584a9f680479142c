"""GPU benchmarks of the CUDA backend, side by side with PyTorch (transformers) on the same shapes, for
scripts/gpu-check.sh. Prints one line per figure (also as JSON with --json) and stops starting new measurements past
the deadline. Figures are measured, never asserted.

    python3 scripts/gpu_bench.py MODEL_DIR [--deadline-s 300] [--skip-torch]
    python3 scripts/gpu_bench.py MODEL_DIR --device cpu --skip-torch --models smollm2-135m --prefill 64 --steps 4 \
        --ttft ""      # a smoke run of this script without a GPU

MODEL_DIR holds the files of models/make_bench_models.py (bench-<name>-f16.gguf).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from make_bench_models import SHAPES, Shape  # noqa: E402

from kvcmas_cpp._native import core, testing_module  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, the datasheet figure
PROMPT_CHUNK = 512  # as kvcmas_cpp.Model.append


class Report:
    def __init__(self, deadline: float, as_json: bool) -> None:
        self.deadline, self.as_json = deadline, as_json

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def put(self, **row) -> None:
        print(json.dumps(row) if self.as_json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def _ids(n: int, n_vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def kvcmas_prefill(m, seq: int, ids: np.ndarray) -> np.ndarray:
    out = None
    for s in range(0, len(ids), PROMPT_CHUNK):
        chunk = ids[s : s + PROMPT_CHUNK]
        want = np.zeros(len(chunk), np.uint8)
        if s + PROMPT_CHUNK >= len(ids):
            want[-1] = 1
        out = m.decode(np.full(len(chunk), seq, np.int32), chunk, want)
    return out


def bench_kvcmas(rep: Report, name: str, path: Path, s: Shape, args: argparse.Namespace) -> dict:
    res = {}
    m = core.Model(str(path), n_threads=4, n_ctx=4096 + 256, kv_budget=24 << 30, kv_type="f16", device=args.device)
    steps = args.steps
    for n in args.prefill:
        if rep.left() < 20:
            return res
        seq = m.seq_new()
        ids = _ids(n, s.n_vocab, n)
        kvcmas_prefill(m, seq, ids[:64])  # warm-up (kernels, allocator)
        m.seq_truncate(seq, 0)
        t0 = time.perf_counter()
        kvcmas_prefill(m, seq, ids)
        dt = time.perf_counter() - t0
        res[f"prefill{n}"] = n / dt
        rep.put(engine="kvcmas", model=name, op=f"prefill {n}", tok_s=round(n / dt, 1), s=round(dt, 3))
        m.seq_remove(seq)
    for batch in (1, 16):
        if rep.left() < 20:
            return res
        seqs = [m.seq_new() for _ in range(batch)]
        for sq in seqs:
            kvcmas_prefill(m, sq, _ids(32, s.n_vocab, sq))
        tok = np.zeros(batch, np.int32)
        ones = np.ones(batch, np.uint8)
        sid = np.array(seqs, np.int32)
        m.decode(sid, tok, ones)  # warm-up step
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = m.decode(sid, tok, ones)
            tok = logits.argmax(axis=1).astype(np.int32)
        dt = time.perf_counter() - t0
        res[f"decode_b{batch}"] = steps * batch / dt
        rep.put(engine="kvcmas", model=name, op=f"decode {steps} batch {batch}", tok_s=round(steps * batch / dt, 1))
        for sq in seqs:
            m.seq_remove(sq)
    return res


def torch_model(s: Shape):
    import torch
    import transformers

    common = dict(
        hidden_size=s.n_embd,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_head_kv,
        intermediate_size=s.n_ff,
        vocab_size=s.n_vocab,
        rope_theta=s.rope_theta,
        rms_norm_eps=s.rms_eps,
        tie_word_embeddings=s.tied,
        max_position_embeddings=40960,
    )
    cfg = transformers.Qwen2Config(**common) if s.arch == "qwen2" else transformers.LlamaConfig(**common)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, torch_dtype=torch.float16, attn_implementation="sdpa"
        )
    return model.eval()


def bench_torch(rep: Report, name: str, s: Shape, args: argparse.Namespace) -> dict:
    import torch

    res = {}
    model = torch_model(s)
    steps = args.steps
    with torch.no_grad():
        for n in args.prefill:
            if rep.left() < 20:
                return res
            ids = torch.tensor(_ids(n, s.n_vocab, n)[None], device="cuda", dtype=torch.long)
            model(ids[:, :64])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            res[f"prefill{n}"] = n / dt
            rep.put(engine="torch", model=name, op=f"prefill {n}", tok_s=round(n / dt, 1), s=round(dt, 3))
        for batch in (1, 16):
            if rep.left() < 20:
                return res
            ids = torch.tensor(np.stack([_ids(32, s.n_vocab, b) for b in range(batch)]), device="cuda")
            out = model(ids, use_cache=True, logits_to_keep=1)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(tok, past_key_values=past, use_cache=True)  # warm-up step
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            res[f"decode_b{batch}"] = steps * batch / dt
            rep.put(engine="torch", model=name, op=f"decode {steps} batch {batch}", tok_s=round(steps * batch / dt, 1))
    del model
    torch.cuda.empty_cache()
    return res


def weight_bytes_per_token(s: Shape) -> int:
    """Bytes a decode step reads from F16 weights: every matrix once, one row of the token embedding."""
    hd, kd = s.head_dim, s.n_head_kv * s.head_dim
    per_layer = s.n_embd * (s.n_head * hd + 2 * kd) + s.n_head * hd * s.n_embd + 3 * s.n_embd * s.n_ff
    return 2 * (s.n_layer * per_layer + s.n_vocab * s.n_embd + s.n_embd)


def bench_ttft(rep: Report, path: Path, s: Shape, lengths: list[int], device: str) -> None:
    """A later agent's time to first token after a first agent computed the shared context: nonshared prefills
    context + own prompt; kvcmas appends the first agent's span (no copy) with a rank-8 correction on every layer
    but the first, fused in attention, then prefills its own 64 tokens."""
    m = core.Model(str(path), n_threads=4, n_ctx=max(lengths) + 256, kv_budget=60 << 30, kv_type="f16", device=device)
    kd, own = s.n_head_kv * s.head_dim, 64
    for n in lengths:
        if rep.left() < 30:
            rep.put(op="ttft", shared=n, skipped="deadline")
            continue
        ctx, mine = _ids(n, s.n_vocab, 1), _ids(own, s.n_vocab, 2)
        first = m.seq_new()
        kvcmas_prefill(m, first, np.concatenate([_ids(16, s.n_vocab, 3), ctx]))
        rng = np.random.default_rng(n)
        corr = core.KvCorrection(n, 8, kd, s.n_layer)
        for il in range(1, s.n_layer):
            corr.set_layer(il, *(rng.standard_normal(sh).astype(np.float32) * 0.01 for sh in ((n, 8), (8, kd)) * 2))
        times = {}
        later = m.seq_new()
        t0 = time.perf_counter()
        kvcmas_prefill(m, later, _ids(24, s.n_vocab, 4))  # its own preamble: the span is read 8 positions later
        m.seq_append_shared(later, m.seq_share(first, 16, n), corr)
        kvcmas_prefill(m, later, mine)
        times["kvcmas"] = time.perf_counter() - t0
        m.seq_remove(later)
        if rep.left() < 20:
            rep.put(op="ttft", shared=n, kvcmas_s=round(times["kvcmas"], 3), nonshared="skipped (deadline)")
            m.seq_remove(first)
            continue
        later = m.seq_new()
        t0 = time.perf_counter()
        kvcmas_prefill(m, later, np.concatenate([_ids(24, s.n_vocab, 4), ctx, mine]))
        times["nonshared"] = time.perf_counter() - t0
        m.seq_remove(later)
        m.seq_remove(first)
        rep.put(
            op=f"ttft later agent ({s.n_layer} layers x {s.n_embd})",
            shared=n,
            nonshared_s=round(times["nonshared"], 3),
            kvcmas_s=round(times["kvcmas"], 3),
            speedup=round(times["nonshared"] / times["kvcmas"], 2),
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="smollm2-135m,qwen2-0.5b,llama3-8b")
    ap.add_argument("--prefill", default="512,4096", help="prompt lengths of the prefill figures")
    ap.add_argument("--steps", type=int, default=128, help="decode steps")
    ap.add_argument("--ttft", default="2048,8192,16384,32768", help="shared lengths of the TTFT figures (8B shape)")
    ap.add_argument("--ttft-model", default="llama3-8b")
    args = ap.parse_args()
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    rep = Report(time.perf_counter() + args.deadline_s, args.json)
    ops = testing_module().BackendOps(args.device, 4)
    rep.put(device=ops.device_description)
    for name in args.models.split(","):
        path = args.model_dir / f"bench-{name}-f16.gguf"
        if not path.exists():
            rep.put(model=name, skipped=f"{path} missing")
            continue
        s = SHAPES[name]
        try:
            ours = bench_kvcmas(rep, name, path, s, args)
            if name == "llama3-8b" and "decode_b1" in ours:
                bw = ours["decode_b1"] * weight_bytes_per_token(s)
                rep.put(
                    model=name,
                    op="decode batch 1 bandwidth",
                    gb_s=round(bw / 1e9, 1),
                    fraction_of_h200=round(bw / H200_BANDWIDTH, 3),
                )
        except Exception as exc:  # report and go on: one failure must not hide the other figures
            rep.put(engine="kvcmas", model=name, error=repr(exc)[:300])
        if not args.skip_torch:
            try:
                bench_torch(rep, name, s, args)
            except Exception as exc:
                rep.put(engine="torch", model=name, error=repr(exc)[:300])
    path = args.model_dir / f"bench-{args.ttft_model}-f16.gguf"
    lengths = [int(x) for x in args.ttft.split(",") if x]
    if path.exists() and lengths:
        try:
            bench_ttft(rep, path, SHAPES[args.ttft_model], lengths, args.device)
        except Exception as exc:
            rep.put(op="ttft", error=repr(exc)[:300])


if __name__ == "__main__":
    main()
