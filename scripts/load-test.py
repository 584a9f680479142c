#!/usr/bin/env python3
"""Bounded load on a kvcmas-server over loopback: N concurrent clients for D seconds, then checks that it held.

Each client loops over a mix of: 4-hop multi-agent workflows (distinct system prompts, a shared question, the
``kvcmas`` extension field, the workflow deleted afterwards via DELETE /v1/kvcmas/workflows/{id}), streaming chats,
streams the client drops after a few chunks (cancellations) and plain completions. Reports requests, status codes,
the server's RSS (before / peak / after, psutil on its pid) and KV bytes from /metrics (before / peak / after).

Exits non-zero on any 5xx, a connection error, a server crash, a server that does not exit 0 on SIGTERM, KV bytes
that do not return to the baseline once the load is over (workflows deleted, sessions idle), or RSS that stays more
than --rss-slack-mib above the baseline plus the growth of the estimators' state (an idle server returns freed KV
blocks and heap pages to the system; what kvcmas learned or holds for calibration is reported by /metrics).

    python scripts/load-test.py                      # starts a server on a free port (default model), 64 x 300 s
    python scripts/load-test.py --clients 64 --duration 150
    python scripts/load-test.py --url http://127.0.0.1:8080 --pid 1234    # an already running server
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

ROLES = [
    ("planner", "You are a careful planner. List the steps needed to solve the problem."),
    ("solver", "You are a solver. Carry out the plan and compute the answer."),
    ("checker", "You are a checker. Verify the computation and point out any mistake."),
    ("summarizer", "You are a summarizer. State the final answer in one sentence."),
]
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]
METHODS = ("kvcmas", "fullshared", "nonshared")


class Client:
    """One HTTP/1.1 client of the load (raw http.client: every status code is seen, nothing is retried)."""

    def __init__(self, host: str, port: int, stats: Stats, timeout: float) -> None:
        self.host, self.port, self.stats, self.timeout = host, port, stats, timeout

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.stats.error(f"{method} {path}: {type(e).__name__}: {e}")
            return -1, None
        finally:
            conn.close()
        self.stats.count(resp.status)
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text.decode(errors="replace")

    def stream(self, body: dict[str, Any], drop_after: int | None) -> tuple[int, str]:
        """A streaming chat; drop_after: close the connection after that many chunks (a client that vanishes)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        text: list[str] = []
        try:
            data = json.dumps({**body, "stream": True})
            conn.request("POST", "/v1/chat/completions", data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.stats.count(resp.status)
            if resp.status != 200:
                resp.read()
                return resp.status, ""
            chunks = 0
            for line in resp.fp:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    self.stats.stream_error(event["error"].get("code") or "?")
                    break
                chunks += 1
                if event.get("choices"):
                    text.append(event["choices"][0]["delta"].get("content") or "")
                if drop_after is not None and chunks >= drop_after:
                    self.stats.bump("dropped_streams")
                    with contextlib.suppress(OSError):
                        assert conn.sock is not None
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    break
            return 200, "".join(text)
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.stats.error(f"stream: {type(e).__name__}: {e}")
            return -1, ""
        finally:
            conn.close()


class Stats:
    """Thread-safe counters of the load."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: collections.Counter[int] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []

    def count(self, status: int) -> None:
        with self.lock:
            self.status[status] += 1

    def bump(self, name: str, by: int = 1) -> None:
        with self.lock:
            self.counters[name] += by

    def stream_error(self, code: str) -> None:
        self.bump(f"stream_error:{code}")

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)


def pick_kind(rng: random.Random) -> str:
    """The load's mix: workflows 40 %, streams 45 % (half of them dropped mid-stream), completions 15 %."""
    x = rng.random()
    return "workflow" if x < 0.4 else "stream" if x < 0.85 else "completion"


def one_task(client: Client, rng: random.Random, name: str, kind: str, max_tokens: int, stats: Stats) -> None:
    question = rng.choice(QUESTIONS)
    if kind == "workflow":  # a 4-hop multi-agent workflow sharing KV through the kvcmas extension
        method = rng.choice(METHODS)
        previous = ""
        for agent, role in ROLES:
            user = question if not previous else f"{question}\n\nPrevious agent said: {previous[:300]}"
            body = {
                "messages": [{"role": "system", "content": role}, {"role": "user", "content": user}],
                "max_tokens": max_tokens,
                "temperature": 0.7,
                "seed": rng.randrange(1 << 30),
                "kvcmas": {"workflow": name, "agent": agent, "method": method},
            }
            status, out = client.request("POST", "/v1/chat/completions", body)
            if status != 200:
                break
            previous = out["choices"][0]["message"]["content"]
        client.request("DELETE", f"/v1/kvcmas/workflows/{urllib.parse.quote(name)}")
        stats.bump("workflows")
    elif kind == "stream":  # a streaming chat, dropped mid-stream by the client half of the time
        role = rng.choice(ROLES)[1]
        body = {
            "messages": [{"role": "system", "content": role}, {"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
        }
        drop = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < 0.5 else None
        client.stream(body, drop)
        stats.bump("streams")
    else:  # a plain completion
        client.request("POST", "/v1/completions", {"prompt": question, "max_tokens": max_tokens // 2 or 1})
        stats.bump("completions")


def run_client(index: int, client: Client, deadline: float, max_tokens: int, stats: Stats, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    n = 0
    while time.monotonic() < deadline:
        n += 1
        one_task(client, rng, f"load-{index}-{n}", pick_kind(rng), max_tokens, stats)


def metrics(client: Client) -> dict[str, float]:
    status, text = client.request("GET", "/metrics")
    if status != 200:
        return {}
    out = {}
    for line in str(text).splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"kvcmas-load-server-{port}.log"
    cmd = [sys.executable, "-m", "kvcmas_cpp.server", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.server_args.split()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"load-test: the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port, log_path
        time.sleep(0.3)
    proc.kill()
    sys.exit("load-test: the server did not come up")


def main() -> int:
    args = parse_args()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    port = 0
    if not args.url:
        proc, port, log_path = start_server(args)
    try:
        return run_load(args, proc, port, log_path)
    finally:
        if proc is not None and proc.poll() is None:  # an error in the script: do not leave the server behind
            proc.kill()
            proc.wait()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", help="an already running server (default: start one on a free port)")
    p.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    p.add_argument("--model", help="GGUF for the started server (default: the server's default model)")
    p.add_argument("--server-args", default="--parallel 8 -t 2", help="extra options of the started server")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each request (default 24)")
    p.add_argument("--settle", type=float, default=60.0, help="seconds allowed for KV to return afterwards")
    p.add_argument("--rss-slack-mib", type=float, default=64.0, help="RSS allowed above the baseline afterwards")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--idle-wait",
        type=float,
        default=0.0,
        help="seconds to wait once the load settled, then report RSS and KV again (e.g. the server's --idle-ttl "
        "plus 60, to see what ages out)",
    )
    return p.parse_args()


def run_load(
    args: argparse.Namespace, proc: subprocess.Popen[bytes] | None, started_port: int, log_path: Path | None
) -> int:
    """The load and its checks; returns the exit status."""
    if proc is None:
        parsed = urllib.parse.urlparse(args.url)
        host, port, pid = parsed.hostname or "127.0.0.1", parsed.port or 80, args.pid
    else:
        host, port, pid = "127.0.0.1", started_port, proc.pid
    stats = Stats()
    client = Client(host, port, stats, timeout=300)
    try:
        import psutil

        server_ps = psutil.Process(pid) if pid else None
    except ImportError:
        server_ps = None
        print("load-test: psutil is not installed: no RSS figures")

    def rss_mib() -> float:
        return server_ps.memory_info().rss / 2**20 if server_ps is not None else float("nan")

    # Warm-up: one of each request kind, so lazily built state (thread pools, caches) is part of the baseline.
    warm_rng = random.Random(args.seed)
    for kind in ("workflow", "stream", "stream", "completion"):
        one_task(client, warm_rng, "load-warm-up", kind, args.max_tokens, Stats())
    client.request("DELETE", "/v1/kvcmas/workflows/default")
    time.sleep(1.0)
    stats.status.clear()
    base = metrics(client)
    rss_before = rss_mib()
    print(f"load-test: {args.clients} clients for {args.duration:.0f} s on {host}:{port} (server pid {pid})")
    print(f"  before: RSS {rss_before:.1f} MiB, KV {base.get('kvcmas_kv_bytes', float('nan')):.0f} bytes")

    peak = {"rss": rss_before, "kv": base.get("kvcmas_kv_bytes", 0.0)}
    stop_sampling = threading.Event()
    health_ms: list[float] = []  # /health latency under the load, as a liveness probe sees it

    def sample() -> None:
        probe = Client(host, port, Stats(), timeout=30)
        while not stop_sampling.is_set():
            with contextlib.suppress(Exception):
                peak["rss"] = max(peak["rss"], rss_mib())
                peak["kv"] = max(peak["kv"], metrics(probe).get("kvcmas_kv_bytes", 0.0))
                t_probe = time.perf_counter()
                probe.request("GET", "/health")
                health_ms.append((time.perf_counter() - t_probe) * 1000.0)
            stop_sampling.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    threads = [
        threading.Thread(target=run_client, args=(i, client, deadline, args.max_tokens, stats, args.seed))
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    stop_sampling.set()
    sampler.join()

    # Afterwards: the default session ends (its prefix caches), every workflow was deleted by its client.
    client.request("DELETE", "/v1/kvcmas/workflows/default")
    settle_deadline = time.monotonic() + args.settle
    after = metrics(client)
    # (KV may end below the baseline: idle namespaces age out with their prefix cache entries, --idle-ttl)
    while time.monotonic() < settle_deadline and (
        after.get("kvcmas_kv_bytes", 0) > base.get("kvcmas_kv_bytes", 0) or after.get("kvcmas_active_requests")
    ):
        time.sleep(0.5)
        after = metrics(client)
    time.sleep(2.0)
    rss_after = rss_mib()
    crashed = proc is not None and proc.poll() is not None
    health = client.request("GET", "/health")[0] if not crashed else -1

    total = sum(stats.status.values())
    five_xx = sum(n for s, n in stats.status.items() if s >= 500)
    print(f"  load: {total} HTTP requests in {elapsed:.0f} s ({total / elapsed:.1f}/s); {dict(stats.counters)}")
    print(f"  status codes: {dict(sorted(stats.status.items()))}; connection errors: {len(stats.errors)}")
    for e in stats.errors[:5]:
        print(f"    {e}")
    gen = after.get("kvcmas_generated_tokens_total", 0) - base.get("kvcmas_generated_tokens_total", 0)
    reused = after.get("kvcmas_reused_tokens_total", 0) - base.get("kvcmas_reused_tokens_total", 0)
    cancelled = after.get("kvcmas_cancelled_total", 0) - base.get("kvcmas_cancelled_total", 0)
    print(f"  server: {gen:.0f} tokens generated, {reused:.0f} prompt tokens reused, {cancelled:.0f} cancelled")
    print(f"  RSS MiB: before {rss_before:.1f}, peak {peak['rss']:.1f}, after {rss_after:.1f}")
    if health_ms:
        ranked = sorted(health_ms)
        p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
        print(
            f"  /health under load: {len(ranked)} probes, p50 {ranked[len(ranked) // 2]:.1f} ms, p99 {p99:.1f} ms, "
            f"max {ranked[-1]:.1f} ms"
        )
    if args.idle_wait > 0:
        time.sleep(args.idle_wait)
        idle = metrics(client)
        rss_idle = rss_mib()
        print(
            f"  {args.idle_wait:.0f} s later: RSS {rss_idle:.1f} MiB ({100 * (rss_idle / rss_before - 1):+.1f}% of "
            f"before), KV {idle.get('kvcmas_kv_bytes', float('nan')):.0f} bytes, sessions "
            f"{idle.get('kvcmas_sessions', float('nan')):.0f}, namespaces "
            f"{idle.get('kvcmas_namespaces', float('nan')):.0f}"
        )
    print(
        f"  KV bytes: before {base.get('kvcmas_kv_bytes', 0):.0f}, peak {peak['kv']:.0f}, "
        f"after {after.get('kvcmas_kv_bytes', float('nan')):.0f}; engine sequences after "
        f"{after.get('kvcmas_engine_sequences', float('nan')):.0f}"
    )
    failures = []
    if five_xx:
        failures.append(f"{five_xx} responses with a 5xx status")
    if stats.errors:
        failures.append(f"{len(stats.errors)} connection errors")
    if crashed or health != 200:
        failures.append("the server crashed or stopped answering /health")
    if after.get("kvcmas_kv_bytes", 0) > base.get("kvcmas_kv_bytes", 0):
        failures.append("KV bytes did not return to the baseline")
    # Once idle, the server hands freed KV blocks back to the system (Model.kv_trim) and trims the heap, so RSS must
    # come back to the baseline within the slack (allocator and interpreter caches), plus what the KV-correction
    # estimators learned or hold for calibration (kvcmas_estimator_bytes: bounded by --calibration-memory).
    pool_after = after.get("kvcmas_kv_allocated_bytes", float("nan")) / 2**20
    learned = (after.get("kvcmas_estimator_bytes", 0.0) - base.get("kvcmas_estimator_bytes", 0.0)) / 2**20
    growth = rss_after - rss_before
    print(
        f"  RSS growth {growth:.1f} MiB: estimator state grew {learned:.1f} MiB, KV pool memory after "
        f"{pool_after:.1f} MiB; allowed beyond the estimator state: {args.rss_slack_mib:.0f} MiB"
    )
    if server_ps is not None and growth - max(learned, 0.0) > args.rss_slack_mib:
        failures.append(f"RSS stayed {growth - learned:.1f} MiB above the baseline plus the estimator state")
    if proc is not None and not crashed:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        print(f"  server exit status after SIGTERM: {code}")
        if code != 0:
            failures.append(f"the server exited with {code} on SIGTERM")
        if failures:
            print(f"  server log: {log_path}")
    for f in failures:
        print(f"load-test: FAILED: {f}")
    if not failures:
        print("load-test: OK")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
