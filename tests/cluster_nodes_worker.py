"""A 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), run by tests/test_cluster.py in its own process.

argv: a Serve config file (docs/cluster.md's N-machine example with this machine's server arguments and a loopback
HTTP address). Each node offers one `kvcmas_engine` resource, as that example's machines do; the file is deployed
with Ray Serve's own CLI, `serve run CONFIG`. The node of one workflow's owner is removed after hop 2: hop 3 must
succeed on another node (dense), hop 4 reuse there. Prints one JSON line with what it saw; the test asserts on it.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

# Loopback, no usage stats, a token only in this environment, every file (also Ray's `ray_current_cluster` address
# file, else in /tmp/ray) under one temporary directory: before Ray is imported (kvcmas_cpp.cluster.cli).
TEMP_DIR = tempfile.mkdtemp(prefix="kvcmas-ray-")
os.makedirs(os.path.join(TEMP_DIR, "ray"))
os.environ |= {
    "RAY_TMPDIR": TEMP_DIR,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from kvcmas_cpp.cluster.config import engine_name  # noqa: E402
from kvcmas_cpp.cluster.routing import rendezvous_order, workflow_key  # noqa: E402


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, out
    return dict(out)


def main() -> None:
    config_path = sys.argv[1]
    with open(config_path) as f:
        port = int(json.load(f)["http_options"]["port"])
    temp_dir = TEMP_DIR  # every node's files, removed at the end
    head = {"num_cpus": 2, "include_dashboard": False, "temp_dir": temp_dir}
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        nodes = [cluster.add_node(num_cpus=0, resources={"kvcmas_engine": 1}, temp_dir=temp_dir) for _ in range(3)]
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        cli = [sys.executable, "-c", "from ray.serve.scripts import cli; cli()"]
        done = subprocess.run(
            [*cli, "run", "--non-blocking", "--address", cluster.address, config_path],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        deadline = time.monotonic() + 180
        while True:
            states = {n: str(a.status) for n, a in serve.status().applications.items()}
            if len(states) == 4 and all(s.endswith("RUNNING") for s in states.values()):
                break
            assert time.monotonic() < deadline and not any("FAILED" in s for s in states.values()), states
            time.sleep(0.5)
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
