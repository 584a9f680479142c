"""Concurrency (`kvcmas bench agents --concurrent ...`): N workflows at once (threads, each its own session) per
level and method: TTFT percentiles of later hops, throughput and peak KV bytes."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..agents import Response
from ..model import Model
from .accuracy import calibration_examples, calibration_tokens, run_workflow
from .progress import progress_bar
from .tasks import get_task


def concurrent(
    model: Model,
    methods: list[str],
    levels: list[int],
    max_tokens: int,
    calibrate: int,
    calibrate_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """N GSM8K workflows at once per level and method (one session per thread); calibrate_tokens as in accuracy."""
    n_calibration_tokens = calibration_tokens(calibrate_tokens, max_tokens)
    task = get_task("gsm8k")
    questions = [e.question for e in task.load(0, max(levels))]
    if calibrate and "kvcmas" in methods:
        for ex in calibration_examples(task, calibrate, max(levels)):
            run_workflow(model, task, "kvcmas", ex.question, n_calibration_tokens, calibrate)
    rows: list[dict[str, Any]] = []
    bar = progress_bar(len(levels) * len(methods), "concurrent")
    for n in levels:
        for m in methods:
            results: list[list[Response]] = []
            errors: list[BaseException] = []
            peak = [model.kv_bytes_in_use]
            stop = threading.Event()

            def watch(peak: list[int] = peak, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], model.kv_bytes_in_use)
                    time.sleep(0.005)

            def work(q: str, m: str = m, results: list = results, errors: list = errors) -> None:
                try:
                    results.append(run_workflow(model, task, m, q, max_tokens, calibrate))
                except BaseException as e:  # noqa: BLE001 - reported after join
                    errors.append(e)

            base = model.kv_bytes_in_use
            watcher = threading.Thread(target=watch)
            watcher.start()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=work, args=(q,)) for q in questions[:n]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            stop.set()
            watcher.join()
            if errors:
                raise errors[0]
            later = np.array([r.stats.ttft_ms for rs in results for r in rs[1:]])
            generated = sum(r.stats.generated_tokens for rs in results for r in rs)
            rows.append(
                {
                    "workflows": n,
                    "method": m,
                    "ttft_p50_ms": float(np.percentile(later, 50)),
                    "ttft_p90_ms": float(np.percentile(later, 90)),
                    "ttft_p99_ms": float(np.percentile(later, 99)),
                    "workflows_per_s": n / wall,
                    "generated_tokens_per_s": generated / wall,
                    "peak_kv_bytes": int(peak[0] - base),
                    "wall_s": wall,
                }
            )
            bar.update()
    bar.close()
    return rows
