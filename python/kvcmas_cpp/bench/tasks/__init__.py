"""Evaluation tasks: GSM8K, MMLU and HumanEval with the spec's rosters, answer extraction and scoring.

Usage: `task = get_task("gsm8k")`, `examples = task.load(0, 50)`, `workflow = task.workflow()` (3 role agents and
the decision agent, question lead-in `task.lead_in`), then `task.score(example, final_text)` on the decision
agent's reply (`task.extract(final_text)` gives the answer it read).
"""

from __future__ import annotations

from .base import Example, Task
from .gsm8k import GSM8KTask
from .humaneval import HumanEvalTask
from .mmlu import MMLUTask
from .sandbox import SandboxResult, run_python

TASKS: dict[str, type[Task]] = {"gsm8k": GSM8KTask, "mmlu": MMLUTask, "humaneval": HumanEvalTask}


def get_task(name: str) -> Task:
    """A new instance of the task called `name` (case-insensitive): "gsm8k", "mmlu" or "humaneval"."""
    cls = TASKS.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return cls()


__all__ = [
    "TASKS",
    "Example",
    "GSM8KTask",
    "HumanEvalTask",
    "MMLUTask",
    "SandboxResult",
    "Task",
    "get_task",
    "run_python",
]
