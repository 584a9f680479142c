"""The task interface of the evaluation harness: examples, the agent roster as a workflow, answer extraction, scoring.

A task's workflow follows the spec (§2.1, §6.1): three role agents in the FullConnected DAG (agent i reads the
outputs of agents 0..i-1) and a final decision agent (FinalRefer) that reads every role agent. The question reaches
every agent as `lead_in + {user_question}`; the lead-in is the spec's `--prefix` (GSM8K "Q:\\n", MMLU and HumanEval
"The task is:\\n\\n").
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..sharing.workflow import Agent, Workflow, response_placeholder


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
    def workflow(self, n_agents: int = 4) -> Workflow:
        """The spec's roster: n_agents - 1 role agents (cycling the three roles) and the decision agent last."""

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


def fully_connected_workflow(
    name: str,
    roles: Sequence[tuple[str, str]],
    decision: tuple[str, str],
    lead_in: str,
    n_agents: int = 4,
    *,
    follow_up: str = "",
    final_instruction: str,
) -> Workflow:
    """Builds the FullConnected DAG (0→1, 0→2, 1→2, ...) plus the decision agent reading every role agent, with the
    same template shape as `gsm8k_workflow`: `lead_in{user_question}`, then each upstream output under
    "<name>'s output:", then `follow_up` (agents after the first) or `final_instruction` (decision agent).

    roles: (name, system prompt) cycled over the n_agents - 1 role agents; decision: (name, system prompt).
    n_agents counts the decision agent (4 = 3 role agents + decision)."""
    if n_agents < 2:
        raise ValueError(f"a workflow needs at least one role agent and the decision agent, got n_agents={n_agents}")
    if not roles:
        raise ValueError(f"workflow {name!r}: no roles given")
    question = lead_in + "{user_question}"
    agents: list[Agent] = []
    for i in range(n_agents - 1):
        role_name, role = roles[i % len(roles)]
        upstream = "".join(f"\n\n{agents[j].name}'s output:\n{{{response_placeholder(j)}}}" for j in range(i))
        agents.append(Agent(role_name, role, question + upstream + (follow_up if i else "")))
    upstream = "".join(f"\n\n{a.name}'s output:\n{{{response_placeholder(j)}}}" for j, a in enumerate(agents))
    agents.append(Agent(decision[0], decision[1], question + upstream + final_instruction))
    return Workflow(name, tuple(agents), lead_in=lead_in)
