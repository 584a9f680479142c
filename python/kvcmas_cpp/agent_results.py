"""What agent calls give back: a reply (Response, ResponseChunk), what it cost and reused (ResponseStats), and a
prompt in the engine (Prefilled, AgentSession.prefill's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from .kv_budget import KVBudget
from .model import KVSequence
from .sharing.estimators import Correction
from .sharing.span import Span
from .sharing.state import HopReport


@dataclass
class ResponseStats:
    """What one agent call cost and reused. Times in milliseconds; bytes of KV rows this call computed and holds
    (prompt rows it forwarded + generated rows) and of its low-rank corrections."""

    agent: str
    method: str
    mode: str  # source | dense | reuse | fallback
    gate: str  # the method's decision for this call
    ttft_ms: float
    prompt_tokens: int
    computed_tokens: int
    reused_tokens: int  # prefix_cached_tokens + span_tokens: rows served from earlier work
    generated_tokens: int = 0
    generation_ms: float = 0.0
    kv_bytes: int = 0
    corr_bytes: int = 0
    corr_rank: int = 0
    recomputed_tokens: int = 0  # shared-span tokens recomputed in this agent's context (counted in computed_tokens)
    prefix_cached_tokens: int = 0  # rows of the agent's prompt prefix computed by an earlier call (exact)
    span_tokens: int = 0  # rows of shared spans other calls computed, read by reference (corrected by the method)
    dense_reason: str | None = None  # why this later call computed its shared spans: calibrating | gate | no match
    # rows of the training read this call scheduled (cold reuse while calibrating): computed after the reply, off its
    # path (an idle worker, close(), run_training_reads(); a server runs them when it has nothing else to do)
    calibration_tokens_scheduled: int = 0
    # of ttft_ms, the time this call spent first running training reads earlier calls left pending: only under
    # training_reads="eager" (AgentSession.training_read_ms_total counts them wherever they ran); 0 on a server
    training_read_ms: float = 0.0
    # the shared spans this call's prompt holds, by author: [{"from": agent name or None (shared context), "tokens",
    # "spans"}] in prompt order (whether they were read or computed: mode says)
    reads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / (self.generation_ms / 1000.0) if steps > 0 and self.generation_ms > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        return d


@dataclass
class Response:
    agent: str
    text: str
    ids: list[int]
    finish_reason: Literal["stop", "length", "tool_calls"]
    stats: ResponseStats
    first_logits: np.ndarray | None = field(default=None, repr=False)  # next-token logits after the prompt
    logprobs: list[dict[str, Any]] | None = None  # logprobs=True: OpenAI's chat logprobs entries, per token
    tool_calls: list[dict[str, Any]] | None = None  # tools=: the OpenAI tool_call objects the reply holds


@dataclass
class ResponseChunk:
    """A streamed piece of a reply; the last one has finish_reason and the whole Response set."""

    text: str
    token: int | None
    finish_reason: Literal["stop", "length"] | None = None
    response: Response | None = None


class PromptOwner(Protocol):
    """The session a Prefilled belongs to (agents.AgentSession)."""

    def stats_of(self, p: Prefilled, generation_ms: float = 0.0) -> ResponseStats: ...

    def release(self, p: Prefilled) -> None: ...


@dataclass
class Prefilled:
    """A prompt in the engine: `seq` ends with the generation prompt, `logits` are the next-token logits."""

    session: PromptOwner
    agent: int
    seq: KVSequence
    logits: np.ndarray
    hop: HopReport
    pos_map: dict[str, tuple[int, int]]
    corrs: dict[str, Correction]
    reply_ph: str
    prefix_rows: int = 0  # rows of the agent's template prefix (before the first span)
    prefix_cached: int = 0  # of them, rows an earlier call computed (served by the model's PrefixCache)
    prefix: KVSequence | None = None  # the template prefix the hop forked (its own fork of the cache's rows)
    training_read_ms: float = 0.0  # spent before the prompt on earlier calls' pending training reads
    in_flight: bool = False  # counted as a call in flight (IdleReads.begin) until finished or closed
    runs: list[str] = field(default_factory=list)  # placeholders of sub-runs of stored spans this prompt reads
    finished: bool = False
    released: bool = False

    @property
    def stats(self) -> dict[str, Any]:
        return self.session.stats_of(self).as_dict()

    def close(self) -> None:
        """Releases the sequence; its rows stay while a stored span of the session reads them."""
        self.session.release(self)

    def __enter__(self) -> Prefilled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def response_stats(
    p: Prefilled, names: list[str], method: str, kv: KVBudget, spans: Mapping[str, Span], generation_ms: float = 0.0
) -> ResponseStats:
    """What p's call cost and reused: names, the session's agents; kv prices its rows; spans, the session's."""
    h = p.hop
    gen = len(h.generated)
    computed = h.computed_tokens + p.prefix_rows - p.prefix_cached  # prefix rows this very call computed count
    return ResponseStats(
        names[p.agent],
        method,
        h.mode,
        h.gate,
        round(h.ttft_ms + p.training_read_ms, 3),  # the caller waited for both
        h.prompt_tokens,
        computed,
        h.prompt_tokens - computed,
        gen,
        round(generation_ms, 3),
        kv.rows_bytes(computed + gen),
        h.corr_bytes,
        h.corr_rank,
        h.recomputed_tokens,
        p.prefix_cached,
        h.prompt_tokens - computed - p.prefix_cached,
        h.dense_reason if h.mode != "reuse" else None,
        h.shadow_tokens,
        round(p.training_read_ms, 3),
        _reads_of(p, names, spans),
    )


def _reads_of(p: Prefilled, names: list[str], spans: Mapping[str, Span]) -> list[dict[str, Any]]:
    """The spans of p's prompt grouped by author (ResponseStats.reads); a reply's author is an agent's name."""
    by_author: dict[str | None, dict[str, Any]] = {}
    for ph, (_, n) in p.pos_map.items():
        span = spans.get(ph)
        if span is None or ph == p.reply_ph:
            continue
        author = span.author
        name = names[author] if author is not None and author < len(names) else None
        entry = by_author.setdefault(name, {"from": name, "tokens": 0, "spans": 0})
        entry["tokens"] += n
        entry["spans"] += 1
    return list(by_author.values())
