"""Qwen2.5-VL against transformers: M-RoPE in the text model, the windowed ViT with its 2x2 merger, dynamic
resolution, and the first generated token with an image.

A random-weight Qwen2_5_VLForConditionalGeneration made here with transformers at small widths (real patch size,
temporal patch, merge size and window), converted by ``kvcmas convert`` (the text half, ``qwen2vl``) and ``kvcmas
mmproj`` (the tower), then run by kvcmas and by transformers at f32.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import kvcmas_cpp  # noqa: E402
from test_vision import _randomize  # noqa: E402  (weights far from transformers' near-zero init)

VOCAB = 400
IMAGE_TOKEN, VISION_START, VISION_END = 397, 395, 396
SECTIONS = [2, 3, 3]  # M-RoPE pairs of the temporal, height and width positions (head_dim 16)


def _config() -> Any:
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "mrope_section": SECTIONS, "rope_theta": 10000.0})  # fmt: skip
    vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=[1, 3], window_size=112, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)  # fmt: skip
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                         video_token_id=398, vision_start_token_id=VISION_START,
                                         vision_end_token_id=VISION_END)  # fmt: skip


def _run(*args: str) -> None:
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{folder, model, lm}: the checkpoint, the transformers model, and the text GGUF written by `kvcmas convert`."""
    root = tmp_path_factory.mktemp("qwen25vl")
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(_config()).eval()
    _randomize(model, 11)
    folder = root / "qwen25vl"
    model.save_pretrained(folder)
    text = root / "text.gguf"
    _run("convert", str(folder), "-o", str(text), "--outtype", "f32", "--no-vocab")
    return {"folder": folder, "model": model, "lm": kvcmas_cpp.Model(text, n_threads=2)}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_text_only_logits_equal_transformers(qwen: dict[str, Any]) -> None:
    """A sequence of text only (t = h = w) gives transformers' logits at every position."""
    lm = qwen["lm"]
    assert lm.arch == "qwen2vl" and list(lm._core.rope_sections) == [*SECTIONS, 0]
    ids = np.random.default_rng(1).integers(0, 390, 37).tolist()
    with torch.no_grad():
        ref = qwen["model"](input_ids=torch.tensor([ids])).logits[0].numpy()
    ours = lm.logits(ids)
    assert ours.shape == ref.shape
    assert np.abs(_log_softmax(ours) - _log_softmax(ref)).max() <= 2e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
