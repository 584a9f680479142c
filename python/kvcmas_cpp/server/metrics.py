"""Server counters and their Prometheus text exposition (format 0.0.4), written by hand: a handful of counters, gauges
and one histogram do not justify a dependency."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# TTFT histogram bucket bounds in seconds (Prometheus convention: cumulative, plus +Inf).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = above every bound
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class Usage:
    """What one tenant's requests did: the part of the server's counters a tenant may see of itself."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    reused_tokens: int = 0
    prefix_cached_tokens: int = 0
    span_tokens: int = 0
    generated_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    dense_hops: dict[str, int] = field(default_factory=dict)  # why a later hop computed its shared spans -> hops
    # per model a generation ran (the base model's id or a LoRA adapter's name) -> MODEL_COUNTERS' keys -> count
    by_model: dict[str, dict[str, int]] = field(default_factory=dict)


# The counters kept per tenant too (Usage's fields): (metric, attribute, help).
USAGE_COUNTERS = (
    ("kvcmas_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished generations."),
    ("kvcmas_prompt_tokens_computed_total", "computed_prompt_tokens", "Prompt tokens whose KV was computed."),
    (
        "kvcmas_reused_tokens_total",
        "reused_tokens",
        "Prompt tokens whose KV was served from earlier work (prefix cache + shared spans).",
    ),
    (
        "kvcmas_prefix_cached_tokens_total",
        "prefix_cached_tokens",
        "Prompt tokens served exactly from an agent's cached prompt prefix.",
    ),
    (
        "kvcmas_span_tokens_total",
        "span_tokens",
        "Prompt tokens read by reference from spans other calls computed (corrected by the method).",
    ),
    ("kvcmas_generated_tokens_total", "generated_tokens", "Tokens generated."),
)


def _fmt(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


# Per served model (the base model's id or a LoRA adapter's name, as replies report it): (metric, key, help).
MODEL_COUNTERS = (
    ("kvcmas_model_generations_total", "generations", "Finished generations (choices), by the model they ran."),
    ("kvcmas_model_prompt_tokens_total", "prompt_tokens", "Prompt tokens of finished generations, by model."),
    (
        "kvcmas_model_reused_tokens_total",
        "reused_tokens",
        "Prompt tokens whose KV was served from earlier work, by the model the generation ran.",
    ),
    ("kvcmas_model_generated_tokens_total", "generated_tokens", "Tokens generated, by model."),
)


class Metrics(Usage):
    """Thread-safe counters of the server: the whole server's Usage (what a tenant also sees of itself) and the rest.
    Gauges that live elsewhere (KV bytes, queue length) are read through callbacks at exposition time, so they are
    never stale. base_model: the id the base model's generations are counted under (MODEL_COUNTERS)."""

    def __init__(self, base_model: str = "base") -> None:
        super().__init__()
        self.base_model = base_model
        self._lock = threading.Lock()
        self.cancelled = 0
        self.rejected_queue_full = 0
        self.rejected_body_too_large = 0
        self.rejected_too_many_requests = 0
        self.rejected_host = 0
        self.rejected_content_type = 0
        self.rejected_body_timeout = 0
        self.timed_out = 0
        self.evictions = 0
        self.images_encoded = 0
        self.calibration_tokens = 0
        self.training_reads: dict[str, int] = {"done": 0, "dropped": 0}  # training reads by outcome
        self.forward_passes: dict[str, int] = {"prefill": 0, "decode": 0, "mixed": 0}  # the scheduler's, by kind
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.counted_elsewhere: dict[str, Callable[[], int]] = {}  # counter -> what another part counts toward it
        # counters another part keeps, by one label: name -> (help, label, read() -> {label value: count})
        self.counters: dict[str, tuple[str, str, Callable[[], dict[str, int]]]] = {}
        self.tenants: dict[str, Usage] = {}  # per tenant (API key): what /metrics shows that tenant

    def add_count(self, name: str, read: Callable[[], int]) -> None:
        """Counter `name` (an attribute) also counts read() at exposition: for a count another part keeps."""
        self.counted_elsewhere[name] = read

    def _total(self, name: str) -> int:
        read = self.counted_elsewhere.get(name)
        return int(getattr(self, name)) + (read() if read is not None else 0)

    def add_gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges[name] = (help_text, read)

    def add_counter(self, name: str, help_text: str, label: str, read: Callable[[], dict[str, int]]) -> None:
        """A counter another part keeps, one sample per value of `label` (read at exposition)."""
        self.counters[name] = (help_text, label, read)

    def _usages(self, tenant: str | None) -> list[Usage]:
        """The server's counters and the tenant's (lock held)."""
        return [self] if tenant is None else [self, self.tenants.setdefault(tenant, Usage())]

    def count_request(self, endpoint: str, status: int, tenant: str | None = None) -> None:
        with self._lock:
            key = (endpoint, status)
            for u in self._usages(tenant):
                u.requests[key] = u.requests.get(key, 0) + 1

    def count_generation(
        self, prompt: int, reused: int, generated: int, ttft_s: float | None, tenant: str | None = None
    ) -> None:
        with self._lock:
            for u in self._usages(tenant):
                u.prompt_tokens += prompt
                u.reused_tokens += reused
                u.computed_prompt_tokens += prompt - reused
                u.generated_tokens += generated
                if ttft_s is not None:
                    u.ttft.observe(ttft_s)

    def count_sharing(self, prefix_cached: int, span: int, dense_reason: str | None, tenant: str | None = None) -> None:
        """Where a finished generation's reused prompt rows came from, and why it ran dense if it did."""
        with self._lock:
            for u in self._usages(tenant):
                u.prefix_cached_tokens += prefix_cached
                u.span_tokens += span
                if dense_reason is not None:
                    u.dense_hops[dense_reason] = u.dense_hops.get(dense_reason, 0) + 1

    def count_done(self, stats: dict[str, Any], choice: int, tenant: str | None, model: str | None = None) -> None:
        """A finished job's usage (jobs.job_stats): choice 0 counts the prompt and where its reused rows came from;
        another choice of an n > 1 request (a fork of that prompt) only its tokens. model: the LoRA adapter it ran
        with (None: the base model)."""
        first = choice == 0
        with self._lock:
            for u in self._usages(tenant):
                counts = u.by_model.setdefault(model or self.base_model, {key: 0 for _, key, _ in MODEL_COUNTERS})
                counts["generations"] += 1
                counts["prompt_tokens"] += stats["prompt_tokens"] if first else 0
                counts["reused_tokens"] += stats["reused_tokens"] if first else 0
                counts["generated_tokens"] += stats["completion_tokens"]
        if first:
            ttft_s = stats["ttft_ms"] / 1000.0
            self.count_generation(
                stats["prompt_tokens"], stats["reused_tokens"], stats["completion_tokens"], ttft_s, tenant
            )
            self.count_sharing(stats["prefix_cached_tokens"], stats["span_tokens"], stats["dense_reason"], tenant)
        else:
            self.count_generation(0, 0, stats["completion_tokens"], None, tenant)

    def count_training_read(self, outcome: str, rows: int) -> None:
        """A training read left the queue: 'done' (it computed `rows` rows) or 'dropped'."""
        with self._lock:
            self.training_reads[outcome] = self.training_reads.get(outcome, 0) + 1
            self.calibration_tokens += rows

    def count_pass(self, kind: str) -> None:
        """A forward pass of the scheduler: 'prefill' (a prompt chunk alone), 'decode' (decode tokens alone) or
        'mixed' (a prompt chunk with the decode tokens)."""
        with self._lock:
            self.forward_passes[kind] += 1

    def bump(self, name: str, by: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + by)

    def render(self, tenant: str | None = None) -> str:
        """The Prometheus text exposition of every metric; of a tenant: only its own requests' counters (the gauges
        and the other counters are the whole server's, which would show other tenants' volume)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lines.append(f"{name}{labels} {_fmt(value)}")

        with self._lock:
            usage: Usage = self if tenant is None else self.tenants.get(tenant) or Usage()
            metric(
                "kvcmas_requests_total",
                "counter",
                "HTTP requests by endpoint and status code.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(usage.requests.items())],
            )
            for name, attr, help_text in USAGE_COUNTERS:
                metric(name, "counter", help_text, [("", getattr(usage, attr))])
            h = usage.ttft
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == float("inf") else _fmt(bound)
                buckets.append((f'{{le="{le}"}}', cumulative))
            lines.append("# HELP kvcmas_ttft_seconds Time from request arrival to the first generated token.")
            lines.append("# TYPE kvcmas_ttft_seconds histogram")
            lines.extend(f"kvcmas_ttft_seconds_bucket{labels} {_fmt(v)}" for labels, v in buckets)
            lines.append(f"kvcmas_ttft_seconds_sum {_fmt(h.total)}")
            lines.append(f"kvcmas_ttft_seconds_count {h.n}")
            metric(
                "kvcmas_dense_hops_total",
                "counter",
                "Generations whose shared spans were computed, by reason (calibrating, gate, no match, forced).",
                [(f'{{reason="{r}"}}', n) for r, n in sorted(usage.dense_hops.items())],
            )
            for name, key, help_text in MODEL_COUNTERS:
                samples: list[tuple[str, float]] = [
                    (f'{{model="{m}"}}', c[key]) for m, c in sorted(usage.by_model.items())
                ]
                metric(name, "counter", help_text, samples)
            if tenant is not None:  # the rest is the whole server's: other tenants' volume shows in it
                return "\n".join(lines) + "\n"
            for name, help_text, value in (
                (
                    "kvcmas_calibration_tokens_total",
                    "Rows computed by training reads of edges still calibrating (cold reuse), after their replies.",
                    self.calibration_tokens,
                ),
                ("kvcmas_cancelled_total", "Generations cancelled by a client disconnect.", self.cancelled),
                (
                    "kvcmas_rejected_total",
                    "Requests refused with 429 because the queue was full.",
                    self.rejected_queue_full,
                ),
                (
                    "kvcmas_rejected_body_too_large_total",
                    "Requests refused with 413 because the body was over --max-body-bytes.",
                    self.rejected_body_too_large,
                ),
                (
                    "kvcmas_rejected_inflight_total",
                    "Requests refused with 503 because --max-inflight requests were being handled.",
                    self.rejected_too_many_requests,
                ),
                (
                    "kvcmas_rejected_host_total",
                    "Requests refused with 400 because their Host header is not served (see --allowed-host).",
                    self.rejected_host,
                ),
                (
                    "kvcmas_rejected_content_type_total",
                    "POST requests refused with 415 because their body was not declared as JSON.",
                    self.rejected_content_type,
                ),
                (
                    "kvcmas_rejected_body_timeout_total",
                    "Requests refused with 408 because their body did not arrive within --body-timeout.",
                    self.rejected_body_timeout,
                ),
                ("kvcmas_timed_out_total", "Requests ended by --request-timeout.", self.timed_out),
                (
                    "kvcmas_evictions_total",
                    "Stored shared spans, prefix cache entries and idle sessions evicted to make room in the KV budget "
                    "(prefix cache entries also beyond the cache's own share of it).",
                    self._total("evictions"),
                ),
                (
                    "kvcmas_images_encoded_total",
                    "Images run through the vision encoder (a repeated image comes from the cache).",
                    self.images_encoded,
                ),
            ):
                metric(name, "counter", help_text, [("", value)])
            metric(
                "kvcmas_training_reads_total",
                "counter",
                "Training reads (kvcmas calibrating) that left the queue, by outcome (done, dropped).",
                [(f'{{outcome="{o}"}}', n) for o, n in sorted(self.training_reads.items())],
            )
            metric(
                "kvcmas_forward_passes_total",
                "counter",
                "Forward passes the scheduler ran for prompt chunks and decode tokens, by kind: a prompt chunk alone "
                "(prefill), decode tokens alone (decode), or a chunk with the decode tokens (mixed). Appends the "
                "sharing methods run outside the prompt's chunks and training reads are not counted.",
                [(f'{{kind="{k}"}}', n) for k, n in sorted(self.forward_passes.items())],
            )
        for name, (help_text, label, counts) in self.counters.items():
            metric(name, "counter", help_text, [(f'{{{label}="{k}"}}', n) for k, n in sorted(counts().items())])
        for name, (help_text, read) in self.gauges.items():
            metric(name, "gauge", help_text, [("", read())])
        return "\n".join(lines) + "\n"
