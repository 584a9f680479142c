"""The Python face of the engine: a loaded model, its KV sequences, and text generation."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from . import adapters as lora
from ._native import core
from .model_chat import chat_completion, render_chat_prompt
from .model_files import default_model_path, resolve_model_path
from .sampling import SamplingParams, TokenLogprob, chat_logprobs, max_tokens_count, stop_strings
from .token_stream import Completion, CompletionChunk, TokenStream
from .tokenizer import Tokenizer, TokenizerError

# Completion and CompletionChunk live in token_stream, the path helpers in model_files: importable from here too
__all__ = [
    "Completion",
    "CompletionChunk",
    "KVSequence",
    "Model",
    "SharedKV",
    "default_model_path",
    "resolve_model_path",
    "token_ids",
    "usable_cpus",
]

# Prompt tokens decoded per engine call: bounds scratch memory for long prompts.
PROMPT_CHUNK = 512

# The core takes its int arguments as C ints (int32) or size_t: a larger Python int fails in the binding with a
# TypeError that names no argument, so they are checked here first.
INT32_MAX = 2**31 - 1
SIZE_MAX = 2**64 - 1

# Threads past the cores wait on each other: on 2 cores, 32 threads decode 1.7x slower than 2, 128 threads 30x,
# and 1000 threads looked hung. More than this many per usable CPU is refused.
MAX_THREADS_PER_CPU = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _check_count(name: str, value: object, most: int) -> None:
    """KvcmasError unless `value` is an int in [1, most], naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise core.KvcmasError(f"{name} must be a positive integer, got {value!r}")
    if value > most:
        raise core.KvcmasError(f"{name} {value} is too large")


def token_ids(ids: Any, where: str) -> list[int]:
    """`ids` as a list of ints, or a ValueError naming `where`: bytes (a Sequence[int], but text read in binary mode)
    and elements that are not integers (2.7 is not token 2) are refused. Ranges are checked where the ids are used."""
    if isinstance(ids, str | bytes | bytearray | memoryview):
        kind = "text" if isinstance(ids, str) else "bytes"
        raise ValueError(f"{where}: token ids are a list of ints, got {kind} (decode bytes, tokenize text)")
    try:
        out = list(ids)
    except TypeError:
        raise ValueError(f"{where}: token ids are a list of ints, got {type(ids).__name__}") from None
    odd = next((t for t in out if isinstance(t, bool) or not isinstance(t, int | np.integer)), None)
    if odd is not None:
        raise ValueError(f"{where}: token ids must be integers, got {odd!r} ({type(odd).__name__})")
    huge = next((t for t in out if abs(int(t)) > INT32_MAX), None)
    if huge is not None:  # the core checks the vocabulary's range, but only of ids a C int holds
        raise ValueError(f"{where}: token id {huge} is out of range")
    return [int(t) for t in out]


class BidirectionalRows(np.ndarray):
    """Input vectors [n, n_embd] whose rows attend to each other, not only to earlier ones: Gemma 3's image tokens
    (its mask is opened within an image). A view type (``rows.view(BidirectionalRows)``), so the marking travels with
    the array through prompt segments and plans; such rows are appended in one piece (KVSequence.append_embeddings)."""


def is_bidirectional(rows: object) -> bool:
    """Whether prompt rows must be computed as one bidirectional span (never split into chunks)."""
    return isinstance(rows, BidirectionalRows)


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


class Model:
    """A GGUF model loaded in the kvcmas engine.

    Args:
        path: the GGUF file (architectures llama and qwen2), or the name of a model the store installs
            (`kvcmas models list`, e.g. "qwen2.5-coder-0.5b": its file, checked by size and sha256); default: the
            default model (SmolLM2-135M-Instruct, `default_model_path()`).
        n_threads: compute threads (default: all cores; at most MAX_THREADS_PER_CPU per usable CPU).
        n_ctx: most tokens one sequence may hold (default: the training context, at most 8192).
        kv_budget: bytes all KV blocks may take (default: four full sequences).
        kv_type: how K and V rows are stored: "f32" (default, exact) or "f16" (half the memory and bandwidth,
            like llama.cpp's default; attention still computes in f32).
        activations: what the decode steps' matrix products over quantized weights (every quantized type)
            multiply with: "q8" (default) quantizes the activations per 32 elements in two 8-bit passes for
            integer dot products, like llama.cpp (fast; logits within a stated bound of the exact ones, 100% top-1
            agreement on real text, docs/quant-kernels.md);
            "f32" keeps them exact (the logits transformers computes, to f32 rounding). F16/BF16/F32 weights,
            prefill and the CUDA backend always use f32 activations.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        n_threads: int | None = None,
        n_ctx: int | None = None,
        kv_budget: int | None = None,
        kv_type: Literal["f32", "f16"] = "f32",
        device: str = "cpu",
        activations: Literal["q8", "f32"] = "q8",
    ) -> None:
        """device: "cpu", or "cuda" / "cuda:N" on a build with the CUDA backend (see `kvcmas_cpp.backends()`)."""
        self.path = default_model_path() if path is None else os.fspath(path)
        if isinstance(self.path, str) and not os.path.exists(self.path):
            from . import model_store

            if self.path in model_store.MODELS:  # a name, as `--model` takes it
                self.path = model_store.resolve(self.path)
        for name, value, most in (
            ("n_threads", n_threads, INT32_MAX),
            ("n_ctx", n_ctx, INT32_MAX),
            ("kv_budget", kv_budget, SIZE_MAX),
        ):
            if value is not None:
                _check_count(name, value, most)
        cpus = usable_cpus()
        if n_threads is not None and n_threads > MAX_THREADS_PER_CPU * cpus:
            raise core.KvcmasError(
                f"n_threads {n_threads} is more than {MAX_THREADS_PER_CPU} per CPU this process may use "
                f"({cpus} CPUs: at most {MAX_THREADS_PER_CPU * cpus}); threads past the cores wait on each other "
                "and slow generation down by orders of magnitude"
            )
        if kv_type not in ("f32", "f16"):
            raise ValueError(f"kv_type must be 'f32' or 'f16', got {kv_type!r}")
        core_args: tuple[Any, ...] = (self.path, n_threads or 0, n_ctx or 0, kv_budget or 0)
        if kv_type != "f32":  # only then: cores built before the option still load models the default way
            core_args += (kv_type,)
        if device != "cpu":  # likewise: cores built before the backend seam have no device argument
            core_args = (*core_args[:4], kv_type, device)
        if activations not in ("q8", "f32"):
            raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
        if activations != "q8":  # likewise: cores built before the option run q8's place with f32
            core_args = (*core_args[:4], kv_type, device, activations)
        self._core = core.Model(*core_args)
        if kv_budget is not None and kv_budget < self.kv_block_bytes:  # no request could ever be served
            raise ValueError(
                f"kv_budget {kv_budget} bytes holds no KV block of this model ({self.kv_block_bytes} bytes, "
                f"{self.kv_block_rows} tokens); one full sequence of {self.n_ctx} tokens takes "
                f"{self.n_ctx * self.kv_row_bytes} bytes"
            )
        self._metadata: dict[str, Any] | None = None
        self._tokenizer: Tokenizer | None = None
        # per-model state other modules keep as long as the model lives (kvcmas_cpp.prefix_cache: its cache)
        self.extensions: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------------- properties
    arch = property(lambda self: self._core.arch, doc="architecture name from the file ('llama', 'qwen2')")
    device = property(lambda self: getattr(self._core, "device", "cpu"), doc="backend it runs on: 'cpu' or 'cuda'")
    activations = property(
        lambda self: getattr(self._core, "activations", "f32"), doc="'q8' or 'f32' (see the constructor)"
    )
    n_vocab = property(lambda self: self._core.n_vocab, doc="vocabulary size")
    n_ctx_train = property(lambda self: self._core.n_ctx_train, doc="context length the model was trained for")
    n_ctx = property(lambda self: self._core.n_ctx, doc="most tokens one sequence may hold")
    n_layer = property(lambda self: self._core.n_layer, doc="transformer blocks")
    n_embd = property(lambda self: self._core.n_embd, doc="hidden size")
    rope_sections = property(
        lambda self: list(self._core.rope_sections), doc="M-RoPE pairs per t / h / w position (empty: one position)"
    )
    n_head = property(lambda self: self._core.n_head, doc="query heads")
    n_head_kv = property(lambda self: self._core.n_head_kv, doc="key/value heads")
    n_threads = property(lambda self: self._core.n_threads, doc="compute threads")
    layer_window = property(
        lambda self: list(self._core.layer_window),
        doc="per layer: how many of the last positions a query attends to (sliding window); 0: all of them",
    )

    @property
    def kv_block_rows(self) -> int:
        """Rows (tokens) per KV block: sequences and stored spans take KV memory in whole blocks (the core's)."""
        return int(self._core.kv_block_rows)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: kv_block_rows rows of K and V, every layer, in the cache's row type (the core's)."""
        return int(self._core.kv_block_bytes)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes one token's K and V rows take in the cache, every layer, in the cache's row type (kv_type)."""
        return self.kv_block_bytes // self.kv_block_rows

    @property
    def kv_budget(self) -> int:
        """Bytes all KV blocks may take (the constructor's kv_budget, or the core's default)."""
        return int(getattr(self._core, "kv_budget", 0) or 0)

    @property
    def n_sequences(self) -> int:
        """KV sequences alive in the engine (stored spans' and forks' included)."""
        return int(self._core.n_seqs)

    @property
    def kv_bytes_in_use(self) -> int:
        """Bytes of the KV blocks that sequences and stored spans hold."""
        return int(self._core.kv_bytes_in_use)

    @property
    def kv_bytes_allocated(self) -> int:
        """Bytes of KV block memory the engine holds: in use plus freed blocks kept for reuse (see kv_trim)."""
        return int(self._core.kv_bytes_allocated)

    def kv_trim(self) -> int:
        """Returns the memory of free KV blocks to the system (a server calls it when idle); returns the bytes
        released. Later sequences map blocks again as they need them."""
        return int(self._core.kv_trim())

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The GGUF metadata (read once, on first use)."""
        if self._metadata is None:
            self._metadata = core.GgufFile(self.path).metadata()
        return self._metadata

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = Tokenizer.from_gguf_metadata(self.metadata)
            except TokenizerError as e:  # the file's vocabulary is at fault: say which file
                raise TokenizerError(f"{os.path.basename(self.path)}: {e}") from None
        return self._tokenizer

    def __repr__(self) -> str:
        return f"Model({self.path!r}, arch={self.arch}, n_layer={self.n_layer}, n_embd={self.n_embd})"

    # ------------------------------------------------------------------------------------------------- text
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of text; add_special adds BOS when the model wants it. Special tokens in text are parsed."""
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Renders messages with the model's chat template (sandboxed; ChatML when the file has none), as
        transformers' apply_chat_template renders it. Tool calls and a tool list attached by
        kvcmas_cpp.tools.render_tool_messages go to the template as kvcmas_cpp.tools.model_messages says (natively
        where the template renders them). template_kwargs: extra template variables (OpenAI clients'
        `chat_template_kwargs`, e.g. {"enable_thinking": False} for Qwen3); a message list may carry them on a
        message under kvcmas_cpp.chat.TEMPLATE_KWARGS_KEY (how a sharing session's prompt gets them)."""
        return render_chat_prompt(self, messages, add_generation_prompt, template_kwargs)

    # ---------------------------------------------------------------------------------------------- compute
    def _decode(
        self, seqs: Sequence[int], tokens: Sequence[int], want: np.ndarray, rope_deltas: Sequence[int] | None = None
    ) -> np.ndarray:
        offsets = None
        if rope_deltas is not None and self.rope_sections and any(rope_deltas):  # M-RoPE text after an image
            offsets = np.repeat(np.asarray(rope_deltas, dtype=np.int32)[:, None], 3, axis=1)
        return self._core.decode(
            np.asarray(seqs, dtype=np.int32),
            np.asarray(tokens, dtype=np.int32),
            np.asarray(want, dtype=np.uint8),
            rope_offsets=offsets,
        )

    def new_sequence(self) -> KVSequence:
        """An empty KV sequence."""
        return KVSequence(self, self._core.seq_new(), [])

    def decode_batch(self, steps: Sequence[tuple[KVSequence, Sequence[int]]]) -> list[np.ndarray]:
        """Appends tokens to several sequences in one forward pass; returns each sequence's last logits."""
        rows = self.decode_steps(steps, [True] * len(steps))
        return [r for r in rows if r is not None]

    def decode_steps(
        self, steps: Sequence[tuple[KVSequence, Sequence[int]]], want_last: Sequence[bool]
    ) -> list[np.ndarray | None]:
        """Appends tokens to several sequences in one forward pass (a prompt chunk beside other sequences' next
        tokens); returns each sequence's last logits where want_last says so, else None. Nothing is appended when
        the engine refuses the pass (KvcmasError)."""
        seqs: list[int] = []
        toks: list[int] = []
        want: list[int] = []
        steps = [(seq, token_ids(ids, "decode_batch")) for seq, ids in steps]
        for (seq, ids), last in zip(steps, want_last, strict=True):
            if not ids:
                raise ValueError("decode_batch: every sequence needs at least one token")
            seqs.extend([seq.id] * len(ids))
            toks.extend(ids)
            want.extend([0] * (len(ids) - 1) + [int(bool(last))])
        filled = [seq.check_fill(ids) for seq, ids in steps]
        if any(seq._rope_marks for seq, _ in steps):  # M-RoPE text after an image
            deltas = [seq._delta_at(p) for (seq, ids), k in zip(steps, filled, strict=True)
                      for p in seq._next_positions(k, len(ids))]  # fmt: skip
            out = self._decode(seqs, toks, np.asarray(want, dtype=np.uint8), deltas)
        else:
            out = self._decode(seqs, toks, np.asarray(want, dtype=np.uint8))
        for (seq, ids), k in zip(steps, filled, strict=True):
            seq.record(ids, k)
        rows = iter(out)  # the wanted rows, in order
        return [next(rows) if last else None for last in want_last]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), n_vocab] (float32) at every position of a fresh sequence holding ids."""
        with self.new_sequence() as seq:
            out = seq.append(ids, logits="all")
        assert out is not None
        return out

    # ------------------------------------------------------------------------------------------- generation
    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        sequence: KVSequence | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
        adapter: str | None = None,
        adapter_scale: float = 1.0,
    ) -> Completion | Iterator[CompletionChunk]:
        """Generates a continuation of prompt (text, or token ids).

        temperature 0 is greedy decoding. Stops at an end-of-generation token, a stop string (not included in the
        text), max_tokens or the sequence's end (n_ctx; finish_reason 'length'). stream=True returns an iterator of
        CompletionChunk. `sequence`: continue an existing KV sequence (its rows are reused; prompt is appended to it)
        instead of a fresh one. presence_penalty,
        frequency_penalty, logit_bias: OpenAI's (see SamplingParams). logprobs: None, or report each token's
        logprob and this many alternatives. constraint: a kvcmas_cpp.constrained.Constraint the output follows
        (it ends when the grammar is complete). adapter: the name of a loaded LoRA adapter (load_adapter) to
        generate with, at adapter_scale.
        """
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special=sequence is None or len(sequence) == 0)
        else:
            ids = token_ids(prompt, "generate")
        max_tokens_count(max_tokens, 0)
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=dict(logit_bias) if logit_bias else None,
        )
        stops = stop_strings(stop)

        def run(seq: KVSequence | None) -> Iterator[CompletionChunk]:
            return self._generate(ids, max_tokens, params, stops, seq, None, constraint, logprobs)

        chunks = run(sequence) if adapter is None else lora.run_with(self, adapter, adapter_scale, sequence, run)
        if stream:
            return chunks
        return collect_completion(chunks, self.tokenizer, logprobs is not None)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        response_format: Mapping[str, Any] | None = None,
        top_logprobs: int | None = None,
        **kwargs: Any,
    ) -> Completion | Iterator[CompletionChunk]:
        """generate() on the chat-template rendering of messages (with the assistant generation prompt).

        The OpenAI chat options, as the server implements them (one implementation): tools / tool_choice /
        parallel_tool_calls (OpenAI tool objects; the calls come back in Completion.tool_calls, finish_reason
        "tool_calls"; "required" and a named function are enforced by constrained decoding), response_format
        ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}), logprobs=True and
        top_logprobs (Completion.logprobs: OpenAI's chat logprobs entries), chat_template_kwargs (template
        variables, e.g. {"enable_thinking": False}). Messages may carry tool_calls and tool messages. Calls are read
        in the model family's format (kvcmas_cpp.tools.tool_format_of), and a thinking model's `<think>` text comes
        back apart, in Completion.reasoning_content. With stream=True the chunks are the raw text (parse it with
        kvcmas_cpp.reasoning.ReasoningStream and kvcmas_cpp.tools.ToolCallStream).
        """
        return chat_completion(
            self, messages, tools, tool_choice, parallel_tool_calls, response_format, top_logprobs, **kwargs
        )

    def _generate(
        self,
        ids: list[int],
        max_tokens: int,
        params: SamplingParams,
        stops: list[str],
        sequence: KVSequence | None,
        first_logits: np.ndarray | None = None,
        constraint: Any = None,
        logprobs: int | None = None,
    ) -> Iterator[CompletionChunk]:
        """The generation loop. first_logits: the prompt is already in `sequence` (ids are its tokens, for the
        repetition penalty only) and these are its next-token logits. constraint: the tokens allowed next
        (kvcmas_cpp.constrained.Constraint); logprobs: None, or each chunk's logprob with this many alternatives."""
        if not ids:
            raise ValueError("generate: the prompt is empty")
        held = len(sequence) if sequence is not None else 0
        if first_logits is None and held + len(ids) >= self.n_ctx:  # the prompt and one generated token must fit
            before = f" after the sequence's {held}" if held else ""
            raise ValueError(
                f"generate: the prompt is {len(ids)} tokens{before}, and the context (n_ctx) is {self.n_ctx} tokens, "
                "the reply included: shorten the prompt or raise n_ctx (Model(n_ctx=...), -c/--ctx-size)"
            )
        stream = TokenStream(self.tokenizer, params, stops, max_tokens, [], constraint, logprobs)  # params checked
        seq = sequence if sequence is not None else self.new_sequence()
        prior = len(seq) if first_logits is None else len(seq) - len(ids)
        stream.history.extend([*seq.tokens, *ids] if first_logits is None else seq.tokens)  # the penalty reads them
        finish: Literal["stop", "length"] = "length"
        try:
            t0 = time.perf_counter()
            logits = seq.append(ids, logits="last") if first_logits is None else first_logits
            stream.max_tokens = min(max_tokens, self.n_ctx - len(seq))  # every token it yields fits in the sequence
            while stream.sampled < stream.max_tokens:
                assert logits is not None
                step = stream.step(logits)
                if step.end_of_generation:
                    finish = "stop"
                    break
                yield CompletionChunk(step.text, step.token, logprob=step.logprob)
                if step.finish is not None:
                    finish = step.finish
                    break
                logits = seq.append([step.token], logits="last")
            timings = stream.timings(t0, prior + len(ids), prior)
            yield CompletionChunk(stream.flush(), None, finish, timings)
        finally:
            if sequence is None:
                seq.close()

    # ------------------------------------------------------------------------------- the sharing layer's door
    # What kvcmas_cpp.sharing and agents need from the core, so that nothing outside this module reaches _core.
    @property
    def head_dim(self) -> int:
        """Width of one attention head's key (and value) rows."""
        return int(self._core.head_dim)

    @property
    def kv_width(self) -> int:
        """Columns of one layer's K (or V) row: n_head_kv * head_dim (the sharing layer's "kd")."""
        return self.n_head_kv * self.head_dim

    def rope_rotate(self, rows: np.ndarray, shift: int, layer: int) -> np.ndarray:
        """Key rows [n, kv_width] rotated by `shift` positions with layer `layer`'s RoPE (a negative shift rotates
        back: a span's keys to its own positions 0..n-1)."""
        return np.asarray(self._core.rope_rotate(np.ascontiguousarray(rows, dtype=np.float32), int(shift), layer))

    def ridge_correction(self, maps: Any, view: KVSequence, pos: int, n: int, frame0: int, prev: Any = None) -> Any:
        """The core KvCorrection of n span rows that a ridge map set (`_core.RidgeMaps`) predicts from a reader's
        base view (view's rows pos..pos+n-1), in the frame of the stored rows (first stored position frame0), with
        the correction `prev` (a KvCorrection or None) in front of it."""
        return core.ridge_correction(self._core, maps, view.id, pos, n, frame0, prev)

    def materialize_last(self, seq: KVSequence) -> None:
        """Turns the corrected shared rows seq appended last into a private corrected copy (plain attention)."""
        core.seq_materialize_last(self._core, seq.id)

    def correction_bytes(self, seq: KVSequence) -> int:
        """Bytes of the low-rank corrections seq's segments hold."""
        return int(sum(s["corr_bytes"] for s in self._core.seq_segments(seq.id)))

    def continue_generation(
        self,
        seq: KVSequence,
        first_logits: np.ndarray,
        max_tokens: int,
        params: SamplingParams,
        stops: list[str],
        constraint: Any = None,
        logprobs: int | None = None,
    ) -> Iterator[CompletionChunk]:
        """Generates after a prompt already in `seq` whose next-token logits are `first_logits` (an agent session's
        prefilled prompt): the chunks generate(stream=True) gives, the rows appended to seq."""
        return self._generate(list(seq.tokens), max_tokens, params, stops, seq, first_logits, constraint, logprobs)

    # ------------------------------------------------------------------------- shapes and files (bench, tools)
    @staticmethod
    def file_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The GGUF metadata of a model file, read without loading the model; KvcmasError (a ValueError) naming the
        file where it is not a GGUF file the core can read."""
        return dict(core.GgufFile(os.fspath(path)).metadata())

    @staticmethod
    def file_tensors(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The tensor table of a model file (name, shape, type_name, n_bytes, ...), read without loading the model."""
        return list(core.GgufFile(os.fspath(path)).tensors())

    # --------------------------------------------------------------------------------------- LoRA adapters
    def load_adapter(self, path: str | os.PathLike[str], name: str | None = None) -> lora.Adapter:
        """Loads a GGUF LoRA adapter of this model (`kvcmas convert-lora` writes one from a PEFT folder) under
        `name` (default: the file's stem), for generate/chat(adapter=name) and set_sequence_adapter."""
        path = os.fspath(path)
        name = lora.new_name(self, path, name)
        aid = self._core.load_adapter(path)
        return lora.register(self, name, aid, path, dict(self._core.adapter_info(aid)))

    def unload_adapter(self, name: str) -> None:
        """Frees a loaded adapter (refused while a sequence uses it)."""
        self._core.unload_adapter(lora.lookup(self, name).id)
        lora.forget(self, name)

    @property
    def adapters(self) -> dict[str, lora.Adapter]:
        """The loaded adapters by name."""
        return dict(lora.registry(self))

    def set_sequence_adapter(self, sequence: KVSequence, adapter: str | None, scale: float = 1.0) -> None:
        """Runs the sequence's next tokens with a loaded adapter at `scale` (None: the base model)."""
        lora.set_sequence_adapter(self, sequence, adapter, scale)


def collect_completion(chunks: Iterator[CompletionChunk], tokenizer: Tokenizer, with_logprobs: bool) -> Completion:
    """A generation's chunks -> its Completion (logprobs in OpenAI's chat shape when asked)."""
    pieces: list[str] = []
    tokens: list[int] = []
    lps: list[TokenLogprob] = []
    for chunk in chunks:
        pieces.append(chunk.text)
        if chunk.token is not None:
            tokens.append(chunk.token)
        if chunk.logprob is not None:
            lps.append(chunk.logprob)
        if chunk.finish_reason is not None:
            assert chunk.timings is not None
            logprobs = chat_logprobs(tokenizer, lps) if with_logprobs else None
            return Completion("".join(pieces), tokens, chunk.finish_reason, chunk.timings, logprobs)
    raise AssertionError("generation ended without a final chunk")
