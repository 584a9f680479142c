"""MXFP4 weights (GGML type 39, gpt-oss's experts): the backend's matmul over raw MXFP4 rows equals the product with
gguf-py's dequantization (decode row dots and prefill tiles, CPU and CUDA where usable), and a gpt-oss checkpoint
converted with its experts as MXFP4 computes transformers' logits with the expert weights rounded the same way
(gguf-py's MXFP4), at the f32 tolerance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from helpers.native import testing

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import kvcmas_convert as kconv  # noqa: E402
from helpers import arch_checks as arch  # noqa: E402
from helpers import gpt_oss as gpt  # noqa: E402  (the tiny gpt-oss checkpoint)

MXFP4 = gguf.GGMLQuantizationType.MXFP4
MATMUL_TOL = {"cpu": 2e-6, "cuda": 2e-3}  # as test_backend_ops: CUDA's prefill GEMM runs TF32


@pytest.fixture(scope="module")
def folder(gpt_oss_folder: Path) -> Path:
    return gpt_oss_folder


@pytest.fixture(params=["cpu", "cuda"], scope="module")
def ops(request):
    listing = kc.backends()
    if request.param not in listing or not listing[request.param][0]:
        pytest.skip(f"{request.param}: not compiled in or not usable here")
    return testing.BackendOps(request.param, 2)


def _random_blocks(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    """Raw MXFP4 rows: every code, exponents around 2^0 plus the subnormal scales 2^-128 and 2^-127."""
    blocks = rng.integers(0, 256, size=(n_out, n_in // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(120, 132, size=blocks.shape[:2])
    blocks[0, :2, 0] = [0, 1]
    return blocks.reshape(n_out, -1)


@pytest.mark.parametrize("n_tok", [1, 3, 8, 17, 40])
def test_matmul_equals_gguf_py_dequantization(ops, n_tok: int) -> None:
    rng = np.random.default_rng(n_tok)
    n_in, n_out = 512, 96
    raw = _random_blocks(rng, n_out, n_in)
    w = gguf.quants.dequantize(raw, MXFP4).reshape(n_out, n_in).astype(np.float64)
    assert np.unique(w).size > 16  # codes and scales both vary
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    got = ops.matmul(int(MXFP4), raw.ravel(), n_in, n_out, x)
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(got - ref) <= MATMUL_TOL[ops.name] * scale + 1e-30)


def test_gpt_oss_with_mxfp4_experts(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "mxfp4.gguf"
    kconv.convert(folder, out, outtype="f32", expert_type="mxfp4", vocab=False, progress=False)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == MXFP4 and types["blk.3.ffn_down_exps.weight"] == MXFP4
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.ffn_gate_exps.bias"] == gguf.GGMLQuantizationType.F32
    ids = arch.prompt_ids(1, arch.PROMPT)
    ref = gpt.rounded_reference(folder, ids, MXFP4, experts_only=True)
    model = kc.Model(out, n_threads=2, activations="f32")
    got = model.logits(ids)
    assert np.abs(got - ref).max() <= arch.LOGIT_TOL, float(np.abs(got - ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    with model.new_sequence() as seq:  # decode: each expert's rows through the row dot
        seq.append(ids[:40], logits="none")
        steps = np.stack([seq.append([t], logits="last") for t in ids[40:]])
    assert np.abs(steps - ref[40:]).max() <= arch.LOGIT_TOL
    assert np.abs(got - arch.reference(folder, ids)).max() > arch.LOGIT_TOL  # the rounding shows: not run at f32
    # the default (8-bit activation) setting runs MXFP4 at f32 activations: the same logits
    np.testing.assert_allclose(kc.Model(out, n_threads=2).logits(ids)[:, :8], got[:, :8], rtol=0, atol=0.05)


def test_expert_type_is_checked(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(kconv.ConvertError, match="--expert-type 'q2' is not one of mxfp4"):
        kconv.convert(folder, tmp_path / "x.gguf", expert_type="q2", progress=False)
    assert gpt.CONFIG["num_local_experts"] == 6


def test_llama_cpp_agrees_on_mxfp4_experts(tmp_path: Path) -> None:
    """The plain-RoPE gpt-oss checkpoint (llama.cpp's YaRN differs: test_arch_gptoss), experts at their usual scale,
    stored as MXFP4, in llama.cpp and in kvcmas. llama.cpp multiplies MXFP4 rows with activations rounded to 8 bits
    (its MXFP4 dot's vec_dot_type is Q8_0), kvcmas with f32 activations: they differ by that rounding (~0.4% of the
    logits' scale here); a misread block layout (nibble order, exponent bias) moves them by their whole scale."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e .[bench]): cannot compare with llama.cpp")
    import llama_cpp

    plain = gpt.converted(tmp_path, 1.0, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    out = tmp_path / "mxfp4.gguf"
    kconv.convert(plain, out, outtype="f32", expert_type="mxfp4", progress=False)
    ids = arch.prompt_ids(5, arch.PROMPT)
    llm = llama_cpp.Llama(str(out), n_ctx=256, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    llm.close()
    ours = kc.Model(out, n_threads=2, activations="f32").logits(ids)
    rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert rel < 1e-2, f"llama.cpp vs kvcmas relative error {rel}"


def _openai_release(folder: Path, out: Path) -> dict[str, np.ndarray]:
    """The tiny checkpoint as OpenAI publishes gpt-oss: each expert matrix as random MXFP4 *_blocks / *_scales
    (uint8), the rest as is. Returns the packed tensors."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(5)
    X, E, F = gpt.CONFIG["num_local_experts"], gpt.CONFIG["hidden_size"], gpt.CONFIG["intermediate_size"]
    packed = {}
    for il in range(gpt.CONFIG["num_hidden_layers"]):
        for proj, rows, n_in in (("gate_up_proj", 2 * F, E), ("down_proj", E, F)):
            name = f"model.layers.{il}.mlp.experts.{proj}"
            del tensors[name]
            packed[name + "_blocks"] = rng.integers(0, 256, (X, rows, n_in // 32, 16), dtype=np.uint8)
            packed[name + "_scales"] = rng.integers(121, 125, (X, rows, n_in // 32), dtype=np.uint8)
    out.mkdir()
    save_file({**tensors, **packed}, out / "model.safetensors")
    for f in folder.iterdir():
        if f.suffix != ".gguf" and f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    return packed


def test_openai_mxfp4_release_converts(folder: Path, tmp_path: Path) -> None:
    """A checkpoint with the experts in OpenAI's packed MXFP4: kvcmas' logits equal transformers' with the experts
    dequantized by transformers' own MXFP4 integration, and --expert-type mxfp4 keeps their values exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = _openai_release(folder, tmp_path / "release")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    dense = {}
    with torch.no_grad():
        for il, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{il}.mlp.experts.{proj}"
                w = convert_moe_packed_tensors(
                    torch.from_numpy(packed[name + "_blocks"]), torch.from_numpy(packed[name + "_scales"]),
                    dtype=torch.float32,
                )  # fmt: skip
                getattr(layer.mlp.experts, proj).copy_(w)
                dense[name] = w.numpy()
        ids = arch.prompt_ids(1, arch.PROMPT)
        ref = model(torch.tensor([ids])).logits[0].numpy()
    f32 = tmp_path / "f32.gguf"
    kconv.convert(tmp_path / "release", f32, outtype="f32", progress=False)
    got = kc.Model(f32, n_threads=2, activations="f32").logits(ids)
    assert np.abs(got - ref).max() <= arch.LOGIT_TOL, float(np.abs(got - ref).max())
    assert np.abs(got - arch.reference(folder, ids)).max() > 100 * arch.LOGIT_TOL  # the packed experts are used
    mx = tmp_path / "mxfp4.gguf"
    kconv.convert(tmp_path / "release", mx, outtype="f32", expert_type="mxfp4", vocab=False, progress=False)
    stored = {t.name: t for t in gguf.GGUFReader(mx).tensors}
    for il in range(gpt.CONFIG["num_hidden_layers"]):
        gate_up = dense[f"model.layers.{il}.mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [X, 2F, E]
        down = dense[f"model.layers.{il}.mlp.experts.down_proj"].transpose(0, 2, 1)  # [X, E, F]
        for name, want in (
            ("ffn_gate_exps", gate_up[:, 0::2]),
            ("ffn_up_exps", gate_up[:, 1::2]),
            ("ffn_down_exps", down),
        ):
            t = stored[f"blk.{il}.{name}.weight"]
            assert t.tensor_type == MXFP4
            np.testing.assert_array_equal(gguf.quants.dequantize(t.data, MXFP4).reshape(want.shape), want)
