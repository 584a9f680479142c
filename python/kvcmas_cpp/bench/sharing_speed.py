"""Speed and memory of `kvcmas bench agents`: a 4-agent workflow whose shared span (the question slot) holds N tokens
of GSM8K text; later agents' TTFT, KV bytes of the request and correction bytes per method, against nonshared (and
llama.cpp's rows with --compare llama-cpp: same prompts, its f16 KV)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..model import Model
from ..sharing.evaluate import question_ids
from ..sharing.methods import labelled_config
from ..sharing.runner import WorkflowRunner
from ..sharing.workflow import gsm8k_workflow, load_gsm8k
from .progress import progress_bar


def _shared_context(model: Model, n: int) -> list[list[int]]:
    """Two different n-token contexts made of consecutive GSM8K questions (one to warm up, one measured)."""
    texts = load_gsm8k(100, 400)
    ids: list[int] = []
    for t in texts:
        ids += question_ids(model, t + "\n")
        if len(ids) >= 2 * n:
            break
    if len(ids) < 2 * n:
        raise ValueError(f"not enough GSM8K text for two {n}-token contexts")
    return [ids[:n], ids[n : 2 * n]]


def speed_and_memory(
    model: Model,
    methods: list[str],
    agents: int,
    sizes: list[int],
    decodes: list[int],
    fitted: dict[str, WorkflowRunner],
    apply: str = "auto",
) -> list[dict[str, Any]]:
    """Per shared size, decode length and method: the measured request's hops (after one warm-up request)."""
    wf = gsm8k_workflow(agents)
    rows: list[dict[str, Any]] = []
    bar = progress_bar(len(sizes) * len(decodes) * len(methods) * 2, "speed")
    for n, decode in ((n, d) for n in sizes for d in decodes):
        contexts = _shared_context(model, n)
        for name in methods:
            cfg = labelled_config(name)
            cfg.apply = apply  # type: ignore[assignment]
            runner = WorkflowRunner(model, wf, cfg, fitted[name].estimator if name in fitted else None)
            for i, ctx in enumerate(contexts):
                res = runner.run(ctx, f"ctx-{n}-{i}", max_new_tokens=decode)
                bar.update()
                if i == len(contexts) - 1:
                    later = res.hops[1:]
                    rows.append(
                        {
                            "shared_tokens": n,
                            "decode_tokens": decode,
                            "method": name,
                            "first_ttft_ms": res.hops[0].ttft_ms,
                            "later_ttft_ms": float(np.mean([h.ttft_ms for h in later])),
                            "computed_tokens": [h.computed_tokens for h in res.hops],
                            "reused_tokens": [h.reused_tokens for h in res.hops],
                            "modes": [h.mode for h in res.hops],
                            "kv_bytes": int(sum(h.kv_bytes for h in res.hops)),
                            "kv_bytes_per_hop": [int(h.kv_bytes) for h in res.hops],
                            "corr_bytes": int(sum(h.corr_bytes for h in res.hops)),
                            "peak_bytes": int(res.hops[-1].peak_bytes),
                            "corr_rank": [h.corr_rank for h in res.hops],
                            "materialized_tokens": [h.materialized_tokens for h in res.hops],
                            "estimator_state_bytes": int(runner.estimator.state_bytes()),
                            "template_kv_bytes": int(runner.template_kv_bytes),
                        }
                    )
                res.close()
            runner.close()
    bar.close()
    base = {(r["shared_tokens"], r["decode_tokens"]): r for r in rows if r["method"] == "nonshared"}
    for r in rows:
        b = base.get((r["shared_tokens"], r["decode_tokens"]))
        if b is not None:
            r["later_ttft_speedup"] = b["later_ttft_ms"] / max(r["later_ttft_ms"], 1e-9)
            r["kv_vs_nonshared"] = r["kv_bytes"] / max(b["kv_bytes"], 1)
    return rows


def llama_cpp_rows(
    model_path: str, model: Model, threads: int | None, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """llama.cpp on the same team, per nonshared row: each hop keeps the prefix nonshared served from its prefix
    cache (llama.cpp's prompt cache keeps a common prefix too) and times the prefill of the rest plus the first
    token, as nonshared computes it (no engine shares KV across agents' prompts). KV: f16 rows (llama.cpp's
    default) of each hop's prompt and generated tokens."""
    from llama_cpp import Llama  # optional extra: pip install 'kvcmas_cpp[bench]'

    from .core import prompt_ids

    base = [r for r in rows if r["method"] == "nonshared"]
    if not base:
        raise ValueError("--compare llama-cpp times what nonshared computes: include nonshared in --method")
    n_threads = threads or os.cpu_count() or 1
    row_bytes = 2 * model.n_layer * 2 * model.n_head_kv * model.head_dim  # K and V, f16
    out: list[dict[str, Any]] = []
    for b in base:
        prompts = [c + r for c, r in zip(b["computed_tokens"], b["reused_tokens"], strict=True)]
        n_ctx = max(prompts) + b["decode_tokens"] + 8
        llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads, verbose=False)
        ids = prompt_ids(llm.n_vocab(), max(prompts))
        n_vocab = llm.n_vocab()
        ttfts: list[float] = []
        for prompt, computed in zip(prompts, b["computed_tokens"], strict=True):
            llm.reset()
            llm.eval(ids[: prompt - computed])  # the cached prefix, not timed (nonshared's is not either)
            t0 = time.perf_counter()
            llm.eval(ids[prompt - computed : prompt])
            last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
            int(np.argmax(last))
            ttfts.append(1000.0 * (time.perf_counter() - t0))
        del llm
        kv = [(p + b["decode_tokens"]) * row_bytes for p in prompts]
        later = float(np.mean(ttfts[1:])) if len(ttfts) > 1 else float("nan")
        out.append(
            {
                "shared_tokens": b["shared_tokens"],
                "decode_tokens": b["decode_tokens"],
                "method": "llama.cpp",
                "first_ttft_ms": ttfts[0],
                "later_ttft_ms": later,
                "computed_tokens": list(b["computed_tokens"]),
                "reused_tokens": [p - c for p, c in zip(prompts, b["computed_tokens"], strict=True)],
                "modes": ["dense"] * len(prompts),
                "kv_bytes": int(sum(kv)),
                "kv_bytes_per_hop": kv,
                "corr_bytes": 0,
                "later_ttft_speedup": b["later_ttft_ms"] / max(later, 1e-9),
                "kv_vs_nonshared": sum(kv) / max(b["kv_bytes"], 1),
            }
        )
    return out
