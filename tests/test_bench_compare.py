"""`kvcmas bench agents --compare llama-cpp`: llama.cpp timed on what nonshared computes for each agent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_bench_agents_times_llama_cpp_on_nonshared_prompts(default_model_path: Path, tmp_path: Path) -> None:
    """The llama.cpp row prefills the prompt tokens nonshared computes per agent (the same cached prefix kept) and
    counts f16 KV rows for each hop's prompt and generated tokens."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/setup.sh --bench)")
    shim = tmp_path / "noamx.so"  # this VM faults on the AMX tiles a native llama.cpp build uses (bench/noamx.c)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(REPO_ROOT / "bench" / "noamx.c"), "-ldl"],
                   check=True)  # fmt: skip
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    args = "--questions 0 --train 1 --shared-tokens 64 --decode 1 --threads 2 --method nonshared,kvcmas"
    cmd = [sys.executable, "-m", "kvcmas_cpp.bench.agents", *args.split(), "--compare", "llama-cpp", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads(out.stdout)["speed"]}
    base, llama = rows["nonshared"], rows["llama.cpp"]
    assert llama["computed_tokens"] == base["computed_tokens"]
    prompts = [c + r for c, r in zip(base["computed_tokens"], base["reused_tokens"], strict=True)]
    assert [c + r for c, r in zip(llama["computed_tokens"], llama["reused_tokens"], strict=True)] == prompts
    import kvcmas_cpp as kc

    model = kc.Model(default_model_path, n_threads=1)
    row_f16 = 2 * model.n_layer * 2 * model.n_head_kv * model.head_dim
    assert llama["kv_bytes_per_hop"] == [(p + 1) * row_f16 for p in prompts]
    assert llama["later_ttft_ms"] > 0 and llama["later_ttft_speedup"] == pytest.approx(
        base["later_ttft_ms"] / llama["later_ttft_ms"]
    )
