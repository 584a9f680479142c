"""The towers of `kvcmas bench vision-towers` at real width (Gemma 3's SigLIP at 896 px: 4,096 rows of full
attention; Qwen2.5-VL's ViT: windowed and full-attention blocks) give the same bits at 1 and 2 threads: the packed
GEMM's units and the attention's blocks may land on any thread."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from PIL import Image  # noqa: E402

from kvcmas_convert.vision import convert_mmproj  # noqa: E402
from kvcmas_cpp.bench import vision_towers as vt  # noqa: E402
from kvcmas_cpp.vision import VisionEncoder  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layers"), [("gemma3", 1), ("qwen2.5vl", 2)])
def test_tower_features_same_bits_at_one_and_two_threads(tmp_path: Path, family: str, layers: int) -> None:
    torch.manual_seed(0)
    model, _, processor = vt.BUILDERS[family](layers)
    vt.fill_zero_matrices(model)
    folder = tmp_path / family
    model.save_pretrained(folder)
    (folder / vt.PROCESSOR_FILES[family]).write_text(json.dumps(processor))
    mmproj = tmp_path / "mmproj.gguf"
    convert_mmproj(folder, mmproj, outtype="f16")
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8))
    out = []
    for n_threads in (1, 2):
        enc = VisionEncoder(mmproj, n_threads=n_threads)
        pixels = enc.preprocess(image)
        out.append(enc.encode_pixels(*pixels) if isinstance(pixels, tuple) else enc.encode_pixels(pixels))
    assert out[0].shape[0] == (256 if family == "gemma3" else 999)
    assert np.abs(out[0]).max() > 0
    np.testing.assert_array_equal(out[0], out[1])
