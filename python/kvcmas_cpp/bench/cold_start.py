"""Cold start (`kvcmas bench agents --cold-start N`): fresh sessions of the GSM8K team over an N-token shared context,
workflow after workflow from a fresh estimator: later-agent TTFT and first-token KL against nonshared while kvcmas
calibrates (cold reuse vs dense) and after."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..agents import AgentSession
from ..model import Model
from ..sharing import methods as registry
from ..sharing.fidelity import kl_divergence
from ..sharing.ridge import RidgeEstimator, RowMoments
from ..sharing.training_read import canonical
from ..sharing.workflow import gsm8k_contexts
from .progress import progress_bar

# row name -> (session method, cold policy, when reads run, MethodConfig overrides; None: the defaults)
ColdMethod = tuple[str, str | None, str | None, dict[str, Any] | None]
COLD_METHODS: dict[str, ColdMethod] = {
    "nonshared": ("nonshared", None, None, None),
    "fullshared": ("fullshared", None, None, None),
    # the defaults: reads off the agents' path (idle, close()), each computing a bounded part of its span (read_rows)
    "kvcmas": ("kvcmas", "reuse", "idle", None),
    "kvcmas read_rows=0": ("kvcmas", "reuse", "idle", {"read_rows": 0}),  # reads of every row (the earlier default)
    "kvcmas reads=eager": ("kvcmas", "reuse", "eager", None),  # reads on the next call's path (the first default)
    "kvcmas cold=dense": ("kvcmas", "dense", "idle", None),
}


def cold_rows(names: list[str] | None) -> dict[str, ColdMethod]:
    """The COLD_METHODS rows named (None: all of them), nonshared first whether named or not (the reference); a
    ValueError naming the choices for a name that is not a row."""
    if names is None:
        return dict(COLD_METHODS)
    unknown = [n for n in names if n not in COLD_METHODS]
    if unknown:
        raise ValueError(f"unknown cold-start rows {unknown}; choose from {', '.join(COLD_METHODS)}")
    return {n: COLD_METHODS[n] for n in dict.fromkeys(["nonshared", *names])}


def _read_rows_of(model: Model, context: str) -> tuple[np.ndarray, np.ndarray]:
    """The solver's (second agent's) training read of a context, every row: its maps' inputs and targets as the
    ridge estimator takes them (RidgeEstimator.add_rows): base rows x and deltas y, [2 * (n_layer - 1), n, kd]."""
    from ..sharing import estimators as est
    from ..sharing.workflow import gsm8k_workflow

    config = registry.method("kvcmas", session=True).config(for_session=True, read_rows=0)
    team = AgentSession(
        model,
        "kvcmas",
        calibration_dir=False,
        training_reads="manual",
        config=config,
        estimator=est.RidgeEstimator(rank=config.rank),
    )
    with team:
        members = [team.agent(a.name, system=a.role, template=a.user_template) for a in gsm8k_workflow(4).agents[:2]]
        team.share(context)
        for member in members:
            with team.prefill_agent(member) as p:
                team.finish(p, [int(np.argmax(p.logits))])
        (read,) = team.take_training_reads()
        try:
            part = max(read.parts, key=lambda q: q.n)  # the context
            computing = sum(-(-len(x) // read.chunk) for x in read.pieces if isinstance(x, list))
            while read.steps < computing:
                read.step()
            base_k, base_v = canonical(model, part.base_seq, part.base_pos, part.n)
            exact_k, exact_v = canonical(model, read.source, part.pos, part.n)
        finally:
            read.close()
    n_layer, n, kd = base_k.shape
    x = np.stack([base_k[1:], base_v[1:]], axis=1).reshape(2 * (n_layer - 1), n, kd)
    y = np.stack([exact_k[1:] - base_k[1:], exact_v[1:] - base_v[1:]], axis=1).reshape(x.shape)
    return x, y


def _residual_ratio(res: np.ndarray, y: np.ndarray) -> Callable[[Any], float]:
    """sel -> ||res[sel]||^2 / ||y[sel]||^2."""
    return lambda sel: float(np.sum(res[sel] ** 2) / max(float(np.sum(y[sel] ** 2)), 1e-30))


def read_rows_fidelity(
    model: Model, shared_tokens: int, read_rows: tuple[int, ...] = (256, 512, 1024, 0)
) -> list[dict[str, Any]]:
    """How close the maps a bounded read fits stay (MethodConfig.read_rows): the solver's edge of the GSM8K team,
    maps fitted (as the estimator fits them, rank 8) on the first N rows of a full read of the first cold-start
    context, applied to the second context's base rows. Per N (0: every row), the maps as the estimator makes them
    (`bounded`: fitted with RidgeEstimator.bounded_alpha, applied to rows < N only, RidgeMap.rows) and, for N > 0, as
    they were before the bound (`every row`: alpha 0.1, applied to every row): the held-out residual
    ||exact - base - predicted||^2 / ||exact - base||^2 over layers 1 on (1.0: no correction, fullshared), for K, V,
    the first 512 rows and the rest."""
    first, second = (_read_rows_of(model, c) for c in gsm8k_contexts(model, shared_tokens, 2))
    x1, y1 = first
    x2, y2 = second
    ridge = RidgeEstimator(rank=8)
    out: list[dict[str, Any]] = []
    for rows in read_rows:
        n = min(rows or x1.shape[1], x1.shape[1])
        bounded = n < x1.shape[1]
        moments = RowMoments(x1.shape[0], x1.shape[2])
        moments.add(x1[:, :n], y1[:, :n])
        variants = [("bounded", ridge.bounded_alpha, n), ("every row", ridge.alpha, 0)] if bounded else []
        for label, alpha, applied in variants or [("every row", ridge.alpha, 0)]:
            maps = moments.fit(8, alpha)
            res = []
            for i, m in enumerate(maps):
                m.rows = applied
                a, b = m.factors(x2[i])
                res.append(y2[i] - a @ b)
            ratio = _residual_ratio(np.stack(res), y2)
            out.append(
                {
                    "read_rows": rows,
                    "rows_fitted": n,
                    "maps": f"{label} (alpha {alpha:g})",
                    "rows_applied": x2.shape[1],
                    "residual": ratio(np.s_[:]),
                    "residual_k": ratio(np.s_[0::2]),
                    "residual_v": ratio(np.s_[1::2]),
                    "residual_first_512": ratio(np.s_[:, :512]),
                    "residual_after_512": ratio(np.s_[:, 512:]) if x2.shape[1] > 512 else float("nan"),
                    # the rows past those fitted (1.0: the map leaves them as the chain does)
                    "residual_past": ratio(np.s_[:, n:]) if x2.shape[1] > n else float("nan"),
                }
            )
    return out


def print_read_rows_fidelity(rows: list[dict[str, Any]]) -> None:
    print(f"## bounded reads: held-out residual of the maps fitted on a read's first N rows ({rows[0]['rows_applied']}")
    print("rows applied; 1.0 = no correction; bounded: the maps as the estimator makes them, applied to rows < N)")
    print("| read_rows | rows fitted | maps | residual | K | V | rows 0-511 | rows 512 on | rows past those fitted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['read_rows'] or 'every row (0)'} | {r['rows_fitted']} | {r['maps']} | {r['residual']:.3f} | "
            f"{r['residual_k']:.3f} | {r['residual_v']:.3f} | {r['residual_first_512']:.3f} | "
            f"{r['residual_after_512']:.3f} | {r['residual_past']:.3f} |"
        )


def cold_start(
    model: Model,
    shared_tokens: int,
    workflows: int,
    max_tokens: int,
    agents: int = 4,
    methods: dict[str, ColdMethod] | None = None,
) -> list[dict[str, Any]]:
    """Per method (COLD_METHODS) and workflow: a fresh session of the GSM8K team reading a new shared_tokens-token
    context, its agents called one after another as a program would, then closed; the kvcmas estimators fresh at the
    first workflow (in memory only); methods: rows to run instead of COLD_METHODS (nonshared first). Replies are
    nonshared's greedy ones, teacher-forced in the other methods, so every method's later agents see the same prompts:
    first-token KL and top-1 are against nonshared's logits for the very same prompt. An agent's TTFT is the caller's
    wait for its prompt (prefill_agent: its own prefill, and under reads=eager the reads it runs first); engine_ms
    is every piece of engine work the workflow took: the calls' prefills and replies (nonshared's token-by-token
    decoding left out, the others' teacher-forced rows counted), close() (it runs what reads are left) and the
    training reads an idle worker ran between them (training_read_ms: the reads wherever they ran)."""
    from ..sharing import estimators as est
    from ..sharing.workflow import gsm8k_workflow

    wf = gsm8k_workflow(agents)
    contexts = gsm8k_contexts(model, shared_tokens, workflows)
    eog = model.tokenizer.eog_ids
    forced: list[list[list[int]]] = []  # per workflow, per agent: nonshared's reply
    reference: list[list[np.ndarray]] = []  # per workflow, per agent: nonshared's first-token logits
    rows: list[dict[str, Any]] = []
    methods = COLD_METHODS if methods is None else methods
    bar = progress_bar(len(methods) * workflows, "cold start")
    ridges = {name: est.RidgeEstimator(rank=8) for name, spec in methods.items() if spec[0] == "kvcmas"}
    # workflow by workflow, every method in turn: a machine whose load drifts slows every row alike
    for w, ctx in enumerate(contexts):
        for name, (method, cold, when, overrides) in methods.items():
            ridge = ridges.get(name)
            config = None
            if method == "kvcmas":
                base = registry.method("kvcmas", session=True).config(for_session=True)
                config = dataclasses.replace(base, **(overrides or {}))
            kw: dict[str, Any] = {}
            if cold:
                kw = {"cold": cold, "estimator": ridge, "config": config, "training_reads": when}
            ttft: list[float] = []
            kl: list[float] = []
            top1: list[bool] = []
            gates: list[str] = []
            calls_ms, reads_on_calls, cal = 0.0, 0.0, 0
            t_start = time.perf_counter()
            team = AgentSession(model, method, calibration_dir=False, **kw)
            members = [team.agent(a.name, system=a.role, template=a.user_template) for a in wf.agents]
            team.share(ctx)
            for i, ag in enumerate(members):
                t0 = time.perf_counter()
                p = team.prefill_agent(ag)
                ttft.append((time.perf_counter() - t0) * 1000.0)
                if method == "nonshared":
                    ids = [int(np.argmax(p.logits))]
                    while len(ids) < max_tokens and ids[-1] not in eog:
                        (lg,) = model.decode_batch([(p.seq, ids[-1:])])
                        ids.append(int(np.argmax(lg)))
                    if i == 0:
                        forced.append([])
                        reference.append([])
                    forced[w].append(ids)
                    reference[w].append(p.logits.astype(np.float64))
                else:
                    kl.append(kl_divergence(reference[w][i], p.logits))
                    top1.append(bool(np.argmax(p.logits) == np.argmax(reference[w][i])))
                t1 = time.perf_counter()
                team.finish(p, forced[w][i])
                p.close()
                calls_ms += ttft[-1] + (time.perf_counter() - t1) * 1000.0
                stats = p.stats
                gates.append(stats["gate"])
                cal += stats["calibration_tokens_scheduled"]
                reads_on_calls += stats["training_read_ms"]
            read_ms_before_close = team.training_read_ms_total
            t2 = time.perf_counter()
            team.close()
            close_ms = (time.perf_counter() - t2) * 1000.0
            workflow_ms = (time.perf_counter() - t_start) * 1000.0
            read_ms = team.training_read_ms_total
            rows.append(
                {
                    "method": name,
                    "workflow": w + 1,
                    "shared_tokens": shared_tokens,
                    "later_ttft_ms": float(np.mean(ttft[1:])),
                    "first_ttft_ms": ttft[0],
                    "later_ttft_each_ms": ttft[1:],
                    "later_kl": float(np.mean(kl[1:])) if kl else 0.0,
                    "later_top1": float(np.mean(top1[1:])) if top1 else 1.0,
                    "first_identical": bool(top1[0] and kl[0] == 0.0) if kl else True,
                    "gates": gates[1:],
                    "training_read_ms": read_ms,
                    "training_read_ms_on_calls": reads_on_calls,
                    # reads run by the idle worker between the calls (not inside any timed call or close())
                    "training_read_ms_idle": max(read_ms_before_close - reads_on_calls, 0.0),
                    "close_ms": close_ms,
                    "engine_ms": calls_ms + close_ms + max(read_ms_before_close - reads_on_calls, 0.0),
                    "workflow_ms": workflow_ms,
                    "calibration_tokens": cal,
                }
            )
            bar.update()
    bar.close()
    order = list(methods)
    rows.sort(key=lambda r: (order.index(r["method"]), r["workflow"]))
    by_workflow = {r["workflow"]: r for r in rows if r["method"] == "nonshared"}
    for r in rows:
        b = by_workflow[r["workflow"]]
        r["later_ttft_speedup"] = b["later_ttft_ms"] / max(r["later_ttft_ms"], 1e-9)
        r["engine_vs_nonshared"] = r["engine_ms"] / max(b["engine_ms"], 1e-9)
    return rows


def cold_start_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: engine time and training reads over all its workflows, against nonshared's engine time; the later
    agents' TTFT speedup on workflows 1 and 2 (nan without a second), their first-token KL on workflow 1 and its
    mean over the workflows after, and their top-1 agreement over every workflow (issue 48's goals)."""
    out: list[dict[str, Any]] = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["workflow"])
        later = [r["later_kl"] for r in mine[1:]]
        out.append(
            {
                "method": m,
                "workflows": len(mine),
                "engine_ms": sum(r["engine_ms"] for r in mine),
                "training_read_ms": sum(r["training_read_ms"] for r in mine),
                "workflow_ms": sum(r["workflow_ms"] for r in mine),
                "ttft_speedup_1": mine[0]["later_ttft_speedup"],
                "ttft_speedup_2": mine[1]["later_ttft_speedup"] if len(mine) > 1 else float("nan"),
                "kl_1": mine[0]["later_kl"],
                "kl_after": float(np.mean(later)) if later else float("nan"),
                "top1": float(np.mean([r["later_top1"] for r in mine])),
            }
        )
    base = next((t["engine_ms"] for t in out if t["method"] == "nonshared"), None)
    for t in out:
        t["engine_vs_nonshared"] = t["engine_ms"] / base if base else float("nan")
    return out


def print_cold_start(rows: list[dict[str, Any]]) -> None:
    print(f"## cold start: fresh sessions over {rows[0]['shared_tokens']} shared tokens, fresh estimators (GSM8K team)")
    print(
        "| method | workflow | later-agent TTFT ms (caller's wait) | speedup vs nonshared | first-token KL (later "
        "agents) | top-1 | gates of later agents | training reads ms (on calls) | engine ms | vs nonshared | "
        "calibration rows |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['workflow']} | {r['later_ttft_ms']:.0f} | {r['later_ttft_speedup']:.2f}x | "
            f"{r['later_kl']:.3e} | {100 * r['later_top1']:.0f}% | {', '.join(sorted(set(r['gates'])))} | "
            f"{r['training_read_ms']:.0f} ({r['training_read_ms_on_calls']:.0f}) | {r['engine_ms']:.0f} | "
            f"{r['engine_vs_nonshared']:.2f}x | {r['calibration_tokens']} |"
        )
    print_kl_side_by_side(rows)
    print(
        "\n| method | workflows | later-agent TTFT vs nonshared, workflow 1 / 2 | first-token KL, workflow 1 / mean "
        "of the rest | top-1 | engine s (calls, reads, close) | vs nonshared | training reads s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for t in cold_start_totals(rows):
        print(
            f"| {t['method']} | {t['workflows']} | {t['ttft_speedup_1']:.2f}x / {t['ttft_speedup_2']:.2f}x | "
            f"{t['kl_1']:.3e} / {t['kl_after']:.3e} | {100 * t['top1']:.0f}% | {t['engine_ms'] / 1000:.1f} | "
            f"{t['engine_vs_nonshared']:.2f}x | {t['training_read_ms'] / 1000:.1f} |"
        )


def print_kl_side_by_side(rows: list[dict[str, Any]], a: str = "kvcmas", b: str = "kvcmas read_rows=0") -> None:
    """Per workflow, the later agents' first-token KL of two rows (the default's bounded reads against reads of every
    row, on the same contexts) and their ratio; nothing when either row was not run."""
    kl = {(r["method"], r["workflow"]): r["later_kl"] for r in rows}
    workflows = sorted({w for m, w in kl if m == a} & {w for m, w in kl if m == b})
    if not workflows:
        return
    print(f"\n| workflow | first-token KL, {a} | {b} | ratio |")
    print("|---|---|---|---|")
    for w in workflows:
        ka, kb = kl[(a, w)], kl[(b, w)]
        print(f"| {w} | {ka:.3e} | {kb:.3e} | {ka / kb if kb else float('nan'):.2f} |")
