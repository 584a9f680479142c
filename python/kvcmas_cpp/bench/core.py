"""`kvcmas bench core`: prefill and decode speed of the engine, side by side with llama.cpp and PyTorch.

Each measurement runs in a fresh subprocess, so peak RSS belongs to one engine alone, and engines are
interleaved round by round, so a slow moment of the machine hits all of them alike. Each figure is the median of the
rounds. kvcmas stores its KV cache as f16 here by default (`--kv-type`), as llama.cpp does by default, so both engines
read the same amount of KV per token, and runs with 8-bit activations (`--activations q8`, the engine's default), as
llama.cpp does.

Decode is bounded by memory bandwidth: every token reads all weights once. The table gives each decode rate as a
fraction of this machine's bandwidth (weights read per token × tokens/s ÷ the bandwidth of a large numpy copy,
measured in the same run), so the remaining headroom is visible; beside it, the same rate against what reading alone
reaches with the run's thread count (each thread summing the squares of its share of a 1 GiB buffer), the bound of a
decode step, which only reads its weights.

`--clock cpu` divides by the CPU time of the engine's process (time.process_time: every thread of it) instead of
the wall-clock time: on a machine other work loads, a run's CPU time is what it would take alone at that thread
count, while its wall time also counts the moments it waited for a core.
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

from ..arguments import non_negative_int, positive_int
from ..errors import CommandError
from .twin import format_twin_table, parse_twin

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
    activations: str = "-"  # kvcmas: activations of the decode matmuls ("q8" | "f32")
    clock: str = "wall"  # what tok/s divides by: "wall" (perf_counter) or "cpu" (the process's CPU time)


# The clocks a run can be timed with (--clock).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def prompt_ids(n_vocab: int, n: int) -> list[int]:
    rng = np.random.default_rng(1234)
    # Avoid the first ids (often control tokens); any ids serve for timing.
    return [int(t) for t in rng.integers(100, min(n_vocab, 32000), size=n)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _run_kvcmas(
    model_path: str, threads: int, prompt: int, gen: int, kv_type: str, clock: str = "wall"
) -> tuple[float, float]:
    from ..model import Model

    kv, _, act = kv_type.partition(":")  # "<kv type>:<activations>"
    model = Model(model_path, n_threads=threads, n_ctx=prompt + gen + 8, kv_type=kv, activations=act or "q8")  # type: ignore[arg-type]
    ids = prompt_ids(model.n_vocab, prompt)
    with model.new_sequence() as warm:  # first touch of the mapped weights
        warm.append(ids[:32])
    with model.new_sequence() as seq:
        t0 = CLOCKS[clock]()
        logits = seq.append(ids, logits="last")
        t1 = CLOCKS[clock]()
        for _ in range(gen):
            assert logits is not None
            logits = seq.append([int(np.argmax(logits))], logits="last")
        t2 = CLOCKS[clock]()
    return prompt / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def _run_llama_cpp(
    model_path: str, threads: int, prompt: int, gen: int, kv_type: str, clock: str = "wall"
) -> tuple[float, float]:
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
    ids = prompt_ids(llm.n_vocab(), prompt)
    llm.eval(ids[:32])
    llm.reset()
    t0 = CLOCKS[clock]()
    llm.eval(ids)
    t1 = CLOCKS[clock]()
    n_vocab = llm.n_vocab()
    for _ in range(gen):
        # eval() keeps no logits unless logits_all: read the last row from the context, as a sampler would.
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        llm.eval([int(np.argmax(last))])
    t2 = CLOCKS[clock]()
    return prompt / (t1 - t0), gen / (t2 - t1) if gen else 0.0


def _run_torch_bf16(
    model_path: str, threads: int, prompt: int, gen: int, kv_type: str, clock: str = "wall"
) -> tuple[float, float]:
    del kv_type  # prefill only: no KV cache is kept
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.bfloat16)
    model.eval()
    ids = torch.tensor([prompt_ids(model.config.vocab_size, prompt)])
    with torch.no_grad():
        model(ids[:, :32])
        t0 = CLOCKS[clock]()
        model(ids)
        t1 = CLOCKS[clock]()
    return prompt / (t1 - t0), 0.0


# KV cache storage each engine runs with, as printed in the table (kvcmas: the --kv-type option).
_ENGINE_KV = {"llama-cpp": "f16", "torch-bf16": "-"}


def _worker(
    engine: str, model_path: str, threads: int, prompt: int, gen: int, kv_type: str, clock: str = "wall"
) -> CoreResult:
    runner = {"kvcmas": _run_kvcmas, "llama-cpp": _run_llama_cpp, "torch-bf16": _run_torch_bf16}[engine]
    prefill, decode = runner(model_path, threads, prompt, gen, kv_type, clock)
    kv = kv_type.partition(":")[0] if engine == "kvcmas" else _ENGINE_KV[engine]
    act = (kv_type.partition(":")[2] or "q8") if engine == "kvcmas" else "-"
    return CoreResult(engine, model_path, threads, prompt, gen, prefill, decode, _peak_rss_mb(), kv, act, clock)


def _measure(
    engine: str, model_path: str, threads: int, prompt: int, gen: int, kv_type: str, clock: str = "wall"
) -> CoreResult:
    cmd = [sys.executable, "-m", "kvcmas_cpp.bench.core", "--worker", engine, model_path]
    cmd += [str(threads), str(prompt), str(gen), kv_type, clock]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise CommandError(
            f"{engine} benchmark failed on {model_path} (exit status {proc.returncode}): "
            f"{lines[-1] if lines else 'no message'}"
        )
    return CoreResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def bench_core(
    models: list[str],
    threads: int,
    prompt: int,
    gen: int,
    compare: list[str],
    rounds: int,
    kv_type: str = "f16",
    activations: str = "q8",
    clock: str = "wall",
) -> list[CoreResult]:
    """Medians of `rounds` interleaved rounds for kvcmas (KV stored as `kv_type`, decode matmuls with `activations`)
    and each engine in `compare`, per model (peak RSS: the largest)."""
    from tqdm import tqdm

    engines = ["kvcmas", *[e for e in compare if e != "kvcmas"]]
    runs: dict[tuple[str, str], list[CoreResult]] = {}
    jobs = [(m, e) for _ in range(rounds) for m in models for e in engines]
    for model_path, engine in tqdm(jobs, desc="bench core", unit="run", file=sys.stderr):
        if engine == "torch-bf16" and (model_path, engine) in runs:
            continue  # slow to load; one round tells the anchor
        r = _measure(engine, model_path, threads, prompt, gen, f"{kv_type}:{activations}", clock)
        runs.setdefault((model_path, engine), []).append(r)
    results = []
    for rs in runs.values():
        r = rs[0]
        r.prefill_tok_s = float(np.median([x.prefill_tok_s for x in rs]))
        r.decode_tok_s = float(np.median([x.decode_tok_s for x in rs]))
        r.peak_rss_mb = max(x.peak_rss_mb for x in rs)
        results.append(r)
    return results


def memory_bandwidth_gb_s() -> float:
    """This machine's memory bandwidth as a large numpy copy sees it (read + write bytes / s, best of 5; one
    thread), measured in a subprocess: the workers would otherwise inherit its 1 GiB as their peak RSS."""
    cmd = [sys.executable, "-m", "kvcmas_cpp.bench.core", "--bandwidth"]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


def read_bandwidth_gb_s(threads: int) -> float:
    """Bytes per second that `threads` threads reach reading a 1 GiB buffer (read only; best of 5), in a subprocess
    whose BLAS runs one thread per caller."""
    cmd = [sys.executable, "-m", "kvcmas_cpp.bench.core", "--read-bandwidth", str(threads)]
    one = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **one})
    return float(out.stdout.strip().splitlines()[-1])


def _read_bandwidth_gb_s(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    from concurrent.futures import ThreadPoolExecutor

    buf = np.ones(mib << 18, dtype=np.float32)
    shares = np.array_split(buf, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:  # np.dot releases the GIL: the threads read at once
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda v: np.dot(v, v), shares))
            best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def _copy_bandwidth_gb_s(mib: int = 512, repeats: int = 5) -> float:
    src = np.ones(mib << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def weight_bytes_per_token(model_path: str, all_experts: bool = False) -> int:
    """Bytes of weights a decode step reads: every matrix once; of the token embedding only one row, unless the
    output projection is tied to it; of a mixture of experts' stacked matrices (`*_exps`) the chosen experts' share
    (expert_used_count of expert_count), or every expert with all_experts (what a prefill pass of many tokens reads
    at most)."""
    from ..model import Model

    tensors = Model.file_tensors(model_path)
    meta = Model.file_metadata(model_path)
    arch = meta.get("general.architecture", "")
    n_expert, n_used = meta.get(f"{arch}.expert_count") or 0, meta.get(f"{arch}.expert_used_count") or 0
    names = {t["name"] for t in tensors}
    total = 0
    for t in tensors:
        if t["name"] == "token_embd.weight" and "output.weight" in names:
            continue
        n_bytes = int(t["n_bytes"])
        chosen_share = n_expert and not all_experts and "_exps." in t["name"]
        total += n_bytes * n_used // n_expert if chosen_share else n_bytes
    return total


def weight_type_mix(model_path: str) -> list[tuple[str, int]]:
    """Bytes of the file's matrices (tensors of 2 or more dimensions) per storage type, largest first."""
    from ..model import Model

    mix: dict[str, int] = {}
    for t in Model.file_tensors(model_path):
        if len(t["shape"]) >= 2:
            name = str(t["type_name"]).upper()
            mix[name] = mix.get(name, 0) + int(t["n_bytes"])
    return sorted(mix.items(), key=lambda kv: -kv[1])


def file_type_label(model_path: str) -> str:
    """The llama.cpp file type the file says it is (general.file_type, e.g. 'Q4_K_M'), or '-' without one."""
    import gguf

    from ..model import Model

    value = Model.file_metadata(model_path).get("general.file_type")
    try:
        return gguf.LlamaFileType(int(value)).name.removeprefix("MOSTLY_") if value is not None else "-"
    except ValueError:
        return f"file type {value}"


def describe_file(model_path: str) -> str:
    """'Q4_K_M: Q4_K 68%, Q6_K 32% of 1,109 MB': the label a file gives itself and what its matrices really hold (a
    file type name alone can mislead: llama.cpp's quantizer falls back to other types on rows that are not a multiple
    of 256, so a "Q4_K_M" file of a 0.5B model holds mostly Q5_0 and Q8_0)."""
    mix = weight_type_mix(model_path)
    total = sum(b for _, b in mix) or 1
    shares = ", ".join(f"{name} {b / total:.0%}" for name, b in mix if b / total >= 0.005)
    return f"{file_type_label(model_path)}: {shares} of {total / 1e6:,.0f} MB"


def format_table(results: list[CoreResult], bandwidth_gb_s: float | None = None, read_gb_s: float | None = None) -> str:
    """Markdown tables: each file's type mix, then our/other ratios per model, and decode as a fraction of the memory
    bandwidth (a copy's; and of the read-only bandwidth where given)."""
    lines = [
        "| file | file type: weight bytes per type | weights read per decode token MB |",
        "|---|---|---|",
    ]
    per_token = {r.model: weight_bytes_per_token(r.model) for r in results}
    for model in per_token:
        lines.append(f"| {Path(model).name} | {describe_file(model)} | {per_token[model] / 1e6:,.0f} |")
    lines += [
        "",
        "| model | engine | threads | KV | activations | prefill tok/s | decode tok/s "
        f"| decode GB/s (of {'copy / of read' if read_gb_s else 'bandwidth'}) "
        "| peak RSS MB | prefill ratio | decode ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = {r.model: r for r in results if r.engine == "kvcmas"}
    for r in results:
        base = ours.get(r.model)
        pre = dec = ""
        if base is not None and r.engine != "kvcmas":
            pre = f"{base.prefill_tok_s / r.prefill_tok_s:.2f}x" if r.prefill_tok_s else ""
            dec = f"{base.decode_tok_s / r.decode_tok_s:.2f}x" if r.decode_tok_s else ""
        decode = f"{r.decode_tok_s:.1f}" if r.decode_tok_s else "-"
        gb_s = r.decode_tok_s * per_token[r.model] / 1e9
        frac = f" ({gb_s / bandwidth_gb_s:.0%})" if bandwidth_gb_s else ""
        if bandwidth_gb_s and read_gb_s:
            frac = f" ({gb_s / bandwidth_gb_s:.0%} / {gb_s / read_gb_s:.0%})"
        traffic = f"{gb_s:.1f}{frac}" if r.decode_tok_s else "-"
        lines.append(
            f"| {Path(r.model).name} | {r.engine} | {r.threads} | {r.kv_type} | {r.activations} "
            f"| {r.prefill_tok_s:.1f} | {decode} | {traffic} | {r.peak_rss_mb:.0f} | {pre} | {dec} |"
        )
    lines.append("")
    lines.append("ratio = kvcmas / that engine (above 1: kvcmas is faster); figures are medians of the rounds")
    if any(r.clock == "cpu" for r in results):
        lines.append("tok/s = tokens per second of CPU time of the engine's process (--clock cpu), not of wall time")
    if bandwidth_gb_s:
        lines.append(
            "decode GB/s = weights read per token x decode tok/s; "
            f"memory bandwidth (numpy copy, read + write) {bandwidth_gb_s:.1f} GB/s"
        )
    if read_gb_s:
        lines.append(
            f"read bandwidth ({results[0].threads} thread{'s' if results[0].threads != 1 else ''} reading a 1 GiB "
            f"buffer) {read_gb_s:.1f} GB/s; "
            "issue 45's goal (decode >= 80%) is against the copy bandwidth"
        )
    return "\n".join(lines)


def add_core_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", help="GGUF file or model name (repeatable; default: the default model)")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--prompt", type=positive_int, default=512, help="prompt tokens to prefill")
    p.add_argument("--gen", type=non_negative_int, default=128, help="tokens to decode")
    p.add_argument("--compare", action="append", default=[], choices=["llama-cpp", "torch-bf16"])
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument(
        "--activations",
        default="q8",
        choices=["q8", "q8-fast", "f32"],
        help="kvcmas matmul activations (default q8: two 8-bit passes; q8-fast: K-quant matmuls in one 8-bit pass, "
        "as llama.cpp; f32: the exact path)",
    )
    p.add_argument(
        "--kv-type",
        default="f16",
        choices=["f16", "f32"],
        help="kvcmas KV cache storage (default f16, llama.cpp's default, for a like-for-like comparison)",
    )
    p.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="time runs by the wall clock (default) or by each engine process's CPU time (a loaded machine)",
    )
    p.add_argument(
        "--twin",
        action="append",
        default=[],
        type=parse_twin,
        metavar="FILE=TWIN",
        help="also run TWIN (FILE's llama twin) and compare their speed per weight byte (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _check_core_arguments(args: argparse.Namespace, models: list[str]) -> None:
    """Refuses what would fail inside a worker, before any run starts: engines not installed, bad model files."""
    import importlib.util

    from ..model import Model

    needs = {
        "llama-cpp": (("llama_cpp",), "llama-cpp-python (scripts/setup.sh --bench)"),
        "torch-bf16": (("torch", "transformers"), "torch and transformers (scripts/setup.sh --test)"),
    }
    for engine in args.compare:
        modules, packages = needs[engine]
        if any(importlib.util.find_spec(m) is None for m in modules):
            raise ValueError(f"--compare {engine} needs {packages} installed")
    for path in models:
        Model.file_metadata(path)  # KvcmasError (a ValueError) naming the file and what is wrong with it


def run_core(args: argparse.Namespace) -> int:
    from ..model import resolve_model_path

    models = [resolve_model_path(m) for m in args.model or []]
    twins = {resolve_model_path(f): resolve_model_path(t) for f, t in args.twin}
    models += [m for m in dict.fromkeys(m for pair in twins.items() for m in pair) if m not in models]
    models = models or [resolve_model_path(None)]
    _check_core_arguments(args, models)
    bandwidth = memory_bandwidth_gb_s()
    read = read_bandwidth_gb_s(args.threads)
    results = bench_core(
        models,
        args.threads,
        args.prompt,
        args.gen,
        args.compare,
        args.rounds,
        args.kv_type,
        args.activations,
        args.clock,
    )
    bandwidth = max(bandwidth, memory_bandwidth_gb_s())  # before and after: the better of the two
    read = max(read, read_bandwidth_gb_s(args.threads))
    if args.json:
        rows = [
            {
                **asdict(r),
                "memory_bandwidth_gb_s": bandwidth,
                "read_bandwidth_gb_s": read,
                "weight_bytes_per_token": weight_bytes_per_token(r.model),
                "file_type": file_type_label(r.model),
                "weight_bytes_per_type": dict(weight_type_mix(r.model)),
                "llama_twin": twins.get(r.model),
            }
            for r in results
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(results, bandwidth, read))
        if twins:
            per_token = {r.model: weight_bytes_per_token(r.model) for r in results}
            per_pass = {r.model: weight_bytes_per_token(r.model, all_experts=True) for r in results}
            print("\n" + format_twin_table(results, twins, per_token, per_pass))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--bandwidth"]:
        print(_copy_bandwidth_gb_s())
    elif len(sys.argv) == 3 and sys.argv[1] == "--read-bandwidth":
        print(_read_bandwidth_gb_s(int(sys.argv[2])))
    elif len(sys.argv) == 9 and sys.argv[1] == "--worker":
        _, _, eng, path, th, pr, ge, kv, clk = sys.argv
        print(json.dumps(asdict(_worker(eng, path, int(th), int(pr), int(ge), kv, clk))))
    else:
        parser = argparse.ArgumentParser(prog="python -m kvcmas_cpp.bench.core")
        add_core_arguments(parser)
        sys.exit(run_core(parser.parse_args()))
