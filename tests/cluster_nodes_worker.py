"""A 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), run by tests/test_cluster.py in its own process.

argv: model path, HTTP port. One engine per node (each node offers one `kvcmas_engine` resource, as in
docs/cluster.md's N-machine example); the node of one workflow's owner is removed after hop 2: hop 3 must succeed on
another node (dense), hop 4 reuse there. Prints one JSON line with what it saw; the test asserts on it.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

# Loopback, no usage stats, a token only in this environment: before Ray is imported (kvcmas_cpp.cluster.cli).
os.environ |= {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from kvcmas_cpp.cluster.routing import rendezvous_order, workflow_key  # noqa: E402
from kvcmas_cpp.cluster.serve_app import APP_NAME, build, engine_name  # noqa: E402


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, out
    return dict(out)


def main() -> None:
    model, port = sys.argv[1], int(sys.argv[2])
    temp_dir = tempfile.mkdtemp(prefix="kvcmas-ray-")  # every node's files, removed at the end
    head = {"num_cpus": 2, "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=0, resources={"kvcmas_engine": 1}, temp_dir=temp_dir) for _ in range(3)]
    try:
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = {
            "replicas": 3,
            "server_args": ["--model", model, "-t", "1", "--no-calibration-dir"],
            "engine_actor_options": {"num_cpus": 0, "resources": {"kvcmas_engine": 1}},
        }
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        placed = {}  # rank -> the node its replica runs on (asked of the replica's actor itself)
        for named in ray.util.list_named_actors(all_namespaces=True):
            for rank in range(3):
                if f"#{engine_name(rank)}#" in named["name"]:
                    actor = ray.get_actor(named["name"], namespace=named["namespace"])
                    node_of = actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                    placed[rank] = ray.get(node_of)
        wf = "wf-nodes"
        owner = rendezvous_order(workflow_key(wf), range(3))[0]
        replies: list[str] = []
        hops = []
        for k in range(4):
            if k == 2:
                node = next(n for n in nodes if n.node_id == placed[owner])
                cluster.remove_node(node)
            msgs = [{"role": "system", "content": f"You are agent {k}."}, {"role": "user", "content": "What is 6*7?"}]
            msgs += [{"role": "user", "content": r} for r in replies]
            t0 = time.monotonic()
            out = post(port, {"messages": msgs, "max_tokens": 4, "temperature": 0, "kvcmas": {"workflow": wf}})
            hops.append(
                {
                    "replica": out["kvcmas"]["replica"],
                    "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "ms": (time.monotonic() - t0) * 1000,
                }
            )
            replies.append(out["choices"][0]["message"]["content"])
        nodes_used = len(set(placed.values()))
        seen = {"owner": f"r{owner}", "hops": hops, "nodes_used": nodes_used, "temp_dir": temp_dir}
        print(json.dumps(seen), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
