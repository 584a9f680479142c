"""A request's state in the method layer: its spans, per hop its prompt, positions and report, and its result."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import KVSequence, is_bidirectional
from .span import Span


@dataclass
class HopReport:
    """What one agent call did. Fidelity fields are set in evaluation mode (against the exact run)."""

    agent: int
    name: str
    mode: str  # "source" | "dense" | "reuse" | "fallback"
    gate: str  # the gate's decision ("n/a", "reuse", "novel -> dense")
    ttft_ms: float
    prompt_tokens: int
    computed_tokens: int  # tokens this request forwarded for the prompt (prefix-cache hits excluded)
    reused_tokens: int  # prefix-cache rows + shared span rows
    kv_bytes: int  # KV blocks this hop allocated (prompt + generation)
    corr_bytes: int  # KvCorrection memory held by this hop's sequence
    corr_rank: int = 0
    corr_factor_bytes: int = 0  # the same, counted from the corrections handed to the engine and kept fused
    materialized_tokens: int = 0  # corrected span rows copied into the sequence (MethodConfig.apply) instead
    recomputed_tokens: int = 0  # shared span rows this reader forwarded itself (MethodConfig.recompute; in computed)
    dense_reason: str | None = None  # why shared spans were computed: calibrating | gate | forced | no match
    shadow_tokens: int = 0  # rows computed after the reply for training reads (cold reuse while calibrating)
    peak_bytes: int = 0  # KV + correction bytes the request holds after this hop: its peak so far (nothing is freed)
    generated: list[int] = field(default_factory=list)
    first_logits: np.ndarray | None = None
    tf_logits: np.ndarray | None = None  # teacher-forced logits over the generated tokens [len-1, n_vocab]
    kl: float | None = None
    top1: bool | None = None
    tf_top1: float | None = None
    k_err: list[float] | None = None
    v_err: list[float] | None = None
    identical: bool | None = None
    prompt: list[int] = field(default_factory=list, repr=False)  # the prompt ids

    def row(self) -> dict[str, object]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("first_logits", "tf_logits", "generated", "prompt")}
        d["generated_tokens"] = len(self.generated)
        return d


@dataclass
class RequestState:
    """One request's spans as the method sees them (placeholder -> Span: ids, role, the stored state later readers
    start from), and per hop its prompt, its placeholder positions and its report."""

    message: str  # the request's key for the estimator's anchors
    spans: dict[str, Span] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)
    spans_at: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    hops: list[HopReport] = field(default_factory=list)
    kv0: int = 0  # model KV bytes when the current hop started
    vectors: np.ndarray | None = None  # input vectors [n, n_embd] that ids -(1 + row) stand for (e.g. image features)
    bidirectional: list[bool] = field(default_factory=list)  # per vector row: of a BidirectionalRows (Gemma 3 image)
    vector_pos: np.ndarray | None = None  # [n, 3] per vector (k, rows, cols): row k of an image (M-RoPE); rows 0: not
    owned: list[KVSequence] = field(default_factory=list)  # sequences spans read besides the hops' (caller closes)

    def add_vectors(self, rows: np.ndarray, image_grid: tuple[int, int] | None = None) -> list[int]:
        """Registers input vectors (rows [n, n_embd]; image_grid: they are an image of (rows, cols) tokens,
        row-major, for M-RoPE) and returns the ids that stand for them in prompts."""
        self.bidirectional += [is_bidirectional(rows)] * len(rows)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        first = 0 if self.vectors is None else self.vectors.shape[0]
        self.vectors = rows.copy() if self.vectors is None else np.concatenate([self.vectors, rows])
        n = rows.shape[0]
        pos = np.zeros((n, 3), dtype=np.int64)
        if image_grid is not None:
            pos[:, 0], pos[:, 1], pos[:, 2] = np.arange(n), image_grid[0], image_grid[1]
        self.vector_pos = pos if self.vector_pos is None else np.concatenate([self.vector_pos, pos])
        return [-(1 + first + i) for i in range(rows.shape[0])]

    def stored(self, ph: str) -> Span | None:
        """The span `ph` if a reader has computed it (Span.stored), else None."""
        span = self.spans.get(ph)
        return span if span is not None and span.stored else None


@dataclass
class RequestResult:
    hops: list[HopReport]
    seqs: list[KVSequence]
    span_pos: list[dict[str, tuple[int, int]]]  # per agent: placeholder -> (position, length) in its sequence
    prompt_ids: list[list[int]]
    owned: list[KVSequence] = field(default_factory=list)  # RequestState.owned

    def close(self) -> None:
        for s in self.seqs + self.owned:
            s.close()
