"""A KV sequence of the engine (KVSequence) and stored rows other sequences read by reference (SharedKV)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .._native import core
from .checks import INT32_MAX, token_ids
from .image_rows import image_pos_of, is_bidirectional, mrope_offsets

if TYPE_CHECKING:
    from .model import Model

# Prompt tokens decoded per engine call: bounds scratch memory for long prompts.
PROMPT_CHUNK = 512


@dataclass(frozen=True)
class SharedKV:
    """KV rows of some sequence, stored once, that other sequences can append without copying (see
    KVSequence.share / append_shared). Holds the rows alive while it lives."""

    handle: Any  # _core.SharedSpan
    tokens: tuple[int, ...]
    # M-RoPE: (end, change) of each whole image in the rows: after row end - 1 a reader's rope_delta changes by it
    rope_marks: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    def slice(self, first: int, n: int) -> SharedKV:
        """Rows [first, first + n) of these rows: the same stored rows, no copy (ValueError outside them)."""
        if not (first >= 0 and n > 0 and first + n <= len(self)):
            raise ValueError(f"SharedKV.slice: rows [{first}, {first + n}) are outside the span's {len(self)} rows")
        if first == 0 and n == len(self):
            return self
        marks = tuple((end - first, d) for end, d in self.rope_marks if first < end <= first + n)
        return SharedKV(self.handle.slice(first, n), self.tokens[first : first + n], marks)


class KVSequence:
    """One sequence of KV rows in the engine (a KV slot). Positions are 0..len-1.

    Forks share their rows with the parent without copying; either may grow or be truncated afterwards without
    affecting the other. Close it (or use it as a context manager) to free its memory at once.
    """

    def __init__(self, model: Model, seq_id: int, tokens: list[int]) -> None:
        self._model = model
        self.id = seq_id
        self.tokens = tokens  # the ids whose KV the sequence holds or will hold (-1 for embedding inputs)
        self._reserved: list[tuple[int, int]] = []  # (position, id) of rows reserved and not yet computed, in order
        # M-RoPE models (qwen2vl): (end, change) of each image: a text row's rotary position is its position plus
        # the changes of the images that end before it (an image advances positions by max(rows, cols), not by its
        # rows x cols)
        self._rope_marks: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def rope_delta(self) -> int:
        """What the next text row's rotary position adds to its position (M-RoPE models; 0 without images)."""
        return sum(d for _, d in self._rope_marks)

    def _delta_at(self, pos: int) -> int:
        return sum(d for end, d in self._rope_marks if end <= pos)

    def _next_positions(self, filled: int, n: int) -> list[int]:
        """Positions of the next n computed rows, the first `filled` of them filling reserved rows."""
        return [p for p, _ in self._reserved[:filled]] + list(range(len(self.tokens), len(self.tokens) + n - filled))

    @property
    def reserved(self) -> int:
        """Rows reserved (reserve) and not yet computed."""
        return len(self._reserved)

    def reserve(self, ids: Sequence[int]) -> None:
        """Reserves rows for `ids` (-1: an input vector) at the sequence's end, computed later by the next appends,
        which fill reserved rows first, in order, and must pass the same ids (or vectors): shared rows may be
        appended in between, so a prompt whose computed rows lie between reused spans runs in one forward pass.
        Until computed, the rows cannot be forked, shared or read."""
        ids = token_ids(ids, "reserve")
        if not ids:
            raise ValueError("reserve: no tokens given")
        self._model._core.seq_reserve(self.id, len(ids))
        self._reserved += [(len(self.tokens) + i, t) for i, t in enumerate(ids)]
        self.tokens.extend(ids)

    def check_fill(self, ids: Sequence[int]) -> int:
        """How many of `ids`, about to be computed for this sequence, fill its reserved rows (the rest extend it);
        ValueError when they are not the ids the rows were reserved for."""
        k = min(len(ids), len(self._reserved))
        want = [t for _, t in self._reserved[:k]]
        if [int(t) for t in ids[:k]] != want:
            raise ValueError(
                f"append: positions {self._reserved[0][0]}.. of sequence {self.id} are reserved for ids {want[:8]}..., "
                f"got {[int(t) for t in ids[:8]]}..."
            )
        return k

    def record(self, ids: Sequence[int], filled: int) -> None:
        """After the engine computed `ids` for this sequence: the first `filled` (check_fill) filled reserved rows,
        the rest extended it."""
        del self._reserved[:filled]
        self.tokens.extend(int(t) for t in ids[filled:])

    def append(self, ids: Sequence[int], logits: Literal["last", "all", "none"] = "last") -> np.ndarray | None:
        """Appends tokens and returns their logits: the last row [n_vocab], all rows [len(ids), n_vocab], or None."""
        ids = token_ids(ids, "append")
        if not ids:
            raise ValueError("append: no tokens given")
        if logits not in ("last", "all", "none"):
            raise ValueError(f"append: logits must be 'last', 'all' or 'none', not {logits!r}")
        if len(self.tokens) + len(ids) > self._model.n_ctx:  # before any chunk is computed, not at the chunk past it
            raise core.KvcmasError(
                f"context overflow: {len(ids)} tokens after the sequence's {len(self.tokens)} exceed n_ctx = "
                f"{self._model.n_ctx}; nothing was computed"
            )
        rows: list[np.ndarray] = []
        for start in range(0, len(ids), PROMPT_CHUNK):
            chunk = ids[start : start + PROMPT_CHUNK]
            is_last_chunk = start + PROMPT_CHUNK >= len(ids)
            want = np.zeros(len(chunk), dtype=np.uint8)
            if logits == "all":
                want[:] = 1
            elif logits == "last" and is_last_chunk:
                want[-1] = 1
            filled = self.check_fill(chunk)
            if self._rope_marks:  # M-RoPE text after an image
                deltas = [self._delta_at(p) for p in self._next_positions(filled, len(chunk))]
                out = self._model._decode([self.id] * len(chunk), chunk, want, deltas)
            else:
                out = self._model._decode([self.id] * len(chunk), chunk, want)
            self.record(chunk, filled)
            if len(out):
                rows.append(out)
        if logits == "none":
            return None
        if logits == "last":
            return rows[-1][-1]
        return np.concatenate(rows, axis=0)

    def append_embeddings(
        self,
        embeddings: np.ndarray,
        logits: bool = False,
        bidirectional: bool | None = None,
        image_grid: tuple[int, int] | None = None,
        image_pos: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Appends input vectors [n, n_embd] (e.g. image features) in place of token embeddings. bidirectional: the
        rows attend to each other, not only to earlier ones (Gemma 3's image tokens: the model's mask within an
        image); default: whether they are BidirectionalRows. For an M-RoPE model the rows of an image take 2D
        positions (others run them in sequence, as any vectors): image_grid (rows, cols) says the vectors are a whole
        image, row-major; image_pos [n, 3] says per vector (k, rows, cols): row k of an image of rows x cols tokens
        (rows = 0: not an image row), so an image may come in several appends; default: an ImageFeatures' grid."""
        if bidirectional is None:
            bidirectional = is_bidirectional(embeddings)
        embd = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embd.ndim != 2 or embd.shape[1] != self._model.n_embd or embd.shape[0] == 0:
            raise ValueError(f"append_embeddings: expected shape [n, {self._model.n_embd}], got {embd.shape}")
        n = embd.shape[0]
        if image_grid is None and image_pos is None:
            image_pos = image_pos_of(embeddings)
        if image_grid is not None:
            rows, cols = (int(x) for x in image_grid)
            if rows <= 0 or cols <= 0 or rows * cols != n:
                raise ValueError(f"append_embeddings: an image grid of {rows} x {cols} does not hold {n} rows")
            image_pos = np.stack([np.arange(n), np.full(n, rows), np.full(n, cols)], axis=1)
        want = np.zeros(n, dtype=np.uint8)
        if logits:
            want[-1] = 1
        seqs = np.full(n, self.id, dtype=np.int32)
        filled = self.check_fill([-1] * n)
        offsets, marks = None, self._rope_marks
        if self._model.rope_sections and (image_pos is not None or marks):
            info = np.zeros((n, 3), dtype=np.int64) if image_pos is None else np.asarray(image_pos, dtype=np.int64)
            if info.shape != (n, 3):
                raise ValueError(f"append_embeddings: image_pos must be [{n}, 3] rows of (k, rows, cols)")
            offsets, marks = mrope_offsets(info, self._next_positions(filled, n), marks)
        span = np.array([0, n], dtype=np.int32) if bidirectional else None
        out = self._model._core.decode(
            seqs, np.full(n, -1, dtype=np.int32), want, embd, np.arange(n, dtype=np.int32), span, offsets
        )
        self.record([-1] * n, filled)
        self._rope_marks = marks
        return out[-1] if logits else None

    def share(self, pos: int, n: int) -> SharedKV:
        """The stored rows of positions [pos, pos + n), to append to other sequences (no copy)."""
        if not (pos >= 0 and n > 0 and pos + n <= len(self.tokens)):
            raise ValueError(f"share: positions [{pos}, {pos + n}) are outside the sequence (length {len(self)})")
        marks = tuple((end - pos, d) for end, d in self._rope_marks if pos < end <= pos + n)
        return SharedKV(self._model._core.seq_share(self.id, pos, n), tuple(self.tokens[pos : pos + n]), marks)

    def append_shared(self, shared: SharedKV, correction: Any = None, corr_row0: int = 0) -> None:
        """Appends shared rows at this sequence's end: attention re-positions their keys (RoPE) in the kernel and,
        given a _core.KvCorrection, adds its low-rank K/V deltas there too (its rows corr_row0.. for these rows, so
        the pieces of one span can read one correction)."""
        if abs(corr_row0) > INT32_MAX:  # the core checks the correction's rows, but only of offsets a C int holds
            raise core.KvcmasError(f"append_shared: corr_row0 {corr_row0} is outside the correction's rows")
        self._model._core.seq_append_shared(self.id, shared.handle, correction, corr_row0)
        for end, d in shared.rope_marks:  # images in the rows: the text after them goes on at their positions
            self._rope_marks.append((len(self.tokens) + end, d))
        self.tokens.extend(shared.tokens)

    def kv(self, pos: int = 0, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Materialized K and V [n_layer, n, n_head_kv * head_dim] of positions [pos, pos + n) as attention sees
        them (keys rotated at their positions, corrections added)."""
        n = len(self.tokens) - pos if n is None else n
        if not (pos >= 0 and n >= 0 and pos + n <= len(self.tokens)):
            raise core.KvcmasError(f"kv: positions [{pos}, {pos + n}) are outside the sequence (length {len(self)})")
        return self._model._core.seq_kv(self.id, pos, n)

    def fork(self) -> KVSequence:
        """A new sequence that reads this one's rows (no copy)."""
        child = KVSequence(self._model, self._model._core.seq_fork(self.id), list(self.tokens))
        child._rope_marks = list(self._rope_marks)
        return child

    def truncate(self, n: int) -> None:
        """Keeps the first n rows."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"truncate: n must be in [0, {len(self.tokens)}], got {n}")
        self._model._core.seq_truncate(self.id, n)
        del self.tokens[n:]
        self._reserved = [(p, t) for p, t in self._reserved if p < n]
        self._rope_marks = [(end, d) for end, d in self._rope_marks if end <= n]

    @property
    def adapter(self) -> tuple[int, float]:
        """(engine id of the LoRA adapter the sequence runs with, or -1; its scale): see kvcmas_cpp.adapters."""
        aid, scale = self._model._core.seq_adapter(self.id)
        return int(aid), float(scale)

    def set_adapter(self, adapter_id: int, scale: float = 1.0) -> None:
        """Runs the next tokens with the loaded adapter of engine id `adapter_id` (-1: the base model) at `scale`;
        forks inherit it. (Model.set_sequence_adapter takes the adapter's name.)"""
        self._model._core.seq_set_adapter(self.id, int(adapter_id), float(scale))

    @property
    def alive(self) -> bool:
        """Whether the engine still holds this sequence (not closed)."""
        return self.id >= 0 and bool(self._model._core.seq_exists(self.id))

    def close(self) -> None:
        if self.id >= 0 and self._model._core.seq_exists(self.id):
            self._model._core.seq_remove(self.id)
        self.id = -1

    def __enter__(self) -> KVSequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # the model may be gone at interpreter exit
            self.close()
