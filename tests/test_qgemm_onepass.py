"""activations="q8-fast": the K-quant prefill (Q4_K, Q5_K, Q6_K; 17 tokens or more) in one 8-bit activation pass
with vpdpbusd on AVX512-VNNI CPUs, vpmaddubsw on AVX2 ones (backend/cpu/qgemm.h: qgemm_onepass_*), against numpy on
the same quantized activations, the exact product's bound, thread counts, and whole models against the exact path."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import kvcmas_cpp as kc
from helpers.native import require_testing, testing
from helpers.quants import K_TYPES, activations, assert_one_pass_product, make_weight, write_k_quant_cases
from helpers.real_text import REAL_K_QUANT_MODEL, agreement, chunked_logits, real_text_ids
from kvcmas_cpp._native import core

# With AVX512-VNNI or AVX2 the one-pass GEMM runs (the same bits); else q8-fast is q8 everywhere.
ONE_PASS = bool(core.cpu_features().get("avx512_vnni") or core.cpu_features().get("qgemm_avx2"))
pytestmark = pytest.mark.skipif(
    not core.cpu_features()["avx2_fma_f16c"], reason="the 8-bit activation kernels are AVX2 kernels"
)


@pytest.mark.parametrize(("n_in", "n_tok"), [(1536, 17), (2048, 64), (8960, 23)])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_one_pass_prefill_on_real_model_widths(qtype: QT, n_in: int, n_tok: int) -> None:
    """Rows of 1,536 to 8,960 columns, 37 rows (a partial panel), 17 / 23 tokens (partial micro tiles): the result is
    numpy's dequantize(w)·x̂ for x̂ = d·q (one pass) to f32 rounding, within |Δy| <= Σ_blocks (d/2)·Σ|w - m| of the
    exact product, the same bits on 1, 2 and 3 threads and whatever tokens are beside a row. Without the integer
    GEMM it is q8's prefill, bit for bit."""
    rng = np.random.default_rng(11000 + int(qtype) + n_in)
    n_out = 37
    raw, w = make_weight(qtype, n_out, n_in, rng)
    x = activations(rng, n_tok + 1, n_in)
    one = testing.matmul(int(qtype), raw, n_in, n_out, x[:n_tok], 1, "q8-fast")
    if not ONE_PASS:
        np.testing.assert_array_equal(one, testing.matmul(int(qtype), raw, n_in, n_out, x[:n_tok], 1, "q8"))
        return
    assert_one_pass_product(one, qtype, raw, w, x[:n_tok])
    for n_threads in (2, 3):
        np.testing.assert_array_equal(
            testing.matmul(int(qtype), raw, n_in, n_out, x[:n_tok], n_threads, "q8-fast"), one
        )
    np.testing.assert_array_equal(testing.matmul(int(qtype), raw, n_in, n_out, x, 2, "q8-fast")[:n_tok], one)
    later = testing.matmul(int(qtype), raw, n_in, n_out, x[1 : n_tok + 1], 3, "q8-fast")
    np.testing.assert_array_equal(later[-2], one[-1])


def test_option_is_checked_and_reported(tiny_models) -> None:
    path = tiny_models[("qwen2", "Q6_K")]
    assert kc.Model(path, n_threads=1, activations="q8-fast").activations == "q8-fast"
    with pytest.raises(ValueError, match="'q8', 'q8-fast' or 'f32'"):
        kc.Model(path, n_threads=1, activations="q8fast")
    raw, _ = make_weight(QT.Q4_0, 4, 32, np.random.default_rng(0))
    with pytest.raises(kc.KvcmasError, match="'q8', 'q8-fast' or 'f32'"):
        testing.matmul(int(QT.Q4_0), raw, 32, 4, np.zeros((1, 32), np.float32), 1, "int8")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_tiny_model_one_pass_prefill_close_to_exact(tiny_models, type_name: str) -> None:
    """A tiny random model of each K-quant type, 64 tokens prefilled in 32-token calls: q8-fast's logits stay close
    to the exact path's and, where the one-pass GEMM runs, differ from q8's (it ran through Model, matmul_multi
    included). Measured: rms 0.020-0.044 of the logit std, top-1 88-98% (random logits: many near ties), against
    q8's 0.0001-0.0002 and 100%."""
    path = tiny_models[("qwen2", type_name)]
    ids = [int(t) for t in np.random.default_rng(8).integers(0, 250, 64)]
    logits = {a: chunked_logits(kc.Model(path, n_threads=2, activations=a), ids, 32) for a in ("f32", "q8", "q8-fast")}
    ref = logits["f32"]
    rms = float(np.sqrt(np.mean((logits["q8-fast"] - ref) ** 2)) / ref.std())
    top1 = float(np.mean(logits["q8-fast"].argmax(-1) == ref.argmax(-1)))
    assert rms < 0.08 and top1 >= 0.8, (top1, rms)
    assert np.array_equal(logits["q8-fast"], logits["q8"]) != ONE_PASS


@pytest.mark.slow
@pytest.mark.skipif(not REAL_K_QUANT_MODEL.exists(), reason="kvcmas models pull qwen2.5-coder-0.5b")
def test_real_model_one_pass_prefill_agrees_with_exact_path() -> None:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (its Q4_K and Q6_K matrices take the one-pass GEMM), 384 tokens of GSM8K,
    128 per call, against the exact path. Measured: top-1 99.2%, rms 0.017 of the logit std, max |Δ logit| 0.71
    (q8: 100%, 0.0001, 0.0035): llama.cpp's accuracy, not q8's, hence an option beside the default."""
    models = {a: kc.Model(REAL_K_QUANT_MODEL, n_threads=2, n_ctx=1024, activations=a) for a in ("f32", "q8-fast")}
    ids = real_text_ids(models["f32"], 384)
    ref = chunked_logits(models["f32"], ids, 128)
    fast = chunked_logits(models["q8-fast"], ids, 128)
    top1, rms = agreement(fast, ref)
    assert top1 >= 0.97 and rms < 0.02, (top1, rms)


@pytest.mark.skipif(not core.cpu_features().get("avx512_vnni"), reason="compares the AVX2 kernel with AVX512-VNNI's")
def test_one_pass_avx2_gives_the_bits_of_avx512_vnni(tmp_path: Path) -> None:
    """KVCMAS_NO_AVX512=1 runs the AVX2 one-pass GEMM (vpmaddubsw + vpmaddwd: the same exact int32 sums, the same f32
    steps): Q4_K, Q5_K and Q6_K, 1,536 / 8,960 columns, 1 and 3 threads, bit for bit with the AVX512-VNNI one."""
    import json
    import subprocess
    import sys

    require_testing()  # the child process loads it
    rng = np.random.default_rng(13000)
    cases = write_k_quant_cases(tmp_path, rng, 37, 23)
    script = (
        "import sys, json, numpy as np; from pathlib import Path; from kvcmas_cpp._native import core, testing_module; "
        f"t = testing_module(); d = Path({str(tmp_path)!r}); "
        "assert not core.cpu_features()['avx512_vnni'] and core.cpu_features()['qgemm_avx2']; "
        f"[np.save(d / f'avx2-{{n}}-{{k}}-{{th}}.npy', t.matmul(q, (d / f'{{n}}-{{k}}.bin').read_bytes(), k, 37, "
        f"np.load(d / f'x-{{k}}.npy'), th, 'q8-fast')) for q, n, k in json.loads(sys.argv[1]) for th in (1, 3)]"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        env={**os.environ, "KVCMAS_NO_AVX512": "1"},
        capture_output=True,
    )
    assert out.returncode == 0, out.stderr.decode()
    for q, name, n_in in cases:
        raw = (tmp_path / f"{name}-{n_in}.bin").read_bytes()
        want = testing.matmul(q, raw, n_in, 37, np.load(tmp_path / f"x-{n_in}.npy"), 2, "q8-fast")
        for th in (1, 3):
            np.testing.assert_array_equal(np.load(tmp_path / f"avx2-{name}-{n_in}-{th}.npy"), want)
