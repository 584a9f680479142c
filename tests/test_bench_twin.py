"""`kvcmas bench core --twin`: a file's speed per weight byte against its llama twin (models/make_bench_models.py)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "models" / "generated"


def _bench_models():
    spec = importlib.util.spec_from_file_location("make_bench_models", ROOT / "models" / "make_bench_models.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_bench_models"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _matrix_elements(shapes: dict[str, tuple[int, ...]], per_token_share: float = 1.0) -> int:
    """Elements of the matrices a decode token reads (stacked experts counted at `per_token_share`)."""
    total = 0
    for name, shape in shapes.items():
        if len(shape) >= 2 and "ffn_gate_inp" not in name:  # the router: the twin has none
            total += int(np.prod(shape) * (per_token_share if "_exps." in name else 1))
    return total


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "gemma3-270m", "qwen3-30b-a3b-4l"])
def test_llama_twin_reads_what_its_architecture_reads(shape: str) -> None:
    """The twin is a plain llama with the architecture's widths, heads, head size and vocabulary, and its matrices
    hold exactly the weights one decode token of the original reads (for the MoE: the chosen experts' share; the
    router, which the twin lacks, aside)."""
    mbm = _bench_models()
    s, t = mbm.SHAPES[shape], mbm.SHAPES[mbm.TWIN_PREFIX + shape]
    assert t.arch == "llama" and not (t.qk_norm or t.post_norms or t.sliding_window or t.n_expert)
    same = ("n_embd", "n_layer", "n_head", "n_head_kv", "n_vocab", "head_dim", "tied", "vocab")
    assert all(getattr(t, k) == getattr(s, k) for k in same)
    share = s.n_expert_used / s.n_expert if s.n_expert else 1.0
    assert _matrix_elements(mbm.tensors(t)) == _matrix_elements(mbm.tensors(s), share)


def test_twin_ratio_is_bytes_times_rate_over_the_twins() -> None:
    from kvcmas_cpp.bench.core import CoreResult
    from kvcmas_cpp.bench.twin import format_twin_table, twin_ratios

    def row(engine: str, model: str, pre: float, dec: float) -> CoreResult:
        return CoreResult(engine, model, 2, 64, 8, pre, dec, 100.0)

    rows = [row("kvcmas", "a.gguf", 300.0, 20.0), row("kvcmas", "t.gguf", 400.0, 30.0),
            row("llama-cpp", "a.gguf", 200.0, 10.0), row("llama-cpp", "t.gguf", 200.0, 10.0)]  # fmt: skip
    per_token = {"a.gguf": 3_000_000, "t.gguf": 2_000_000}
    got = {r.engine: (pre, dec) for r, t, pre, dec in twin_ratios(rows, {"a.gguf": "t.gguf"}, per_token)}
    assert got["kvcmas"] == pytest.approx((300 * 3 / (400 * 2), 20 * 3 / (30 * 2)))
    assert got["llama-cpp"] == pytest.approx((1.5, 1.5))
    table = format_twin_table(rows, {"a.gguf": "t.gguf"}, per_token)
    assert "| a.gguf | t.gguf | kvcmas | 0.1 | 0.1 | 1.00x | 1.12x |" in table
    assert format_twin_table(rows, {}, per_token) == ""
    per_pass = {"a.gguf": 8_000_000, "t.gguf": 2_000_000}  # a's prefill pass reads every expert
    ((_, _, pre, dec),) = twin_ratios(rows[:2], {"a.gguf": "t.gguf"}, per_token, per_pass)
    assert (pre, dec) == pytest.approx((300 * 8 / (400 * 2), 20 * 3 / (30 * 2)))
    prefill_only = [row("kvcmas", "a.gguf", 300.0, 0.0), row("kvcmas", "t.gguf", 400.0, 0.0)]  # --gen 0
    assert "| kvcmas | - | - | - | 1.12x |" in format_twin_table(prefill_only, {"a.gguf": "t.gguf"}, per_token)


def test_bench_core_twin_column_from_a_real_run() -> None:
    """A short run of two files, one the other's twin: the twin table's decode ratio is the main table's tok/s x
    weight bytes per token over the twin's, and a malformed --twin is refused naming the form."""
    a, t = GENERATED / "tiny-llama-q8_0.gguf", GENERATED / "tiny-llama-f16.gguf"
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "bench", "core", "--threads", "1", "--prompt", "16", "--gen", "4",
           "--rounds", "1", "--twin", f"{a}={t}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    from kvcmas_cpp.bench.core import weight_bytes_per_token

    rate = {}  # kvcmas decode tok/s per file, from the main table
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[1] == "kvcmas":
            rate[cells[0]] = float(cells[6])
    (twin_row,) = [line for line in out.stdout.splitlines() if line.startswith(f"| {a.name} | {t.name} | kvcmas")]
    dec = float(twin_row.strip("|").split("|")[5].strip().rstrip("x"))
    expected = rate[a.name] * weight_bytes_per_token(str(a)) / (rate[t.name] * weight_bytes_per_token(str(t)))
    assert dec == pytest.approx(expected, abs=0.01)
    bad = subprocess.run([*cmd[:-1], "no-equals-sign"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and re.search(r"--twin takes FILE=TWIN", bad.stderr), bad.stderr
