"""Random weights for the vision towers the tests build with transformers, and the images they encode."""

from __future__ import annotations

from typing import Any


def randomize_weights(model: Any, seed: int) -> None:
    """Weights far from transformers' near-zero init, so every part of the network moves the output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def sample_images() -> dict[str, Any]:
    """scikit-image's photos and synthetic images of the sizes and shapes vision tests need: landscape 451 x 300,
    portrait 300 x 451, 512 x 512, 600 x 400, tiny 10 x 7, tall 90 x 700."""
    from pathlib import Path

    import numpy as np
    import skimage.data
    from PIL import Image

    photos = Path(skimage.data.__file__).parent
    chelsea = Image.open(photos / "chelsea.png").convert("RGB")
    rng = np.random.default_rng(3)
    return {
        "landscape": chelsea,
        "portrait": chelsea.transpose(Image.Transpose.ROTATE_90),
        "astronaut": Image.open(photos / "astronaut.png").convert("RGB"),
        "coffee": Image.open(photos / "coffee.png").convert("RGB"),
        "tiny": Image.fromarray(rng.integers(0, 256, (7, 10, 3), dtype=np.uint8)),
        "tall": Image.fromarray(rng.integers(0, 256, (700, 90, 3), dtype=np.uint8)),
    }
