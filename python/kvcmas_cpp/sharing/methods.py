"""The sharing methods, one entry each (REGISTRY): a method's MethodConfig defaults, what sessions change in them,
and its estimator factory. Adding a method is one entry here; the runner, AgentSession, the server's choices and the
benchmarks read this table.

| method | estimator | defaults |
|---|---|---|
| nonshared | none (every agent prefills its whole prompt) | |
| fullshared | none (spans shared uncorrected) | |
| kvcmas | RidgeEstimator (rank 8): learned per edge | head 4; sessions fit online, bounded reads (READ_ROWS) |
| kvcmas-ref | the reference code's anchor pool, from the model file's kvcmas.* settings | rank 32 |
| kvcomm | anchor pool with full-rank deltas | rank 0 |
| oracle | the exact delta, rank 32 (needs the exact run: benchmarks only) | rank 32 |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from . import estimators as est
from . import recompute as recompute_mod

if TYPE_CHECKING:
    from ..model import Model

GAMMA = {"mmlu": 0.29, "gsm8k": 0.32, "humaneval": 0.34, "mathvista": 0.50, "videomme": 0.60}


def reference_estimator(model: Model, workload: str, **overrides: Any) -> est.AnchorEstimator:
    """The reference (`kvcmas-ref`) estimator configured from the model file's `kvcmas.*` settings (written by
    `kvcmas convert` / `kvcmas gguf set`); keyword arguments named like the settings (`rank_k`, `anchor_pool_size`,
    `anchor_window`, `gate_threshold`, `gate_top_p`, `rank_base_k`) override them. Without a file value the gate
    threshold is the spec's per-workload γ."""
    from kvcmas_convert import kvcmas_settings

    settings: dict[str, Any] = dict(kvcmas_settings(model.metadata))
    unknown = set(overrides) - set(settings)
    if unknown:
        raise ValueError(f"unknown kvcmas settings: {', '.join(sorted(unknown))}")
    if "kvcmas.gate_threshold" not in model.metadata:
        settings["gate_threshold"] = GAMMA.get(workload, settings["gate_threshold"])
    settings.update(overrides)
    settings = dict(kvcmas_settings({f"kvcmas.{k}": v for k, v in settings.items()}))  # validates the overrides
    return est.AnchorEstimator(
        rank=int(settings["rank_k"]),
        base_rank=int(settings["rank_base_k"]) or None,
        max_anchors=int(settings["anchor_pool_size"]),
        window=int(settings["anchor_window"]),
        gamma=float(settings["gate_threshold"]),
        top_p=float(settings["gate_top_p"]),
    )


@dataclass
class MethodConfig:
    """One sharing method. head: span tokens forwarded exactly before the shared rest; tail: 'exact' forwards the
    template text after a span, 'rotate' reuses it rotate-only; gate: 'auto' (the estimator decides), 'dense'
    (force fallback: every hop is dense), 'reuse' (never fall back); chain: chain the question span hop to hop;
    calibrate > 0: a RidgeEstimator is fitted online, per edge, from its first `calibrate` training reads; cold: what
    a reader does before its edge has a map: 'reuse' (share the span with the calibration-free correction, i.e. the
    chain's correction so far: fullshared with exact head and tail on a fresh edge, and compute the exact rows after
    the reply, off the first token's path, as the training read) or 'dense' (compute the span densely: that is the
    training read).
    apply: how a reader holds a corrected span: 'fused' (the span by reference, factors applied inside attention),
    'materialize' (a private corrected copy of the rows, plain attention over it), 'auto' (a copy only where the
    correction's factors would take at least the copy's bytes, so it saves no memory: full-rank corrections; fused
    otherwise, which keeps kvcmas' memory figures). ridge_path: where the ridge estimator's factors are computed:
    'core' (C++, from the reader's base view inside the engine) or 'numpy' (the reference implementation).
    recompute: the share of a hop's shared rows (after the spans' heads) a reader recomputes in its own context,
    chosen by the rule of sharing/recompute.py in blocks of recompute_block rows (0: pure reuse; 1: every row, equal to
    nonshared); correct=False reads the other rows uncorrected (the selective-recompute-only baseline; the
    estimator still scores the rows). read_rows (cold reuse): a training read computes a long span's exact rows up to
    its first read_rows rows after the head and fits the edge on those, the rest of the span appended as the reader
    read it (0: every row; docs/cold-start.md)."""

    name: str
    head: int = 0
    tail: Literal["exact", "rotate"] = "exact"
    gate: Literal["auto", "dense", "reuse"] = "auto"
    chain: bool = True
    rank: int = 8
    calibrate: int = 0  # ridge learned online: an edge is fitted after this many training reads
    cold: Literal["reuse", "dense"] = "reuse"  # an edge without a map (online calibration): shared, or dense
    apply: Literal["auto", "fused", "materialize"] = "auto"
    ridge_path: Literal["core", "numpy"] = "core"
    recompute: float = 0.0
    recompute_block: int = recompute_mod.DEFAULT_BLOCK
    correct: bool = True
    read_rows: int = 0  # cold reuse: a training read reads a span's first this many rows (0: all of them)

    def __post_init__(self) -> None:
        if self.read_rows < 0:
            raise ValueError(f"read_rows must be >= 0 (0: every row), got {self.read_rows}")
        if not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"recompute must be in [0, 1], got {self.recompute}")
        if self.recompute_block < 1:
            raise ValueError(f"recompute_block must be >= 1, got {self.recompute_block}")


# A session's training read (cold reuse) computes a span's exact rows up to this many after its head, and the edge is
# fitted on those (MethodConfig.read_rows; 0: every row). On a 2K-token context it cuts a workflow's reads to about a
# quarter of the rows, which brings the first five workflows' engine time under half of nonshared's, with maps as
# close on average over the workflows after (docs/cold-start.md, "Bounded reads").
READ_ROWS = 512

# Online ridge: training reads per edge before kvcmas applies a learned map. One: a read holds every row of its span
# (a 2K-token context: 2K examples per layer for a 128-192-dim map), and maps fitted on one workflow's reads reuse as
# well on later workflows as maps fitted on four, while three fewer workflows pay for the reads and share cold
# (docs/cold-start.md, "How many reads").
CALIBRATION_READS = 1


@dataclass(frozen=True)
class Method:
    """One sharing method. defaults: its MethodConfig fields (a benchmark's runner); session: fields an AgentSession
    (and so the server) changes on top (kvcmas calibrates online there); estimator(model, workflow, config): a fresh
    estimator (workflow: the workflow or workload name, e.g. for kvcmas-ref's per-workload gate threshold).
    in_sessions: AgentSession runs it (oracle needs the exact run); served: kvcmas-server offers it. shares: spans
    are stored once and later readers append them by reference (False: nonshared, every reader computes its whole
    prompt, and a message stays one piece). learns: its estimator learns from dense reads (a benchmark fits it on
    training questions first: kvcmas, kvcmas-ref, kvcomm)."""

    name: str
    estimator: Callable[[Model, str, MethodConfig], est.Estimator]
    defaults: dict[str, Any] = field(default_factory=dict)
    session: dict[str, Any] = field(default_factory=dict)
    in_sessions: bool = True
    served: bool = False
    shares: bool = True
    learns: bool = False

    @property
    def learns_online(self) -> bool:
        """Sessions fit its estimator from their own training reads (calibrate > 0): its cold setting, training
        reads and calibration directory apply."""
        return bool(self.session.get("calibrate", self.defaults.get("calibrate", 0)))

    def config(self, *, for_session: bool = False, **overrides: Any) -> MethodConfig:
        """The method's MethodConfig: its defaults (plus the session's when for_session), then overrides."""
        fields = {**self.defaults, **(self.session if for_session else {}), **overrides}
        return MethodConfig(self.name, **fields)

    def session_config(
        self,
        config: MethodConfig | None = None,
        *,
        cold: Literal["reuse", "dense"] | None = None,
        recompute: float | None = None,
    ) -> MethodConfig:
        """An AgentSession's MethodConfig: `config` (default: the method's, for_session) with `cold` and `recompute`
        when given. Sessions share spans with exact tails only."""
        config = self.config(for_session=True) if config is None else config
        if cold is not None:
            if cold not in ("reuse", "dense"):
                raise ValueError(f"cold must be 'reuse' or 'dense', got {cold!r}")
            config = dataclasses.replace(config, cold=cold)
        if config.tail != "exact":
            raise ValueError("AgentSession shares spans with exact tails only (MethodConfig.tail='exact')")
        if recompute is not None:
            config = dataclasses.replace(config, recompute=float(recompute))  # validated by MethodConfig
        return config


def _no_estimator(model: Model, workflow: str, config: MethodConfig) -> est.Estimator:
    return est.Estimator()


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("nonshared", _no_estimator, served=True, shares=False),
        Method("fullshared", _no_estimator, served=True),
        Method(
            "kvcmas",
            lambda model, workflow, config: est.RidgeEstimator(rank=config.rank),
            defaults={"head": 4, "rank": 8},
            session={"calibrate": CALIBRATION_READS, "read_rows": READ_ROWS},
            served=True,
            learns=True,
        ),
        Method(
            "kvcmas-ref",
            lambda model, workflow, config: reference_estimator(model, workflow),
            defaults={"rank": 32},
            learns=True,
        ),
        Method(
            "kvcomm",
            lambda model, workflow, config: est.AnchorEstimator(
                rank=None, base_rank=None, max_anchors=20, gamma=0.3, name="kvcomm"
            ),
            defaults={"rank": 0},
            learns=True,
        ),
        Method(
            "oracle",
            lambda model, workflow, config: est.OracleEstimator(config.rank),
            defaults={"rank": 32},
            in_sessions=False,
        ),
    )
}


def names(*, session: bool = False, served: bool = False) -> tuple[str, ...]:
    """The registered methods (those AgentSession runs, with session; those the server offers, with served)."""
    return tuple(n for n, m in REGISTRY.items() if (m.in_sessions or not session) and (m.served or not served))


def method(name: str, *, session: bool = False, served: bool = False) -> Method:
    """The registry's entry for a method name; a ValueError naming the choices when there is none (among those
    AgentSession runs, with session; the server offers, with served)."""
    if name not in names(session=session, served=served):
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(names(session=session, served=served))}")
    return REGISTRY[name]


# The registry's names at import (command-line choices, messages): method() and names() see later entries too.
METHODS = names()
REFERENCE = next(n for n, m in REGISTRY.items() if not m.shares)  # the exact run other methods are measured against
LEARNING_METHODS = tuple(n for n, m in REGISTRY.items() if m.learns)
SESSION_METHODS = names(session=True)
SERVED_METHODS = names(served=True)


def default_config(name: str) -> MethodConfig:
    """The method's defaults (Method.defaults): kvcmas = ridge rank 8 + exact head 4; kvcmas-ref/kvcomm = the
    reference setup (rotate-only tail as in the reference code is selectable with tail='rotate'); oracle = exact
    delta rank 32."""
    return method(name).config()


def make_estimator(model: Model, config: MethodConfig, workflow: str) -> est.Estimator:
    """A fresh estimator of config's method."""
    return method(config.name).estimator(model, workflow, config)


BASELINE = "recompute"  # label prefix of the selective-recompute-only baseline


def parse_label(label: str) -> tuple[str, float | None, bool]:
    """A benchmark method label: a method name, `METHOD@B` (the method at recompute budget B) or `recompute@B` (the
    baseline: kvcmas' rows chosen, no correction applied). Returns (method, budget or None, correct)."""
    name, sep, budget_text = label.partition("@")
    if not sep:
        if name not in METHODS:
            raise ValueError(f"unknown method {label!r}; choose from {', '.join(METHODS)}, METHOD@B or recompute@B")
        return name, None, True
    try:
        budget = float(budget_text)
    except ValueError:
        raise ValueError(f"{label!r}: the recompute budget after @ must be a number in [0, 1]") from None
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"{label!r}: the recompute budget must be in [0, 1]")
    if name == BASELINE:
        return "kvcmas", budget, False
    if name not in METHODS or not REGISTRY[name].shares:
        raise ValueError(f"{label!r}: budgets apply to the sharing methods (or {BASELINE}@B)")
    return name, budget, True


def labelled_config(label: str, base: MethodConfig | None = None) -> MethodConfig:
    """The MethodConfig a label names: `base` (default: the method's default_config) with the label's budget."""
    name, budget, correct = parse_label(label)
    cfg = base if base is not None else default_config(name)
    if budget is None:
        return cfg
    return dataclasses.replace(cfg, recompute=budget, correct=correct)
