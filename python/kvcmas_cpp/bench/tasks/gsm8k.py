"""GSM8K (grade-school math, test split shipped in kvcmas_cpp/data/gsm8k/): rule-based answer extraction.

The spec's runner extracts the prediction with an extra LLM call (`gsm8k_dataset.py: get_pred_value`) and counts a
question solved iff float(pred) == float(gold). We extract with rules instead, so scoring costs no model call and
does not depend on the model being evaluated: the number after the last "The answer is" (the format every role
prompt asks for), else the last number in the text. Numbers may carry a sign, "$", thousands commas and decimals;
a trailing full stop is not a decimal point.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ...sharing.workflow import Workflow, gsm8k_path, gsm8k_workflow
from .base import Example, Task, check_range

# A number not glued to a preceding word, digit, '.' or ',' (so "16-3" gives 16 and 3, not -3), with an optional
# sign and dollar sign, thousands groups "1,234,567" or plain digits, and an optional fraction with digits.
_NUMBER_RE = re.compile(
    r"(?<![\w.,])(?P<sign>[-−])?\s?\$?\s?(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?![\d,]\d)"
)
# The answer statements we look for, last one wins: "The answer is 18", "answer: 18", "#### 18", "\boxed{18}".
_ANSWER_RE = re.compile(r"answer\s+is\b|answer\s*:|####|\\boxed\{", re.IGNORECASE)
_ANSWER_WINDOW = 40  # characters after the statement searched for its number ("The answer is: $1,234.")


def normalize_number(text: str) -> str:
    """Canonical text of a number: no commas, "$" or spaces; sign kept; trailing fractional zeros dropped
    ("1,234.50" -> "1234.5", "18.00" -> "18", "-0" -> "0")."""
    s = text.replace(",", "").replace("$", "").replace(" ", "").replace("−", "-")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s.startswith("-."):
        s = "-0" + s[1:]
    elif s.startswith("."):
        s = "0" + s
    if s in ("-0", "", "-"):
        s = "0"
    return s


def _number(match: re.Match[str]) -> str:
    return normalize_number((match.group("sign") or "") + match.group("num"))


def extract_number(text: str) -> str | None:
    """The number a solution text gives as its answer (see the module docstring), normalised; None if it has none."""
    statements = list(_ANSWER_RE.finditer(text))
    for statement in reversed(statements):
        window = text[statement.end() : statement.end() + _ANSWER_WINDOW]
        found = _NUMBER_RE.search(window)
        if found:
            return _number(found)
    numbers = list(_NUMBER_RE.finditer(text))
    return _number(numbers[-1]) if numbers else None


def numbers_equal(pred: str, gold: str, rel_tol: float = 1e-6) -> bool:
    """float(pred) == float(gold) up to a small relative tolerance (absolute near zero)."""
    try:
        a, b = float(pred), float(gold)
    except ValueError:
        return False
    return abs(a - b) <= rel_tol * max(1.0, abs(b))


class GSM8KTask(Task):
    """GSM8K test split (1319 questions, MIT) in file order; roster Math Solver, Mathematical Analyst, Programming
    Expert + decision maker (`kvcmas_cpp.sharing.workflow.gsm8k_workflow`)."""

    name = "gsm8k"
    lead_in = "Q:\n"
    gamma = 0.32

    def _lines(self) -> tuple[Path, list[str]]:
        path = gsm8k_path()
        if not path.is_file():
            raise FileNotFoundError(f"GSM8K test split not found at {path}")
        with path.open() as f:
            return path, [line for line in f if line.strip()]

    def size(self) -> int:
        return len(self._lines()[1])

    def load(self, start: int, count: int) -> list[Example]:
        path, lines = self._lines()
        check_range(start, count, len(lines), str(path))
        examples = []
        for i in range(start, start + count):
            row = json.loads(lines[i])
            solution = row["answer"]
            if "####" not in solution:
                raise ValueError(f"{path} line {i + 1}: the answer has no '#### <number>' line")
            examples.append(
                Example(
                    id=f"gsm8k/{i}",
                    question=row["question"],
                    reference=normalize_number(solution.rsplit("####", 1)[1].strip()),
                    extra={"solution": solution},
                )
            )
        return examples

    def workflow(self, n_agents: int = 4, topology: str = "full") -> Workflow:
        return gsm8k_workflow(n_agents, topology)

    def extract(self, text: str) -> str | None:
        return extract_number(text)

    def score(self, example: Example, text: str) -> bool:
        pred = self.extract(text)
        return pred is not None and numbers_equal(pred, example.reference)
