"""`kvcmas bench core`: prefill and decode speed of the engine, side by side with llama.cpp and PyTorch.

Each measurement runs in a fresh subprocess, so peak RSS belongs to one engine alone, and engines are
interleaved round by round, so a slow moment of the machine hits all of them alike. The best round is kept.
kvcmas stores its KV cache as f16 here by default (`--kv-type`), as llama.cpp does by default, so both engines
read the same amount of KV per token.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ENGINES = ("kvcmas", "llama-cpp", "torch-bf16")


@dataclass
class CoreResult:
    engine: str
    model: str
    threads: int
    prompt: int
    gen: int
    prefill_tok_s: float
    decode_tok_s: float  # 0 when the engine measured prefill only
    peak_rss_mb: float
    kv_type: str = "-"  # KV cache storage of the run ("-": the engine's own default, or no KV cache)


def _prompt_ids(n_vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(1234)
    # Avoid the first ids (often control tokens); any ids serve for timing.
    return [int(t) for t in rng.integers(100, min(n_vocab, 32000), size=n)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run_kvcmas(model_path: str, threads: int, prompt: int, gen: int, kv_type: str) -> tuple[float, float]:
    from .model import Model

    model = Model(model_path, n_threads=threads, n_ctx=prompt + gen + 8, kv_type=kv_type)  # type: ignore[arg-type]
    ids = _prompt_ids(model.n_vocab, prompt)
    with model.new_sequence() as warm:  # first touch of the mapped weights
        warm.append(ids[:32])
    with model.new_sequence() as seq:
        t0 = time.perf_counter()
        logits = seq.append(ids, logits="last")
        t1 = time.perf_counter()
        for _ in range(gen):
            assert logits is not None
            logits = seq.append([int(np.argmax(logits))], logits="last")
        t2 = time.perf_counter()
    return prompt / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def _run_llama_cpp(model_path: str, threads: int, prompt: int, gen: int, kv_type: str) -> tuple[float, float]:
    from llama_cpp import Llama  # optional extra: pip install 'kvcmas_cpp[bench]'

    del kv_type  # llama.cpp keeps its default KV type (f16)
    llm = Llama(
        model_path=model_path,
        n_ctx=prompt + gen + 8,
        n_batch=prompt,
        n_ubatch=prompt,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    ids = _prompt_ids(llm.n_vocab(), prompt)
    llm.eval(ids[:32])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n_vocab = llm.n_vocab()
    for _ in range(gen):
        # eval() keeps no logits unless logits_all: read the last row from the context, as a sampler would.
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        llm.eval([int(np.argmax(last))])
    t2 = time.perf_counter()
    return prompt / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def _run_torch_bf16(model_path: str, threads: int, prompt: int, gen: int, kv_type: str) -> tuple[float, float]:
    del kv_type  # prefill only: no KV cache is kept
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor([_prompt_ids(model.config.vocab_size, prompt)])
    with torch.no_grad():
        model(ids[:, :32])
        t0 = time.perf_counter()
        model(ids)
        t1 = time.perf_counter()
    return prompt / (t1 - t0), 0.0


# KV cache storage each engine runs with, as printed in the table (kvcmas: the --kv-type option).
_ENGINE_KV = {"llama-cpp": "f16", "torch-bf16": "-"}


def _worker(engine: str, model_path: str, threads: int, prompt: int, gen: int, kv_type: str) -> CoreResult:
    runner = {"kvcmas": _run_kvcmas, "llama-cpp": _run_llama_cpp, "torch-bf16": _run_torch_bf16}[engine]
    prefill, decode = runner(model_path, threads, prompt, gen, kv_type)
    kv = kv_type if engine == "kvcmas" else _ENGINE_KV[engine]
    return CoreResult(engine, model_path, threads, prompt, gen, prefill, decode, _peak_rss_mb(), kv)


def _measure(engine: str, model_path: str, threads: int, prompt: int, gen: int, kv_type: str) -> CoreResult:
    cmd = [sys.executable, "-m", "kvcmas_cpp.bench", "--worker", engine, model_path]
    cmd += [str(threads), str(prompt), str(gen), kv_type]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} benchmark failed on {model_path}:\n{proc.stderr[-2000:]}")
    return CoreResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def bench_core(
    models: list[str], threads: int, prompt: int, gen: int, compare: list[str], rounds: int, kv_type: str = "f16"
) -> list[CoreResult]:
    """Best of `rounds` interleaved rounds for kvcmas (KV stored as `kv_type`) and each engine in `compare`, per
    model."""
    from tqdm import tqdm

    engines = ["kvcmas", *[e for e in compare if e != "kvcmas"]]
    best: dict[tuple[str, str], CoreResult] = {}
    jobs = [(m, e) for _ in range(rounds) for m in models for e in engines]
    for model_path, engine in tqdm(jobs, desc="bench core", unit="run", file=sys.stderr):
        if engine == "torch-bf16" and (model_path, engine) in best:
            continue  # slow to load; one round tells the anchor
        r = _measure(engine, model_path, threads, prompt, gen, kv_type)
        key = (model_path, engine)
        old = best.get(key)
        if old is None:
            best[key] = r
        else:
            old.prefill_tok_s = max(old.prefill_tok_s, r.prefill_tok_s)
            old.decode_tok_s = max(old.decode_tok_s, r.decode_tok_s)
            old.peak_rss_mb = max(old.peak_rss_mb, r.peak_rss_mb)
    return list(best.values())


def format_table(results: list[CoreResult]) -> str:
    """Markdown table with our/other ratios per model."""
    lines = [
        "| model | engine | threads | KV | prefill tok/s | decode tok/s | peak RSS MB | prefill ratio | decode ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ours = {r.model: r for r in results if r.engine == "kvcmas"}
    for r in results:
        base = ours.get(r.model)
        pre = dec = ""
        if base is not None and r.engine != "kvcmas":
            pre = f"{base.prefill_tok_s / r.prefill_tok_s:.2f}x" if r.prefill_tok_s else ""
            dec = f"{base.decode_tok_s / r.decode_tok_s:.2f}x" if r.decode_tok_s else ""
        decode = f"{r.decode_tok_s:.1f}" if r.decode_tok_s else "-"
        lines.append(
            f"| {Path(r.model).name} | {r.engine} | {r.threads} | {r.kv_type} | {r.prefill_tok_s:.1f} | {decode} "
            f"| {r.peak_rss_mb:.0f} | {pre} | {dec} |"
        )
    lines.append("")
    lines.append("ratio = kvcmas / that engine (above 1: kvcmas is faster)")
    return "\n".join(lines)


def add_core_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="GGUF file or model name (repeatable; default: the default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens to prefill")
    p.add_argument("--gen", type=int, default=128, help="tokens to decode")
    p.add_argument("--compare", action="append", default=[], choices=["llama-cpp", "torch-bf16"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best is kept")
    p.add_argument(
        "--kv-type",
        default="f16",
        choices=["f16", "f32"],
        help="kvcmas KV cache storage (default f16, llama.cpp's default, for a like-for-like comparison)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_core(args: argparse.Namespace) -> int:
    from .model import resolve_model_path

    models = [resolve_model_path(m) for m in args.model] if args.model else [resolve_model_path(None)]
    results = bench_core(models, args.threads, args.prompt, args.gen, args.compare, args.rounds, args.kv_type)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        _, _, eng, path, th, pr, ge, kv = sys.argv
        print(json.dumps(asdict(_worker(eng, path, int(th), int(pr), int(ge), kv))))
    else:
        parser = argparse.ArgumentParser(prog="python -m kvcmas_cpp.bench")
        add_core_arguments(parser)
        sys.exit(run_core(parser.parse_args()))
