"""Prefill plans: a prompt's computation as a generator of the appends it needs, driven by whoever runs the engine.

A plan (`Plan[R]`) yields `Append` steps (rows to compute at a sequence's end), is sent each one's logits, and returns
its result (e.g. a Prefilled). The work between appends (forks, appends of stored rows by reference, copies of
corrected rows, a correction's factors) is cheap next to computing rows and runs inside the plan; every row a
prompt computes is an Append. An append the driver fails is thrown into the plan at its yield, exactly where a
direct append would have raised, so the plan cleans up (or retries) as straight-line code would.

Drivers: `run_plan` runs a plan to its end on the calling thread, each append in chunks (chunk_bounds) through a
ChunkExecutor. A server's scheduler holds several plans in flight instead and runs one chunk per forward pass with
other requests' decode tokens, choosing each step which plan goes on (server/scheduler.py): no prefill runs inside
another's step. Each row attends to the rows before it whatever the chunking, so the rows and logits equal a
one-piece append as long as no chunk is shorter than MIN_CHUNK_ROWS (unless its whole append is).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from .model import KVSequence, is_bidirectional

# The engine computes appends of up to 12 rows with its decode kernels, and of up to 16 rows over quantized weights
# with 8-bit activations (q8), which round differently from its prefill kernels: a chunked append never makes a chunk
# that small (unless the whole append is), so it computes the same rows as one piece.
MIN_CHUNK_ROWS = 17

Rows = list[int] | np.ndarray  # token ids, or input vectors [n, n_embd] (e.g. an image's embeddings)


@dataclass
class Append:
    """One step of a plan: `rows` (at least one) computed at seq's end; the plan is sent the logits of its last row
    ("last") or None ("none")."""

    seq: KVSequence
    rows: Rows
    logits: Literal["last", "none"] = "none"
    image_pos: np.ndarray | None = None  # vector rows: [len(rows), 3] (k, rows, cols) of image rows (M-RoPE)

    def __post_init__(self) -> None:
        if not len(self.rows):
            raise ValueError("a plan's append needs at least one row")


R = TypeVar("R")
Plan = Generator[Append, "np.ndarray | None", R]


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of the chunks an append of n rows runs in: `chunk` rows each (at least MIN_CHUNK_ROWS), a short
    remainder joining the chunk before it."""
    chunk = max(chunk, MIN_CHUNK_ROWS)
    starts = list(range(0, n, chunk))
    if len(starts) > 1 and n - starts[-1] < MIN_CHUNK_ROWS:
        starts.pop()
    return [(a, starts[i + 1] if i + 1 < len(starts) else n) for i, a in enumerate(starts)]


def append_chunk(rows: Rows, chunk: int) -> int:
    """The chunk size an append of `rows` runs in: `chunk`, or all of them for bidirectional rows (Gemma 3's image
    tokens attend to each other, so they are computed in one forward pass)."""
    return max(chunk, len(rows)) if is_bidirectional(rows) else chunk


class ChunkExecutor:
    """Runs one chunk of an Append by itself (the engine's append at the sequence's end). A caller may override
    append, e.g. to count chunks or to run each with other work."""

    def append(
        self, seq: KVSequence, chunk: Rows, logits: Literal["last", "none"], image_pos: np.ndarray | None = None
    ) -> np.ndarray | None:
        """Appends a chunk of token ids, or of input vectors [n, n_embd] (image_pos: KVSequence.append_embeddings),
        at seq's end; returns the last row's logits ("last") or None."""
        if isinstance(chunk, np.ndarray):
            return seq.append_embeddings(chunk, logits == "last", image_pos=image_pos)
        return seq.append(chunk, logits)


def run_append(step: Append, executor: ChunkExecutor | None = None, chunk_tokens: int = 1 << 30) -> np.ndarray | None:
    """Computes one Append in chunks of about chunk_tokens rows (chunk_bounds) through executor (default: each
    chunk by itself); returns what the plan is sent."""
    executor = executor if executor is not None else ChunkExecutor()
    out: np.ndarray | None = None
    bounds = chunk_bounds(len(step.rows), append_chunk(step.rows, chunk_tokens))
    for k, (a, b) in enumerate(bounds):
        want = step.logits if k == len(bounds) - 1 else "none"
        if step.image_pos is None:
            out = executor.append(step.seq, step.rows[a:b], want)
        else:
            out = executor.append(step.seq, step.rows[a:b], want, image_pos=step.image_pos[a:b])
    return out


def run_plan(plan: Plan[R], executor: ChunkExecutor | None = None, chunk_tokens: int = 1 << 30) -> R:
    """Drives a plan to its end on this thread: each Append by run_append; an append's error is thrown into the
    plan (which may handle it); the plan's result is returned. chunk_tokens >= 1."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    sent: np.ndarray | None = None
    error: Exception | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(sent)
        except StopIteration as done:
            result: R = done.value
            return result
        sent, error = None, None
        try:
            sent = run_append(step, executor, chunk_tokens)
        except Exception as e:
            error = e
        except BaseException:
            plan.close()
            raise
