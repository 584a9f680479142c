"""Fuzz target: image decoding (``kvcmas_cpp.vision.load_image``) on arbitrary bytes, then preprocessing.

Contract: any input either decodes to an 8-bit RGB image within the limits (then CLIP and SigLIP preprocessing give
finite float32 [3, S, S] arrays) or raises ImageError (a ValueError) naming the problem. Anything else (another
exception type, a crash, a hang, unbounded memory) is a finding. Limits are small here (1 MiB, 4 Mpixel) so the
decompression-bomb path is exercised too.

    python fuzz/fuzz_image.py -max_total_time=45 fuzz/corpus/image
"""

from __future__ import annotations

import sys

import _harness
import atheris

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["kvcmas_cpp.vision"]):
    import numpy as np

    from kvcmas_cpp.vision.image import ImageError, load_image
    from kvcmas_cpp.vision.preprocess import PreprocessConfig, preprocess

MAX_PIXELS = 4 << 20
MAX_BYTES = 1 << 20
CONFIGS = (PreprocessConfig.clip(image_size=28), PreprocessConfig.siglip(image_size=28))


def test_one_input(data: bytes) -> None:
    try:
        image = load_image(data, max_pixels=MAX_PIXELS, max_bytes=MAX_BYTES)
    except ImageError:
        return
    assert image.mode == "RGB" and image.width * image.height <= MAX_PIXELS, (image.mode, image.size)
    for cfg in CONFIGS:
        pixels = preprocess(image, cfg)
        assert pixels.dtype == np.float32 and pixels.shape == (3, 28, 28), pixels.shape
        assert np.isfinite(pixels).all()


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
