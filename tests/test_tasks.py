"""Evaluation tasks: data loading, answer extraction and scoring (GSM8K, MMLU, HumanEval), the sandbox that runs
generated code, and the task workflows (roster shape, placeholders, templates on the default model)."""

from __future__ import annotations

import gzip
import json
import os
import resource
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from kvcmas_cpp.bench.tasks import Example, GSM8KTask, HumanEvalTask, MMLUTask, get_task, run_python
from kvcmas_cpp.bench.tasks.humaneval import build_program, extract_code, humaneval_path
from kvcmas_cpp.bench.tasks.mmlu import mmlu_path
from kvcmas_cpp.model import Model
from kvcmas_cpp.sharing.workflow import PLACEHOLDER_RE, build_template, gsm8k_path, gsm8k_workflow, response_placeholder

TASK_NAMES = ("gsm8k", "mmlu", "humaneval")


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_get_task_names_and_attributes() -> None:
    expected = {
        "gsm8k": (GSM8KTask, "Q:\n", 0.32),
        "mmlu": (MMLUTask, "The task is:\n\n", 0.29),
        "humaneval": (HumanEvalTask, "The task is:\n\n", 0.34),
    }
    for name, (cls, lead_in, gamma) in expected.items():
        task = get_task(name)
        assert isinstance(task, cls) and task.name == name
        assert task.lead_in == lead_in and task.gamma == gamma
    assert isinstance(get_task("GSM8K"), GSM8KTask)


def _records_in_file(name: str) -> int:
    """Records in a task's data file, counted independently of the task code."""
    if name == "gsm8k":
        with gsm8k_path().open() as f:
            return sum(1 for line in f if line.strip())
    if name == "mmlu":  # rows with a usable answer letter only
        with mmlu_path().open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return sum(1 for row in rows if row.get("correct_answer") in ("A", "B", "C", "D"))
    with gzip.open(humaneval_path(), "rt") as f:
        return sum(1 for line in f if line.strip())


@pytest.mark.parametrize("name", TASK_NAMES)
def test_size_is_the_data_set_size(name: str) -> None:
    task = get_task(name)
    size = task.size()
    assert size == _records_in_file(name) > 0
    assert len(task.load(size - 1, 1)) == 1
    with pytest.raises(ValueError):
        task.load(size, 1)


def test_get_task_unknown_lists_choices() -> None:
    with pytest.raises(ValueError) as info:
        get_task("mathvista")
    assert all(name in str(info.value) for name in TASK_NAMES)


# ---------------------------------------------------------------------------------------------------------------
# GSM8K


def _gsm8k_lines(n: int) -> list[dict[str, str]]:
    with gsm8k_path().open() as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_gsm8k_load_matches_file() -> None:
    rows = _gsm8k_lines(50)
    examples = GSM8KTask().load(0, 50)
    assert len(examples) == 50
    for row, ex in zip(rows, examples, strict=True):
        assert ex.question == row["question"]
        gold = row["answer"].split("####")[-1].strip().replace(",", "")
        assert float(ex.reference) == float(gold)
    assert GSM8KTask().load(10, 3) == examples[10:13]
    with pytest.raises(ValueError):
        GSM8KTask().load(1319, 1)  # the test split has 1319 questions
    assert len(GSM8KTask().load(1318, 1)) == 1


def test_gsm8k_extracts_reference_solutions() -> None:
    """The dataset's own worked solutions, ending with the answer sentence the role prompts ask for."""
    task = GSM8KTask()
    for row, ex in zip(_gsm8k_lines(50), task.load(0, 50), strict=True):
        body, gold = row["answer"].rsplit("####", 1)
        text = body.rstrip() + f"\nThe answer is {gold.strip()}."
        assert task.extract(text) == ex.reference, text
        assert task.score(ex, text)
        assert not task.score(ex, body.rstrip() + f"\nThe answer is {float(ex.reference) + 1}.")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is $1,234.", "1234"),
        ("So she loses 3 pounds: the change is -3", "-3"),
        ("Each costs 2.50", "2.5"),
        ("The answer is: $18.00 per day.", "18"),
        ("16 - 3 - 4 = 9 eggs are left, 9 * 2 = $18 a day.", "18"),
        ("The answer is 140. Checked with 3 other methods.", "140"),
        ("I computed 5 first, but the answer is 7", "7"),
        ("Total: 1,000,000 dollars", "1000000"),
        ("The answer is -12.5", "-12.5"),
        ("temperatures of 10-12 degrees", "12"),
        ("no number at all", None),
    ],
)
def test_gsm8k_extract_variants(text: str, expected: str | None) -> None:
    assert GSM8KTask().extract(text) == expected


def test_gsm8k_score_float_equality() -> None:
    task = GSM8KTask()
    ex = Example("x", "q", "2.5", {})
    assert task.score(ex, "It costs $2.50.")
    assert not task.score(ex, "It costs $2.51.")
    assert not task.score(ex, "I cannot tell.")


# ---------------------------------------------------------------------------------------------------------------
# MMLU


def _valid_mmlu_lines() -> list[int]:
    with mmlu_path().open() as f:
        return [i for i, line in enumerate(f) if json.loads(line)["correct_answer"] in ("A", "B", "C", "D")]


def test_mmlu_load_seed_888_permutation() -> None:
    task = MMLUTask()
    examples = task.load(0, 200)
    valid = _valid_mmlu_lines()
    expected_lines = [valid[k] for k in np.random.default_rng(888).permutation(len(valid))[:200]]
    assert [ex.extra["line"] for ex in examples] == expected_lines
    assert examples == task.load(0, 200)  # deterministic
    assert task.load(50, 10) == examples[50:60]
    assert len({ex.id for ex in examples}) == 200
    with pytest.raises(ValueError):
        task.load(len(valid), 1)


def test_mmlu_examples_have_four_choices() -> None:
    with mmlu_path().open() as f:
        rows = f.readlines()
    for ex in MMLUTask().load(0, 100):
        row = json.loads(rows[ex.extra["line"]])
        assert ex.reference == row["correct_answer"] in ("A", "B", "C", "D")
        assert ex.extra["choices"] == [row[f"answer_{c}"] for c in "abcd"]
        assert ex.question.startswith(row["question"])
        for letter, choice in zip("ABCD", ex.extra["choices"], strict=True):
            assert f"\n{letter}) {choice}" in ex.question
        assert ex.question.index("\nA) ") < ex.question.index("\nB) ") < ex.question.index("\nD) ")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Step by step ... The correct answer is: B", "B"),
        ("The output is: (C)", "C"),
        ("Answer: **D**", "D"),
        ("the answer is option A, because ...", "A"),
        ("B", "B"),
        ("(A)\nBecause the statute says so.", "A"),
        ("Reasoning...\nC)", "C"),
        ("First I thought the answer is A. On reflection, the correct answer is: D.", "D"),
        ("I think the answer is a trick question.", None),
        ("A good question with no clear answer.", None),
    ],
)
def test_mmlu_extract_formats(text: str, expected: str | None) -> None:
    assert MMLUTask().extract(text) == expected


def test_mmlu_score_letter_equality() -> None:
    task = MMLUTask()
    ex = task.load(0, 1)[0]
    wrong = next(c for c in "ABCD" if c != ex.reference)
    assert task.score(ex, f"The correct answer is: {ex.reference}")
    assert not task.score(ex, f"The correct answer is: {wrong}")
    assert not task.score(ex, "I do not know.")


# ---------------------------------------------------------------------------------------------------------------
# HumanEval


def _humaneval_rows(n: int) -> list[dict[str, str]]:
    with gzip.open(humaneval_path(), "rt") as f:
        return [json.loads(next(f)) for _ in range(n)]


def test_humaneval_canonical_solutions_pass() -> None:
    task = HumanEvalTask()
    rows = _humaneval_rows(10)
    examples = task.load(0, 10)
    for row, ex in zip(rows, examples, strict=True):
        assert ex.id == row["task_id"] and ex.extra["entry_point"] == row["entry_point"]
        assert task.score(ex, row["canonical_solution"]), ex.id


def test_humaneval_wrong_completions_fail() -> None:
    task = HumanEvalTask(timeout_s=2)
    ex = task.load(0, 1)[0]
    assert not task.score(ex, "    return None\n")
    assert not task.score(ex, "    return True\n")
    assert not task.score(ex, "    while True:\n        pass\n")  # killed at the timeout
    assert not task.score(ex, "```python\ndef has_close_elements(:\n```")  # syntax error
    assert not task.score(ex, "")  # no code at all


def test_humaneval_full_function_in_fenced_reply_passes() -> None:
    """A chat-style reply: prose, a draft block, then the final block with the whole function (no imports)."""
    task = HumanEvalTask()
    row = _humaneval_rows(1)[0]
    ex = task.load(0, 1)[0]
    signature = next(line for line in row["prompt"].splitlines() if line.startswith("def "))
    reply = (
        "Here is a first idea:\n```python\ndef has_close_elements(numbers, threshold):\n    return None\n```\n"
        "And the final version:\n```python\n" + signature + "\n" + row["canonical_solution"] + "```\nDone."
    )
    code = task.extract(reply)
    assert code is not None and code.startswith(signature) and "return None" not in code
    assert task.score(ex, reply)


def test_humaneval_extract_code() -> None:
    assert extract_code("```python\na = 1\n```\n```py\nb = 2\n```\n```\nc = 3\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("x = 1\n") == "x = 1\n"  # no fence: the whole text
    assert extract_code("text\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut at max_tokens
    assert extract_code("```python\n\n```") is None


def test_humaneval_program_uses_prompt_for_completions_and_helpers() -> None:
    row = _humaneval_rows(1)[0]
    body = build_program(row, row["canonical_solution"])
    assert body.startswith(row["prompt"] + row["canonical_solution"])
    assert body.rstrip().endswith(f"check({row['entry_point']})")


# ---------------------------------------------------------------------------------------------------------------
# sandbox


def test_sandbox_runs_code_and_cleans_up() -> None:
    res = run_python("import os\nprint('hello', 6 * 7)\nprint(os.getcwd())\nopen('scratch.txt', 'w').write('ok')")
    assert res.passed and res.returncode == 0 and not res.timed_out
    out = res.stdout.splitlines()
    assert out[0] == "hello 42"
    assert not Path(out[1]).exists()  # the temporary working directory is deleted
    failed = run_python("import sys\nprint('bad', file=sys.stderr)\nsys.exit(3)")
    assert not failed.passed and failed.returncode == 3 and "bad" in failed.stderr
    raised = run_python("raise ValueError('boom')")
    assert not raised.passed and "ValueError: boom" in raised.stderr
    syntax = run_python("def f(:\n")
    assert not syntax.passed and "SyntaxError" in syntax.stderr


def test_sandbox_kills_infinite_loop() -> None:
    timeout = 1.0
    start = time.monotonic()
    res = run_python("while True:\n    pass\n", timeout_s=timeout)
    assert time.monotonic() - start < timeout + 5
    assert res.timed_out and not res.passed and res.returncode is not None and res.returncode < 0
    sleeper = run_python("import time\ntime.sleep(60)", timeout_s=timeout)
    assert sleeper.timed_out and not sleeper.passed


def test_sandbox_memory_bomb_is_contained() -> None:
    limits_before = resource.getrlimit(resource.RLIMIT_AS)
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(4 * 2**30))\n", timeout_s=10)
    assert not res.passed and not res.timed_out and "MemoryError" in res.stderr
    gradual = run_python("chunks = []\nwhile True:\n    chunks.append(b' ' * 10**7)\n", timeout_s=10, memory_mb=256)
    assert not gradual.passed and "MemoryError" in gradual.stderr
    assert resource.getrlimit(resource.RLIMIT_AS) == limits_before  # the limits applied to the child only
    assert run_python("x = bytearray(50 * 2**20)\nprint(len(x))", memory_mb=512).passed  # honest use still works


def test_sandbox_blocks_network() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
            "import socket\nsocket.getaddrinfo('localhost', 80)",
        ):
            res = run_python(code)
            assert not res.passed and "PermissionError" in res.stderr, code
        with pytest.raises(socket.timeout):
            server.accept()  # nobody connected


def test_sandbox_blocks_process_creation_and_outside_writes(tmp_path: Path) -> None:
    # Each of these would exit 0 if it were allowed (a single child, never a fork bomb).
    for code in (
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)",
    ):
        res = run_python(code)
        assert not res.passed and "PermissionError" in res.stderr, code
    target = tmp_path / "escaped.txt"
    res = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert not res.passed and not target.exists()


def test_sandbox_file_size_limit() -> None:
    res = run_python("with open('big.bin', 'wb') as f:\n    f.write(b'x' * (64 * 2**20))\n", file_size_mb=16)
    assert not res.passed and "File too large" in res.stderr
    assert run_python("with open('small.bin', 'wb') as f:\n    f.write(b'x' * 2**20)\n", file_size_mb=16).passed


def test_sandbox_truncates_output_flood() -> None:
    cap = 64 * 1024
    res = run_python("import sys\nsys.stdout.write('y' * 20_000_000)\n", max_output_bytes=cap)
    assert res.passed and res.output_truncated
    assert res.stdout.startswith("y" * 1000) and len(res.stdout) < cap + 200
    endless = run_python("while True:\n    print('z' * 10000)\n", timeout_s=1, max_output_bytes=cap)
    assert endless.timed_out and len(endless.stdout) < cap + 200


def test_sandbox_rejects_bad_limits() -> None:
    with pytest.raises(ValueError):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError):
        run_python("pass", memory_mb=-1)


def test_sandbox_starts_in_isolated_mode() -> None:
    code = "import json, os, sys\nprint(json.dumps([sys.flags.isolated, sys.flags.no_site, dict(os.environ)]))"
    res = run_python(code)
    assert res.passed, res.stderr
    isolated, no_site, env = json.loads(res.stdout)
    assert isolated == 1 and no_site == 1
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE"}  # nothing of the caller's environment
    assert env["HOME"] != os.environ.get("HOME")


# ---------------------------------------------------------------------------------------------------------------
# workflows


@pytest.mark.parametrize("name", TASK_NAMES)
def test_workflow_roster_and_placeholders(name: str) -> None:
    task = get_task(name)
    wf = task.workflow()
    assert len(wf.agents) == 4 and wf.lead_in == task.lead_in
    roles = {
        "gsm8k": ["Math Solver", "Mathematical Analyst", "Programming Expert"],
        "mmlu": ["Knowledgeable Expert", "Wiki Searcher", "Critic"],
        "humaneval": ["Project Manager", "Algorithm Designer", "Programming Expert"],
    }[name]
    assert [a.name for a in wf.agents[:3]] == roles
    for i, agent in enumerate(wf.agents):
        assert agent.user_template.startswith(task.lead_in + "{user_question}")
        found = PLACEHOLDER_RE.findall(agent.user_template)
        assert found == ["user_question"] + [response_placeholder(j) for j in range(i)]
    if name == "gsm8k":
        assert wf == gsm8k_workflow()
    for n in (2, 6):
        agents = task.workflow(n).agents
        assert len(agents) == n
        assert PLACEHOLDER_RE.findall(agents[-1].user_template)[1:] == [response_placeholder(j) for j in range(n - 1)]
    with pytest.raises(ValueError):
        task.workflow(1)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_workflow_templates_build_on_default_model(model: Model, name: str) -> None:
    for agent in get_task(name).workflow().agents:
        template = build_template(model, agent)
        assert template.placeholders == PLACEHOLDER_RE.findall(agent.user_template)
        assert len(template.texts) == len(template.placeholders) + 1 and all(template.texts)
        spans = {ph: [7 + k] for k, ph in enumerate(template.placeholders)}
        ids = template.prompt_ids(spans)
        assert len(ids) == sum(map(len, template.texts)) + len(spans)
