"""Gemma 3 multimodal against transformers: pixels, image features, and first-token logprobs with images.

A random-weight Gemma3ForConditionalGeneration made here with transformers at small widths but the real structure
(SigLIP with 14-px patches, 4 x 4 average pooling to mm_tokens_per_image soft tokens, the RMSNorm + projection
projector, a gemma3 text model with a sliding and a global layer), saved with its processor settings, converted by
``kvcmas mmproj`` (both halves), then run by kvcmas and by transformers at f32. The sliding window (8) is shorter
than an image's span (16 soft tokens), so the bidirectional mask within an image meets the window.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
PIL_Image = pytest.importorskip("PIL.Image")
skimage_data = pytest.importorskip("skimage.data")

import kvcmas_cpp  # noqa: E402
from kvcmas_convert.vision import convert_llava_text  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402
from test_vision import _randomize  # noqa: E402  (weights far from transformers' near-zero init)

PHOTOS = Path(skimage_data.__file__).parent
S, P, TOKENS = 224, 14, 16  # 16 x 16 patches pooled 4 x 4 -> 4 x 4 soft tokens
VOCAB, BOI, EOI, IMAGE_TOKEN = 320, 300, 301, 302
WINDOW = 8


def _images() -> dict[str, Any]:
    chelsea = PIL_Image.open(PHOTOS / "chelsea.png").convert("RGB")  # 451 x 300
    rng = np.random.default_rng(3)
    return {
        "landscape": chelsea,
        "portrait": chelsea.transpose(PIL_Image.Transpose.ROTATE_90),
        "astronaut": PIL_Image.open(PHOTOS / "astronaut.png").convert("RGB"),  # 512 x 512
        "tiny": PIL_Image.fromarray(rng.integers(0, 256, (7, 10, 3), dtype=np.uint8)),
    }


IMAGES = _images()


def _image_processor() -> Any:
    return transformers.Gemma3ImageProcessorPil(
        size={"height": S, "width": S}, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2
    )


def _make(root: Path) -> tuple[Path, Any]:
    tcfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=8192,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    vcfg = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=S, patch_size=P,
        vision_use_head=False,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=tcfg, vision_config=vcfg, mm_tokens_per_image=TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
        image_token_index=IMAGE_TOKEN,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(6)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _randomize(model, 7)
    folder = root / "gemma3"
    model.save_pretrained(folder)
    ip = _image_processor()
    processor = {"image_processor": ip.to_dict(), "image_seq_length": TOKENS, "processor_class": "Gemma3Processor"}
    (folder / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return folder, model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{folder, model, enc, lm}: the checkpoint, its mmproj written by the `kvcmas mmproj` command, its text GGUF."""
    root = tmp_path_factory.mktemp("gemma3")
    folder, model = _make(root)
    mmproj, text = root / "gemma3-mmproj.gguf", root / "gemma3-text.gguf"
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "mmproj", str(folder), "-o", str(mmproj), "--outtype", "f32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{TOKENS} image tokens" in done.stderr
    convert_llava_text(folder, text, outtype="f32", vocab=False, progress=False)
    enc = VisionEncoder(mmproj, n_threads=2)
    lm = kvcmas_cpp.Model(text, n_threads=2)
    return {"folder": folder, "model": model, "enc": enc, "lm": lm}


def test_mmproj_holds_the_gemma3_projector(gemma3: dict[str, Any]) -> None:
    """llama.cpp's clip names: projector type "gemma3", the pooling factor, mm.soft_emb_norm stored as 1 + w."""
    from gguf import GGUFReader

    enc: VisionEncoder = gemma3["enc"]
    assert enc.n_tokens == TOKENS and enc.n_embd == 64 and enc._core.projector_type == "gemma3"
    assert enc._core.pool_kernel == 4 and enc.config.resample == "bilinear"
    reader = GGUFReader(enc.path)
    assert reader.fields["clip.projector_type"].contents() == "gemma3"
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 4
    tensors = {t.name: t for t in reader.tensors}
    proj = gemma3["model"].model.multi_modal_projector
    norm = np.asarray(tensors["mm.soft_emb_norm.weight"].data)
    assert np.array_equal(norm, proj.mm_soft_emb_norm.weight.detach().numpy() + 1)
    weight = np.asarray(tensors["mm.input_projection.weight"].data).reshape(32, 64)
    assert np.array_equal(weight, proj.mm_input_projection_weight.detach().numpy())


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixels_equal_the_processor(gemma3: dict[str, Any], name: str) -> None:
    """The tower input equals Gemma3ImageProcessor's pixel_values bit for bit (bilinear resize to 224 x 224)."""
    ref = _image_processor()(images=[IMAGES[name]], return_tensors="np")["pixel_values"][0]
    ours = gemma3["enc"].preprocess(IMAGES[name])
    assert ours.shape == ref.shape == (3, S, S) and ours.dtype == np.float32
    assert np.array_equal(ours, ref), f"{name}: max |d| {np.abs(ours - ref).max()}"


def _hf_features(model: Any, names: list[str]) -> np.ndarray:
    pixels = _image_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels)
    return np.asarray(getattr(out, "pooler_output", out))


def test_features_equal_transformers(gemma3: dict[str, Any]) -> None:
    """Tower, post-LayerNorm, 4 x 4 average pooling, RMSNorm and projection equal get_image_features' at f32."""
    names = list(IMAGES)
    refs = _hf_features(gemma3["model"], names)
    for name, ref in zip(names, refs, strict=True):
        got = gemma3["enc"].encode(IMAGES[name])
        assert got.shape == ref.shape == (TOKENS, 64), name
        err = float(np.abs(got - ref).max())
        assert err <= 1e-4 * float(np.abs(ref).max()) + 1e-6, f"{name}: max |d| {err}"


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _prompt(texts: list[list[int]], n_images: int) -> list[int]:
    ids = list(texts[0])
    for i in range(n_images):
        ids += [BOI] + [IMAGE_TOKEN] * TOKENS + [EOI] + texts[i + 1]
    return ids


def _kvcmas_logprobs(
    gemma3: dict[str, Any], texts: list[list[int]], names: list[str], bidirectional: bool = True
) -> Any:  # noqa: E501
    enc: VisionEncoder = gemma3["enc"]
    with gemma3["lm"].new_sequence() as seq:
        seq.append(texts[0] + [BOI], logits="none")
        last = None
        for i, name in enumerate(names):
            seq.append_embeddings(enc.encode(IMAGES[name]), bidirectional=bidirectional)
            last = seq.append([EOI] + texts[i + 1] + ([BOI] if i + 1 < len(names) else []), logits="last")
        return _log_softmax(np.asarray(last))


TEXTS = [[2, 11, 42, 7, 13, 21, 34, 55, 89, 5], [99, 3], [250, 17, 8, 1]]  # 10 tokens before the first image


@pytest.mark.parametrize("names", [["landscape"], ["astronaut"], ["portrait", "tiny"]], ids=lambda n: "+".join(n))
def test_first_token_logprobs_equal_transformers(gemma3: dict[str, Any], names: list[str]) -> None:
    """The text model fed the image rows (unscaled, where token embeddings are scaled by sqrt(n_embd)) with the
    bidirectional mask within each image (and the sliding window ending at each token's own position) gives the
    first-token log-probabilities of Gemma3ForConditionalGeneration with pixel_values and token_type_ids."""
    texts = TEXTS[: len(names) + 1]
    ids = _prompt(texts, len(names))
    pixels = _image_processor()(images=[IMAGES[n] for n in names], return_tensors="pt")["pixel_values"]
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == IMAGE_TOKEN).long()
    with torch.no_grad():
        ref_logits = gemma3["model"](input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids).logits
    ref = torch.log_softmax(ref_logits[0, -1].double(), -1).numpy()
    got = _kvcmas_logprobs(gemma3, texts, names)
    assert int(got.argmax()) == int(ref.argmax())
    assert float(np.abs(got - ref).max()) <= 2e-3
    # the mask matters here: image rows attending only causally answer measurably differently
    causal = _kvcmas_logprobs(gemma3, texts, names, bidirectional=False)
    assert float(np.abs(causal - ref).max()) > 1e-2
