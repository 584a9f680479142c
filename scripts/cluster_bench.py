"""Figures of docs/cluster.md: ingress overhead, keys moved by churn, failover time.

  python scripts/cluster_bench.py keys                      # routing only (no Ray): keys moved on loss / scale-up
  python scripts/cluster_bench.py overhead --ingress URL --direct URL [-n 200]
  python scripts/cluster_bench.py failover --ingress URL    # kills a replica of the cluster `kvcmas cluster up` made
  python scripts/cluster_bench.py load --ingress URL [--workflows 6 --hops 4 --rounds 3]
  python scripts/cluster_bench.py scale --ingress URL --replicas 3 [--workflows 40]   # scales that cluster to 4

`overhead` sends the same small request (1 new token, nonshared) alternately to the ingress and to a plain
kvcmas-server on the same model and threads, and reports the latency the ingress adds (p50, p99 of each minus the
other's). `failover` runs 2 hops of a workflow, kills the owner's actor, and times hop 3 (which fails over) against
hop 4 (which reuses there). `load` runs --workflows concurrent 4-hop workflows (one thread each, streamed, a
workflow's hops one after the other), --rounds times, and reports the time to the first streamed token of the later
hops (2..4), to compare 1 and N replicas at the same offered load. `scale` runs 2 hops of --workflows workflows,
scales the running cluster to --replicas + 1 with `kvcmas cluster up --replicas`, runs hop 3, and counts the
workflows that moved, the ones that stayed and reused, and the engines whose process changed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from typing import Any

from kvcmas_cpp.cluster.routing import rendezvous_order, workflow_key


def _post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    dt = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200, out
    return dt, out


def _delete(url: str, wf: str) -> None:
    """Ends a workflow (frees its spans: a long benchmark would fill the replicas' KV budget otherwise)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("DELETE", f"/v1/kvcmas/workflows/{wf}")
    conn.getresponse().read()
    conn.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead(args: argparse.Namespace) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 1,
        "temperature": 0,
        "kvcmas": {"method": "nonshared"},
    }
    times: dict[str, list[float]] = {"ingress": [], "direct": []}
    for url in (args.ingress, args.direct):  # warm-up
        for _ in range(5):
            _post(url, body)
    for i in range(args.n):
        for name in ("ingress", "direct") if i % 2 else ("direct", "ingress"):
            times[name].append(_post(getattr(args, name), body)[0] * 1000)
    print("| path | p50 ms | p99 ms | mean ms |\n|---|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {_pct(xs, 0.5):.1f} | {_pct(xs, 0.99):.1f} | {statistics.mean(xs):.1f} |")
    added50 = _pct(times["ingress"], 0.5) - _pct(times["direct"], 0.5)
    added99 = _pct(times["ingress"], 0.99) - _pct(times["direct"], 0.99)
    print(f"| added by the ingress | {added50:.1f} | {added99:.1f} | |")


def keys(args: argparse.Namespace) -> None:
    ks = [workflow_key(f"wf-{i}") for i in range(args.keys)]
    n = args.replicas
    own = {k: rendezvous_order(k, range(n))[0] for k in ks}
    lost = sum(1 for k in ks if own[k] == 0)
    moved_loss = sum(1 for k in ks if own[k] != 0 and [r for r in rendezvous_order(k, range(n)) if r != 0][0] != own[k])
    grow = {k: rendezvous_order(k, range(n + 1))[0] for k in ks}
    moved_up = sum(1 for k in ks if grow[k] != own[k])
    to_new = sum(1 for k in ks if grow[k] != own[k] and grow[k] == n)
    print(f"{args.keys} workflows on {n} ranks: shares {sorted(Counter(own.values()).values())}")
    print("| event | workflows moved | of which survivors' |\n|---|---|---|")
    print(f"| rank 0 down (rendezvous over ranks) | {lost} ({lost / len(ks):.1%}) | {moved_loss} |")
    print("| rank 0 replaced, back up (same rank) | 0 beyond rank 0's own | 0 |")
    print(f"| scale-up {n} -> {n + 1} | {moved_up} ({moved_up / len(ks):.1%}) | {to_new} of them to the new rank |")
    try:
        from ray.serve.experimental.consistent_hash_router import DEFAULT_NUM_VIRTUAL_NODES, _hash_bytes
    except ImportError:
        return
    import bisect

    def ring(ids: list[str]) -> tuple[list[int], list[str]]:
        pts = sorted((_hash_bytes(f"{r}:{i}".encode()), r) for r in ids for i in range(DEFAULT_NUM_VIRTUAL_NODES))
        return [h for h, _ in pts], [r for _, r in pts]

    def owner(rg: tuple[list[int], list[str]], key: str) -> str:
        hs, rs = rg
        return rs[bisect.bisect_right(hs, _hash_bytes(key.encode())) % len(hs)]

    ids = [f"replica-{i}" for i in range(n)]
    before = ring(ids)
    after = ring(["replica-new", *ids[1:]])  # Serve replaced replica 0: a new unique id
    survivors = [k for k in ks if owner(before, k) != "replica-0"]
    stolen = sum(1 for k in survivors if owner(after, k) != owner(before, k))
    print(
        f"| Ray's ConsistentHashRouter, replica 0 replaced (new unique id) | | {stolen} of {len(survivors)} "
        f"survivors' ({stolen / len(survivors):.1%}) |"
    )


def failover(args: argparse.Namespace) -> None:
    from kvcmas_cpp.cluster.cli import connect, read_state

    state = read_state()
    assert state is not None, "no cluster is up (kvcmas cluster up)"
    connect(state)  # before Ray is imported
    import ray

    results = []
    for trial in range(args.trials):
        wf = f"wf-failover-{time.time_ns()}-{trial}"
        rank = rendezvous_order(workflow_key(wf), range(args.replicas))[0]
        replies: list[str] = []
        times = []
        for k in range(4):
            msgs = [{"role": "system", "content": f"You are agent {k}."}, {"role": "user", "content": "What is 6*7?"}]
            msgs += [{"role": "user", "content": r} for r in replies]
            if k == 2:
                name = next(
                    a for a in ray.util.list_named_actors(all_namespaces=True) if f"#kvcmas-engine-{rank}#" in a["name"]
                )
                ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
            body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "kvcmas": {"workflow": wf}}
            dt, out = _post(args.ingress, body)
            times.append(dt * 1000)
            replies.append(out["choices"][0]["message"]["content"])
        results.append(times)
        _delete(args.ingress, wf)
        print(f"trial {trial}: hops ms {[round(t) for t in times]}")
        deadline = time.time() + 60
        while time.time() < deadline:  # the replacement, before the next trial
            u = urllib.parse.urlsplit(args.ingress)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            conn.request("GET", "/health")
            if json.loads(conn.getresponse().read()).get("status") == "ok":
                break
            time.sleep(0.5)
    hop3 = [t[2] for t in results]
    hop4 = [t[3] for t in results]
    p50, worst, after = statistics.median(hop3), max(hop3), statistics.median(hop4)
    print(f"failover hop p50 {p50:.0f} ms (max {worst:.0f}); next hop {after:.0f} ms")


def _stream_ttft(url: str, body: dict[str, Any]) -> tuple[float, float, dict[str, Any], str]:
    """One streamed chat: (seconds to the first content token, seconds to the end, the last chunk's kvcmas, text)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    t0 = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body | {"stream": True}), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, text, info = None, [], {}
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        info = chunk.get("kvcmas") or info
        piece = "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
        if piece and first is None:
            first = time.perf_counter() - t0
        text.append(piece)
    total = time.perf_counter() - t0
    conn.close()
    return first if first is not None else total, total, info, "".join(text)


ROLES = [
    "You are a careful planner. List the steps needed to solve the problem.",
    "You are a solver. Carry out the plan and compute the answer.",
    "You are a checker. Verify the computation and point out any mistake.",
    "You are a summarizer. State the final answer in one sentence.",
]


def _task(i: int) -> str:
    return f"Problem {i}: a shop sells {i % 50 + 3} apples on Monday and twice as many on Tuesday. How many in all?"


def _workflow_hop(url: str, wf: str, task: str, k: int, replies: list[str], max_tokens: int) -> tuple[float, dict]:
    msgs = [{"role": "system", "content": ROLES[k % len(ROLES)]}, {"role": "user", "content": task}]
    msgs += [{"role": "user", "content": r} for r in replies]
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "kvcmas": {"workflow": wf}}
    ttft, _, info, text = _stream_ttft(url, body)
    replies.append(text)
    return ttft, info


def load(args: argparse.Namespace) -> None:
    later: list[float] = []
    reused = dense = 0
    replicas: Counter[str] = Counter()
    t_all = time.perf_counter()
    for rnd in range(args.rounds + 1):  # round 0 warms up (system prompts, first contact): not counted
        stamp = time.time_ns()
        out: list[list[tuple[float, dict]]] = [[] for _ in range(args.workflows)]

        def run(w: int, stamp: int = stamp, out: list[list[tuple[float, dict]]] = out) -> None:
            replies: list[str] = []
            for k in range(args.hops):
                out[w].append(
                    _workflow_hop(args.ingress, f"wf-load-{stamp}-{w}", _task(w), k, replies, args.max_tokens)
                )

        threads = [threading.Thread(target=run, args=(w,)) for w in range(args.workflows)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        for w in range(args.workflows):
            _delete(args.ingress, f"wf-load-{stamp}-{w}")
        if rnd == 0:
            t_all = time.perf_counter()
            continue
        for hops in out:
            assert len(hops) == args.hops, "a workflow failed"
            for ttft, info in hops[1:]:
                later.append(ttft * 1000)
                replicas[info.get("replica", "?")] += 1
                if info.get("span_tokens", 0) > 0:
                    reused += 1
                else:
                    dense += 1
        print(f"round {rnd}: {args.workflows} workflows x {args.hops} hops in {wall:.1f} s")
    elapsed = time.perf_counter() - t_all
    print(f"replicas used by later hops: {dict(sorted(replicas.items()))}; reused {reused}, dense {dense}")
    print("| later hops | p50 TTFT ms | p90 TTFT ms | mean TTFT ms | workflows/s |\n|---|---|---|---|---|")
    rate = args.workflows * args.rounds / elapsed
    print(
        f"| {len(later)} | {_pct(later, 0.5):.0f} | {_pct(later, 0.9):.0f} | {statistics.mean(later):.0f} | "
        f"{rate:.2f} |"
    )


def _processes(url: str) -> dict[str, tuple[int, float]]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    conn.close()
    return {name: (r.get("pid"), r.get("started")) for name, r in health["replicas"].items()}


def scale(args: argparse.Namespace) -> None:
    n = args.replicas
    stamp = time.time_ns()
    names = [f"wf-scale-{stamp}-{i}" for i in range(args.workflows)]
    replies: dict[str, list[str]] = {wf: [] for wf in names}
    where: dict[str, str] = {}
    for i, wf in enumerate(names):
        for k in range(2):
            where[wf] = _workflow_hop(args.ingress, wf, _task(i), k, replies[wf], args.max_tokens)[1]["replica"]
    before = _processes(args.ingress)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "cluster", "up", "--replicas", str(n + 1)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    scale_s = time.perf_counter() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    after = _processes(args.ingress)
    restarted = [r for r in before if after.get(r) != before[r]]
    moved = stayed_reused = stayed_dense = to_new = 0
    for i, wf in enumerate(names):
        ttft, info = _workflow_hop(args.ingress, wf, _task(i), 2, replies[wf], args.max_tokens)
        if info["replica"] != where[wf]:
            moved += 1
            to_new += info["replica"] == f"r{n}"
        elif info.get("span_tokens", 0) > 0:
            stayed_reused += 1
        else:
            stayed_dense += 1
    for wf in names:
        _delete(args.ingress, wf)
    w = len(names)
    print(f"scale {n} -> {n + 1}: `kvcmas cluster up --replicas {n + 1}` took {scale_s:.1f} s")
    print(
        "| workflows | moved | of which to the new rank | stayed, next hop reused | stayed, next hop dense | "
        "engines restarted |\n|---|---|---|---|---|---|"
    )
    print(
        f"| {w} | {moved} ({moved / w:.0%}) | {to_new} | {stayed_reused} | {stayed_dense} | "
        f"{len(restarted)} of {len(before)} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--ingress", required=True)
    o.add_argument("--direct", required=True)
    o.add_argument("-n", type=int, default=200)
    o.set_defaults(func=overhead)
    k = sub.add_parser("keys")
    k.add_argument("--keys", type=int, default=10000)
    k.add_argument("--replicas", type=int, default=3)
    k.set_defaults(func=keys)
    f = sub.add_parser("failover")
    f.add_argument("--ingress", required=True)
    f.add_argument("--replicas", type=int, default=3)
    f.add_argument("--trials", type=int, default=3)
    f.set_defaults(func=failover)
    ld = sub.add_parser("load")
    ld.add_argument("--ingress", required=True)
    ld.add_argument("--workflows", type=int, default=6)
    ld.add_argument("--hops", type=int, default=4)
    ld.add_argument("--rounds", type=int, default=3)
    ld.add_argument("--max-tokens", type=int, default=16)
    ld.set_defaults(func=load)
    sc = sub.add_parser("scale")
    sc.add_argument("--ingress", required=True)
    sc.add_argument("--replicas", type=int, required=True, help="the running cluster's replicas (scaled to one more)")
    sc.add_argument("--workflows", type=int, default=40)
    sc.add_argument("--max-tokens", type=int, default=8)
    sc.set_defaults(func=scale)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
