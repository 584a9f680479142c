"""Image preprocessing of CLIP and SigLIP towers, following Hugging Face's image processors step by step.

CLIP (``CLIPImageProcessor``): resize so the shortest edge is ``resize_size`` (the long edge scaled and truncated
to an integer), bicubic; centre crop ``image_size`` squared; rescale by 1/255; normalise by mean / std.
SigLIP (``SiglipImageProcessor``): resize to ``image_size`` squared, bicubic; rescale; normalise.
Gemma 3 (``Gemma3ImageProcessor``): SigLIP's steps with a bilinear resize (``resample``).
Resizing is Pillow's bicubic filter on the 8-bit image, as the processors' PIL backend does, so the results agree
to float rounding; it is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image

from .image import to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


@dataclass(frozen=True)
class PreprocessConfig:
    """How to turn an RGB image into the tower's input [3, image_size, image_size]."""

    image_size: int
    resize_mode: Literal["shortest_edge", "square"]
    resize_size: int  # shortest edge before the crop ("shortest_edge"); image_size for "square"
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1.0 / 255.0
    resample: Literal["bicubic", "bilinear"] = "bicubic"  # the resize filter

    def __post_init__(self) -> None:
        if self.image_size <= 0 or self.resize_size < self.image_size:
            raise ValueError(f"PreprocessConfig: need 0 < image_size <= resize_size, got {self}")
        if self.resize_mode not in ("shortest_edge", "square"):
            raise ValueError(f"PreprocessConfig: resize_mode must be 'shortest_edge' or 'square': {self.resize_mode!r}")
        if self.resample not in RESAMPLE:
            raise ValueError(f"PreprocessConfig: resample must be one of {sorted(RESAMPLE)}: {self.resample!r}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("PreprocessConfig: image_mean and image_std need 3 values (std > 0)")

    @classmethod
    def clip(cls, image_size: int = 224, resize_size: int | None = None) -> PreprocessConfig:
        """OpenAI CLIP's defaults (LLaVA-1.5: 336)."""
        return cls(image_size, "shortest_edge", resize_size or image_size, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    @classmethod
    def siglip(cls, image_size: int = 384) -> PreprocessConfig:
        """SigLIP's defaults (mean = std = 0.5)."""
        return cls(image_size, "square", image_size, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))

    @classmethod
    def from_encoder(cls, core_encoder: Any) -> PreprocessConfig:
        """The settings an mmproj file records (a ``_core.VisionEncoder``)."""
        mean, std = tuple(core_encoder.image_mean), tuple(core_encoder.image_std)
        return cls(
            int(core_encoder.image_size), core_encoder.resize_mode, int(core_encoder.resize_size),
            (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]), _exact(float(core_encoder.rescale_factor)),
            core_encoder.resample,
        )  # fmt: skip


def _exact(rescale: float) -> float:
    """1/255 as Python's float when the file's float32 holds it (processors multiply by the float64 value)."""
    return 1.0 / 255.0 if abs(rescale - 1.0 / 255.0) < 1e-9 else rescale


def resize_shortest_edge_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) after scaling the shorter side to ``size``; the longer side is truncated, as transformers
    does."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def preprocess(image: Image.Image, config: PreprocessConfig) -> np.ndarray:
    """An RGB (or convertible) PIL image -> float32 pixel values [3, image_size, image_size], channel-major."""
    rgb = to_rgb(image)
    s = config.image_size
    if config.resize_mode == "square":
        rgb = square(rgb, s, config.resample)
    else:
        w, h = resize_shortest_edge_size(rgb.width, rgb.height, config.resize_size)
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), resample=RESAMPLE[config.resample])
        top, left = (h - s) // 2, (w - s) // 2
        rgb = rgb.crop((left, top, left + s, top + s))
    return normalize(rgb, config)


def normalize(rgb: Image.Image, config: PreprocessConfig) -> np.ndarray:
    """8-bit RGB -> [3, H, W] float32: rescaled in float64 and rounded, then normalised in float32 (the order and
    precision of transformers' rescale and normalize, so the values are the same bits)."""
    pixels = (np.asarray(rgb, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def square(rgb: Image.Image, side: int, resample: str = "bicubic") -> Image.Image:
    """The image squashed to side x side (8-bit, with the named filter)."""
    return rgb if rgb.size == (side, side) else rgb.resize((side, side), resample=RESAMPLE[resample])
