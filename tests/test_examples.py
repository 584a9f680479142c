"""examples/ end to end: the plain-openai-client example against a fresh kvcmas-server under the default method
reports the reuse it got, and that report agrees with the server's own counters."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.server import ServerProcess

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def kvcmas_server(default_model_path: Path) -> Iterator[ServerProcess]:
    # fresh: no learned maps from earlier runs (the first workflow must reuse without calibration)
    srv = ServerProcess(str(default_model_path), "--method", "kvcmas", "--no-calibration-dir")
    yield srv
    srv.stop()


def test_openai_client_example_reuses_spans_under_kvcmas(kvcmas_server: ServerProcess) -> None:
    pytest.importorskip("openai", reason="the example needs the openai client (pip install openai)")
    before = kvcmas_server.metrics()
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", kvcmas_server.url, "--max-tokens", "24"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:] + kvcmas_server.log()
    report = json.loads(run.stdout.strip().splitlines()[-1])
    after = kvcmas_server.metrics()
    assert report["requests"] == 3
    # the two later agents read the task (and the replies) from spans the first agent computed
    assert report["later_span_tokens"] > 0 and report["later_span_share"] > 0.5
    assert report["dense_hops"] == {}
    # the example's figures are the server's counters over the run
    spans = after["kvcmas_span_tokens_total"] - before["kvcmas_span_tokens_total"]
    prompts = after["kvcmas_prompt_tokens_total"] - before["kvcmas_prompt_tokens_total"]
    assert report["later_span_tokens"] == spans
    assert report["first_prompt_tokens"] + report["later_prompt_tokens"] == prompts
