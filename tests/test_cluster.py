"""kvcmas on a Ray Serve cluster (kvcmas_cpp.cluster, docs/cluster.md).

The routing tests need no Ray: the routing key's rule and rendezvous hashing's churn properties, against brute-force
counts. The cluster tests (skipped without Ray: pip install 'kvcmas_cpp[cluster]') start one real cluster for the
module with `kvcmas cluster up` (3 engine replicas of the tiny model, 1 thread each, on a private loopback Ray head)
and end it with `kvcmas cluster down`, then check that none of its processes or files are left. References: which
replica owns a key is recomputed here from the routing rule; reuse is the replica's own `cached_tokens`; a stream's
text is the same request's non-streamed text; a killed replica is a real `ray.kill` of its actor.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvcmas_cpp as kc
from helpers.server import ServerProcess, free_port
from kvcmas_cpp.cluster.config import ENGINE_IMPORT, serve_config, settings_of
from kvcmas_cpp.cluster.routing import SESSION_HEADER, rendezvous_order, routing_key, workflow_key

ROLES = [
    "You are a careful planner. List the steps needed to solve the problem.",
    "You are a solver. Carry out the plan and compute the answer.",
    "You are a checker. Verify the computation and point out any mistake.",
    "You are a summarizer. State the final answer in one sentence.",
]
N_REPLICAS = 3  # the documented config's
DOCS = Path(__file__).resolve().parent.parent / "docs" / "cluster.md"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic v1-style fields


def _task(i: int) -> str:
    return f"Problem {i}: a shop sells {i + 3} apples on Monday and twice as many on Tuesday. How many in all?"


# ------------------------------------------------------------------------------------------ routing (no Ray)
def test_routing_key_rule() -> None:
    wf = {"messages": [{"role": "user", "content": "x"}], "kvcmas": {"workflow": "wf-1"}}
    assert routing_key(wf, {SESSION_HEADER: "s"}) == workflow_key("wf-1")  # the body's workflow wins
    assert routing_key({"messages": [{"role": "user", "content": "x"}]}, {SESSION_HEADER: "s"}) == "session:s"
    # unmodified agents of one workflow: own system prompts, the same task first, different later messages
    keys = {
        routing_key(
            {
                "messages": [{"role": "system", "content": role}, {"role": "user", "content": _task(1)}]
                + [{"role": "user", "content": f"reply {j}"} for j in range(k)]
            },
            {},
        )
        for k, role in enumerate(ROLES)
    }
    assert len(keys) == 1
    other = routing_key({"messages": [{"role": "user", "content": _task(2)}]}, {})
    salted = routing_key({"messages": [{"role": "user", "content": _task(1)}], "cache_salt": "s"}, {})
    assert len(keys | {other, salted}) == 3
    # bodies the replica will refuse still get a key (never an error in the ingress)
    for body in (None, [], "x", {"messages": "x"}, {"messages": [3]}, {"prompt": [1, 2]}, {"kvcmas": 5}):
        assert isinstance(routing_key(body, {}), str)


def test_rendezvous_moves_only_what_churn_must() -> None:
    keys = [f"workflow:{i}" for i in range(6000)]
    owner3 = {k: rendezvous_order(k, range(3))[0] for k in keys}
    shares = Counter(owner3.values())
    assert all(abs(n / len(keys) - 1 / 3) < 0.03 for n in shares.values()), shares
    # rank 1 gone: exactly its keys move, each to its own second choice
    for k in keys:
        survivor = [r for r in rendezvous_order(k, range(3)) if r != 1][0]
        assert survivor == owner3[k] or owner3[k] == 1
    # a fourth rank: only keys that move to it move, about 1/4 of them
    owner4 = {k: rendezvous_order(k, range(4))[0] for k in keys}
    moved = [k for k in keys if owner4[k] != owner3[k]]
    assert all(owner4[k] == 3 for k in moved)
    assert 0.21 < len(moved) / len(keys) < 0.29
    assert rendezvous_order("abc", [2, 0, 1]) == rendezvous_order("abc", range(3))  # order-free, deterministic


def _documented() -> tuple[list[str], dict[str, Any]]:
    """docs/cluster.md's N-machine example: the `kvcmas cluster config` command it shows and the file it shows."""
    import shlex

    yaml = pytest.importorskip("yaml")
    text = DOCS.read_text()
    section = text[text.index("## N machines") :]
    command = next(line for line in section.splitlines() if line.startswith("kvcmas cluster config "))
    block = section[section.index("```yaml\n") + 8 :]
    return shlex.split(command.split(">")[0])[3:], dict(yaml.safe_load(block[: block.index("```")]))


def _documented_here(server_args: list[str], port: int) -> dict[str, Any]:
    """The documented config file with this machine's server arguments (model, threads) and a loopback port."""
    config = _documented()[1]
    for app in config["applications"]:
        if app["import_path"] == ENGINE_IMPORT:
            app["args"]["server_args"] = server_args
    return config | {"http_options": {"host": "127.0.0.1", "port": port}}


def test_serve_config_round_trip_and_refusals() -> None:
    settings = {"replicas": 2, "server_args": ["--model", "m.gguf", "-t", "1"], "max_body_bytes": 1000}
    config = serve_config(settings, {"host": "127.0.0.1", "port": 9})
    assert [a["name"] for a in config["applications"]] == ["kvcmas-engine-0", "kvcmas-engine-1", "kvcmas"]
    assert settings_of(config) == settings | {"engine_actor_options": {"num_cpus": 0}}
    # one more rank leaves the existing ranks' applications as they were: what keeps Serve from restarting them
    grown = serve_config(settings | {"replicas": 3}, {"host": "127.0.0.1", "port": 9})
    assert grown["applications"][:2] == config["applications"][:2]
    assert grown["applications"][-1]["args"]["replicas"] == 3
    for bad in ({"replicas": 0}, {"replica": 2}, {"server_args": ["--no-such-flag"]}):
        with pytest.raises(ValueError):
            serve_config(bad)
    for apps in (config["applications"][1:], config["applications"][:1] + config["applications"][2:]):
        with pytest.raises(ValueError, match="ranks"):
            settings_of({"applications": apps})
    differ = json.loads(json.dumps(config))
    differ["applications"][1]["args"]["server_args"][-1] = "2"
    with pytest.raises(ValueError, match="different settings"):
        settings_of(differ)


def test_documented_config_is_what_cluster_config_writes_and_builds() -> None:
    """The file docs/cluster.md tells users to `serve deploy` is what its `kvcmas cluster config` command prints;
    Ray Serve's own config schema accepts it, and every application's import path builds with its args (as Serve's
    build task does). Deploying it: the `cluster` fixture (kvcmas cluster up --config) and, with `serve run`, the
    slow 3-node test."""
    yaml = pytest.importorskip("yaml")
    argv, documented = _documented()
    done = subprocess.run(
        [sys.executable, "-m", "kvcmas_cpp.cli", "cluster", "config", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout) == documented
    assert settings_of(documented)["replicas"] == N_REPLICAS
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'")
    # in a process of its own: Ray reads its settings when it is imported, and this process' Ray is the cluster's
    code = """if True:
        import json, sys
        from ray._common.utils import import_attr
        from ray.serve import Application
        from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
        from ray.serve.schema import ServeDeploySchema
        schema = ServeDeploySchema.model_validate(json.loads(sys.stdin.read()))
        for app in schema.applications:
            built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
            assert isinstance(built, Application), app.name
            print(app.name)
    """
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(documented), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [app["name"] for app in documented["applications"]]


def test_cluster_up_refuses_bad_settings_before_starting_anything(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("applications: [\n")
    cases = {
        ("--config", str(tmp_path / "missing.yaml")): "missing.yaml",
        ("--config", str(bad_yaml)): "not YAML",
        ("--replicas", "0"): "replicas must be >= 1",
        ("--", "--no-such-flag"): "server_args",
    }
    for argv, message in cases.items():
        cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "cluster", "up", *argv]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "kvcmas: error" in done.stderr and message in done.stderr, done.stderr
    assert not (tmp_path / "cache").exists()  # no state file: nothing was started


def test_single_node_never_imports_ray() -> None:
    code = "import sys, kvcmas_cpp.cli as c, kvcmas_cpp.server; c.build_parser(); print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ 3 nodes
@pytest.mark.slow
def test_three_nodes_one_removed(tiny_models: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """ray.cluster_utils.Cluster in a process of its own (tests/cluster_nodes_worker.py): docs/cluster.md's config
    file (this machine's server arguments, loopback) deployed by `serve run`, one engine per node; the node of a
    workflow's owner is removed after hop 2; hop 3 fails over (dense), hop 4 reuses there."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'")
    before = _ray_processes()
    env = dict(os.environ)
    package_root = str(Path(kc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    worker = Path(__file__).with_name("cluster_nodes_worker.py")
    server_args = ["--model", str(tiny_models[("llama", "Q8_0")]), "-t", "1", "--no-calibration-dir"]
    config = _documented_here(server_args, free_port())
    path = tmp_path / "kvcmas-cluster.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    done = subprocess.run(
        [sys.executable, str(worker), str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"owner"')))
    hops = seen["hops"]
    assert seen["nodes_used"] == 3
    assert hops[0]["replica"] == hops[1]["replica"] == seen["owner"] and hops[1]["cached"] > 0
    assert hops[2]["replica"] != seen["owner"] and hops[2]["cached"] == 0
    assert hops[3]["replica"] == hops[2]["replica"] and hops[3]["cached"] > 0
    assert not _left_behind(before) and not Path(seen["temp_dir"]).exists()


# ------------------------------------------------------------------------------------------ the cluster
class Cluster:
    def __init__(self, root: Path, model: Path) -> None:
        self.port = free_port()
        self.env = dict(os.environ)
        self.env["XDG_CACHE_HOME"] = str(root / "cache")  # the state file
        package_root = str(Path(kc.__file__).resolve().parent.parent)
        self.env["PYTHONPATH"] = os.pathsep.join([package_root, self.env.get("PYTHONPATH", "")])
        self.calibration_dir = root / "calibration"
        self.log = root / "cluster.log"
        self.model = model

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "cluster", *args]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        with open(self.log, "a") as f:
            f.write(f"$ {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}\n")
        return done

    def up(self) -> None:
        """From docs/cluster.md's N-machine config file, with this machine's server arguments, loopback address and
        port; the head offers the `kvcmas_engine` resource the file's engines ask for (one a machine there)."""
        server_args = ["--model", str(self.model), "-t", "1", "--calibration-dir", str(self.calibration_dir)]
        config = _documented_here(server_args, self.port)
        path = self.log.parent / "kvcmas-cluster.json"
        path.write_text(json.dumps(config))
        resources = json.dumps({"kvcmas_engine": N_REPLICAS + 1})  # + 1: test_scale_up_keeps_the_running_engines
        done = self.cli("up", "--config", str(path), "--num-cpus", "2", "--resources", resources)
        said = (done.stdout + done.stderr).lower()
        if done.returncode != 0 and ("bind" in said or "proxyactor" in said):
            # the free port was taken by another process between choosing and binding it, or Ray Serve killed a
            # proxy that did not start within its fixed 60 s (a loaded machine): once more, on another port
            self.cli("down")
            self.port = free_port()
            path.write_text(json.dumps(_documented_here(server_args, self.port)))
            done = self.cli("up", "--config", str(path), "--num-cpus", "2", "--resources", resources)
        assert done.returncode == 0, done.stdout + done.stderr

    def processes(self) -> dict[str, tuple[int, float]]:
        """Each replica's engine process as the cluster's /health reports it: (pid, start time)."""
        health = _wait_healthy(self)
        assert health["status"] == "ok", health
        return {name: (r["pid"], r["started"]) for name, r in health["replicas"].items()}

    def state(self) -> dict[str, Any]:
        return dict(json.loads((Path(self.env["XDG_CACHE_HOME"]) / "kvcmas" / "cluster.json").read_text()))

    request = ServerProcess.request  # one HTTP request to the ingress: (status, headers, parsed JSON or text)
    metrics = ServerProcess.metrics

    def chat(self, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
        status, headers, out = self.request(
            "POST", "/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": 6, **kw}
        )
        assert status == 200, out
        assert headers["x-kvcmas-replica"] == out["kvcmas"]["replica"]
        return dict(out)


@pytest.fixture(scope="module")
def cluster(tiny_models: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'")

    from kvcmas_cpp.cluster.cli import connect

    token_file = Path.home() / ".ray" / "auth_token"
    had_token_file = token_file.exists()
    saved = dict(os.environ)
    before = _ray_processes()
    c = Cluster(tmp_path_factory.mktemp("cluster"), tiny_models[("llama", "Q8_0")])
    try:
        c.up()
        state = c.state()
        assert _left_behind(before)  # the reference below sees the cluster's processes
        connect(state)  # this process kills replicas' actors (Ray is imported here, with the cluster's settings)
        yield c
    finally:
        with contextlib.suppress(ImportError):
            import ray

            ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        done = c.cli("down")
        assert done.returncode == 0, done.stdout + done.stderr
    left = _left_behind(before)
    assert not left, f"processes of the cluster still running: {left}"
    assert not Path(state["temp_dir"]).exists()
    assert token_file.exists() == had_token_file  # the token lived in the state file only, now removed
    assert not (Path(c.env["XDG_CACHE_HOME"]) / "kvcmas" / "cluster.json").exists()


def _ray_processes() -> dict[int, str]:
    """Every Ray process on this machine (pid -> command line), whatever it calls itself."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and ("ray::" in line or "/ray/" in line or " ray." in line):
            found[proc.pid] = line[:120]
    return found


def _left_behind(before: dict[int, str]) -> list[str]:
    """Ray processes that were not running before (nothing else on this machine runs Ray)."""
    return [line for pid, line in _ray_processes().items() if pid not in before]


def _owner(key: str) -> str:
    return f"r{rendezvous_order(key, range(N_REPLICAS))[0]}"


def _hop(c: Cluster, k: int, task: str, replies: list[str], options: dict[str, Any] | None) -> dict[str, Any]:
    messages = [{"role": "system", "content": ROLES[k]}, {"role": "user", "content": task}]
    messages += [{"role": "user", "content": r} for r in replies]
    body = c.chat(messages, **({"kvcmas": options | {"agent": f"agent{k}"}} if options is not None else {}))
    replies.append(body["choices"][0]["message"]["content"])
    return body


def _workflows(c: Cluster, n: int, named: bool) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for w in range(n):
        wf = f"wf-{'named' if named else 'plain'}-{w}"
        replies: list[str] = []
        out[wf] = [_hop(c, k, _task(w), replies, {"workflow": wf} if named else None) for k in range(len(ROLES))]
    return out


def test_workflows_stick_to_one_replica_and_reuse(cluster: Cluster) -> None:
    runs = _workflows(cluster, 12, named=True)
    for wf, hops in runs.items():
        assert {h["kvcmas"]["replica"] for h in hops} == {_owner(workflow_key(wf))}, wf
        assert all(h["kvcmas"]["workflow"] == wf for h in hops)
        assert all(h["kvcmas"]["span_tokens"] > 0 for h in hops[1:]), wf
    assert len({hops[0]["kvcmas"]["replica"] for hops in runs.values()}) >= 2
    # every replica was given the one shared --calibration-dir: the maps they learned are there for a replacement
    assert list(cluster.calibration_dir.glob("*/*.npz"))
    for wf in runs:  # DELETE reaches the owner: the workflow is open there once, and only once
        assert cluster.request("DELETE", f"/v1/kvcmas/workflows/{wf}")[0] == 200
        assert cluster.request("DELETE", f"/v1/kvcmas/workflows/{wf}")[0] == 404


def test_unmodified_requests_stick_by_their_task(cluster: Cluster) -> None:
    runs = _workflows(cluster, 12, named=False)
    for wf, hops in runs.items():
        assert len({h["kvcmas"]["replica"] for h in hops}) == 1, wf
        assert all(h["kvcmas"]["span_tokens"] > 0 for h in hops[1:]), wf
    assert len({hops[0]["kvcmas"]["replica"] for hops in runs.values()}) >= 2


def test_streaming_through_the_ingress(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": ROLES[0]}, {"role": "user", "content": _task(99)}]
    options = {"method": "nonshared"}
    whole = cluster.chat(messages, kvcmas=options | {"workflow": "wf-stream-a"})
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    body = {"messages": messages, "temperature": 0, "max_tokens": 6, "stream": True, "kvcmas": options}
    body["kvcmas"] = options | {"workflow": "wf-stream-b"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    events = []
    for line in resp:  # arrives event by event, not as one buffered body
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
    conn.close()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["kvcmas"]["replica"] == _owner(workflow_key("wf-stream-b"))


def _engine_actor(rank: int) -> Any:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#kvcmas-engine-{rank}#" in a["name"]]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def _wait_healthy(c: Cluster, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status, _, health = c.request("GET", "/health")
        if status == 200 and health["status"] == "ok" or time.monotonic() > deadline:
            return dict(health)
        time.sleep(0.5)


def test_failover_then_reuse_and_survivors_stay(cluster: Cluster) -> None:
    import ray

    wf = "wf-failover"
    owner = _owner(workflow_key(wf))
    # one hop of other workflows, before the kill: where they are and that their next hop reuses there
    others: dict[str, list[str]] = {f"wf-survivor-{i}": [] for i in range(9)}
    first = {name: _hop(cluster, 0, _task(200 + i), replies, {"workflow": name})
             for i, (name, replies) in enumerate(others.items())}  # fmt: skip
    replies: list[str] = []
    hops = [_hop(cluster, k, _task(100), replies, {"workflow": wf}) for k in range(2)]
    assert {h["kvcmas"]["replica"] for h in hops} == {owner}
    ray.kill(_engine_actor(int(owner[1:])), no_restart=True)
    t0 = time.monotonic()
    hop3 = _hop(cluster, 2, _task(100), replies, {"workflow": wf})
    failover_s = time.monotonic() - t0
    assert hop3["kvcmas"]["replica"] != owner
    # dense: none of the workflow's spans lives there (its system prompt may come from that replica's prefix cache)
    assert hop3["kvcmas"]["span_tokens"] == 0
    hop4 = _hop(cluster, 3, _task(100), replies, {"workflow": wf})
    assert hop4["kvcmas"]["replica"] == hop3["kvcmas"]["replica"]
    assert hop4["kvcmas"]["span_tokens"] > 0
    health = _wait_healthy(cluster)
    assert health["status"] == "ok", health  # Serve replaced the replica under the same rank
    assert health["failovers"] >= 1
    # once the replacement is up, no surviving workflow moved; the dead replica's own ones start afresh there
    for i, (name, prior) in enumerate(others.items()):
        again = _hop(cluster, 1, _task(200 + i), prior, {"workflow": name})
        before = first[name]["kvcmas"]["replica"]
        assert again["kvcmas"]["replica"] == before == _owner(workflow_key(name))
        spans = again["kvcmas"]["span_tokens"]
        assert (spans == 0) if before == owner else (spans > 0), (name, before, spans)
    # the moved workflow stays where its spans are, and its DELETE reaches it there
    assert cluster.request("DELETE", f"/v1/kvcmas/workflows/{wf}")[0] == 200
    print(f"failover hop: {failover_s * 1000:.0f} ms")


def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error_event(cluster: Cluster) -> None:
    """The owner dies after the first streamed chunk: the client's stream ends (no hang) with the error event the
    server's own stream errors have (code replica_lost), not with [DONE]; the replacement then comes up."""
    import ray

    eog = kc.Model(str(cluster.model), n_threads=1).tokenizer.eog_ids  # suppressed: the answer runs long
    wf = "wf-lost-mid-stream"
    body = {
        "messages": [{"role": "user", "content": _task(7)}],
        "temperature": 0,
        "max_tokens": 1500,
        "stream": True,
        "logit_bias": {str(t): -100 for t in eog},
        "kvcmas": {"workflow": wf, "method": "nonshared"},
    }
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events: list[bytes] = []
    killed_at = None
    for line in resp:
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if killed_at is None:
                ray.kill(_engine_actor(int(_owner(workflow_key(wf))[1:])), no_restart=True)
                killed_at = time.monotonic()
    assert killed_at is not None
    ended_s = time.monotonic() - killed_at
    conn.close()
    assert events[-1] != b"[DONE]", "the stream finished before the kill: make it longer"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "replica_lost" and "send it again" in last["error"]["message"], last
    tokens = sum(bool(json.loads(e)["choices"]) for e in events[:-1])
    assert tokens < body["max_tokens"] and ended_s < 30, (tokens, ended_s)
    assert _wait_healthy(cluster)["status"] == "ok"


def test_cluster_metrics_and_health_per_replica(cluster: Cluster) -> None:
    health = _wait_healthy(cluster)
    assert set(health["replicas"]) == {f"r{r}" for r in range(N_REPLICAS)}
    samples = cluster.metrics()  # checks the exposition syntax
    for r in range(N_REPLICAS):
        assert samples[f'kvcmas_cluster_replica_up{{replica="r{r}"}}'] == 1
        assert any(n.startswith(f'kvcmas_requests_total{{replica="r{r}",') for n in samples)
    done = cluster.cli("status")
    assert done.returncode == 0 and json.loads(done.stdout)["health"]["status"] == "ok"


def test_bad_requests_get_the_replicas_400(cluster: Cluster) -> None:
    status, headers, body = cluster.request("POST", "/v1/chat/completions", {"messages": "not a list"})
    assert status == 400, body
    assert body["error"]["param"] == "messages" and headers["x-kvcmas-replica"].startswith("r")
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=b"{not json", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400, resp.read()
    conn.close()


@contextlib.contextmanager
def _traffic(c: Cluster) -> Iterator[list[tuple[int, str]]]:
    """While the block runs, one client sends hops of workflows (a new one every 4 hops) one after another; yields
    the list of their answers, (HTTP status, body), filled when the block ends."""
    import threading

    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def run() -> None:
        n = 0
        while not stop.is_set():
            wf, k = f"wf-traffic-{n // 4}", n % 4
            body = {"messages": [{"role": "system", "content": ROLES[k]}, {"role": "user", "content": _task(n // 4)}]}
            try:
                status, _, out = c.request(
                    "POST", "/v1/chat/completions", body | {"max_tokens": 4, "kvcmas": {"workflow": wf}}
                )
            except OSError as e:
                status, out = -1, str(e)
            answers.append((status, str(out)[:200]))
            n += 1

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield answers
    finally:
        stop.set()
        thread.join(timeout=120)


def test_scale_up_keeps_the_running_engines(cluster: Cluster) -> None:
    """`kvcmas cluster up --replicas 4` on the running 3: the 3 engines keep their processes (and spans): a workflow
    whose owner stays reuses on its next hop; only the workflows the 4th rank now owns move, each to it, dense.
    Then back to 3: the 4th rank goes, the others still keep their processes. A client sends requests throughout
    both changes: every one is answered 200 (a request for the rank being removed fails over)."""
    names = [f"wf-scale-{i}" for i in range(12)]
    replies: dict[str, list[str]] = {wf: [] for wf in names}
    for i, wf in enumerate(names):
        for k in range(2):
            assert _hop(cluster, k, _task(300 + i), replies[wf], {"workflow": wf})["kvcmas"]["replica"] == _owner(
                workflow_key(wf)
            )
    before = cluster.processes()
    with _traffic(cluster) as answered:  # requests keep coming while the cluster changes: none fails
        done = cluster.cli("up", "--replicas", str(N_REPLICAS + 1))
    assert done.returncode == 0, done.stdout + done.stderr
    assert answered and all(status == 200 for status, _ in answered), [a for a in answered if a[0] != 200]
    after = cluster.processes()
    assert set(after) == {f"r{r}" for r in range(N_REPLICAS + 1)}
    assert {name: after[name] for name in before} == before  # the same processes: not restarted
    moved = []
    for i, wf in enumerate(names):
        hop = _hop(cluster, 2, _task(300 + i), replies[wf], {"workflow": wf})["kvcmas"]
        owner = f"r{rendezvous_order(workflow_key(wf), range(N_REPLICAS + 1))[0]}"
        assert hop["replica"] == owner, wf
        if owner == _owner(workflow_key(wf)):
            assert hop["span_tokens"] > 0, (wf, hop)  # its spans are still there
        else:
            assert owner == f"r{N_REPLICAS}" and hop["span_tokens"] == 0, (wf, hop)
            moved.append(wf)
    assert 0 < len(moved) < len(names) / 2, moved  # about 1/4 (the 1/N property itself: the routing test)
    with _traffic(cluster) as answered:
        done = cluster.cli("up", "--replicas", str(N_REPLICAS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert answered and all(status == 200 for status, _ in answered), [a for a in answered if a[0] != 200]
    assert cluster.processes() == before
    for i, wf in enumerate(names):
        if wf not in moved:
            hop = _hop(cluster, 3, _task(300 + i), replies[wf], {"workflow": wf})["kvcmas"]
            assert hop["replica"] == _owner(workflow_key(wf)) and hop["span_tokens"] > 0, (wf, hop)
