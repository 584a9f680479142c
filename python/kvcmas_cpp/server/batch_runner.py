"""The batch runner: the forward passes of the scheduler's turns, and the prefill plans that ask for them.

A prefill is a plan (kvcmas_cpp.plan; MethodBackend.prefill_plan: a generator that yields the appends computing
its rows). The runner starts a job's plan, runs the next chunk of its current append (plan.chunk_bounds: the same
rows and logits as one piece) in ONE forward pass together with the pending token of every generating job (the
weights are read once for all of them), and resumes the plan with the append's logits, or throws the engine's
refusal into it, until the plan returns the job's Prefilled. It decides nothing: the scheduler says which job's
chunk runs and with which generating jobs, and turns the logits it gets back into tokens (TokenStream).

A chunk runs alone, followed by a decode-only pass, when it holds image embeddings, is shorter than MIN_CHUNK_ROWS
(alone the engine computes it with its decode kernels, in a bigger batch with its prefill kernels, and its rows,
which the prefix cache may keep, must not depend on what else runs), would make the batch over PROMPT_CHUNK rows
(the engine call's scratch bound), or is refused in the batch. A decode row computed in a batch with a chunk may
differ from the same row computed alone in the last bits (the engine picks its kernels by batch size).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .._native import KvcmasError
from ..model import PROMPT_CHUNK, Model
from ..plan import MIN_CHUNK_ROWS, ChunkExecutor, append_chunk, chunk_bounds
from .backend import PlainBackend, Prefilled, Segment
from .jobs import Job
from .lora import Pick
from .metrics import Metrics

log = logging.getLogger("kvcmas.server")


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS, Windows)."""
    try:
        import ctypes

        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _return_free_heap() -> None:
    """Gives memory freed by the finished requests back to the system when the server goes idle (glibc keeps freed
    heap pages of its arenas otherwise, so RSS would stay at the load's peak)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class ChunkResult:
    """What one prefill pass gave: the chunk's logits (its append's last chunk, when asked), the generating jobs'
    next-token logits when they rode along (None: they did not, and still need their decode step), and whether the
    chunk finished its append."""

    logits: np.ndarray | None
    decode_rows: list[np.ndarray] | None
    last: bool


@dataclass
class PrefillEnd:
    """A plan that returned (prefilled) or failed (error)."""

    prefilled: Prefilled | None
    error: Exception | None


class BatchRunner:
    """Runs prefill plans and forward passes on the scheduler's thread."""

    def __init__(self, model: Model, metrics: Metrics, prefill_chunk: int) -> None:
        self.model = model
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.plain = PlainBackend(model)  # plain prompts (completions): a fresh sequence, less the prefix cache's

    # ------------------------------------------------------------------------------------------------ plans
    def start(self, job: Job) -> PrefillEnd | None:
        """Makes the job's prefill plan (its backend's) and runs it up to its first append (None), or its end."""
        assert job.backend is not None
        job.prefilling = True
        job.t_prefill = time.perf_counter()
        segments: list[Segment] = job.segments if job.segments is not None else [job.ids]
        lora = Pick(job.model, job.adapter)
        if job.session is not None and job.messages is not None:
            job.plan = job.backend.prefill_plan(job.messages, segments, job.agent, job.recompute, lora=lora)
        else:
            ns = job.namespace.cache_namespace() if job.namespace is not None else None
            job.plan = self.plain.prefill_plan([], segments, None, lora=lora, namespace=ns)
        return self.advance(job, None, None)

    def advance(self, job: Job, sent: np.ndarray | None, error: Exception | None) -> PrefillEnd | None:
        """Resumes job's plan with its last append's logits (or that append's error, thrown in) up to its next
        append (None); when the plan returns or raises, its end."""
        assert job.plan is not None
        t0 = time.perf_counter()
        prefilled: Prefilled | None = None
        try:
            job.append = job.plan.throw(error) if error is not None else job.plan.send(sent)
            job.appended = 0
            job.plan_ms += (time.perf_counter() - t0) * 1000.0
            return None
        except StopIteration as done:
            prefilled = done.value
            error = None
        except Exception as e:  # the plan's own error, or the append's it did not handle
            error = e
        job.plan_ms += (time.perf_counter() - t0) * 1000.0
        job.plan = job.append = None
        job.prefilling = False
        job.interleaved_ms = max(0.0, (time.perf_counter() - job.t_prefill) * 1000.0 - job.engine_ms - job.plan_ms)
        return PrefillEnd(prefilled, error)

    # ------------------------------------------------------------------------------------------------ passes
    def run_chunk(self, job: Job, running: list[Job]) -> ChunkResult:
        """The next chunk of job's current append in one forward pass with the pending token of every job in
        `running` (see the module's docstring for when it runs alone instead). Raises what the engine raised for
        the chunk (the caller throws it into the plan)."""
        step = job.append
        assert step is not None
        first, end = chunk_bounds(len(step.rows) - job.appended, append_chunk(step.rows, self.prefill_chunk))[0]
        first, end = first + job.appended, end + job.appended
        last = end == len(step.rows)
        chunk = step.rows[first:end]
        logits: Literal["last", "none"] = step.logits if last else "none"
        t_pass = time.perf_counter()
        fits = MIN_CHUNK_ROWS <= len(chunk) <= PROMPT_CHUNK - len(running)
        rows: list[np.ndarray | None] | None = None
        if running and not isinstance(chunk, np.ndarray) and fits:
            steps = [(step.seq, [int(t) for t in chunk])]
            steps += [(j.prefilled.seq, [j.pending_token]) for j in running if j.prefilled is not None]
            try:
                rows = self.model.decode_steps(steps, [logits == "last"] + [True] * len(running))
            except KvcmasError as e:
                log.info("a mixed step was refused by the engine (%s): the chunk and the decode step run apart", e)
        if rows is not None:
            out, decode_rows = rows[0], [r for r in rows[1:] if r is not None]
            self.metrics.count_pass("mixed")
        else:
            pos = None if step.image_pos is None else step.image_pos[first:end]  # an M-RoPE image's rows
            out, decode_rows = ChunkExecutor().append(step.seq, chunk, logits, pos), None
            self.metrics.count_pass("prefill")
        job.engine_ms += (time.perf_counter() - t_pass) * 1000.0
        job.appended = end
        job.remaining = max(0, job.remaining - (end - first))
        job.chunks_run += 1
        return ChunkResult(out, decode_rows, last)

    def decode(self, running: list[Job]) -> list[np.ndarray]:
        """One decode-only pass: each running job's pending token; their next-token logits (KvcmasError: refused)."""
        rows = self.model.decode_batch([(j.prefilled.seq, [j.pending_token]) for j in running if j.prefilled])
        self.metrics.count_pass("decode")
        return rows

    def release_free_memory(self) -> int:
        """Gives freed heap pages and free KV blocks back to the system (the server went idle; RSS would stay at the
        load's peak otherwise); returns the KV bytes released."""
        _return_free_heap()
        released = self.model.kv_trim()
        if released:
            log.debug("idle: %d bytes of free KV blocks released", released)
        return released
