"""Every architecture of cpp/engine/arch on a tiny random checkpoint made here with transformers, its special parts
switched on (GQA everywhere; YaRN; Gemma 3 with a window shorter than the prompt, mixed layer types, its own RoPE
bases and linear scaling on global layers; Phi-3 LongRoPE with partial rotary and a prompt past the short context;
SmolLM3 no-RoPE layers; Qwen3 MoE with 6 experts, 2 chosen), converted with kvcmas convert:

* logits equal transformers' at f32 over a prompt longer than the window (argmax identical, max |d| <= 1e-3), in
  one prefill and token by token;
* a span read at a shift, uncorrected, is exact under the architecture's RoPE: layer 0 (context-free) equals a fresh
  prefill at the reader's positions and every layer equals the source's rows with keys rotated by that layer's RoPE,
  to 1e-4;
* a 4-agent workflow: the first agent is identical to nonshared, later agents reuse the shared spans, and the
  recompute dial at 1 gives nonshared's logits; the kvcmas method's corrections (core vs numpy path) agree;
* llama.cpp (where installed) agrees on the same file;
* an architecture the engine lacks is refused naming itself and the supported list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import kvcmas_convert as kconv  # noqa: E402
import kvcmas_cpp as kc  # noqa: E402
from helpers import arch_checks as checks  # noqa: E402
from helpers.arch_checks import COMMON, LOGIT_TOL, N_VOCAB, PROMPT, WINDOW, prompt_ids, reference  # noqa: E402
from kvcmas_convert import constants as C  # noqa: E402


def _yarn(orig: int) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig, "rope_theta": 10000.0}


# name -> (config class, model class, config overrides, GGUF architecture)
CASES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, C.ARCH_QWEN3),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "rope_parameters": _yarn(32)}, C.ARCH_QWEN3),
    "qwen3moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {
            "head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        C.ARCH_QWEN3_MOE,
    ),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": _yarn(32)}, C.ARCH_LLAMA),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, C.ARCH_OLMO2),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, C.ARCH_SMOLLM3),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {
            "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
        C.ARCH_GEMMA3,
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0], "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
            },
        },
        C.ARCH_PHI3,
    ),
}  # fmt: skip


def _make(folder: Path, case: str) -> Path:
    config_name, model_name, extra, _ = CASES[case]
    torch.manual_seed(7)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random norms, so a wrong mapping shows
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok = checks.tokenizer()
    assert len(tok) == N_VOCAB
    tok.save_pretrained(folder)
    kconv.convert(folder, folder / "model.gguf", outtype="f32", progress=False)
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, _make(tmp_path_factory.mktemp(request.param), request.param)


def test_logits_match_transformers(case: tuple[str, Path]) -> None:
    name, folder = case
    meta = kconv.read_metadata(folder / "model.gguf")
    arch = CASES[name][3]
    assert meta[C.KEY_ARCHITECTURE] == arch
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    ids = prompt_ids(1, PROMPT)
    ref = reference(folder, ids)
    got = model.logits(ids)
    assert np.abs(got - ref).max() <= LOGIT_TOL, (name, float(np.abs(got - ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all(), name
    with model.new_sequence() as seq:
        seq.append(ids[:40], logits="none")
        steps = np.stack([seq.append([t], logits="last") for t in ids[40:]])
    assert np.abs(steps - ref[40:]).max() <= LOGIT_TOL, name
    if name == "gemma3":
        assert model.layer_window == [WINDOW, 0, WINDOW, WINDOW]
        assert meta["gemma3.rope.freq_base_swa"] == 10000.0
    if name == "phi3":  # the prompt runs past the short context: the long factors are what matched
        assert meta["phi3.rope.dimension_count"] == 12 and meta["phi3.rope.scaling.original_context_length"] == 32
    if name.endswith("yarn"):
        assert meta[f"{arch}.rope.scaling.type"] == "yarn"


def _rounded_reference(folder: Path, ids: list[int], outtype: str) -> np.ndarray:
    """transformers' logits with every weight matrix rounded as the converter stores it (per row, so the GGUF's
    row permutations and expert stacking round the same values): the engine must then match at f32 tolerance."""
    import gguf

    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                continue  # vectors (norms, biases) stay f32 in the file; experts may be held as one 3-D tensor
            w = p.numpy().reshape(-1, p.shape[-1])
            t = qtype if outtype != "q8_0" or w.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F16
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(p.shape)))
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize(
    "outtype", ["q8_0", pytest.param("f16", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)]
)
def test_weight_types(case: tuple[str, Path], outtype: str, tmp_path: Path) -> None:
    """The checkpoint stored as f16, bf16 and q8_0 (experts included) computes what transformers computes with the
    same rounded weights, at the f32 tolerance; and the rounding is visible (the test is not run at f32)."""
    name, folder = case
    out = tmp_path / f"{outtype}.gguf"
    kconv.convert(folder, out, outtype=outtype, vocab=False, progress=False)
    ids = prompt_ids(1, PROMPT)
    ref = _rounded_reference(folder, ids, outtype)
    got = kc.Model(out, n_threads=2, activations="f32").logits(ids)
    assert np.abs(got - ref).max() <= LOGIT_TOL, (name, outtype, float(np.abs(got - ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all(), (name, outtype)
    assert np.abs(got - reference(folder, ids)).max() > LOGIT_TOL, (name, outtype)


def test_shifted_span_is_exact_under_the_architectures_rope(case: tuple[str, Path]) -> None:
    checks.check_shifted_span_is_exact(*case)


def test_span_by_reference_equals_dense_prefill(case: tuple[str, Path]) -> None:
    checks.check_span_by_reference_equals_dense_prefill(*case)


def test_four_agent_workflow(case: tuple[str, Path]) -> None:
    checks.check_four_agent_workflow(*case)


def test_llama_cpp_agrees(case: tuple[str, Path]) -> None:
    checks.check_llama_cpp_agrees(*case)


def test_ridge_corrections_core_equal_numpy(case: tuple[str, Path]) -> None:
    checks.check_ridge_corrections_core_equal_numpy(*case)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "models" / "generated" / "tiny-llama-f32.gguf"
    if not src.exists():
        pytest.skip("tiny models not generated")
    path = tmp_path / "mamba.gguf"
    path.write_bytes(src.read_bytes())
    # same length, so the file stays valid: "llama" -> "mamba" in general.architecture (keys stay llama.*)
    data = path.read_bytes()
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    assert data[at : at + 5] == b"llama"
    path.write_bytes(data[:at] + b"mamba" + data[at + 5 :])
    with pytest.raises(Exception, match=r"unsupported architecture 'mamba' \(kvcmas runs llama, qwen2, qwen3"):
        kc.Model(path, n_threads=1)
    assert kc.supported_architectures() == list(C.ENGINE_ARCHITECTURES)


def test_bench_counts_chosen_experts_per_token_and_every_expert_per_pass(case: tuple[str, Path]) -> None:
    """`kvcmas bench core`'s weight bytes (its GB/s and its twin ratios): a decode token of the MoE reads the chosen
    experts' share of the stacked expert matrices, a prefill pass up to all of them; a dense file reads the same in
    both. Reference: the tensor sizes as gguf-py reads the file."""
    from gguf import GGUFReader

    from kvcmas_cpp.bench.core import weight_bytes_per_token

    name, folder = case
    path = folder / "model.gguf"
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:  # an untied file reads one row of the token embedding per token
        del tensors["token_embd.weight"]
    experts = sum(n for t, n in tensors.items() if "_exps." in t)
    dense = sum(tensors.values()) - experts
    used, total = (CASES[name][2].get(k) for k in ("num_experts_per_tok", "num_experts"))
    per_token = dense + (experts * used // total if experts else 0)
    assert weight_bytes_per_token(str(path)) == per_token
    assert weight_bytes_per_token(str(path), all_experts=True) == dense + experts
    assert (experts > 0) == (name == "qwen3moe")
