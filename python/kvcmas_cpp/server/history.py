"""What the server answered, kept per tenant for GET /v1/kvcmas/workflows and /v1/kvcmas/summary (docs/ui.md).

Every finished generation is recorded once, from the same dict its response carried: a chat request's hop (its
`kvcmas` object, its `timings`, the spans its prompt read by author, and an estimate of the same hop under nonshared)
goes into its workflow's history; every generation counts in its tenant's totals and TTFT samples. Memory is bounded
whatever clients send: per tenant MAX_WORKFLOWS workflows (the least recently active goes first), per workflow the
last MAX_HOPS hops (hops_total still counts every one), per tenant TTFT_WINDOWS windows of TTFT_WINDOW_S seconds of
at most TTFT_SAMPLES samples each, names cut to NAME_CHARS characters. Tenants are the server's API keys (a fixed
set). A tenant's records are only ever read back by that tenant.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_WORKFLOWS = 64  # workflows kept per tenant
MAX_HOPS = 128  # hops kept per workflow (the last ones)
MAX_READ_AUTHORS = 32  # authors listed per hop (the rest are summed into one entry with "from": "(others)")
NAME_CHARS = 120  # agent names (a system prompt when the request named no agent) are cut to this length
TTFT_WINDOW_S = 10.0
TTFT_WINDOWS = 60  # ten minutes of TTFT windows
TTFT_SAMPLES = 512  # samples kept per window (n still counts every one)
RATE_SAMPLES = 32  # prefill rates kept for the nonshared estimate
RATE_MIN_ROWS = 64  # hops computing fewer prompt rows than this do not measure the prefill rate (overheads dominate)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile q (0..100) of values (not empty): the smallest value with at least q% of the
    values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def short_name(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 1] + "\u2026"


@dataclass
class _Workflow:
    id: str
    created: float
    updated: float = 0.0
    hops: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_HOPS))
    hops_total: int = 0
    agents: dict[str, None] = field(default_factory=dict)  # in order of first appearance (bounded by MAX_HOPS)
    methods: set[str] = field(default_factory=set)  # of every hop (the served methods: a handful)
    reused_tokens: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class _Tenant:
    workflows: OrderedDict[str, _Workflow] = field(default_factory=OrderedDict)  # least recently active first
    totals: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "requests",
                "prompt_tokens",
                "computed_tokens",
                "reused_tokens",
                "prefix_cached_tokens",
                "span_tokens",
                "completion_tokens",
            ),
            0,
        )
    )
    dense_hops: dict[str, int] = field(default_factory=dict)
    ttft: deque[tuple[float, int, list[float]]] = field(default_factory=lambda: deque(maxlen=TTFT_WINDOWS))
    salts: OrderedDict[str, None] = field(default_factory=OrderedDict)  # cache_salts seen (estimators to report)


class History:
    """The per-tenant records behind the UI's endpoints. Thread-safe."""

    def __init__(self, rows_bytes: Callable[[int], int]) -> None:
        self.rows_bytes = rows_bytes  # KV bytes of n rows (KVBudget.rows_bytes): what a nonshared hop would hold
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}
        self._rates: deque[float] = deque(maxlen=RATE_SAMPLES)  # prompt rows/s of hops that computed their prompt

    # ------------------------------------------------------------------------------------------------ writing
    def record(
        self,
        tenant: str,
        salt: str,
        workflow: str | None,
        response_id: str,
        kvcmas: dict[str, Any],
        timings: dict[str, Any],
        usage: dict[str, Any],
        reads: list[dict[str, Any]],
        display_agent: str,
    ) -> None:
        """One finished generation: kvcmas/timings/usage are the dicts its response carried. workflow: None for a
        completion (it counts in the totals only). display_agent: the name the graph shows for the reader."""
        now = time.time()
        display_agent = short_name(display_agent)
        computed, prompt = int(kvcmas["computed_tokens"]), int(usage["prompt_tokens"])
        with self._lock:
            t = self._tenants.setdefault(tenant, _Tenant())
            self._count(t, kvcmas, usage, float(timings["ttft_ms"]), now)
            if salt not in t.salts and len(t.salts) >= MAX_WORKFLOWS:
                t.salts.popitem(last=False)
            t.salts[salt] = None
            t.salts.move_to_end(salt)
            # a hop that computed its prompt itself measures the prefill rate (a reused hop's time is the method's);
            # one that reused nothing is its own nonshared hop, however short
            own_rate: float | None = None
            measured = kvcmas.get("mode") != "reuse" and timings["prompt_per_second"] > 0
            if measured and (computed >= RATE_MIN_ROWS or int(kvcmas["reused_tokens"]) == 0):
                own_rate = float(timings["prompt_per_second"])
            if measured and computed >= RATE_MIN_ROWS:
                self._rates.append(float(timings["prompt_per_second"]))
            if workflow is None:
                return
            hop = {
                "index": 0,
                "id": response_id,
                "created": round(now, 3),
                **kvcmas,
                "node": display_agent,
                "prompt_tokens": prompt,
                "completion_tokens": int(usage["completion_tokens"]),
                "timings": dict(timings),
                "reads": self._reads(reads),
                "nonshared_estimate": self._nonshared(prompt, int(usage["completion_tokens"]), timings, own_rate),
            }
            wf = t.workflows.pop(workflow, None)
            if wf is None:
                wf = _Workflow(workflow, now)
                while len(t.workflows) >= MAX_WORKFLOWS:
                    t.workflows.popitem(last=False)
            t.workflows[workflow] = wf  # the most recently active last
            hop["index"] = wf.hops_total
            wf.hops.append(hop)
            wf.hops_total += 1
            wf.updated = now
            if display_agent not in wf.agents and len(wf.agents) < MAX_HOPS:
                wf.agents[display_agent] = None
            wf.methods.add(str(kvcmas["method"]))
            wf.reused_tokens += int(kvcmas["reused_tokens"])
            wf.computed_tokens += computed
            wf.prompt_tokens += prompt

    @staticmethod
    def _count(t: _Tenant, kvcmas: dict[str, Any], usage: dict[str, Any], ttft_ms: float, now: float) -> None:
        tot = t.totals
        tot["requests"] += 1
        tot["prompt_tokens"] += int(usage["prompt_tokens"])
        tot["computed_tokens"] += int(kvcmas["computed_tokens"])
        tot["reused_tokens"] += int(kvcmas["reused_tokens"])
        tot["prefix_cached_tokens"] += int(kvcmas["prefix_cached_tokens"])
        tot["span_tokens"] += int(kvcmas["span_tokens"])
        tot["completion_tokens"] += int(usage["completion_tokens"])
        reason = kvcmas.get("dense_reason")
        if reason is not None:
            t.dense_hops[reason] = t.dense_hops.get(reason, 0) + 1
        start = math.floor(now / TTFT_WINDOW_S) * TTFT_WINDOW_S
        if not t.ttft or t.ttft[-1][0] != start:
            t.ttft.append((start, 0, []))
        w_start, n, samples = t.ttft[-1]
        if len(samples) < TTFT_SAMPLES:
            samples.append(ttft_ms)
        t.ttft[-1] = (w_start, n + 1, samples)

    @staticmethod
    def _reads(reads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [
            {
                "from": None if r["from"] is None else short_name(str(r["from"])),
                "tokens": r["tokens"],
                "spans": r["spans"],
            }
            for r in reads[:MAX_READ_AUTHORS]
        ]
        rest = reads[MAX_READ_AUTHORS:]
        if rest:
            out.append(
                {
                    "from": "(others)",
                    "tokens": sum(r["tokens"] for r in rest),
                    "spans": sum(r["spans"] for r in rest),
                }
            )
        return out

    def prefill_rate(self) -> float | None:
        """Prompt rows per second of the recent hops that computed at least RATE_MIN_ROWS rows themselves (median),
        or None before any did."""
        rates = list(self._rates)
        return percentile(rates, 50) if rates else None

    def _nonshared(
        self, prompt: int, completion: int, timings: dict[str, Any], own_rate: float | None
    ) -> dict[str, Any]:
        """The same hop had it computed its whole prompt: an estimate. KV bytes are exact for nonshared (every prompt
        and generated row); the prefill time is the prompt at a measured prefill rate, plus the hop's own waits. The
        rate: the hop's own when it computed at least RATE_MIN_ROWS rows itself or reused nothing (measured in its
        own conditions; then a hop that reused nothing estimates its own TTFT), else the median of the recent hops
        that computed RATE_MIN_ROWS rows."""
        rate, basis = (own_rate, "this hop") if own_rate is not None else (self.prefill_rate(), "recent hops")
        estimate: dict[str, Any] = {
            "estimate": True,
            "computed_tokens": prompt,
            "kv_bytes": self.rows_bytes(prompt + completion),
            "prefill_rate_tokens_per_s": None if rate is None else round(rate, 2),
            "rate_from": None if rate is None else basis,
            "prompt_ms": None,
            "ttft_ms": None,
        }
        if rate is not None:
            prompt_ms = prompt / rate * 1000.0
            waits = float(timings["queue_ms"]) + float(timings["wait_ms"]) + float(timings["interleaved_ms"])
            estimate["prompt_ms"] = round(prompt_ms, 3)
            estimate["ttft_ms"] = round(waits + prompt_ms, 3)
        return estimate

    # ------------------------------------------------------------------------------------------------ reading
    def workflows(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's workflows, the most recently active first."""
        with self._lock:
            t = self._tenants.get(tenant)
            if t is None:
                return []
            return [self._summary(wf) for wf in reversed(t.workflows.values())]

    @staticmethod
    def _summary(wf: _Workflow) -> dict[str, Any]:
        return {
            "id": wf.id,
            "created": round(wf.created, 3),
            "updated": round(wf.updated, 3),
            "hops": wf.hops_total,
            "hops_kept": len(wf.hops),
            "agents": list(wf.agents),
            "prompt_tokens": wf.prompt_tokens,
            "reused_tokens": wf.reused_tokens,
            "computed_tokens": wf.computed_tokens,
            "methods": sorted(wf.methods),
        }

    def workflow(self, tenant: str, workflow: str) -> dict[str, Any] | None:
        """One of the tenant's workflows with its hops in order, or None (not the tenant's, or unknown)."""
        with self._lock:
            t = self._tenants.get(tenant)
            wf = t.workflows.get(workflow) if t is not None else None
            if wf is None:
                return None
            return {**self._summary(wf), "hops": [dict(h) for h in wf.hops], "hops_total": wf.hops_total}

    def tenant_summary(self, tenant: str) -> dict[str, Any]:
        """The tenant's totals since the server started, its TTFT windows and the cache_salts it used."""
        now = time.time()
        with self._lock:
            t = self._tenants.get(tenant) or _Tenant()
            tot = dict(t.totals)
            windows = [(s, n, list(v)) for s, n, v in t.ttft if s > now - TTFT_WINDOW_S * TTFT_WINDOWS]
            dense = dict(t.dense_hops)
            salts = list(t.salts)
        prompt = tot["prompt_tokens"]
        recent = [v for _, _, vs in windows for v in vs]
        return {
            **tot,
            "dense_hops": dense,
            "prefix_cache_hit_rate": tot["prefix_cached_tokens"] / prompt if prompt else None,
            "span_hit_rate": tot["span_tokens"] / prompt if prompt else None,
            "ttft_ms": _quantiles(recent, sum(n for _, n, _ in windows)),
            "ttft_window_s": TTFT_WINDOW_S,
            "ttft_series": [{"t": s, **_quantiles(vs, n)} for s, n, vs in windows],
            "cache_salts": salts,
        }


def _quantiles(values: list[float], n: int) -> dict[str, Any]:
    if not values:
        return {"n": n, "p50": None, "p90": None, "p99": None}
    return {"n": n, "p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}
