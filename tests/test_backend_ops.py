"""Every op of the backend seam (cpp/backend/backend.h) on every usable backend, against independent numpy references
(in the spirit of llama.cpp's test-backend-ops), over the shape matrix the CPU kernel tests use: GQA ratios, head
sizes, ranks 0-32, several shifted segments, f16/f32 KV, every weight type. The CPU backend always runs; CUDA runs on
a build with KVCMAS_CUDA=ON on a machine with a GPU, and skips saying which of the two is missing. Whole-model
checks of CUDA against the CPU backend are at the end (GPU only)."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.attention import make_runs, reference, rotate
from helpers.native import testing
from kvcmas_cpp._native import core

gguf = pytest.importorskip("gguf")
mtm = pytest.importorskip("make_test_models")

BACKENDS = ["cpu", "cuda"]
WEIGHT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
BASE = 10000.0

# Relative error bounds (of the reference's scale) per backend: the CPU computes in f32 with f32 sums; CUDA's
# prefill GEMM uses TF32 tensor cores (10-bit mantissa inputs, f32 sums).
MATMUL_TOL = {"cpu": 2e-6, "cuda": 2e-3}
OP_TOL = {"cpu": 1e-6, "cuda": 1e-5}
ATTN_TOL = {"cpu": 5e-6, "cuda": 2e-4}  # the CPU's cases here: ~1e-6
# Shifts of 1024 positions or more (the Llama-3-8B case at 2048): the f32 rotation of q by -2048 positions reaches
# ~7e-5 over 40 queries on the CPU, the same on the fused and the copied path.
ATTN_TOL_FAR = {"cpu": 1e-4, "cuda": 2e-4}


def _usable(name: str) -> tuple[bool, str]:
    listing = kc.backends()
    if name not in listing:
        return False, f"backend '{name}' is not compiled into this build (CPU-only; rebuild with KVCMAS_CUDA=ON)"
    return listing[name]


@pytest.fixture(params=BACKENDS, scope="module")
def ops(request):
    ok, why = _usable(request.param)
    if not ok:
        pytest.skip(f"{request.param}: {why}")
    return testing.BackendOps(request.param, 2)


def _inv_freq(n_rot: int) -> np.ndarray:
    return (BASE ** (-2.0 * np.arange(n_rot // 2) / n_rot)).astype(np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _weight(rng, type_name: str, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(raw bytes, values as stored [n_out, n_in], GGUF type id) of a random weight."""
    w = (rng.standard_normal((n_out, n_in)) * 0.5).astype(np.float32)
    if type_name == "BF16":
        bits = (w.view(np.uint32) + 0x7FFF + ((w.view(np.uint32) >> 16) & 1)) >> 16  # round to nearest even
        raw = bits.astype(np.uint16)
        return (
            raw.view(np.uint8).ravel(),
            (raw.astype(np.uint32) << 16).view(np.float32),
            int(gguf.GGMLQuantizationType.BF16),
        )
    data, qtype = mtm.encode(w, type_name)
    values = mtm.decode(data, qtype).reshape(n_out, n_in)
    return np.ascontiguousarray(data).view(np.uint8).ravel(), values, int(qtype)


# --------------------------------------------------------------------------------------------------- matmul, rows


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
@pytest.mark.parametrize("n_tok", [1, 3, 8, 17, 40])
def test_matmul_every_weight_type(ops, type_name: str, n_tok: int) -> None:
    rng = np.random.default_rng(hash((type_name, n_tok)) % 2**32)
    n_in, n_out = 512, 96
    raw, w, type_id = _weight(rng, type_name, n_in, n_out)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    got = ops.matmul(type_id, raw, n_in, n_out, x)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(got - ref) <= MATMUL_TOL[ops.name] * scale + 1e-30), type_name


@pytest.mark.parametrize("n_tok", [1, 12])
def test_matmul_multi_equals_separate_products(ops, n_tok: int) -> None:
    rng = np.random.default_rng(n_tok)
    n_in, outs = 256, [700, 40, 136]  # rows not multiples of the threads' 16-row portions
    parts = [_weight(rng, "Q8_0", n_in, n) for n in outs]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    got = ops.matmul_multi(parts[0][2], [p[0] for p in parts], n_in, outs, x)
    for (raw, _, type_id), n_out, y in zip(parts, outs, got, strict=True):
        np.testing.assert_array_equal(y, ops.matmul(type_id, raw, n_in, n_out, x))


# Rows per expert of a grouped call: empty experts, decode-sized groups and prefill-sized ones (17+ rows).
EXPERT_ROWS = [0, 3, 17, 1, 0, 24, 5, 9, 2, 6]


def _experts_case(rng, type_name: str, n_in: int, outs: list[int]):
    """(weights per expert and matrix, first rows, x) of a grouped expert product over EXPERT_ROWS."""
    parts = [_weight(rng, type_name, n_in, n_out) for _ in EXPERT_ROWS for n_out in outs]
    first = np.concatenate([[0], np.cumsum(EXPERT_ROWS)]).astype(np.int64)
    x = rng.standard_normal((int(first[-1]), n_in)).astype(np.float32)
    return parts, [int(f) for f in first], x


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "F16"])
def test_matmul_experts_equals_per_expert_products(ops, type_name: str) -> None:
    """Every expert's rows of the grouped call are bit for bit what matmul_multi over those rows alone gives (the
    MoE layer's old per-expert loop), and within the matmul bound of numpy's product."""
    rng = np.random.default_rng(zlib.crc32(type_name.encode()))
    n_in, outs = 256, [96, 40]
    parts, first, x = _experts_case(rng, type_name, n_in, outs)
    type_id = parts[0][2]
    got = ops.matmul_experts(type_id, [p[0] for p in parts], n_in, outs, first, x)
    for g in range(len(EXPERT_ROWS)):
        a, b = first[g], first[g + 1]
        mine = parts[g * len(outs) : (g + 1) * len(outs)]
        alone = ops.matmul_multi(type_id, [p[0] for p in mine], n_in, outs, x[a:b]) if b > a else None
        for i, (_, w, _) in enumerate(mine):
            if b == a:
                continue
            np.testing.assert_array_equal(got[i][a:b], alone[i])
            ref = x[a:b].astype(np.float64) @ w.astype(np.float64).T
            scale = np.abs(x[a:b]).astype(np.float64) @ np.abs(w).astype(np.float64).T
            assert np.all(np.abs(got[i][a:b] - ref) <= MATMUL_TOL[ops.name] * scale + 1e-30)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_matmul_experts_q8_same_bits_any_thread_count(type_name: str) -> None:
    """The CPU with 8-bit activations: the grouped call gives each expert's per-expert bits (decode kernels for its
    small groups, the integer GEMM for 17+ rows) at 1, 2 and 3 threads, one expert per thread or the whole pool."""
    rng = np.random.default_rng(zlib.crc32(f"q8/{type_name}".encode()))
    n_in, outs = 256, [64]
    parts, first, x = _experts_case(rng, type_name, n_in, outs)
    type_id, datas = parts[0][2], [p[0] for p in parts]
    want = None
    for n_threads in (1, 2, 3):
        ops = testing.BackendOps("cpu", n_threads)
        ops.set_activations("q8")
        got = ops.matmul_experts(type_id, datas, n_in, outs, first, x)[0]
        if want is None:
            want = np.zeros_like(got)
            for g in range(len(EXPERT_ROWS)):
                a, b = first[g], first[g + 1]
                if b > a:
                    want[a:b] = ops.matmul(type_id, datas[g], n_in, outs[0], x[a:b])
        np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match="matmul_experts"):
        ops.matmul_experts(type_id, datas[:-1], n_in, outs, first, x)


INT_PREFILL = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]  # the types of the integer prefill GEMM (qgemm.h)


@pytest.mark.parametrize("type_name", INT_PREFILL)
@pytest.mark.parametrize("n_tok", [17, 40])
def test_matmul_q8_prefill_integer_path(type_name: str, n_tok: int) -> None:
    """The CPU backend with 8-bit activations: prefill (17+ tokens) is within the activation rounding bound of the
    exact product (the integer GEMM on AVX2 / AVX512-VNNI CPUs, the exact f32 path elsewhere), matmul_multi over a
    layer's Q/K/V-like matrices (one quantization, one job) gives the same bits as separate matmuls, and 1, 2 and 3
    threads the same bits."""
    from helpers.quants import min_part, quantize_q8

    rng = np.random.default_rng(zlib.crc32(f"{type_name}/{n_tok}".encode()))
    n_in, outs = 1536, [256, 37, 100]
    parts = [_weight(rng, type_name, n_in, n) for n in outs]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 7] *= 40.0  # an outlier channel: coarse steps in its blocks
    _, step = quantize_q8(x)
    first = None
    for n_threads in (1, 2, 3):
        ops = testing.BackendOps("cpu", n_threads)
        ops.set_activations("q8")
        got = ops.matmul_multi(parts[0][2], [p[0] for p in parts], n_in, outs, x)
        for (raw, w, type_id), n_out, y in zip(parts, outs, got, strict=True):
            np.testing.assert_array_equal(y, ops.matmul(type_id, raw, n_in, n_out, x))
            ref = x.astype(np.float64) @ w.astype(np.float64).T
            scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
            # Each x moves by at most its block's step; a min term (Q4_1, Q4_K, Q5_K) uses the exact sums of x.
            wq = np.abs(w - min_part(raw, gguf.GGMLQuantizationType(type_id), n_out, n_in))
            bound = step @ wq.reshape(n_out, -1, 32).sum(axis=-1).T
            assert np.all(np.abs(y - ref) <= bound * (1 + 1e-6) + MATMUL_TOL["cpu"] * scale), type_name
        if first is None:
            first = got
        for a, b in zip(first, got, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n_tok", [3, 17, 40])
def test_matmul_q8_fast_prefill_one_pass_path(n_tok: int) -> None:
    """activations="q8-fast" on the CPU backend: a Qwen2.5 layer's Q/K/V mix (Q4_K, Q4_K, Q6_K) and a Q5_K matrix
    through matmul_multi and matmul (prefill, and 3 tokens: decode) equal numpy's dequantize(w)·x̂ for the one-pass
    x̂ = d·q (AVX512-VNNI or AVX2; elsewhere q8's) to f32 rounding, matmul_multi gives the bits of separate matmuls,
    and 1, 2 and 3 threads the same bits."""
    from helpers.quants import min_part, quantize_q8, quantize_q8_one_pass

    one_pass = bool(core.cpu_features().get("avx512_vnni") or core.cpu_features().get("qgemm_avx2"))
    if n_tok < 17:  # the decode path: one-pass kernels wherever the AVX2 ones run
        one_pass = bool(core.cpu_features()["avx2_fma_f16c"])
    rng = np.random.default_rng(zlib.crc32(f"q8-fast/{n_tok}".encode()))
    n_in, outs, types = 1536, [256, 37, 100, 64], ["Q4_K", "Q4_K", "Q6_K", "Q5_K"]
    parts = [_weight(rng, t, n_in, n) for t, n in zip(types, outs, strict=True)]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 7] *= 40.0
    xq, _ = quantize_q8_one_pass(x) if one_pass else quantize_q8(x)
    first = None
    for n_threads in (1, 2, 3):
        ops = testing.BackendOps("cpu", n_threads)
        ops.set_activations("q8-fast")
        got = ops.matmul_multi(0, [p[0] for p in parts], n_in, outs, x, type_ids=[p[2] for p in parts])
        for (raw, w, type_id), n_out, y in zip(parts, outs, got, strict=True):
            np.testing.assert_array_equal(y, ops.matmul(type_id, raw, n_in, n_out, x))
            mins = min_part(raw, gguf.GGMLQuantizationType(type_id), n_out, n_in)
            ref = xq @ (w - mins).T + x.astype(np.float64) @ mins.T
            scale = np.abs(xq) @ np.abs(w - mins).T + np.abs(x).astype(np.float64) @ np.abs(mins).T
            assert np.all(np.abs(y - ref) <= 1e-5 * scale), types
        if first is None:
            first = got
        for a, b in zip(first, got, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_embed_rows(ops, type_name: str) -> None:
    rng = np.random.default_rng(3)
    raw, w, type_id = _weight(rng, type_name, 256, 50)
    tokens = np.array([7, -1, 0, 49, 7], np.int32)
    got = ops.embed_rows(type_id, raw, 256, 50, tokens)
    for i, t in enumerate(tokens):
        np.testing.assert_array_equal(got[i], w[t] if t >= 0 else 0.0)


def test_rms_norm_add_bias_add_swiglu_geglu_scale(ops) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    y = rng.standard_normal((5, 576)).astype(np.float32)
    tol = OP_TOL[ops.name]
    x64 = x.astype(np.float64)
    norm = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-5), norm, rtol=tol, atol=tol)
    np.testing.assert_allclose(ops.add_bias(x, w), x64 + w, rtol=tol, atol=tol)
    np.testing.assert_allclose(ops.add(x, y), x64 + y, rtol=tol, atol=tol)
    silu = x64 / (1.0 + np.exp(-x64)) * y
    np.testing.assert_allclose(ops.swiglu(x, y), silu, rtol=2 * tol, atol=2 * tol)
    # GeGLU (gemma): tanh-approximated GELU, as torch's gelu(approximate="tanh")
    gelu = 0.5 * x64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x64 + 0.044715 * x64**3))) * y
    np.testing.assert_allclose(ops.geglu_tanh(x, y), gelu, rtol=4 * tol, atol=4 * tol)
    np.testing.assert_allclose(ops.scale(x, 24.0), x64 * 24.0, rtol=tol, atol=tol)
    # in place over rows of one head: the per-head Q/K norm of qwen3 / gemma3 (rows of 64 with one weight)
    heads = x.reshape(-1, 64)
    hn = heads.astype(np.float64)
    np.testing.assert_allclose(
        ops.rms_norm(heads, w[:64], 1e-6), hn / np.sqrt((hn**2).mean(axis=1, keepdims=True) + 1e-6) * w[:64],
        rtol=tol, atol=tol,
    )  # fmt: skip


def test_moe_route_gather_and_scaled_add(ops) -> None:
    """Top-k expert routing (softmax, k largest, renormalized or not) and the row gather / weighted scatter-add the
    expert matmuls run between, against numpy; a destination row named twice sums both contributions in order."""
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((13, 10)).astype(np.float32)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    order = np.argsort(-p, axis=1, kind="stable")
    tol = OP_TOL[ops.name]
    for k, norm in ((1, False), (3, True), (3, False), (10, True)):
        ids, w = ops.moe_route(logits, k, norm)
        np.testing.assert_array_equal(ids.astype(np.int64), order[:, :k])
        want = np.take_along_axis(p, order[:, :k], axis=1)
        if norm:
            want = want / want.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(w, want, rtol=10 * tol, atol=10 * tol)
    src = rng.standard_normal((9, 40)).astype(np.float32)
    dst = rng.standard_normal((6, 40)).astype(np.float32)
    rows = np.array([4, 0, 8, 4], dtype=np.int32)
    dst_rows = np.array([5, 1, 5, 0], dtype=np.int32)
    scales = np.array([0.5, -2.0, 0.25, 1.0], dtype=np.float32)
    gathered, added = ops.gather_add_rows(src, rows, dst, dst_rows, scales)
    np.testing.assert_array_equal(gathered, src[rows])
    want_dst = dst.astype(np.float64)
    for r, d, s in zip(rows, dst_rows, scales, strict=True):
        want_dst[d] += s * src[r].astype(np.float64)
    np.testing.assert_allclose(added, want_dst, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------------- KV and attention


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize(
    "n_head,n_head_kv,hd,n_rot,neox", [(9, 3, 64, 64, False), (8, 2, 128, 128, True), (6, 2, 32, 16, True)]
)
def test_rope_kv_write(ops, kv_type, n_head, n_head_kv, hd, n_rot, neox) -> None:
    rng = np.random.default_rng(n_head * hd)
    n, kd = 37, n_head_kv * hd  # over one block of 32 rows
    q = rng.standard_normal((n, n_head * hd)).astype(np.float32)
    k = rng.standard_normal((n, kd)).astype(np.float32)
    v = rng.standard_normal((n, kd)).astype(np.float32)
    pos_q = np.arange(100, 100 + n, dtype=np.int64)
    pos_k = pos_q - 40  # a shared span's frame
    qr, ks, vs = ops.rope_kv_write(n_head, n_head_kv, hd, kv_type, n_rot, neox, _inv_freq(n_rot), q, k, v, pos_q, pos_k)
    store = _f16 if kv_type == "f16" else (lambda a: a)
    for i in range(n):
        np.testing.assert_allclose(qr[i], rotate(q[i : i + 1], pos_q[i], hd, n_rot, neox, BASE)[0], rtol=0, atol=2e-5)
        kr = rotate(k[i : i + 1], pos_k[i], hd, n_rot, neox, BASE)[0]
        np.testing.assert_allclose(ks[i], store(kr.astype(np.float32)), rtol=0, atol=2e-5 if kv_type == "f32" else 2e-3)
    np.testing.assert_array_equal(vs, store(v))


# (n_head, n_head_kv, head_dim, n_rot, neox, lengths, shifts, ranks): the CPU kernel tests' matrix
ATTN_CASES = [
    (4, 4, 64, 64, False, [32, 17], [0, 0], [0, 0]),
    (9, 3, 64, 64, False, [32, 32, 5], [0, 40, 40], [0, 8, 8]),
    (8, 2, 64, 64, True, [7, 30, 3], [0, -12, 100], [0, 32, 1]),
    (8, 1, 128, 128, False, [40, 9], [3, 0], [16, 0]),
    (6, 2, 32, 16, True, [13, 13, 13], [5, 6, 7], [2, 2, 2]),
    (4, 2, 24, 24, False, [10, 11], [0, 9], [0, 3]),
    (32, 8, 128, 128, False, [64, 64, 20], [0, 2048, 2048], [0, 32, 32]),  # Llama-3-8B heads
]


def _stack(runs, kv_type):
    """Rows of all runs stacked (as stored), the run specs over them, and their corrections."""
    k = np.concatenate([r["k"] for r in runs])
    v = np.concatenate([r["v"] for r in runs])
    if kv_type == "f16":
        k, v = _f16(k), _f16(v)
    specs, corrs, row = [], [], 0
    for r in runs:
        corr = -1
        if "a_k" in r:
            corrs.append((r["a_k"], r["b_k"], r["a_v"], r["b_v"]))
            corr = len(corrs) - 1
        specs.append((row, len(r["k"]), r["shift"], corr))
        row += len(r["k"])
    return k, v, specs, corrs


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=[str(i) for i in range(len(ATTN_CASES))])
@pytest.mark.parametrize("nq", [1, 5, 40])
def test_attention_shifted_corrected_runs(ops, case, kv_type, nq) -> None:
    """nq = 40 (several query blocks in one call, as a prefill makes): on the CPU, corrected runs that enough of
    the queries see are corrected once into a copy instead of fused per query (CpuBackend::copy_busy_corrections),
    runs seen by fewer stay fused; both must match the reference."""
    n_head, n_head_kv, hd, n_rot, neox, lengths, shifts, ranks = case
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))  # the same data every run
    runs = make_runs(rng, lengths, shifts, ranks, n_head_kv, hd)
    k, v, specs, corrs = _stack(runs, kv_type)
    stored = [dict(r, k=k[s[0] : s[0] + s[1]], v=v[s[0] : s[0] + s[1]]) for r, s in zip(runs, specs, strict=True)]
    total = sum(lengths)
    nq = min(nq, total)
    q = rng.standard_normal((nq, n_head * hd)).astype(np.float32)
    n_visible0 = total - nq + 1
    got = ops.attention(
        n_head, n_head_kv, hd, kv_type, n_rot, neox, _inv_freq(n_rot), q, k, v, specs, corrs, n_visible0
    )
    tol = (ATTN_TOL_FAR if max(abs(s) for s in shifts) >= 1024 else ATTN_TOL)[ops.name]
    for i in range(nq):
        ref = reference(q[i].reshape(n_head, hd), stored, n_head_kv, n_rot, neox, BASE, n_visible0 + i).ravel()
        err = np.abs(got[i] - ref).max() / np.abs(ref).max()
        assert err <= tol, (case, kv_type, i, err)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_kv_read_and_copy_materialize_corrected_shifted_rows(ops, kv_type) -> None:
    n_head_kv, hd, n_rot, neox = 3, 64, 64, False
    rng = np.random.default_rng(8)
    runs = make_runs(rng, [20, 40], [0, 13], [0, 8], n_head_kv, hd)
    k, v, specs, corrs = _stack(runs, kv_type)
    want_k, want_v = [], []
    for r, s in zip(runs, specs, strict=True):
        kk, vv = k[s[0] : s[0] + s[1]].astype(np.float64), v[s[0] : s[0] + s[1]].astype(np.float64)
        if "a_k" in r:
            kk = kk + r["a_k"].astype(np.float64) @ r["b_k"]
            vv = vv + r["a_v"].astype(np.float64) @ r["b_v"]
        want_k.append(rotate(kk, s[2], hd, n_rot, neox, BASE))
        want_v.append(vv)
    want_k, want_v = np.concatenate(want_k), np.concatenate(want_v)
    got_k, got_v = ops.kv_read(n_head_kv, hd, kv_type, n_rot, neox, _inv_freq(n_rot), k, v, specs, corrs)
    np.testing.assert_allclose(got_k, want_k, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-4)
    shifts = np.concatenate([np.full(s[1], s[2], np.int64) for s in specs])
    cp_k, cp_v = ops.kv_copy(n_head_kv, hd, kv_type, n_rot, neox, _inv_freq(n_rot), k, v, specs, corrs, shifts)
    store = _f16 if kv_type == "f16" else (lambda a: a.astype(np.float32))
    atol = 1e-4 if kv_type == "f32" else 5e-3
    np.testing.assert_allclose(cp_k, store(want_k.astype(np.float32)), rtol=0, atol=atol)
    np.testing.assert_allclose(cp_v, store(want_v.astype(np.float32)), rtol=0, atol=atol)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("corr_rank", [0, 5])
def test_ridge_rows(ops, kv_type, values, corr_rank) -> None:
    rng = np.random.default_rng(9 + corr_rank)
    kd, rank, n = 192, 7, 30
    k = rng.standard_normal((n, kd)).astype(np.float32)
    v = rng.standard_normal((n, kd)).astype(np.float32)
    if kv_type == "f16":
        k, v = _f16(k), _f16(v)
    corrs, corr = [], -1
    if corr_rank:
        corrs = [tuple(rng.standard_normal(s).astype(np.float32) for s in ((n, corr_rank), (corr_rank, kd)) * 2)]
        corr = 0
    mu = rng.standard_normal(kd).astype(np.float32)
    proj = rng.standard_normal((kd, rank)).astype(np.float32)
    m = rng.standard_normal((corr_rank, rank)).astype(np.float32)
    got = ops.ridge_rows(kv_type, k, v, (0, n, 0, corr), corrs, values, 2, 27, mu, proj, m)
    x = (v if values else k)[2:27].astype(np.float64)
    want = (x - mu) @ proj
    if corr_rank:
        a = corrs[0][2 if values else 0][2:27].astype(np.float64)
        want = want + a @ m
    np.testing.assert_allclose(got[:, :rank], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, rank], 1.0)


# --------------------------------------------------------------------------------------------------- whole model (GPU)


def _need_cuda() -> None:
    ok, why = _usable("cuda")
    if not ok:
        pytest.skip(f"cuda: {why}")


def test_cuda_request_is_a_clear_error_where_it_cannot_run() -> None:
    ok, why = _usable("cuda")
    if ok:
        pytest.skip("a usable GPU is present: the error path is not reachable here")
    path = mtm.ensure_tiny_models(variants=["llama"], types=["F32"])[("llama", "F32")]
    with pytest.raises(kc.KvcmasError, match="CUDA|cuda|GPU") as info:
        kc.Model(path, device="cuda")
    built = "cuda" in kc.backends()
    assert ("no CUDA backend" in str(info.value)) != built, str(info.value)


def test_cli_device_flag_reports_an_unusable_cuda(capsys) -> None:
    ok, _ = _usable("cuda")
    if ok:
        pytest.skip("a usable GPU is present")
    from kvcmas_cpp import cli

    path = mtm.ensure_tiny_models(variants=["llama"], types=["F32"])[("llama", "F32")]
    assert cli.main(["generate", "-m", str(path), "--device", "cuda", "-n", "1", "--raw", "hi"]) == 1
    assert "cuda" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_f32() -> Path:
    return mtm.ensure_tiny_models(variants=["llama"], types=["F32"])[("llama", "F32")]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "variant,type_name", [("llama", "F32"), ("qwen2", "Q8_0"), ("llama", "Q4_K"), ("llama_rope3", "F16")]
)
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_cuda_logits_match_cpu(variant, type_name, kv_type) -> None:
    _need_cuda()
    path = mtm.ensure_tiny_models(variants=[variant], types=[type_name])[(variant, type_name)]
    ids = list(np.random.default_rng(1).integers(0, 200, 70))
    out = {}
    for dev in ("cpu", "cuda"):
        m = kc.Model(path, n_ctx=256, kv_type=kv_type, device=dev)
        with m.new_sequence() as s:
            prefill = s.append(ids, logits="all")
            steps = [s.append([int(np.argmax(prefill[-1]))], logits="last")]
        out[dev] = np.concatenate([prefill, np.stack(steps)])
    err = np.abs(out["cuda"] - out["cpu"]).max() / np.abs(out["cpu"]).max()
    assert err <= 5e-3, err  # TF32 prefill GEMM


@pytest.mark.gpu
def test_cuda_greedy_64_tokens_identical_on_f32(tiny_f32) -> None:
    _need_cuda()
    toks = {}
    for dev in ("cpu", "cuda"):
        m = kc.Model(tiny_f32, n_ctx=256, device=dev)
        with m.new_sequence() as s:
            logits = s.append([1, 5, 9, 14], logits="last")
            seq = []
            for _ in range(64):
                t = int(np.argmax(logits))
                seq.append(t)
                logits = s.append([t], logits="last")
        toks[dev] = seq
    assert toks["cuda"] == toks["cpu"]


@pytest.mark.gpu
def test_cuda_shared_corrected_span_matches_cpu(tiny_f32) -> None:
    """A kvcmas-style reuse on the device: a span shared at a shift with a correction, then decoded, as on the CPU."""
    _need_cuda()
    out = {}
    for dev in ("cpu", "cuda"):
        m = kc.Model(tiny_f32, n_ctx=256, device=dev)
        rng = np.random.default_rng(2)
        kd = m.n_head_kv * m.head_dim
        corr = core.KvCorrection(40, 4, kd, m.n_layer)
        for il in range(1, m.n_layer):
            corr.set_layer(il, *(rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((40, 4), (4, kd)) * 2))
        with m.new_sequence() as a, m.new_sequence() as b:
            a.append(list(range(3, 53)), logits="none")
            b.append(list(range(60, 67)), logits="none")
            b.append_shared(a.share(10, 40), corr)
            out[dev] = b.append([5, 6, 7], logits="all")
    err = np.abs(out["cuda"] - out["cpu"]).max() / np.abs(out["cpu"]).max()
    assert err <= 5e-3, err


@pytest.mark.gpu
def test_cuda_out_of_memory_is_a_clear_error_and_frees_what_it_took() -> None:
    _need_cuda()
    ops = testing.BackendOps("cuda", 1)
    free0 = ops.free_bytes()
    with pytest.raises(kc.KvcmasError, match="out of device memory"):
        ops.try_alloc(free0 + (1 << 40))
    assert abs(ops.free_bytes() - free0) < (64 << 20)


# ---------------------------------------------------------------------------------------------------------- LoRA


def _stored(m: np.ndarray, factor_type: str) -> np.ndarray:
    """A factor's rows [rows][width] as lora_add stores them (f32, f16, or i8 with one absmax/127 scale per row),
    in f64."""
    if factor_type == "f16":
        return m.astype(np.float16).astype(np.float64)
    if factor_type == "i8":
        d = (np.abs(m).max(axis=1) / np.float32(127)).astype(np.float32)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
        q = np.clip(np.rint(m * inv[:, None]), -127, 127)
        return q.astype(np.float64) * d[:, None].astype(np.float64)
    return m.astype(np.float64)


def _lora_groups(rng, n_tok: int, n_in: int, n_out: int) -> list:
    """Adapter groups of ranks 8, 1, 16 over a batch of n_tok rows, every 4th row in no group."""
    order = rng.permutation(n_tok).astype(np.int32)
    groups = []
    for g, rank in enumerate([8, 1, 16]):
        rows = np.sort(order[g::4])
        a = rng.standard_normal((rank, n_in)).astype(np.float32) * 0.1
        b = rng.standard_normal((n_out, rank)).astype(np.float32) * 0.1
        groups.append((a, b, rows, rng.uniform(-2, 2, len(rows)).astype(np.float32)))
    return groups


@pytest.mark.parametrize("factor_type", ["f32", "f16", "i8"])
@pytest.mark.parametrize("n_tok", [1, 5, 40])
@pytest.mark.parametrize("n_out", [200, 203])
def test_lora_add_groups_of_adapters(ops, n_tok: int, factor_type: str, n_out: int) -> None:
    """y[r] += s·B(A x[r]) per adapter group (ranks 1, 8, 16; some rows in no group), against numpy in f64 over the
    factors as stored (f32, f16, i8 with row scales); each row's result is the one it gets alone (a mixed batch
    changes nothing for a row). 203 outputs: B's last tile of 8 outputs part padding (backend.h, lora_b_index)."""
    rng = np.random.default_rng(n_tok)
    n_in = 320
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    y = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    groups = _lora_groups(rng, n_tok, n_in, n_out)
    got = ops.lora_add(x, y, groups, factor_type)
    ref = y.astype(np.float64)
    bound = np.zeros_like(ref)
    for a, b, rows, scales in groups:
        a64, b64 = _stored(a, factor_type), _stored(b.T.copy(), factor_type).T  # b_t's rows are B's columns
        for r, s in zip(rows, scales, strict=True):
            t = a64 @ x[r]
            ref[r] += s * (b64 @ t)
            bound[r] = abs(s) * (np.abs(b64) @ (np.abs(a64) @ np.abs(x[r]))) + np.abs(y[r])
    assert np.all(np.abs(got - ref) <= OP_TOL[ops.name] * 4 * bound + 1e-30)
    untouched = np.setdiff1d(np.arange(n_tok), np.concatenate([g[2] for g in groups]))
    np.testing.assert_array_equal(got[untouched], y[untouched])
    for a, b, rows, scales in groups:
        for r, s in zip(rows[:2], scales[:2], strict=True):  # the row alone, in a batch of one
            one = [(a, b, np.zeros(1, np.int32), np.array([s], np.float32))]
            alone = ops.lora_add(x[r : r + 1], y[r : r + 1], one, factor_type)
            np.testing.assert_array_equal(alone[0], got[r])


@pytest.mark.parametrize("factor_type", ["f32", "f16", "i8"])
def test_lora_add_products_of_one_input_and_thread_counts(ops, factor_type: str) -> None:
    """Several products of one x in one call (Q/K/V, gate/up) give each what it gets in a call of its own, and the
    CPU gives the same bits at 1 and 2 threads (the work is split, each value computed the same way). 128 rows: enough
    work that the CPU splits it over its threads (whole groups, or one group's products)."""
    rng = np.random.default_rng(7)
    n_tok, n_in, n_outs = 128, 576, (576, 192, 1536)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    products = []
    for n_out in n_outs:
        y = rng.standard_normal((n_tok, n_out)).astype(np.float32)
        products.append((y, _lora_groups(rng, n_tok, n_in, n_out)))
    together = ops.lora_add_products(x, products, factor_type)
    for (y, groups), got in zip(products, together, strict=True):
        np.testing.assert_array_equal(got, ops.lora_add(x, y, groups, factor_type))
    if ops.name == "cpu":
        one_thread = testing.BackendOps("cpu", 1)
        for got, alone in zip(together, one_thread.lora_add_products(x, products, factor_type), strict=True):
            np.testing.assert_array_equal(got, alone)
        y, groups = products[2][0], products[2][1][2:]  # one group: its A and B products split over the threads
        np.testing.assert_array_equal(
            ops.lora_add(x, y, groups, factor_type), one_thread.lora_add(x, y, groups, factor_type)
        )


def test_lora_add_refuses_bad_groups(ops) -> None:
    x, y = np.zeros((3, 8), np.float32), np.zeros((3, 4), np.float32)
    a, b = np.zeros((2, 8), np.float32), np.zeros((4, 2), np.float32)
    one = np.ones(1, np.float32)
    with pytest.raises(kc.KvcmasError, match="a \\[rank, n_in\\]"):
        ops.lora_add(x, y, [(a, np.zeros((4, 3), np.float32), np.zeros(1, np.int32), one)])
    with pytest.raises(kc.KvcmasError, match="distinct rows"):
        ops.lora_add(x, y, [(a, b, np.array([3], np.int32), one)])
    with pytest.raises(kc.KvcmasError, match="distinct rows"):
        ops.lora_add(x, y, [(a, b, np.zeros(1, np.int32), one), (a, b, np.zeros(1, np.int32), one)])
    with pytest.raises(kc.KvcmasError, match="factor_type must be"):
        ops.lora_add(x, y, [(a, b, np.zeros(1, np.int32), one)], "q4")


def test_swiglu_oai(ops) -> None:
    """gpt-oss's clamped SwiGLU: values on both sides of the clamp (gate above 7, up beyond ±7)."""
    rng = np.random.default_rng(31)
    g = (rng.standard_normal((5, 67)) * 6).astype(np.float32)
    u = (rng.standard_normal((5, 67)) * 6).astype(np.float32)
    x = np.minimum(g.astype(np.float64), 7.0)
    want = x / (1 + np.exp(-1.702 * x)) * (np.clip(u.astype(np.float64), -7.0, 7.0) + 1)
    assert (g > 7).any() and (np.abs(u) > 7).any()
    tol = 4 * OP_TOL[ops.name]
    np.testing.assert_allclose(ops.swiglu_oai(g, u, 1.702, 7.0), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("nq", [1, 20])
def test_attention_with_sinks(ops, kv_type, nq) -> None:
    """Per-head sink logits join the softmax's denominator (gpt-oss): out = Σ_j p_j v_j with p = exp(s_j) /
    (Σ exp(s) + exp(sink_h)); over shifted and corrected runs, GQA."""
    n_head, n_head_kv, hd, n_rot = 8, 2, 64, 64
    rng = np.random.default_rng(32)
    runs = make_runs(rng, [13, 30], [0, 9], [0, 4], n_head_kv, hd)
    k, v, specs, corrs = _stack(runs, kv_type)
    stored = [dict(r, k=k[s[0] : s[0] + s[1]], v=v[s[0] : s[0] + s[1]]) for r, s in zip(runs, specs, strict=True)]
    q = rng.standard_normal((nq, n_head * hd)).astype(np.float32)
    sinks = rng.uniform(-2, 4, n_head).astype(np.float32)
    n_visible0 = 43 - nq + 1
    got = ops.attention(
        n_head, n_head_kv, hd, kv_type, n_rot, True, _inv_freq(n_rot), q, k, v, specs, corrs, n_visible0, sinks
    )
    plain = ops.attention(
        n_head, n_head_kv, hd, kv_type, n_rot, True, _inv_freq(n_rot), q, k, v, specs, corrs, n_visible0
    )
    for i in range(nq):
        qi = q[i].reshape(n_head, hd)
        ref = reference(qi, stored, n_head_kv, n_rot, True, BASE, n_visible0 + i)
        # the same attention with the sink: each head's output scaled by Z / (Z + exp(sink)), Z = Σ exp(s_j)
        keys = []
        for r in stored:
            kk = r["k"].astype(np.float64) + (r["a_k"].astype(np.float64) @ r["b_k"] if "a_k" in r else 0.0)
            keys.append(rotate(kk, r["shift"], hd, n_rot, True, BASE))
        keys = np.concatenate(keys)[: n_visible0 + i]
        group = n_head // n_head_kv
        for h in range(n_head):
            s = keys[:, (h // group) * hd : (h // group + 1) * hd] @ qi[h].astype(np.float64) / np.sqrt(hd)
            z = np.exp(s - s.max()).sum()
            ref[h] *= z / (z + np.exp(sinks[h] - s.max()))
        err = np.abs(got[i] - ref.ravel()).max() / np.abs(ref).max()
        assert err <= ATTN_TOL[ops.name], (kv_type, i, err)
        assert np.abs(got[i] - plain[i]).max() > 100 * ATTN_TOL[ops.name] * np.abs(ref).max()
