"""Figures of docs/cluster.md: ingress overhead, keys moved by churn, failover time.

  python scripts/cluster_bench.py keys                      # routing only (no Ray): keys moved on loss / scale-up
  python scripts/cluster_bench.py overhead --ingress URL --direct URL [-n 200]
  python scripts/cluster_bench.py failover --ingress URL    # kills a replica of the cluster `kvcmas cluster up` made

`overhead` sends the same small request (1 new token, nonshared) alternately to the ingress and to a plain
kvcmas-server on the same model and threads, and reports the latency the ingress adds (p50, p99 of each minus the
other's). `failover` runs 2 hops of a workflow, kills the owner's actor, and times hop 3 (which fails over) against
hop 4 (which reuses there).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
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
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
