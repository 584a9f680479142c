"""Admission: whether a job's KV reservation fits the budget beside the admitted jobs', and what makes room.

A job reserves blocks (kvcmas_cpp.kv_budget) for its prompt plus its reserved tokens and each other choice's
tokens (Job.claims), less the prompt rows the prefix cache serves it: re-read whenever the cache changes, so an
eviction puts them back in the reservation. Memory in use is read from the engine, so rows a job reuses from shared
spans cost nothing extra. Room is made in a fixed order (evict_one): a stored span of the least recently used
sharing session, then the least recently used prefix cache entry, then a pending training read, then an idle
session that holds spans.
"""

from __future__ import annotations

from ..kv_budget import KVBudget
from ..prefix_cache import PrefixCache
from .jobs import Job
from .metrics import Metrics
from .sessions import SessionStore
from .training_reads import TrainingReads


class Admission:
    """KV reservations of the scheduler's jobs (scheduler thread only)."""

    def __init__(
        self,
        budget: KVBudget,
        prefix_cache: PrefixCache,
        sessions: SessionStore,
        reads: TrainingReads,
        metrics: Metrics,
    ) -> None:
        self.budget = budget
        self.prefix_cache = prefix_cache
        self.sessions = sessions
        self.reads = reads
        self.metrics = metrics

    def prompt_rows(self, job: Job) -> int:
        """The prompt rows a job will compute: its prompt less the rows the prefix cache serves it now (its
        namespace's longest match; text prompts only). Memoized per cache version."""
        cache = self.prefix_cache
        if job.cached_version != cache.version:
            job.cached_version = cache.version
            ns = job.space
            text = job.segments is None or all(isinstance(g, list) for g in job.segments)
            job.cached = cache.cached_rows(ns.cache_namespace(), job.ids, job.adapter) if ns is not None and text else 0
        return job.n_prompt - job.cached

    def outstanding_bytes(self, active: list[Job]) -> int:
        """KV the admitted jobs may still allocate: their remaining tokens, and their prompts until prefilled."""
        claims = (j.claims(self.prompt_rows(j) if j.prefilled is None else 0) for j in active)
        return self.budget.reservations_bytes(rows for claim in claims for rows in claim)

    def needed_bytes(self, job: Job) -> int:
        """KV a job reserves to be admitted: its prompt and tokens, and each other choice's tokens (n > 1)."""
        return self.budget.reservations_bytes(job.claims(self.prompt_rows(job)))

    def fits(self, job: Job, active: list[Job]) -> bool:
        return self.budget.fits(self.outstanding_bytes(active), self.needed_bytes(job))

    def grow_reservation(self, job: Job, active: list[Job]) -> bool:
        """A job whose generation reached its reservation: doubles it (up to max_tokens) if the budget allows,
        evicting stored spans for it. False when it cannot grow."""
        new = min(job.max_tokens, 2 * job.reserve)
        while True:
            extra = self.budget.reservation_bytes(new - len(job.generated))
            if self.budget.fits(self.outstanding_bytes(active), extra):
                job.reserve = new
                return True
            if not self.evict_one():
                return False

    def evict_one(self) -> bool:
        """Evicts one stored span, from the least recently used session that has any; when none has, the least
        recently used prefix cache entry (a prefill in progress holds its own fork of its prefix); then a pending
        training read (it holds forks of rows the sessions let go of); when none is left, closes the least recently
        used idle session (which drops whatever else it holds). Sessions in the middle of a prefill are left alone.
        False when nothing could go."""
        if self.sessions.evict_span():
            self.metrics.bump("evictions")
            return True
        if self.prefix_cache.evict_lru():  # counted by the cache (kvcmas_evictions_total reads its count)
            return True
        if self.reads.drop():
            return True
        if self.sessions.close_idle_holder():
            self.metrics.bump("evictions")
            return True
        return False
