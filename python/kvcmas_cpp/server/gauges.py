"""The server's gauges and counters read at scrape time (/metrics): the scheduler's, the KV memory's, the prefix
cache's, the sessions', the estimators' and the process's."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..sharing import persist

if TYPE_CHECKING:
    from .app import Server


def resident_bytes() -> int:
    """The process's resident memory from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def register_gauges(server: Server) -> None:
    """Adds the server's gauges (read at scrape time) to its Metrics."""
    m, s, model, cfg = server.metrics, server.scheduler, server.model, server.cfg
    # The prefix cache counts its evictions, the scheduler's and its own (beyond its share of the budget); it is
    # the model's, so what it counted before this server is left out.
    evicted_before = s.prefix_cache.evictions
    m.add_count("evictions", lambda: s.prefix_cache.evictions - evicted_before)
    m.add_gauge("kvcmas_active_requests", "Requests being generated.", lambda: s.n_active)
    m.add_gauge("kvcmas_queued_requests", "Requests waiting for a slot or KV memory.", lambda: s.n_queued)
    m.add_gauge(
        "kvcmas_training_reads_pending",
        "Training reads (kvcmas calibrating) scheduled by replies and not yet run.",
        lambda: s.n_training_reads,
    )
    m.add_gauge("kvcmas_engine_sequences", "KV sequences alive in the engine.", lambda: model.n_sequences)
    m.add_gauge("kvcmas_kv_bytes", "KV memory in use (bytes).", lambda: model.kv_bytes_in_use)
    m.add_gauge("kvcmas_kv_peak_bytes", "Most KV memory in use so far (bytes).", lambda: s.peak_kv_bytes)
    m.add_gauge("kvcmas_kv_budget_bytes", "KV memory budget (bytes).", lambda: s.kv_budget)
    m.add_gauge("kvcmas_kv_stored_bytes", "KV bytes held by stored shared spans.", lambda: s.stored_bytes)
    m.add_gauge(
        "kvcmas_prefix_cache_entries",
        "Token prefixes the exact prefix cache holds.",
        lambda: s.prefix_cache.entries,
    )
    m.add_gauge(
        "kvcmas_prefix_cache_tokens",
        "Tokens of the prefix cache's entries (a run two entries share counted for each).",
        lambda: s.prefix_cache.tokens,
    )
    m.add_gauge(
        "kvcmas_kv_allocated_bytes",
        "KV block memory the engine holds: in use plus free blocks kept for reuse (bytes).",
        lambda: model.kv_bytes_allocated,
    )
    m.add_gauge(
        "kvcmas_kv_trimmed_bytes",
        "Free KV block memory handed back to the system when the server went idle, in all (bytes).",
        lambda: s.trimmed_bytes,
    )
    m.add_gauge(
        "kvcmas_estimator_bytes",
        "What the KV-correction estimators hold: learned maps plus calibration reads pending, bounded by "
        "--calibration-memory (bytes).",
        lambda: s.estimator_bytes,
    )
    m.add_gauge("kvcmas_sessions", "Sharing sessions open (workflow, cache_salt and method).", lambda: s.n_sessions)
    m.add_gauge(
        "kvcmas_namespaces",
        "Namespaces (tenant and cache_salt) whose state is kept until they have been idle for --idle-ttl.",
        lambda: s.n_namespaces,
    )
    m.add_counter(
        "kvcmas_expired_total",
        "Idle state that went, by kind: sharing sessions idle for --idle-ttl (session; their stored spans freed), "
        "namespaces idle for as long (namespace; their estimators and prefix cache entries dropped), and idle "
        "sessions closed beyond --max-sessions-per-tenant or the server's 256 (capped).",
        "kind",
        lambda: dict(s.expired),
    )
    m.add_gauge(
        "process_resident_memory_bytes",
        "Resident memory of the server process (bytes): model weights read so far, KV blocks, estimators, "
        "Python objects and the allocator's free pages.",
        resident_bytes,
    )
    m.add_gauge(
        "kvcmas_calibration_saved",
        "1 when what kvcmas learns is kept in --calibration-dir across restarts; 0 when it is kept in memory only "
        "(--no-calibration-dir, or an unusable directory with --allow-unsaved-calibration).",
        lambda: int(cfg.calibration_dir is not False and server.calibration_problem is None),
    )
    m.add_gauge(
        "kvcmas_calibration_save_failures",
        "Fitted maps kvcmas could not write to --calibration-dir since start-up (they stay in memory).",
        lambda: persist.save_failure_count(),
    )
