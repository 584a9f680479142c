"""The vision towers' ops of the backend seam (cpp/backend/backend.h: layer_norm, activate, segment_attention,
rotate_half_rows, avg_pool_rms_norm) on every usable backend at 1 and 2 threads, against numpy references in f64:
odd widths, several segments (short ones take the CPU's fused kernel, long ones its GEMM path), Qwen2.5-VL's head
size. The encoders built on them are checked against transformers in tests/test_vision*.py; here also the refusal of
a backend the build or machine cannot run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.native import testing
from kvcmas_cpp._native import core

BACKENDS = ["cpu", "cuda"]
TOL = {"cpu": 2e-6, "cuda": 2e-5}
ATTN_TOL = {"cpu": 5e-6, "cuda": 5e-5}


@pytest.fixture(params=[(b, t) for b in BACKENDS for t in (1, 2)], ids=lambda p: f"{p[0]}-{p[1]}t", scope="module")
def ops(request):
    name, n_threads = request.param
    listing = kc.backends()
    if name not in listing:
        pytest.skip(f"backend '{name}' is not compiled into this build (CPU-only; rebuild with KVCMAS_CUDA=ON)")
    ok, why = listing[name]
    if not ok:
        pytest.skip(f"{name}: {why}")
    return testing.BackendOps(name, n_threads)


@pytest.mark.parametrize(("rows", "width"), [(7, 1152), (3, 37), (1, 5)])
def test_layer_norm(ops, rows: int, width: int) -> None:
    rng = np.random.default_rng(rows * width)
    x = (rng.standard_normal((rows, width)) * 3 + 1.5).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-6) * w + b
    tol = TOL[ops.name] * 10
    np.testing.assert_allclose(ops.layer_norm(x, w, b, 1e-6), ref, rtol=tol, atol=tol)


def _act(name: str, x: np.ndarray) -> np.ndarray:
    if name == "gelu":
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    if name == "gelu_pytorch_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "quick_gelu":
        return x / (1.0 + np.exp(-1.702 * x))
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "quick_gelu", "silu"])
@pytest.mark.parametrize("gated", [False, True])
def test_activate(ops, name: str, gated: bool) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 77)) * 4).astype(np.float32)  # 77: AVX2 lanes and a portable tail per row
    x[0, :4] = [-30.0, 30.0, 0.0, -0.0]
    mul = rng.standard_normal(x.shape).astype(np.float32) if gated else None
    ref = _act(name, x.astype(np.float64)) * (mul if gated else 1.0)
    got = ops.activate(name, x, mul)
    np.testing.assert_allclose(got, ref, rtol=4 * TOL[ops.name], atol=4 * TOL[ops.name])
    with pytest.raises(kc.KvcmasError, match="unknown activation 'relu'"):
        ops.activate("relu", x)


def _segment_reference(q, k, v, n_head, seg):
    n, e = q.shape
    hd = e // n_head
    out = np.zeros((n, e))
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    for a, b in zip(seg[:-1], seg[1:], strict=True):
        for h in range(n_head):
            cols = slice(h * hd, (h + 1) * hd)
            s = q64[a:b, cols] @ k64[a:b, cols].T / math.sqrt(hd)
            p = np.exp(s - s.max(1, keepdims=True))
            out[a:b, cols] = (p / p.sum(1, keepdims=True)) @ v64[a:b, cols]
    return out


@pytest.mark.parametrize(
    ("n_head", "hd", "seg"),
    [
        (3, 24, [0, 5, 70, 71, 600]),  # one row alone, short segments (fused kernel), one of 529 (the GEMM path)
        (2, 80, [0, 64, 128, 192]),  # Qwen2.5-VL's head size, its 8 x 8-patch windows
        (1, 8, [0, 1]),
        (2, 72, [0, 1000]),  # Gemma 3's head size: a long segment over a partial key panel and query block
        (2, 80, [0, 20, 1043]),  # Qwen2.5-VL's head size in a full-attention block (a partial value panel)
    ],
)
def test_segment_attention(ops, n_head: int, hd: int, seg: list[int]) -> None:
    rng = np.random.default_rng(len(seg) + hd)
    n = seg[-1]
    q, k, v = (rng.standard_normal((n, n_head * hd)).astype(np.float32) for _ in range(3))
    got = ops.segment_attention(q * 2, k, v, n_head, seg)
    ref = _segment_reference(q * 2, k, v, n_head, seg)
    np.testing.assert_allclose(got, ref, rtol=ATTN_TOL[ops.name], atol=ATTN_TOL[ops.name])


def test_segment_attention_bits_do_not_depend_on_threads() -> None:
    """A long segment (the CPU's blocked attention on AVX-512 machines, else its GEMMs) gives the same bits at 1
    and 2 threads: every output is one fixed order of operations, whichever thread computes it."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((700, 3 * 72)).astype(np.float32) for _ in range(3))
    one, two = (testing.BackendOps("cpu", t).segment_attention(q, k, v, 3, [0, 3, 700]) for t in (1, 2))
    np.testing.assert_array_equal(one, two)


def test_segment_attention_refuses_bad_segments(ops) -> None:
    x = np.zeros((10, 8), np.float32)
    with pytest.raises(kc.KvcmasError, match="from row 0 to row 10"):
        ops.segment_attention(x, x, x, 2, [0, 5, 9])  # the segments do not end at the last row
    with pytest.raises(kc.KvcmasError, match="segment 0 ends before it starts"):
        ops.segment_attention(x, x, x, 2, [0, -1, 10])
    with pytest.raises(kc.KvcmasError, match="3 heads do not divide rows of 8"):
        ops.segment_attention(x, x, x, 3, [0, 10])


def test_rotate_half_rows(ops) -> None:
    rng = np.random.default_rng(9)
    n, n_head, hd = 13, 3, 20
    x = rng.standard_normal((n, n_head * hd)).astype(np.float32)
    ang = rng.uniform(-7, 7, (n, hd // 2))
    cos_t, sin_t = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    ref = x.astype(np.float64).reshape(n, n_head, hd).copy()
    a, b = ref[..., : hd // 2].copy(), ref[..., hd // 2 :].copy()
    c, s = cos_t[:, None, :].astype(np.float64), sin_t[:, None, :].astype(np.float64)
    ref[..., : hd // 2], ref[..., hd // 2 :] = a * c - b * s, b * c + a * s
    got = ops.rotate_half_rows(x, cos_t, sin_t, n_head)
    np.testing.assert_allclose(got, ref.reshape(n, -1), rtol=TOL[ops.name], atol=TOL[ops.name])


@pytest.mark.parametrize(("n_img", "grid", "k", "width"), [(2, 6, 3, 40), (1, 8, 4, 33), (1, 3, 1, 7)])
def test_avg_pool_rms_norm(ops, n_img: int, grid: int, k: int, width: int) -> None:
    rng = np.random.default_rng(grid * width)
    x = rng.standard_normal((n_img * grid * grid, width)).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    side = grid // k
    g = x.astype(np.float64).reshape(n_img, side, k, side, k, width).mean(axis=(2, 4)).reshape(-1, width)
    ref = g / np.sqrt((g**2).mean(1, keepdims=True) + 1e-6) * w
    got = ops.avg_pool_rms_norm(x, w, n_img, grid, k, 1e-6)
    np.testing.assert_allclose(got, ref, rtol=4 * TOL[ops.name], atol=4 * TOL[ops.name])


@pytest.fixture(scope="module")
def tiny_mmproj(tmp_path_factory) -> Path:
    from kvcmas_cpp.vision.random_mmproj import write_random_mmproj

    path = tmp_path_factory.mktemp("mmproj") / "clip.gguf"
    write_random_mmproj(
        path, model_type="clip", image_size=28, patch_size=14, n_embd=32, n_ff=64, n_layer=1, n_head=2, n_embd_out=32
    )
    return path


def test_encoders_run_on_the_named_backend(tiny_mmproj: Path) -> None:
    from kvcmas_cpp.vision import VisionEncoder

    enc = VisionEncoder(tiny_mmproj, n_threads=1, backend="cpu")
    assert enc.backend == "cpu"
    assert VisionEncoder(tiny_mmproj, n_threads=1).backend == "cpu"  # the default


@pytest.mark.parametrize("name", ["tpu", "cuda:x", ""])
def test_unknown_backend_is_refused_naming_it(tiny_mmproj: Path, name: str) -> None:
    from kvcmas_cpp.vision import VisionEncoder

    with pytest.raises(kc.KvcmasError, match=f"backend '{name}'"):
        VisionEncoder(tiny_mmproj, n_threads=1, backend=name)
    # the Qwen2.5-VL tower makes its backend first, the same way
    with pytest.raises(kc.KvcmasError, match=f"backend '{name}'"):
        core.QwenVisionEncoder(str(tiny_mmproj), 1, name)


def test_cuda_tower_where_it_cannot_run_says_why(tiny_mmproj: Path) -> None:
    ok, why = kc.backends().get("cuda", (False, "not compiled"))
    if ok:
        pytest.skip("a usable GPU: the tower runs there (test_cuda_tower_matches_cpu)")
    with pytest.raises(kc.KvcmasError, match="backend 'cuda'.*(CUDA backend|CUDA device|usable GPU)"):
        core.VisionEncoder(str(tiny_mmproj), 1, "cuda")


def test_cuda_tower_matches_cpu(tiny_mmproj: Path) -> None:
    ok, why = kc.backends().get("cuda", (False, "not compiled into this build"))
    if not ok:
        pytest.skip(f"cuda: {why}")
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((3, 28, 28)).astype(np.float32)
    cpu = core.VisionEncoder(str(tiny_mmproj), 1, "cpu").encode(pixels)
    gpu = core.VisionEncoder(str(tiny_mmproj), 1, "cuda").encode(pixels)
    np.testing.assert_allclose(gpu, cpu, rtol=2e-3, atol=2e-3 * float(np.abs(cpu).max()))
