"""AnyRes: how LLaVA-NeXT and LLaVA-OneVision turn one image of any size into tower inputs and feature rows.

Following transformers' ``LlavaOnevisionImageProcessor`` / ``LlavaNextImageProcessor`` (PIL backend) and the models'
``pack_image_features`` step by step:

- **tiles**: the grid pinpoint (height, width) that keeps the most of the image's pixels and wastes the least is
  chosen; the image is resized (bicubic, 8-bit) to fit it with its aspect ratio (the fitting side exact, the other
  rounded up), centred on black padding, and cut into S x S tiles, row by row.
- **base view**: the whole image squashed to S x S, always the first tower input.
- **features**: the tiles' G x G feature grids are laid out as one (rows x G) x (cols x G) grid, the padding rows or
  columns are cut off again (unpad), the grid is shrunk bilinearly when it holds more than 1.1² x N tiles' worth of
  features (OneVision's ``anyres_max_N``), an ``image_newline`` row ends every feature row, and the base view's
  G² rows come first.
- **single view** (OneVision's rule for an image among several in one prompt, and ``detail: "low"``): the image
  padded to a square with the mean colour, squashed to S x S, its G² feature rows and one ``image_newline`` row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

ANYRES, SINGLE = "anyres", "single"  # the two views of an image (see the module docstring)
VIEWS = (ANYRES, SINGLE)


@dataclass(frozen=True)
class AnyResConfig:
    """The AnyRes settings an mmproj file records.

    Args:
        grid_pinpoints: candidate resolutions as (height, width), each a multiple of the tile size.
        tile: S, the tower's input side.
        grid: G, feature rows and columns per tile (S // patch size).
        max_tiles: N of OneVision's ``anyres_max_N`` (pool the unpadded grid above 1.1² x N tiles); None: never.
        pad_color: the 8-bit colour of the single view's square padding (the processor's mean x 255, truncated).
    """

    grid_pinpoints: tuple[tuple[int, int], ...]
    tile: int
    grid: int
    max_tiles: int | None = None
    pad_color: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        if not self.grid_pinpoints:
            raise ValueError("AnyResConfig: grid_pinpoints is empty")
        bad = [p for p in self.grid_pinpoints if p[0] <= 0 or p[1] <= 0 or p[0] % self.tile or p[1] % self.tile]
        if bad:
            raise ValueError(f"AnyResConfig: grid pinpoints {bad} are not positive multiples of the tile {self.tile}")
        if self.max_tiles is not None and self.max_tiles <= 0:
            raise ValueError(f"AnyResConfig: max_tiles must be positive, got {self.max_tiles}")


def parse_vision_aspect_ratio(value: str) -> int:
    """N of ``anyres_max_N`` (ValueError for anything else)."""
    prefix = "anyres_max_"
    if not value.startswith(prefix) or not value[len(prefix) :].isdigit() or int(value[len(prefix) :]) <= 0:
        raise ValueError(f"vision_aspect_ratio {value!r} is not of the form 'anyres_max_N' (N > 0)")
    return int(value[len(prefix) :])


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The pinpoint (height, width) that keeps the most of the image's pixels, then wastes the fewest; the first
    such in list order."""
    best, best_kept, best_waste = pinpoints[0], -1, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (h, w), kept, waste
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized into target with its aspect ratio: the fitting side exact, the other
    rounded up (and at most the target's)."""
    th, tw = target
    if tw / width < th / height:
        return min(math.ceil(height * (tw / width)), th), tw
    return th, min(math.ceil(width * (th / height)), tw)


def tiles(rgb: Image.Image, config: AnyResConfig) -> list[Image.Image]:
    """The S x S tiles of the image at its best pinpoint, row by row (without the base view)."""
    target = best_resolution(rgb.height, rgb.width, config.grid_pinpoints)
    h, w = fitted_size(rgb.height, rgb.width, target)
    resized = rgb if (w, h) == rgb.size else rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (target[1], target[0]), (0, 0, 0))
    canvas.paste(resized, ((target[1] - w) // 2, (target[0] - h) // 2))
    s = config.tile
    return [canvas.crop((x, y, x + s, y + s)) for y in range(0, target[0], s) for x in range(0, target[1], s)]


def pad_to_square(rgb: Image.Image, color: tuple[int, int, int]) -> Image.Image:
    """The image centred on a square of its longer side, filled with color."""
    if rgb.width == rgb.height:
        return rgb
    side = max(rgb.size)
    canvas = Image.new("RGB", (side, side), color)
    canvas.paste(rgb, ((side - rgb.width) // 2, (side - rgb.height) // 2))
    return canvas


def _unpadded(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) cuts of a rows x cols feature grid that hold the padding of an image of
    height x width fitted into it."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        cut = (rows - new_rows) // 2
        return cut, cut, 0, 0
    new_cols = int(round(width * (rows / height), 7))
    cut = (cols - new_cols) // 2
    return 0, 0, cut, cut


def _pooled(rows: int, cols: int, config: AnyResConfig) -> tuple[int, int] | None:
    """The grid's size after anyres_max_N pooling, or None when it is not pooled."""
    if config.max_tiles is None:
        return None
    ratio = math.sqrt(rows * cols / (config.max_tiles * config.grid**2))
    if ratio <= 1.1:
        return None
    return int(rows // ratio), int(cols // ratio)


def feature_grid(height: int, width: int, config: AnyResConfig) -> tuple[int, int]:
    """(rows, columns) of the AnyRes feature grid of an image of height x width, after unpad and pooling (each row
    then gets one newline row)."""
    th, tw = best_resolution(height, width, config.grid_pinpoints)
    rows, cols = th // config.tile * config.grid, tw // config.tile * config.grid
    top, bottom, left, right = _unpadded(height, width, rows, cols)
    rows, cols = rows - top - bottom, cols - left - right
    return _pooled(rows, cols, config) or (rows, cols)


def n_rows(height: int, width: int, config: AnyResConfig, view: str) -> int:
    """Feature rows (image tokens) of an image of height x width in a view."""
    base = config.grid**2
    if view == SINGLE:
        return base + 1
    rows, cols = feature_grid(height, width, config)
    return base + rows * (cols + 1)


def bilinear(x: np.ndarray, out_rows: int, out_cols: int) -> np.ndarray:
    """[rows, cols, D] resampled to [out_rows, out_cols, D] as torch's interpolate(mode="bilinear",
    align_corners=False) does with an output size (source = (dst + 0.5) x in/out - 0.5, clamped at 0)."""

    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale = np.float32(n_in / n_out)
        src = np.maximum((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5), 0)
        i0 = src.astype(np.int64)
        i1 = np.minimum(i0 + 1, n_in - 1)
        frac = (src - i0).astype(np.float32)
        return i0, i1, frac

    r0, r1, fr = axis(x.shape[0], out_rows)
    c0, c1, fc = axis(x.shape[1], out_cols)
    fr, fc = fr[:, None, None], fc[None, :, None]
    top = x[r0][:, c0] * (1 - fc) + x[r0][:, c1] * fc
    bottom = x[r1][:, c0] * (1 - fc) + x[r1][:, c1] * fc
    return np.ascontiguousarray((top * (1 - fr) + bottom * fr).astype(np.float32))


def pack(
    base: np.ndarray, tile_features: np.ndarray, height: int, width: int, config: AnyResConfig, newline: np.ndarray
) -> np.ndarray:
    """The AnyRes feature rows: base [G², D], tile_features [n_tiles, G², D] of an image of height x width ->
    [n_rows(height, width, config, ANYRES), D]."""
    g = config.grid
    th, tw = best_resolution(height, width, config.grid_pinpoints)
    n_r, n_c = th // config.tile, tw // config.tile
    d = base.shape[1]
    if tile_features.shape != (n_r * n_c, g * g, d):
        raise ValueError(f"pack: expected tile features {(n_r * n_c, g * g, d)}, got {tile_features.shape}")
    grid = tile_features.reshape(n_r, n_c, g, g, d).transpose(0, 2, 1, 3, 4).reshape(n_r * g, n_c * g, d)
    top, bottom, left, right = _unpadded(height, width, n_r * g, n_c * g)
    grid = grid[top : n_r * g - bottom, left : n_c * g - right]
    pooled = _pooled(grid.shape[0], grid.shape[1], config)
    if pooled is not None:
        grid = bilinear(grid, *pooled)
    rows = np.concatenate([grid, np.broadcast_to(newline.astype(np.float32), (grid.shape[0], 1, d))], axis=1)
    return np.ascontiguousarray(np.concatenate([base, rows.reshape(-1, d)]), dtype=np.float32)
