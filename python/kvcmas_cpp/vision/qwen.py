"""Qwen2.5-VL images: dynamic resolution, the tower's patches, and the M-RoPE positions of an image span.

Preprocessing follows ``Qwen2VLImageProcessor`` (its PIL backend) step by step: ``smart_resize`` picks the size
nearest the image's whose sides are multiples of patch x merge (28) within [min_pixels, max_pixels]; Pillow's
bicubic filter resizes the 8-bit image; rescale and normalise (OpenAI CLIP's mean / std); the patches are laid out
merge block by merge block, each patch channel-major with its two (identical) time steps. The tower gives one row
per 2x2 merge block, row-major: ``(grid_h / 2) x (grid_w / 2)`` image tokens.

M-RoPE (``get_rope_index``): a text token's temporal, height and width positions are equal; an image's tokens sit
at ``base + (0, row, col)``, base the position the first of them would have as text; the text after the image goes
on from ``base + max(rows, cols)``. The engine takes them as offsets from each token's sequence position
(``_core.Model.decode(rope_offsets=...)``), so a sequence carries one number, ``rope_delta``: what its next text
position adds to its length (``KVSequence.append_embeddings(image_grid=...)``, ``model.image_rope_offsets``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from .._native import core
from ..model import ImageFeatures
from .encoder import ENCODER_CLASSES, QWEN25VL_PROJECTOR, VisionEncoder
from .image import ImageSource
from .preprocess import PreprocessConfig, normalize, to_rgb

MAX_ASPECT_RATIO = 200  # the processor refuses images longer than this many times their width (or the reverse)


@dataclass(frozen=True)
class QwenImageConfig:
    """Dynamic-resolution settings of a Qwen2.5-VL tower (recorded in its mmproj file)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1.0 / 255.0

    @property
    def factor(self) -> int:
        """Pixels a side of one image token (a merge block)."""
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, config: QwenImageConfig) -> tuple[int, int]:
    """(height, width) the processor resizes an image to: each side rounded to a multiple of ``factor``, then the
    whole scaled down (sides floored) above max_pixels or up (sides ceiled) below min_pixels, keeping the aspect."""
    f = config.factor
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width} x {height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h, w = round(height / f) * f, round(width / f) * f  # Python's round (half to even), as the processor
    if h * w > config.max_pixels:
        scale = math.sqrt(height * width / config.max_pixels)
        h, w = max(f, math.floor(height / scale / f) * f), max(f, math.floor(width / scale / f) * f)
    elif h * w < config.min_pixels:
        scale = math.sqrt(config.min_pixels / (height * width))
        h, w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
    return h, w


def grid(width: int, height: int, config: QwenImageConfig) -> tuple[int, int]:
    """(grid_h, grid_w): patches a side of an image of width x height after smart_resize."""
    h, w = smart_resize(height, width, config)
    return h // config.patch_size, w // config.patch_size


def n_image_tokens(width: int, height: int, config: QwenImageConfig) -> int:
    gh, gw = grid(width, height, config)
    return gh * gw // config.merge_size**2


def preprocess(image: Image.Image, config: QwenImageConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """An RGB (or convertible) image -> (patches [grid_h * grid_w, 3 * T * P * P] float32, (grid_h, grid_w)), the
    processor's pixel_values and image_grid_thw[1:]."""
    rgb = to_rgb(image)
    h, w = smart_resize(rgb.height, rgb.width, config)
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    norm = PreprocessConfig(1, "square", 1, config.image_mean, config.image_std, config.rescale_factor)
    pixels = normalize(rgb, norm)  # [3, h, w]
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = h // p, w // p
    # [3, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, 3, p, p]: merge blocks row-major, their patches row-major
    blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # a still image, t times
    return np.ascontiguousarray(frames.reshape(gh * gw, 3 * t * p * p), dtype=np.float32), (gh, gw)


class QwenVisionEncoder(VisionEncoder):
    """Qwen2.5-VL's tower and merger from an mmproj GGUF (``VisionEncoder(path)`` opens one as this class): one view
    per image, at its own resolution; the same feature cache and image limits as ``VisionEncoder``."""

    image_tokens = ("<|vision_start|>", "<|vision_end|>")  # Qwen2.5-VL's template: its <|image_pad|> run between

    window_size = property(lambda self: int(self._core.window_size), doc="side in pixels of a windowed block's window")
    full_attention = property(
        lambda self: list(self._core.full_attention), doc="per tower block: full attention (True) or windowed"
    )

    def _open(self, n_threads: int, backend: str) -> None:
        self._core: Any = core.QwenVisionEncoder(self.path, n_threads, backend)
        c = self._core
        mean, std = tuple(float(x) for x in c.image_mean), tuple(float(x) for x in c.image_std)
        self.qwen = QwenImageConfig(
            int(c.patch_size), int(c.merge_size), int(c.temporal_patch_size), int(c.min_pixels), int(c.max_pixels),
            (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]),
        )  # fmt: skip
        self.anyres, self.image_newline, self.multi_image_single = None, None, False

    n_tokens = property(lambda self: self.qwen.max_pixels // self.qwen.factor**2, doc="most rows of one image")
    image_size = property(lambda self: None, doc="no fixed size: each image at its own resolution")
    has_projector = property(lambda self: True, doc="the merger projects to the text model")
    model_type = property(lambda self: "qwen2.5vl", doc="the tower family")
    projector_type = property(lambda self: "qwen2.5vl_merger", doc="the 2x2 patch merger")

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of image tokens for an image of width x height."""
        gh, gw = grid(width, height, self.qwen)
        return gh // self.qwen.merge_size, gw // self.qwen.merge_size

    def n_image_tokens(self, width: int, height: int, view: str | None = None) -> int:
        self._check_view(view)
        rows, cols = self.grid(width, height)
        return rows * cols

    def preprocess(  # type: ignore[override]
        self, image: ImageSource, view: str | None = None
    ) -> tuple[np.ndarray, tuple[int, int]]:
        """(patches [grid_h * grid_w, 3 * 2 * P * P], (grid_h, grid_w)): the processor's pixel_values and grid."""
        self._check_view(view)
        return preprocess(self.load(image), self.qwen)

    def encode_pixels(self, patches: np.ndarray, grid_hw: tuple[int, int]) -> np.ndarray:  # type: ignore[override]
        """The tower on preprocessed patches -> [grid_h * grid_w / 4, n_embd] (no cache)."""
        patches = np.ascontiguousarray(patches, dtype=np.float32)
        return self._core.encode(patches, int(grid_hw[0]), int(grid_hw[1]))

    def _features(self, rgb: Image.Image, view: str | None) -> np.ndarray:
        patches, (gh, gw) = preprocess(rgb, self.qwen)
        m = self.qwen.merge_size
        return ImageFeatures.of(self.encode_pixels(patches, (gh, gw)), (gh // m, gw // m))

    def __repr__(self) -> str:
        return f"QwenVisionEncoder({self.path!r}, {self.qwen.min_pixels}..{self.qwen.max_pixels} pixels)"


ENCODER_CLASSES[QWEN25VL_PROJECTOR] = QwenVisionEncoder
