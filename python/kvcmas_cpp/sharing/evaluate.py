"""Evaluation mode: every method teacher-forced on the exact run's outputs, fidelity per hop against it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from ..model import Model
from . import estimators as est
from .blas_threads import single_threaded_blas
from .methods import MethodConfig, default_config
from .runner import HopReport, WorkflowRunner
from .workflow import Workflow


def question_ids(model: Model, text: str) -> list[int]:
    """The shared span's ids: the question tokenized once, identical in every agent."""
    return model.tokenizer.encode(text, add_special=False, parse_special=False)


@dataclass
class Evaluation:
    """Per method, the hop reports of every evaluated question (hops[method][question][agent])."""

    hops: dict[str, list[list[HopReport]]] = field(default_factory=dict)
    state_bytes: dict[str, int] = field(default_factory=dict)

    def summary(self, method: str, agents: Sequence[int] | None = None) -> dict[str, float]:
        """Means over questions and the given agents (default: every agent after the first)."""
        rows = [h for q in self.hops[method] for h in q if (h.agent in agents if agents is not None else h.agent > 0)]
        k_err = np.array([h.k_err for h in rows])
        v_err = np.array([h.v_err for h in rows])
        return {
            "kl": float(np.mean([h.kl for h in rows])),
            "top1": float(np.mean([h.top1 for h in rows])),
            "tf_top1": float(np.mean([h.tf_top1 for h in rows])),
            "k_err": float(k_err.mean()),
            "v_err": float(v_err.mean()),
            "computed_tokens": float(np.mean([h.computed_tokens for h in rows])),
            "reuse_share": float(np.mean([h.mode == "reuse" for h in rows])),
            "corr_bytes": float(np.mean([h.corr_bytes for h in rows])),
            "state_bytes": float(self.state_bytes.get(method, 0)),
        }


def build_runners(
    model: Model,
    workflow: Workflow,
    methods: Iterable[str],
    train: Sequence[str],
    gen_tokens: int = 8,
    progress: Callable[[str], None] | None = None,
    configs: dict[str, MethodConfig] | None = None,
) -> dict[str, WorkflowRunner]:
    """Runners for the methods, with learned estimators fitted / calibrated on the training questions (the ridge map
    on exact runs; the anchor pools by running the method's own online logic)."""
    runners: dict[str, WorkflowRunner] = {}
    with single_threaded_blas():
        for name in methods:
            _build_one(model, workflow, name, train, gen_tokens, progress, configs, runners)
    return runners


def _build_one(
    model: Model,
    workflow: Workflow,
    name: str,
    train: Sequence[str],
    gen_tokens: int,
    progress: Callable[[str], None] | None,
    configs: dict[str, MethodConfig] | None,
    runners: dict[str, WorkflowRunner],
) -> None:
    cfg = (configs or {}).get(name) or default_config(name)
    runner = WorkflowRunner(model, workflow, cfg)
    if runner.estimator.learns_from_reads:  # offline: dense runs of training questions, then one fit
        trainer = WorkflowRunner(model, workflow, MethodConfig("nonshared", head=cfg.head), runner.estimator)
        for i, q in enumerate(train):
            trainer.run(question_ids(model, q), f"train-{i}", max_new_tokens=gen_tokens, ridge_training=True).close()
            if progress:
                progress(name)
        trainer.close()
        cast(est.LearnsFromReads, runner.estimator).fit()
    elif runner.estimator.observes_dense:  # the anchor pools fill from the method's own dense hops
        for i, q in enumerate(train):
            runner.run(question_ids(model, q), f"train-{i}", max_new_tokens=gen_tokens).close()
            if progress:
                progress(name)
    runners[name] = runner


def evaluate(
    model: Model,
    workflow: Workflow,
    runners: dict[str, WorkflowRunner],
    questions: Sequence[str],
    gen_tokens: int = 8,
    progress: Callable[[], None] | None = None,
) -> Evaluation:
    """Runs the exact (nonshared) workflow live per question, then every method teacher-forced on its outputs."""
    with single_threaded_blas():
        return _evaluate(model, workflow, runners, questions, gen_tokens, progress)


def _evaluate(
    model: Model,
    workflow: Workflow,
    runners: dict[str, WorkflowRunner],
    questions: Sequence[str],
    gen_tokens: int,
    progress: Callable[[], None] | None,
) -> Evaluation:
    exact_runner = WorkflowRunner(model, workflow, MethodConfig("nonshared"))
    ev = Evaluation()
    for i, q in enumerate(questions):
        ids = question_ids(model, q)
        exact = exact_runner.run(ids, f"eval-{i}", max_new_tokens=gen_tokens)
        forced = [h.generated for h in exact.hops]
        for name, runner in runners.items():
            res = runner.run(ids, f"eval-{i}", forced=forced, exact=exact)
            ev.hops.setdefault(name, []).append(res.hops)
            res.close()
        exact.close()
        if progress:
            progress()
    for name, runner in runners.items():
        ev.state_bytes[name] = runner.estimator.state_bytes()
    exact_runner.close()
    return ev
