"""End-to-end correctness of the engine's logits and greedy generation against transformers on the same GGUF files.

References: transformers loads each GGUF file itself (gguf-py dequantisation, float32 compute). For the tiny random
models a second, independent numpy forward pass (llama.cpp conventions: permuted Q/K with adjacent-pair RoPE for
llama, NEOX RoPE for qwen2, `rope_freqs` divisors) first checks the transformers reference, so that a failure
can be pinned on the engine rather than on the reference.

Tolerances are relative to the reference logits' standard deviation ("rel") unless stated otherwise; see TINY_TOL.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

mtm = pytest.importorskip("make_test_models", reason="needs gguf-py (pip install -e .[test])")
kc = pytest.importorskip("kvcmas_cpp")
pytestmark = pytest.mark.skipif(not hasattr(kc, "Model"), reason="kvcmas_cpp.Model not available (engine not built)")

GSM8K = kc.sharing.gsm8k_path()  # shipped with the package

# Prose prompts (our own sentences) for the SmolLM2 F32/F16 checks; each is cut to 64 tokens.
PROSE_PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "brass, and watched the ships pass far out at sea. One stormy night, a small fishing boat lost its way near the "
    "rocks, and the keeper knew that only the light could guide it home. He ran up the stairs as fast as he could.",
    "To make a simple loaf of bread, mix flour, water, salt and a little yeast in a large bowl. Knead the dough for "
    "ten minutes until it is smooth, then let it rise in a warm place for an hour. Shape it, let it rise again, and "
    "bake it in a hot oven until the crust is golden brown. Let it cool on a rack before you slice it.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into sugar "
    "and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll that absorbs the light. Without it, most life on Earth could not exist, because "
    "plants are the base of nearly every food chain.",
)
CHAT_PROMPTS = ("Write a short story about a robot who learns to paint.", "Explain why the sky is blue.")

# Tiny models: per weight type (max |d|/std, rms(d)/std, min top-1 agreement) between engine and transformers.
# Justification (written when the decode path rounded activations as llama.cpp does; it now keeps them f32, so these
# bounds have slack to spare): f16 for F16 weights, bf16 for BF16, 8-bit blocks Q8_0/Q8_1/Q8_K for quantized weights.
# Emulating that rounding inside the transformers
# reference on these models (128 positions each) moves the logits by
#   f16: max 0.004, rms 0.0007 | bf16: max 0.027, rms 0.0055 | 8-bit: max 0.08-0.16, rms 0.018-0.029
# (random 3-layer models accumulate the ~0.5% per-matmul rounding to 2-3% of the logit std). The bounds are about
# twice that, and far below what a wrong dequantisation or layout does: the same weights stored as F32 vs Q4_0 differ
# by max 1.3, rms 0.3. Top-1 agreement is a coarse extra: random-weight logits have small top-2 gaps, so 8-bit
# rounding alone flips 0-10% of the positions (measured 0.90-1.0 over 192 decode steps); broken decoding gives 0.5-0.7.
# F32: only the order of f32 operations differs (transformers vs a float64 numpy pass: ~3e-6 rel).
TINY_TOL: dict[str, tuple[float, float, float]] = {
    "F32": (1e-4, 2e-5, 1.0),
    "F16": (1e-2, 2e-3, 0.97),
    "BF16": (0.08, 0.015, 0.95),
}
for _t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"):
    TINY_TOL[_t] = (0.35, 0.06, 0.85)
TINY_SEQ_LEN = 96
TINY_PROMPT_LEN = 16  # decode-path check: prompt appended at once, then one token per call
TINY_DECODE_STEPS = 192


# ----------------------------------------------------------------------------------------------------------------------
# helpers


@functools.lru_cache(maxsize=3)
def engine_model(path: str) -> kc.Model:
    return kc.Model(path, n_threads=2, activations="f32")  # the exact path: what transformers computes


def compare(engine: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Deviation statistics of engine logits against reference logits (same shape [n_pos, n_vocab])."""
    assert engine.shape == ref.shape, f"logits shape {engine.shape} != reference {ref.shape}"
    assert engine.dtype == np.float32, f"logits dtype {engine.dtype}, expected float32"
    assert np.isfinite(engine).all(), "engine logits contain NaN/inf"
    diff = np.abs(engine.astype(np.float64) - ref)
    per_pos = diff.max(axis=1)
    agree = engine.argmax(axis=1) == ref.argmax(axis=1)
    std = float(ref.std())
    return {
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max()) / std,
        "rms_rel": float(np.sqrt(np.mean(diff**2))) / std,
        "top1": float(agree.mean()),
        "first_bad_pos": int(np.argmax(per_pos > 1e-3 * std)) if (per_pos > 1e-3 * std).any() else -1,
        "first_top1_miss": int(np.argmin(agree)) if not agree.all() else -1,
    }


def fmt(stats: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())


def tiny_ids(variant: str, n: int, seed: int) -> list[int]:
    """Deterministic token ids over the whole tiny vocabulary (control tokens included)."""
    rng = np.random.default_rng(seed + sum(map(ord, variant)))
    return [int(t) for t in rng.integers(0, mtm.TINY_N_VOCAB, n)]


def numpy_forward(weights: dict[str, np.ndarray], spec: mtm.TinySpec, ids: Sequence[int]) -> np.ndarray:
    """Float64 forward pass with llama.cpp's conventions on GGUF-layout weights: logits [len(ids), n_vocab]."""

    def rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.rms_eps) * w

    def rope(x: np.ndarray) -> np.ndarray:  # x [T, H, D]
        n_pos, _, dim = x.shape
        inv = spec.rope_theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        if "rope_freqs.weight" in weights:
            inv = inv / weights["rope_freqs.weight"]
        ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if spec.arch == "qwen2":  # NEOX: rotate (i, i + D/2)
            a, b = x[..., : dim // 2], x[..., dim // 2 :]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]  # llama.cpp "normal" mode: rotate (2i, 2i+1)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    n_pos, hd, group = len(ids), spec.head_dim, spec.n_head // spec.n_head_kv
    x = weights["token_embd.weight"][list(ids)].astype(np.float64)
    mask = np.triu(np.full((n_pos, n_pos), -np.inf), 1)
    for layer in range(spec.n_layer):
        p = f"blk.{layer}."
        h = rms_norm(x, weights[p + "attn_norm.weight"])
        q, k, v = (h @ weights[p + f"attn_{n}.weight"].T + weights.get(p + f"attn_{n}.bias", 0.0) for n in "qkv")
        q, k = rope(q.reshape(n_pos, spec.n_head, hd)), rope(k.reshape(n_pos, spec.n_head_kv, hd))
        v = v.reshape(n_pos, spec.n_head_kv, hd)
        att = np.empty((n_pos, spec.n_head, hd))
        for head in range(spec.n_head):
            s = q[:, head] @ k[:, head // group].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            att[:, head] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, head // group]
        x = x + att.reshape(n_pos, -1) @ weights[p + "attn_output.weight"].T
        h = rms_norm(x, weights[p + "ffn_norm.weight"])
        gate, up = h @ weights[p + "ffn_gate.weight"].T, h @ weights[p + "ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ weights[p + "ffn_down.weight"].T
    x = rms_norm(x, weights["output_norm.weight"])
    return x @ weights.get("output.weight", weights["token_embd.weight"]).T


def smollm_prompt_ids(reference, path: Path, text: str, n: int) -> list[int]:
    ids = reference.encode(path, text)
    assert len(ids) >= n, f"prompt has only {len(ids)} tokens, need {n}"
    return list(ids[:n])


def strip_eos(tokens: Sequence[int], eos: int) -> list[int]:
    tokens = list(tokens)
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


# ----------------------------------------------------------------------------------------------------------------------
# tiny random models


@pytest.mark.parametrize("variant", list(mtm.TINY_VARIANTS))
def test_tiny_reference_agrees_with_numpy(tiny_models, reference, variant: str) -> None:
    """The transformers reference itself (F32 and Q4_K files) matches an independent float64 forward pass."""
    spec = mtm.TINY_VARIANTS[variant]
    ids = tiny_ids(variant, 40, seed=3)
    for type_name in ("F32", "Q4_K"):
        ref = reference.logits(tiny_models[(variant, type_name)], ids)
        expected = numpy_forward(mtm.tiny_reference_weights(variant, type_name), spec, ids)
        stats = compare(ref, expected)
        assert stats["max_rel"] < 1e-4, f"{variant}/{type_name}: transformers vs numpy: {fmt(stats)}"
        assert expected.std() > 0.3, "degenerate tiny model: logits nearly constant"


@pytest.mark.parametrize("type_name", mtm.TINY_TYPES)
@pytest.mark.parametrize("variant", list(mtm.TINY_VARIANTS))
def test_tiny_logits_match_transformers(tiny_models, reference, variant: str, type_name: str) -> None:
    """Logits at every position (prefill path) of a 96-token sequence, per architecture variant x weight type."""
    path = tiny_models[(variant, type_name)]
    model = engine_model(str(path))
    spec = mtm.TINY_VARIANTS[variant]
    assert (model.arch, model.n_vocab, model.n_layer) == (spec.arch, mtm.TINY_N_VOCAB, spec.n_layer)
    assert (model.n_embd, model.n_head, model.n_head_kv) == (spec.n_embd, spec.n_head, spec.n_head_kv)
    assert model.n_ctx_train == spec.n_ctx_train
    ids = tiny_ids(variant, TINY_SEQ_LEN, seed=11)
    stats = compare(model.logits(ids), reference.logits(path, ids))
    max_rel, rms_rel, top1 = TINY_TOL[type_name]
    msg = f"{variant}/{type_name}: {fmt(stats)}"
    assert stats["max_rel"] <= max_rel, msg
    assert stats["rms_rel"] <= rms_rel, msg
    assert stats["top1"] >= top1, msg


@pytest.mark.parametrize("type_name", mtm.TINY_TYPES)
@pytest.mark.parametrize("variant", list(mtm.TINY_VARIANTS))
def test_tiny_decode_path_matches_transformers(tiny_models, reference, variant: str, type_name: str) -> None:
    """One token per engine call after a prompt (the decode path: dot products straight from the stored format)."""
    path = tiny_models[(variant, type_name)]
    model = engine_model(str(path))
    if not hasattr(model, "new_sequence"):
        pytest.skip("engine has no KV sequence API")
    ids = tiny_ids(variant, TINY_PROMPT_LEN + TINY_DECODE_STEPS, seed=17)
    rows = []
    with model.new_sequence() as seq:
        rows.append(seq.append(ids[:TINY_PROMPT_LEN], logits="last"))
        for token in ids[TINY_PROMPT_LEN:]:
            rows.append(seq.append([token], logits="last"))
    engine = np.stack(rows)
    ref = reference.logits(path, ids)[TINY_PROMPT_LEN - 1 :]
    stats = compare(engine, ref)
    max_rel, rms_rel, top1 = TINY_TOL[type_name]
    msg = f"{variant}/{type_name} decode: {fmt(stats)}"
    assert stats["max_rel"] <= max_rel, msg
    assert stats["rms_rel"] <= rms_rel, msg
    assert stats["top1"] >= top1, msg


# ----------------------------------------------------------------------------------------------------------------------
# SmolLM2-135M


@pytest.mark.parametrize(("type_name", "max_abs"), [("F32", 0.02), ("F16", 0.1)])
def test_smollm2_logits_match_transformers(
    reference_models, default_model_path, reference, type_name: str, max_abs: float
) -> None:
    """F32 / F16 re-exports: same argmax at every position of 3 prose prompts of 64 tokens, bounded |d logit|."""
    path = reference_models[type_name]
    model = engine_model(str(path))
    assert (model.arch, model.n_layer, model.n_embd, model.n_head, model.n_head_kv) == ("llama", 30, 576, 9, 3)
    for i, text in enumerate(PROSE_PROMPTS):
        ids = smollm_prompt_ids(reference, default_model_path, text, 64)
        ref = reference.logits(path, ids)
        stats = compare(model.logits(ids), ref)
        msg = f"SmolLM2 {type_name} prompt {i}: {fmt(stats)}"
        assert stats["top1"] == 1.0, msg
        assert stats["max_abs"] <= max_abs, msg


@pytest.mark.parametrize("type_name", ["F32", "F16"])
def test_smollm2_greedy_generation_matches_transformers(
    reference_models, default_model_path, reference, type_name: str
) -> None:
    """Greedy 32-token continuations of chat prompts are identical to transformers' generate(do_sample=False)."""
    path = reference_models[type_name]
    model = engine_model(str(path))
    eos = reference.token_id(default_model_path, "<|im_end|>")
    for text in CHAT_PROMPTS:
        ids = reference.chat_prompt_ids(default_model_path, text)
        expected = strip_eos(reference.greedy(path, ids, 32, eos), eos)
        out = model.generate(ids, max_tokens=32, temperature=0.0)
        got = strip_eos(out.tokens, eos)
        pairs = zip(got, expected, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(expected)))
        assert got == expected, (
            f"SmolLM2 {type_name} greedy differs from token {first}: engine "
            f"{got[first : first + 5]} vs transformers {expected[first : first + 5]}"
        )
        assert len(expected) >= 8, "reference stopped too early for a meaningful comparison"


def test_smollm2_q4_1_top1_agreement(default_model_path, reference) -> None:
    """The original Q4_1 file: top-1 agreement >= 95% over 256 teacher-forced tokens of GSM8K questions."""
    with GSM8K.open() as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(12), f, strict=False)]
    ids = smollm_prompt_ids(reference, default_model_path, "\n\n".join(questions), 256)
    model = engine_model(str(default_model_path))
    stats = compare(model.logits(ids), reference.logits(default_model_path, ids))
    assert stats["top1"] >= 0.95, f"SmolLM2 Q4_1: {fmt(stats)}"
