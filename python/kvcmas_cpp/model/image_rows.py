"""Prompt rows that are images: rows that attend to each other (Gemma 3), an image's rows with their token grid, and
the M-RoPE positions (Qwen2.5-VL) such rows take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class BidirectionalRows(np.ndarray):
    """Input vectors [n, n_embd] whose rows attend to each other, not only to earlier ones: Gemma 3's image tokens
    (its mask is opened within an image). A view type (``rows.view(BidirectionalRows)``), so the marking travels with
    the array through prompt segments and plans; such rows are appended in one piece (KVSequence.append_embeddings)."""


def is_bidirectional(rows: object) -> bool:
    """Whether prompt rows must be computed as one bidirectional span (never split into chunks)."""
    return isinstance(rows, BidirectionalRows)


class ImageFeatures(np.ndarray):
    """An image's rows [rows * cols, n_embd] (a vision encoder's output) that know their token grid, so every path
    that appends them (KVSequence.append_embeddings, plans, the server's segments, an agent session's vectors) gives
    an M-RoPE model their 2D positions. A slice or copy is plain rows again."""

    grid: tuple[int, int] | None

    @classmethod
    def of(cls, rows: np.ndarray, grid: tuple[int, int]) -> ImageFeatures:
        if grid[0] * grid[1] != len(rows):
            raise ValueError(f"an image grid of {grid[0]} x {grid[1]} does not hold {len(rows)} rows")
        out = rows.view(cls)
        out.grid = (int(grid[0]), int(grid[1]))
        return out

    def __array_finalize__(self, obj: Any) -> None:
        grid = getattr(obj, "grid", None)
        self.grid = grid if grid is not None and self.ndim == 2 and len(self) == grid[0] * grid[1] else None


def image_pos_of(rows: Any) -> np.ndarray | None:
    """[n, 3] (k, rows, cols) of ImageFeatures with a grid (append_embeddings' image_pos), else None."""
    grid = getattr(rows, "grid", None)
    if grid is None:
        return None
    n = grid[0] * grid[1]
    return np.stack([np.arange(n), np.full(n, grid[0]), np.full(n, grid[1])], axis=1)


def mrope_offsets(
    image_pos: np.ndarray, positions: Sequence[int], marks: list[tuple[int, int]]
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """M-RoPE of rows at sequence `positions` (get_rope_index's positions, as offsets from the sequence positions):
    image_pos [n, 3] per row (k, rows, cols), row k of an image of rows x cols tokens (rows = 0: a text row); marks:
    (end, change) of the images before, each adding its change to the positions from `end` on. A text row sits at
    its position plus the changes before it; image row k at base + (0, k // cols, k % cols), base the position its
    first row would have as text; an image's change is max(rows, cols) - rows x cols. Returns (offsets [n, 3]
    int32, marks with the images these rows end)."""
    marks = list(marks)
    offsets = np.zeros((len(positions), 3), dtype=np.int32)
    for i, pos in enumerate(positions):
        k, rows, cols = (int(x) for x in image_pos[i])
        if rows <= 0:
            offsets[i] = sum(d for end, d in marks if end <= pos)
            continue
        if cols <= 0 or not 0 <= k < rows * cols:
            raise ValueError(f"M-RoPE: image row {k} is outside a {rows} x {cols} image")
        d = sum(d for end, d in marks if end <= pos - k)  # as of the image's first row
        offsets[i] = (d - k, d + k // cols - k, d + k % cols - k)
        if k == rows * cols - 1:  # the image's last row: the text after it goes on from its positions
            marks.append((pos + 1, max(rows, cols) - rows * cols))
    return offsets, marks
