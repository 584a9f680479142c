"""activations="q8-fast" on the decode path (1..16 tokens): Q4_K, Q5_K and Q6_K weights against one 8-bit activation
pass (backend/cpu/quants-dot.h: the one-pass kernels, AVX512-VNNI zmm, AVX-VNNI or AVX2 ymm), against numpy on the
same quantized activations, the exact product's bound, thread counts, tokens beside a row, and the three instruction
sets bit for bit (the default q8's K-quant kernels too: its 512-bit ones against the 256-bit ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import kvcmas_cpp as kc
from helpers.native import require_testing, testing
from helpers.quants import K_TYPES, activations, assert_one_pass_product, make_weight, write_k_quant_cases
from helpers.real_text import REAL_K_QUANT_MODEL, agreement, chunked_logits, real_text_ids
from kvcmas_cpp._native import core

pytestmark = pytest.mark.skipif(
    not core.cpu_features()["avx2_fma_f16c"], reason="the 8-bit activation kernels are AVX2 kernels"
)

N_OUT = 37


@pytest.mark.parametrize(("n_in", "n_tok"), [(1536, 1), (1536, 5), (2048, 4), (2048, 16), (8960, 1), (8960, 7)])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_one_pass_decode_matches_numpy(qtype: QT, n_in: int, n_tok: int) -> None:
    """The result is numpy's dequantize(w)·x̂ for x̂ = d·q (one pass, Q8_0 rounding per 32) to f32 rounding, within
    |Δy| <= Σ_blocks (d/2)·Σ|w - m| of the exact product; not q8's two passes; the same bits on 1, 2 and 3 threads and
    whatever tokens are beside a row."""
    rng = np.random.default_rng(21000 + int(qtype) + n_in + n_tok)
    raw, w = make_weight(qtype, N_OUT, n_in, rng)
    x = activations(rng, n_tok + 1, n_in)
    one = testing.matmul(int(qtype), raw, n_in, N_OUT, x[:n_tok], 1, "q8-fast")
    assert_one_pass_product(one, qtype, raw, w, x[:n_tok])
    for n_threads in (2, 3):
        np.testing.assert_array_equal(
            testing.matmul(int(qtype), raw, n_in, N_OUT, x[:n_tok], n_threads, "q8-fast"), one
        )
    if n_tok < 16:
        np.testing.assert_array_equal(testing.matmul(int(qtype), raw, n_in, N_OUT, x, 2, "q8-fast")[:n_tok], one)


def test_other_types_keep_q8_on_decode() -> None:
    """Types without a one-pass kernel (Q8_0, Q4_0) decode as under q8, bit for bit."""
    rng = np.random.default_rng(22000)
    for qtype in (QT.Q8_0, QT.Q4_0):
        raw, _ = make_weight(qtype, 40, 1536, rng)
        x = activations(rng, 6, 1536)
        np.testing.assert_array_equal(
            testing.matmul(int(qtype), raw, 1536, 40, x, 2, "q8-fast"),
            testing.matmul(int(qtype), raw, 1536, 40, x, 2, "q8"),
        )


def isa_variants() -> list[dict[str, str]]:
    """Environments that switch the kernels this CPU would otherwise take: AVX-VNNI ymm (no AVX-512), AVX2 ymm."""
    features = core.cpu_features()
    variants = []
    if features.get("avx512_vnni"):
        variants.append({"KVCMAS_NO_AVX512": "1"})
    if features.get("avx_vnni") or features.get("avx512_vnni"):
        variants.append({"KVCMAS_NO_AVX512": "1", "KVCMAS_NO_VNNI": "1"})
    return variants


@pytest.mark.skipif(not isa_variants(), reason="only the AVX2 kernels run on this CPU")
def test_decode_same_bits_on_every_isa(tmp_path: Path) -> None:
    """The zmm (AVX512-VNNI), AVX-VNNI and AVX2 kernels of the one-pass (q8-fast) and the two-pass (default q8)
    decode: Q4_K, Q5_K, Q6_K, 1,536 / 8,960 columns, 1..16 tokens, bit for bit (exact int32 sums, the same f32 steps
    per lane)."""
    require_testing()
    rng = np.random.default_rng(23000)
    cases = write_k_quant_cases(tmp_path, rng, N_OUT, 16)
    script = (
        "import sys, json, numpy as np; from pathlib import Path; from kvcmas_cpp._native import testing_module; "
        f"t = testing_module(); d = Path({str(tmp_path)!r}); "
        "[np.save(d / f'{sys.argv[2]}-{n}-{k}-{m}-{a}.npy', t.matmul(q, (d / f'{n}-{k}.bin').read_bytes(), k, 37, "
        "np.load(d / f'x-{k}.npy')[:m], 2, a)) for q, n, k in json.loads(sys.argv[1]) for m in (1, 3, 16) "
        "for a in ('q8', 'q8-fast')]"
    )
    for i, env in enumerate(isa_variants()):
        out = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cases), f"v{i}"], env={**os.environ, **env}, capture_output=True
        )
        assert out.returncode == 0, out.stderr.decode()
    for q, name, n_in in cases:
        raw = (tmp_path / f"{name}-{n_in}.bin").read_bytes()
        for m in (1, 3, 16):
            for act in ("q8", "q8-fast"):
                want = testing.matmul(q, raw, n_in, N_OUT, np.load(tmp_path / f"x-{n_in}.npy")[:m], 2, act)
                for i in range(len(isa_variants())):
                    np.testing.assert_array_equal(np.load(tmp_path / f"v{i}-{name}-{n_in}-{m}-{act}.npy"), want)


@pytest.mark.slow
@pytest.mark.skipif(not REAL_K_QUANT_MODEL.exists(), reason="kvcmas models pull qwen2.5-coder-0.5b")
def test_real_model_one_pass_decode_agrees_with_exact_path() -> None:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 256 tokens of GSM8K appended 4 per call (the decode path, its Q4_K and
    Q6_K matrices on the one-pass kernels) against the exact path. Measured: top-1 100%, rms 0.018 of the logit std,
    max |Δ logit| 0.66 (q8: 100%, 0.0001, 0.003) (docs/prefill-kernels.md, Round 5)."""
    models = {a: kc.Model(REAL_K_QUANT_MODEL, n_threads=2, n_ctx=512, activations=a) for a in ("f32", "q8-fast")}
    ids = real_text_ids(models["f32"], 256)
    ref = chunked_logits(models["f32"], ids, 4)
    fast = chunked_logits(models["q8-fast"], ids, 4)
    top1, rms = agreement(fast, ref)
    assert top1 >= 0.97 and rms < 0.025, (top1, rms)
