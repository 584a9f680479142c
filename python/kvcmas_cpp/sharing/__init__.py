"""KVCMAS's method layer: agent workflows whose shared spans are stored once and read by later agents with
low-rank KV corrections applied inside attention (see docs/kvcmas-estimators.md)."""

from __future__ import annotations

from .estimators import AnchorEstimator, Estimator, OracleEstimator, RidgeEstimator
from .methods import METHODS, REGISTRY, MethodConfig, default_config
from .runner import HopReport, RequestResult, WorkflowRunner
from .span import Span
from .workflow import Agent, Template, Workflow, build_template, gsm8k_path, gsm8k_workflow, load_gsm8k

__all__ = [
    "METHODS",
    "Agent",
    "AnchorEstimator",
    "Estimator",
    "HopReport",
    "MethodConfig",
    "OracleEstimator",
    "REGISTRY",
    "RequestResult",
    "RidgeEstimator",
    "Span",
    "Template",
    "Workflow",
    "WorkflowRunner",
    "build_template",
    "default_config",
    "gsm8k_path",
    "gsm8k_workflow",
    "load_gsm8k",
]
