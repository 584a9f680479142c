"""A kvcmas-server subprocess on a free port and the requests the server tests send it (chat, a 4-agent workflow,
/metrics parsed)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kvcmas_cpp as kc

BLOCK_BYTES = 30 * 2 * 32 * 192 * 4  # one KV block of SmolLM2-135M: 30 layers, K and V, 32 rows, 3 kv heads x 64
TASK = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
ROLES = [
    "You are a careful planner. List the steps needed to solve the problem.",
    "You are a solver. Carry out the plan and compute the answer.",
    "You are a checker. Verify the computation and point out any mistake.",
    "You are a summarizer. State the final answer in one sentence.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A kvcmas-server subprocess; the environment carries the same kvcmas_cpp the tests import."""

    def __init__(self, model_path: str, *args: str) -> None:
        self.port = free_port()
        env = dict(os.environ)
        package_root = str(Path(kc.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
        cmd = [sys.executable, "-m", "kvcmas_cpp.server", "--model", model_path, "--port", str(self.port), "-t", "2"]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvcmas-server-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([*cmd, *args], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvcmas-server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                if self.request("GET", "/health")[0] == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvcmas-server did not come up:\n{self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """One HTTP request; returns (status, headers, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            parsed: Any = json.loads(text)
        except json.JSONDecodeError:
            parsed = text
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        status, _, text = self.request("GET", "/metrics", headers=headers)
        assert status == 200
        return parse_prometheus(text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of the text exposition format, keyed by 'name{labels}' as written. Checks every line's syntax."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram"), line
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        key, value = line.rsplit(" ", 1)
        base = key.split("{", 1)[0]
        family = base.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert base in typed or family in typed, f"sample without # TYPE: {line}"
        samples[key] = float(value)
    return samples


def chat(
    server: ServerProcess, messages: list[dict[str, str]], headers: dict[str, str] | None = None, **kw: Any
) -> dict[str, Any]:
    body = {"messages": messages, "temperature": 0, **kw}
    status, _, out = server.request("POST", "/v1/chat/completions", body, headers=headers)
    assert status == 200, out
    return dict(out)


def run_workflow(
    server: ServerProcess,
    workflow: str,
    method: str | None,
    task: str = TASK,
    max_tokens: int = 12,
    headers: dict[str, str] | None = None,
    recompute: float | None = None,
) -> list[dict[str, Any]]:
    """Four agents, each with its own system prompt, reading the task and every earlier agent's reply."""
    replies: list[str] = []
    out: list[dict[str, Any]] = []
    for k, role in enumerate(ROLES):
        messages = [{"role": "system", "content": role}, {"role": "user", "content": task}]
        messages += [{"role": "user", "content": r} for r in replies]
        options: dict[str, Any] = {"workflow": workflow, "agent": f"agent{k}"}
        if method is not None:
            options["method"] = method
        if recompute is not None:
            options["recompute"] = recompute
        body = chat(server, messages, headers, max_tokens=max_tokens, kvcmas=options)
        replies.append(body["choices"][0]["message"]["content"])
        out.append(body)
    status, _, _ = server.request("DELETE", f"/v1/kvcmas/workflows/{workflow}", headers=headers)
    assert status == 200
    return out
