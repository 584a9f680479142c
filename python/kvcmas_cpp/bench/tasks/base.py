"""The task interface of the evaluation harness: examples, the agent roster as a workflow, answer extraction, scoring.

A task's workflow follows the spec (§2.1, §6.1): three role agents in the FullConnected DAG (agent i reads the
outputs of agents 0..i-1) and a final decision agent (FinalRefer) that reads every role agent. The question reaches
every agent as `lead_in + {user_question}`; the lead-in is the spec's `--prefix` (GSM8K "Q:\\n", MMLU and HumanEval
"The task is:\\n\\n").
"""

from __future__ import annotations

import abc
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...sharing.workflow import Workflow, team_workflow


@dataclass(frozen=True)
class Example:
    """One benchmark item. question: the text that fills {user_question} (without the lead-in); reference: the
    gold answer in the form `Task.extract` returns (GSM8K: a number, MMLU: a letter, HumanEval: the canonical
    solution); extra: task-specific fields (HumanEval: prompt, test, entry_point; MMLU: choices, topic)."""

    id: str
    question: str
    reference: str
    extra: dict[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """A benchmark. Subclasses set the class attributes and implement load/workflow/extract/score."""

    name: ClassVar[str]
    lead_in: ClassVar[str]
    gamma: ClassVar[float]  # the spec's reuse-gate threshold γ for this benchmark

    @abc.abstractmethod
    def load(self, start: int, count: int) -> list[Example]:
        """Examples [start, start + count) in the task's evaluation order. Raises ValueError when the data set has
        fewer, FileNotFoundError when its file is missing."""

    @abc.abstractmethod
    def size(self) -> int:
        """How many examples the data set has (FileNotFoundError when its file is missing)."""

    # the roster: (name, system prompt) of the role agents, the decision agent, and the template endings
    roles: ClassVar[tuple[tuple[str, str], ...]] = ()
    decision: ClassVar[tuple[str, str]] = ("Decision Maker", "")
    follow_up: ClassVar[str] = ""
    final_instruction: ClassVar[str] = ""

    def workflow(self, n_agents: int = 4, topology: str = "full") -> Workflow:
        """The spec's roster: n_agents - 1 role agents (cycling the three roles) and the decision agent last, in the
        FullConnected DAG ('full') or a chain (see sharing.workflow.team_workflow)."""
        return team_workflow(
            self.name,
            self.roles,
            self.decision,
            self.lead_in,
            n_agents,
            follow_up=self.follow_up,
            final_instruction=self.final_instruction,
            topology=topology,
        )

    @abc.abstractmethod
    def extract(self, text: str) -> str | None:
        """The answer a model's final text gives, normalised as `Example.reference` is; None when it gives none."""

    @abc.abstractmethod
    def score(self, example: Example, text: str) -> bool:
        """True when the model's final text answers `example` correctly."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, lead_in={self.lead_in!r}, gamma={self.gamma})"


def check_range(start: int, count: int, available: int, source: str) -> None:
    """Validates a [start, start + count) slice of a data set with `available` items."""
    if start < 0 or count < 0:
        raise ValueError(f"{source}: start and count must be non-negative, got start={start}, count={count}")
    if start + count > available:
        raise ValueError(f"{source} has only {available} examples, asked for [{start}, {start + count})")


def package_data(package: str, relative: str, install: str) -> Path:
    """A data file shipped inside an installed package, located without importing it (`install`: how to get it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {package} package is not installed: `{install}`")
    roots = list(spec.submodule_search_locations)
    for root in roots:
        path = Path(root) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(f"{package} is installed but has no {relative} in {roots}")
