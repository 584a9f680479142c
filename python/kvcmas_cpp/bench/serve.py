"""`kvcmas bench serve`: multi-agent workflows replayed against a real kvcmas-server.

Each workflow is 4 hops (planner, solver, checker, summarizer: distinct system prompts). Every hop sees the shared
context (reference problems and a GSM8K question) and the replies of the hops before it, as separate messages, so
later hops hold spans that earlier agents computed. Workflows arrive as a Poisson process at each request rate; a
workflow's hops run one after another. The same arrivals are replayed for every method (``"kvcmas": {"method"}``
per request, so one server serves all methods), and a workflow's sessions are dropped when it ends.

TTFT is measured by the client (request sent -> first streamed token), as a user sees it. Peak memory is sampled
from the server while a run lasts: KV bytes in use (/metrics) and, for a server this command started, its RSS.
Where a later hop's time goes comes from the server's timings (p50 per phase): queue (waiting for a slot or KV
memory), wait (admitted, waiting for other prompts' prefill), engine (its own prompt rows in the engine), session
(the method's work besides: forks, corrections, reading rows), others (other requests' prefill chunks and decode
steps run between its chunks), and how many later hops ran dense because kvcmas was still calibrating an edge.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import output_file
from ..errors import CommandError

AGENTS = (
    "You are a careful planner. List the steps needed to solve the problem, without solving it.",
    "You are a solver. Follow the plan and compute the answer step by step.",
    "You are a checker. Verify the solution and point out any mistake.",
    "You are a summarizer. State the final answer in one sentence.",
)


PHASES = ("ttft_ms", "queue_ms", "wait_ms", "prompt_ms", "engine_ms", "session_ms", "interleaved_ms")


@dataclass
class Hop:
    workflow: int
    hop: int
    ttft_ms: float
    total_ms: float
    prompt_tokens: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    method: str = ""
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # the server's: queue_ms, wait_ms, engine_ms, ...
    gate: str = ""


@dataclass
class RunResult:
    method: str
    rate: float
    hops: list[Hop] = field(default_factory=list)
    wall_s: float = 0.0
    peak_kv_bytes: int = 0
    peak_rss_bytes: int = 0

    def later_ttft(self) -> np.ndarray:
        return np.array([h.ttft_ms for h in self.hops if h.hop > 0 and h.error is None])

    def first_ttft(self) -> np.ndarray:
        return np.array([h.ttft_ms for h in self.hops if h.hop == 0 and h.error is None])

    def row(self) -> dict[str, Any]:
        later = self.later_ttft()
        first = self.first_ttft()
        ok = [h for h in self.hops if h.error is None]
        prompt = sum(h.prompt_tokens for h in ok)
        return {
            "method": self.method,
            "rate": self.rate,
            "requests": len(self.hops),
            "errors": sum(h.error is not None for h in self.hops),
            "later_p50_ms": float(np.percentile(later, 50)) if later.size else float("nan"),
            "later_p90_ms": float(np.percentile(later, 90)) if later.size else float("nan"),
            "later_p99_ms": float(np.percentile(later, 99)) if later.size else float("nan"),
            "hop1_p50_ms": float(np.percentile(first, 50)) if first.size else float("nan"),
            "tokens_per_s": sum(h.completion_tokens for h in ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
            "reused_pct": 100.0 * sum(h.reused_tokens for h in ok) / prompt if prompt else 0.0,
            "peak_kv_mib": self.peak_kv_bytes / 2**20,
            "peak_rss_mib": self.peak_rss_bytes / 2**20,
            "wall_s": self.wall_s,
            "phases_p50_ms": self.phases(),
            "later_dense": sum(1 for h in self.hops if h.hop > 0 and h.error is None and "dense" in h.gate),
        }

    def phases(self) -> dict[str, float]:
        """p50 over later hops of each phase of the server's timings (ms)."""
        later = [h.timings for h in self.hops if h.hop > 0 and h.error is None and h.timings]
        return {
            key: float(np.percentile([t.get(key, 0.0) for t in later], 50)) if later else float("nan") for key in PHASES
        }


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running kvcmas-server (default: start one for the run)")
    p.add_argument("--api-key", default=None, help="API key of the --url server")
    p.add_argument("-m", "--model", default=None, help="GGUF file for the started server (default model otherwise)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads of the started server")
    p.add_argument("--parallel", type=int, default=8, help="--parallel of the started server (default 8)")
    p.add_argument("--methods", default="nonshared,kvcmas", help="comma-separated methods (default nonshared,kvcmas)")
    p.add_argument("--rates", default="0.1,0.2", help="workflow arrival rates per second (default 0.1,0.2)")
    p.add_argument("--workflows", type=int, default=4, help="workflows per rate and method (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each hop generates (default 16)")
    p.add_argument("--context-tokens", type=int, default=320, help="shared context per workflow (default ~320)")
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="sequential workflows per sharing method before measuring (default 4). kvcmas reads each edge (span, "
        "reader) once before fitting its correction online (CALIBRATION_READS), and a short reply gives an edge no "
        "example: the warm-up goes on (up to 8 more workflows) until a whole workflow's later hops reuse, so the "
        "runs measure serving, not calibration",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=output_file, default=None, help="write the rows to this JSON file")


# --------------------------------------------------------------------------------------------- the workload
def _contexts(n: int, context_tokens: int, seed: int) -> list[str]:
    """n shared contexts: reference problems (about context_tokens tokens, ~4 characters each) and a question."""
    from ..sharing.workflow import load_gsm8k

    questions = load_gsm8k(0, 1000)
    out: list[str] = []
    rng = np.random.default_rng(seed)
    for i in range(n):
        picks = rng.permutation(len(questions))
        refs: list[str] = []
        chars = 0
        for j in picks[1:]:
            q = questions[int(j)]
            if chars + len(q) > 4 * context_tokens:
                break
            refs.append(q)
            chars += len(q)
        out.append(
            "Reference problems:\n" + "\n".join(f"- {q}" for q in refs) + f"\n\nProblem {i}: {questions[int(picks[0])]}"
        )
    return out


class _Client:
    def __init__(self, url: str, api_key: str | None) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self, timeout: float = 600.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, str]:
        conn = self.connect(10)
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    def delete(self, path: str) -> None:
        conn = self.connect(10)
        try:
            conn.request("DELETE", path, headers=self.headers)
            conn.getresponse().read()
        finally:
            conn.close()

    def stream_chat(self, body: dict[str, Any]) -> tuple[float, float, str, dict[str, Any]]:
        """Sends a streaming chat request: (ttft ms, total ms, text, the final chunk). Raises on HTTP errors."""
        conn = self.connect()
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise CommandError(f"the server answered HTTP {resp.status}: {resp.read()[:300]!r}")
            ttft = 0.0
            pieces: list[str] = []
            final: dict[str, Any] = {}
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                if not ttft:
                    ttft = (time.perf_counter() - t0) * 1000.0  # the first chunk is sent with the first token
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise CommandError(f"the server sent an error mid-stream: {chunk['error'].get('message')}")
                for choice in chunk.get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or "")
                    if choice.get("finish_reason"):
                        final = chunk
            return ttft, (time.perf_counter() - t0) * 1000.0, "".join(pieces), final
        finally:
            conn.close()


def _run_workflow(
    client: _Client, index: int, tag: str, method: str, context: str, max_tokens: int, out: list[Hop]
) -> None:
    """The workflow's 4 hops, one after another; each appends its Hop to out."""
    workflow = f"{tag}-{method}-{index}"
    replies: list[str] = []
    try:
        for hop, system in enumerate(AGENTS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": context}]
            messages += [{"role": "user", "content": r} for r in replies]
            body = {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "kvcmas": {"workflow": workflow, "agent": f"agent{hop}", "method": method},
            }
            try:
                ttft, total, text, final = client.stream_chat(body)
            except (OSError, RuntimeError, ValueError) as e:
                out.append(Hop(index, hop, float("nan"), float("nan"), error=str(e)))
                return
            usage = final.get("usage", {})
            kv = final.get("kvcmas", {})
            timings = final.get("timings", {})
            out.append(
                Hop(
                    index,
                    hop,
                    ttft,
                    total,
                    int(usage.get("prompt_tokens", 0)),
                    int(kv.get("reused_tokens", 0)),
                    int(usage.get("completion_tokens", 0)),
                    str(kv.get("method", "")),
                    timings={k: float(timings.get(k, 0.0)) for k in PHASES},
                    gate=str(kv.get("gate") or kv.get("mode") or ""),
                )
            )
            replies.append(text)
    finally:
        with contextlib.suppress(OSError):
            client.delete(f"/v1/kvcmas/workflows/{workflow}")


class _Monitor:
    """Samples the server's KV bytes (and RSS of a local pid) until stopped."""

    def __init__(self, client: _Client, pid: int | None) -> None:
        self.client = client
        self.pid = pid
        self.peak_kv = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        proc = None
        if self.pid is not None:
            with contextlib.suppress(Exception):
                import psutil

                proc = psutil.Process(self.pid)
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                status, text = self.client.get("/metrics")
                if status == 200:
                    for line in text.splitlines():
                        if line.startswith("kvcmas_kv_bytes "):
                            self.peak_kv = max(self.peak_kv, int(float(line.split()[1])))
                if proc is not None:
                    self.peak_rss = max(self.peak_rss, int(proc.memory_info().rss))
            self._stop.wait(0.1)


def _run_rate(
    client: _Client,
    method: str,
    rate: float,
    contexts: list[str],
    max_tokens: int,
    seed: int,
    pid: int | None,
) -> RunResult:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(contexts)))
    arrivals -= arrivals[0]  # the first workflow starts at once
    hops: list[Hop] = []
    threads: list[threading.Thread] = []
    tag = f"bench{os.getpid()}-r{rate:g}"
    with _Monitor(client, pid) as monitor:
        t0 = time.perf_counter()
        for i, (at, context) in enumerate(zip(arrivals, contexts, strict=True)):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=_run_workflow, args=(client, i, tag, method, context, max_tokens, hops))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    return RunResult(method, rate, hops, wall, monitor.peak_kv, monitor.peak_rss)


# ---------------------------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "kvcmas_cpp.server", "--port", str(port), "--parallel", str(args.parallel)]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    # The server's log goes to a file: an unread pipe would fill up and stall the server.
    log_path = Path(tempfile.gettempdir()) / f"kvcmas-bench-server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"server log: {log_path}", file=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    client = _Client(url, None)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            last = lines[-1] if lines else "no message"
            raise CommandError(
                f"kvcmas-server exited with {proc.returncode} before it served: {last} (log: {log_path})"
            )
        with contextlib.suppress(OSError):
            if client.get("/health")[0] == 200:
                return proc, url
        time.sleep(0.25)
    proc.kill()
    raise CommandError(f"kvcmas-server did not come up within 120 s (log: {log_path})")


def _print_phases(rows: list[dict[str, Any]]) -> None:
    print(
        "later hops, p50 per phase (ms, server timings): ttft = queue + wait + prefill; prefill = engine + "
        "session + others"
    )
    head = (
        f"{'method':<10} {'rate/s':>6} {'ttft':>7} {'queue':>6} {'wait':>6} {'prefill':>7} {'engine':>7} "
        f"{'session':>7} {'others':>7} {'dense':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        p = r["phases_p50_ms"]
        print(
            f"{r['method']:<10} {r['rate']:>6g} {p['ttft_ms']:>7.0f} {p['queue_ms']:>6.0f} {p['wait_ms']:>6.0f} "
            f"{p['prompt_ms']:>7.0f} {p['engine_ms']:>7.0f} {p['session_ms']:>7.0f} {p['interleaved_ms']:>7.0f} "
            f"{r['later_dense']:>5}"
        )


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'method':<10} {'rate/s':>6} {'reqs':>5} {'err':>3} {'later TTFT p50':>14} {'p90':>8} {'p99':>8} "
        f"{'hop1 p50':>9} {'tok/s':>6} {'req/s':>6} {'reused':>7} {'peak KV MiB':>11} {'peak RSS MiB':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['method']:<10} {r['rate']:>6g} {r['requests']:>5} {r['errors']:>3} {r['later_p50_ms']:>11.0f} ms "
            f"{r['later_p90_ms']:>8.0f} {r['later_p99_ms']:>8.0f} {r['hop1_p50_ms']:>9.0f} {r['tokens_per_s']:>6.1f} "
            f"{r['requests_per_s']:>6.2f} {r['reused_pct']:>6.1f}% {r['peak_kv_mib']:>11.1f} {r['peak_rss_mib']:>12.1f}"
        )


def run_bench_serve(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("nonshared", "fullshared", "kvcmas")]
    if bad or not methods:
        raise ValueError(f"--methods: unknown method(s) {bad or methods}; use nonshared, fullshared, kvcmas")
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--rates must be positive, got {args.rates!r}")
    if args.workflows < 1 or args.max_tokens < 1 or args.context_tokens < 0:
        raise ValueError("--workflows and --max-tokens must be >= 1, --context-tokens >= 0")

    proc: subprocess.Popen[bytes] | None = None
    if args.url:
        url, pid = args.url.rstrip("/"), None
    else:
        print("starting kvcmas-server ...", file=sys.stderr)
        proc, url = _start_server(args)
        pid = proc.pid
    client = _Client(url, args.api_key if args.url else None)
    rows: list[dict[str, Any]] = []
    try:
        status, _ = client.get("/v1/models")
        if status != 200:
            raise CommandError(
                f"{url}/v1/models answered HTTP {status}" + (": check --api-key" if status == 401 else "")
            )
        # Warm-up outside the measured runs: first-use costs, and kvcmas's calibration (it reads each edge densely
        # a few times, fitting its correction online, before it shares the edge).
        extra_warmup = 8
        warm = _contexts(max(1, args.warmup) + extra_warmup, args.context_tokens, args.seed + 999)
        for method in methods:
            n_warm = 1 if method == "nonshared" else max(1, args.warmup)
            print(f"warm-up: method {method}, {n_warm} workflow(s) ...", file=sys.stderr)
            for w in range(n_warm + (extra_warmup if method == "kvcmas" else 0)):
                hops: list[Hop] = []
                _run_workflow(client, w, f"warmup{os.getpid()}", method, warm[w], args.max_tokens, hops)
                if w + 1 >= n_warm and all("dense" not in h.gate for h in hops if h.hop > 0):
                    break  # calibrated (or nothing to calibrate)
                if w + 1 >= n_warm:
                    print(f"  workflow {w}: later hops still calibrating, one more", file=sys.stderr)
        contexts = _contexts(args.workflows, args.context_tokens, args.seed)
        for rate in rates:
            for method in methods:
                print(f"run: method {method}, {rate:g} workflows/s, {args.workflows} workflows ...", file=sys.stderr)
                result = _run_rate(client, method, rate, contexts, args.max_tokens, args.seed, pid)
                for h in result.hops:
                    if h.error:
                        print(f"  workflow {h.workflow} hop {h.hop}: {h.error}", file=sys.stderr)
                rows.append(result.row())
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            if proc.poll() is None:
                proc.kill()
    print()
    _print_table(rows)
    print()
    _print_phases(rows)
    if "nonshared" in methods:
        print()
        for rate in rates:
            base = next(r for r in rows if r["rate"] == rate and r["method"] == "nonshared")
            for r in rows:
                if r["rate"] == rate and r["method"] != "nonshared" and r["later_p50_ms"] > 0:
                    ratio = base["later_p50_ms"] / r["later_p50_ms"]
                    print(f"rate {rate:g}/s: later-hop p50 TTFT nonshared / {r['method']} = {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcmas bench serve", description=__doc__.splitlines()[0] if __doc__ else "")
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
