"""Correction state and fidelity of `kvcmas bench agents`.

- correction state vs kvcomm: bytes of the persistent estimator state and per-hop corrections at SmolLM2's K/V width
  and at 1024 (Llama-3-8B's), measured on a few random-weight layers in numpy and scaled to the layer count;
- fidelity: N GSM8K questions teacher-forced on the nonshared run, first-token KL, top-1, teacher-forced top-1,
  K/V relative error per method, with the oracle row and the share of the fullshared-to-oracle gap each closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..model import Model
from ..sharing import estimators as est
from ..sharing.evaluate import build_runners, evaluate
from ..sharing.methods import LEARNING_METHODS, MethodConfig, labelled_config, parse_label
from ..sharing.runner import WorkflowRunner
from ..sharing.workflow import gsm8k_workflow, load_gsm8k
from .progress import progress_bar


def correction_state(
    kd_list: list[int],
    sizes: list[int],
    n_layer_list: list[int],
    readers: int = 3,
    layers_measured: int = 2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Bytes per method for one shared span read by `readers` agents, measured by building each estimator's state
    on `layers_measured` random layers of width kd (span of min(size, 256) rows), then scaled to the size and layer
    count (the state is linear in both). kvcomm: a pool of 20 full-rank anchors; kvcmas-ref: 10 anchors at rank 32
    (bases at rank 32); kvcmas: a ridge map per edge (rank 8 + offset) and the per-hop rank-9 factors."""
    rng = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for kd, n_layer in zip(kd_list, n_layer_list, strict=True):
        m_rows = 256
        ctxs = [
            est.EdgeContext(
                "user_question",
                r,
                "m",
                *(rng.standard_normal((layers_measured, m_rows, kd)).astype(np.float32) for _ in range(4)),
            )
            for r in range(1, readers + 1)
        ]
        ridge = est.RidgeEstimator(rank=8)
        for c in ctxs:
            ridge.add_example(c)
        ridge.fit()
        per_edge_map = ridge.state_bytes() / readers / (layers_measured - 1)  # layer 0 has no map
        anchors: dict[str, float] = {}
        for name, rank, pool in (("kvcomm", None, 20), ("kvcmas-ref", 32, 10)):
            a = est.AnchorEstimator(rank=rank, base_rank=rank, seed=seed)
            for c in ctxs:
                a.record(c, is_question=True)
            # one anchor's bytes per layer and row (factors at rank 32 hold r*kd besides the rows)
            one = a.state_bytes() / layers_measured
            anchors[name] = one * pool
        for n in sizes:
            scale_rows = n / m_rows
            kvcomm = anchors["kvcomm"] * scale_rows * n_layer
            # low-rank: S*r terms scale with rows, r*kd terms do not; measure both parts from the formula check
            ref_rows = 10 * (2 + 2 * readers) * (n * 32 + 32 * kd) * 4 * n_layer
            kvcmas_state = per_edge_map * readers * (n_layer - 1)
            kvcmas_hop = readers * (n_layer - 1) * 2 * (n * 9 + 9 * kd) * 4
            out.append(
                {
                    "kd": kd,
                    "n_layer": n_layer,
                    "shared_tokens": n,
                    "kvcomm_bytes": int(kvcomm),
                    "kvcmas_ref_bytes": int(ref_rows),
                    "kvcmas_state_bytes": int(kvcmas_state),
                    "kvcmas_hop_corr_bytes": int(kvcmas_hop),
                    "kvcmas_vs_kvcomm": (kvcmas_state + kvcmas_hop) / kvcomm,
                    "kvcmas_ref_vs_kvcomm": ref_rows / kvcomm,
                    "measured_kvcmas_ref_bytes_per_anchor_layer": anchors["kvcmas-ref"] / 10,
                }
            )
    return out


def fit_runners(
    model: Model, names: list[str], agents: int, n_train: int, gen_tokens: int, oracle_rank: int
) -> dict[str, WorkflowRunner]:
    """A runner per method label in `names` (not nonshared), the learned estimators fitted on GSM8K test lines
    40.. (n_train questions, gen_tokens per agent)."""
    wf = gsm8k_workflow(agents)
    configs = {"oracle": MethodConfig("oracle", rank=oracle_rank)}
    # labels with a budget on the ridge method read the base method's fitted estimator (fitted once); the others
    # (anchor pools learn online) get their own
    ridge_labels = [m for m in names if "@" in m and parse_label(m)[0] == "kvcmas"]
    fit = [m for m in names if m not in ridge_labels]
    if ridge_labels and "kvcmas" not in fit:
        fit.append("kvcmas")
    configs.update({m: labelled_config(m) for m in fit if "@" in m})
    train = load_gsm8k(40, n_train)
    learned = [m for m in fit if parse_label(m)[0] in LEARNING_METHODS]
    bar = progress_bar(n_train * len(learned), "fit")
    built = build_runners(
        model, wf, fit, train, gen_tokens=gen_tokens, progress=lambda _n: bar.update(), configs=configs
    )
    bar.close()
    runners = {m: built[m] for m in names if m in built}
    for m in ridge_labels:
        runners[m] = WorkflowRunner(model, wf, labelled_config(m), built["kvcmas"].estimator)
    if "kvcmas" not in names:
        built["kvcmas"].close()
    return {m: runners[m] for m in names}


def fidelity(
    model: Model, methods: list[str], agents: int, n_questions: int, n_train: int, gen_tokens: int, oracle_rank: int
) -> tuple[list[dict[str, Any]], dict[str, WorkflowRunner]]:
    wf = gsm8k_workflow(agents)
    names = [m for m in methods if m != "nonshared"]
    if "oracle" not in names:
        names.append("oracle")
    runners = fit_runners(model, names, agents, n_train, gen_tokens, oracle_rank)
    bar = progress_bar(n_questions, "fidelity")
    ev = evaluate(model, wf, runners, load_gsm8k(10, n_questions), gen_tokens=gen_tokens, progress=lambda: bar.update())
    bar.close()
    rows: list[dict[str, Any]] = []
    for name in runners:
        for label, ag in (("later agents", None), *((f"agent {a}", [a]) for a in range(1, agents))):
            rows.append({"method": name, "agents": label, **ev.summary(name, ag)})
    if "fullshared" in runners:  # paired over the same questions: per-question mean over the later agents

        def per_question(name: str) -> np.ndarray:
            return np.array([np.mean([h.tf_top1 for h in q[1:]]) for q in ev.hops[name]])

        base = per_question("fullshared")
        for r in rows:
            if r["agents"] == "later agents":
                diff = per_question(r["method"]) - base
                half = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
                r["tf_top1_minus_fullshared"] = float(diff.mean())
                r["tf_top1_minus_fullshared_ci95"] = [float(diff.mean() - half), float(diff.mean() + half)]
    for r in rows:
        full = (
            next(x for x in rows if x["method"] == "fullshared" and x["agents"] == r["agents"])
            if "fullshared" in runners
            else None
        )
        orc = next(x for x in rows if x["method"] == "oracle" and x["agents"] == r["agents"])
        if full is not None and full["kl"] > orc["kl"]:
            r["kl_gap_closed"] = (full["kl"] - r["kl"]) / (full["kl"] - orc["kl"])
    return rows, runners
