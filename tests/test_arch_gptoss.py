"""gpt-oss on a tiny random ``GptOssForCausalLM`` made here with transformers, its special parts switched on: GQA,
6 experts with 2 chosen, router / expert / q/k/v/o biases, attention sinks, sliding-window layers (window 8, shorter
than the prompt) alternating with full ones, YaRN without truncation, experts large enough that the SwiGLU clamps.
Converted with kvcmas convert:

* logits equal transformers' at f32 (argmax identical, max |d| <= 1e-3) in one prefill and token by token, and the
  sinks and the clamp matter (the reference without them differs);
* a span read at a shift, uncorrected, equals a fresh prefill at that position in layer 0 and the source's rows
  rotated by the layer's RoPE in every layer (1e-4); a span read by reference equals a dense prefill;
* a 4-agent kvcmas workflow runs (first agent identical to nonshared, later agents reuse, recompute 1 = nonshared);
* llama.cpp (llama-cpp-python, where it knows gpt-oss) agrees on the same file;
* the converter refuses what the engine would read differently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import kvcmas_convert as kconv  # noqa: E402
import kvcmas_cpp as kc  # noqa: E402
from helpers import arch_checks as arch  # noqa: E402  (the shared tokenizer, ids, reference and per-architecture checks)
from helpers.arch_checks import WINDOW  # noqa: E402
from helpers.gpt_oss import CONFIG, converted, rounded_reference  # noqa: E402
from kvcmas_convert import constants as C  # noqa: E402


@pytest.fixture(scope="module")
def folder(gpt_oss_folder: Path) -> Path:
    return gpt_oss_folder


@pytest.fixture(scope="module")
def case(folder: Path) -> tuple[str, Path]:
    return "gpt-oss", folder


def test_logits_match_transformers(case: tuple[str, Path]) -> None:
    _, folder = case
    meta = kconv.read_metadata(folder / "model.gguf")
    assert meta[C.KEY_ARCHITECTURE] == C.ARCH_GPT_OSS
    assert meta["gpt-oss.expert_count"] == 6 and meta["gpt-oss.expert_used_count"] == 2
    assert meta["gpt-oss.rope.scaling.type"] == "yarn"
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    assert model.layer_window == [WINDOW, 0, WINDOW, 0]
    ids = arch.prompt_ids(1, arch.PROMPT)
    ref = arch.reference(folder, ids)
    got = model.logits(ids)
    assert np.abs(got - ref).max() <= arch.LOGIT_TOL, float(np.abs(got - ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    with model.new_sequence() as seq:
        seq.append(ids[:40], logits="none")
        steps = np.stack([seq.append([t], logits="last") for t in ids[40:]])
    assert np.abs(steps - ref[40:]).max() <= arch.LOGIT_TOL


@pytest.mark.parametrize("outtype", ["q8_0", pytest.param("f16", marks=pytest.mark.slow)])
def test_weight_types(folder: Path, tmp_path: Path, outtype: str) -> None:
    """Stored as q8_0 / f16 (experts included), the file computes transformers' logits with the same rounding at
    the f32 tolerance, and the rounding shows."""
    import gguf

    out = tmp_path / f"{outtype}.gguf"
    kconv.convert(folder, out, outtype=outtype, vocab=False, progress=False)
    ids = arch.prompt_ids(1, arch.PROMPT)
    ref = rounded_reference(folder, ids, gguf.GGMLQuantizationType[outtype.upper()])
    got = kc.Model(out, n_threads=2, activations="f32").logits(ids)
    assert np.abs(got - ref).max() <= arch.LOGIT_TOL, float(np.abs(got - ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(got - arch.reference(folder, ids)).max() > arch.LOGIT_TOL


def test_ridge_corrections_core_equal_numpy(case: tuple[str, Path]) -> None:
    arch.check_ridge_corrections_core_equal_numpy(*case)


def _reference_changed(folder: Path, ids: list[int], change: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            if change == "no sinks":
                layer.self_attn.sinks.fill_(-1e9)
            else:  # no clamp
                layer.mlp.experts.limit = float("inf")
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("change", ["no sinks", "no clamp"])
def test_the_checks_have_teeth(case: tuple[str, Path], change: str) -> None:
    """The sinks and the SwiGLU clamp change the logits by far more than the tolerance, so matching transformers
    proves they are applied."""
    _, folder = case
    ids = arch.prompt_ids(1, arch.PROMPT)
    assert np.abs(_reference_changed(folder, ids, change) - arch.reference(folder, ids)).max() > 100 * arch.LOGIT_TOL


def test_shifted_span_is_exact(case: tuple[str, Path]) -> None:
    arch.check_shifted_span_is_exact(*case)


def test_span_by_reference_equals_dense_prefill(case: tuple[str, Path]) -> None:
    arch.check_span_by_reference_equals_dense_prefill(*case)


def test_four_agent_workflow(case: tuple[str, Path]) -> None:
    arch.check_four_agent_workflow(*case)


def test_llama_cpp_agrees(tmp_path: Path) -> None:
    """On the checkpoint with plain RoPE. With YaRN llama.cpp rounds the ramp's ends to whole dims (transformers'
    truncate=True) where gpt-oss does not (truncate=False, which transformers and kvcmas apply): on this tiny head
    size that moves llama.cpp's logits by up to 0.4 of their scale, so its YaRN is not compared here."""
    plain = converted(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    np.testing.assert_allclose(
        kc.Model(plain / "model.gguf", n_threads=2, activations="f32").logits(arch.prompt_ids(1, arch.PROMPT)),
        arch.reference(plain, arch.prompt_ids(1, arch.PROMPT)), rtol=0, atol=arch.LOGIT_TOL,
    )  # fmt: skip
    arch.check_llama_cpp_agrees("gpt-oss", plain)


def _config_with(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    out = tmp_path / "changed"
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.gguf":
            (out / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"swiglu_limit": 10.0}, "swiglu_limit 10.0 differs"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "not the alternating pattern"),
        ({"rope_parameters": dict(CONFIG["rope_parameters"], truncate=True)}, "truncate=True is not supported"),
    ],
)
def test_converter_refuses_what_the_engine_reads_differently(
    folder: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(kconv.ConvertError, match=message):
        kconv.convert(_config_with(folder, tmp_path, **changes), tmp_path / "x.gguf", outtype="f32", progress=False)


def test_a_file_without_the_window_pattern_alternates(folder: Path, tmp_path: Path) -> None:
    """llama.cpp's gpt-oss files carry the window only (its loader alternates the layers): the same file with the
    pattern key renamed away reads as even layers sliding, with the same logits."""
    data = (folder / "model.gguf").read_bytes()
    key = b"gpt-oss.attention.sliding_window_pattern"
    assert data.count(key) == 1
    path = tmp_path / "no-pattern.gguf"
    path.write_bytes(data.replace(key, key[:-1] + b"X"))  # same length: the file stays valid
    assert "gpt-oss.attention.sliding_window_pattern" not in kconv.read_metadata(path)
    plain = kc.Model(path, n_threads=2, activations="f32")
    assert plain.layer_window == [WINDOW, 0, WINDOW, 0]
    ids = arch.prompt_ids(1, arch.PROMPT)
    np.testing.assert_array_equal(
        plain.logits(ids), kc.Model(folder / "model.gguf", n_threads=2, activations="f32").logits(ids)
    )
