"""`kvcmas cluster up|down|status`: the Serve application of serve_app.py on a Ray cluster.

`up` without an address (--address or RAY_ADDRESS) starts a Ray head on this machine, bound to 127.0.0.1, with usage
stats off, token authentication on (a fresh token, kept in the state file, never in ~/.ray) and its own temporary
directory; `down` ends exactly that head's processes (by pid) and removes the directory and the state file. With an
address, `up` deploys onto that cluster and `down` only removes the application (the cluster stays). The state file
($XDG_CACHE_HOME/kvcmas/cluster.json, mode 0600) tells `status` and `down` where the cluster is.

Ray is imported only inside the commands: `kvcmas --help` and the rest of the CLI never need it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8000
INSTALL_HINT = "kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'"
LOOPBACK = "127.0.0.1"
HEAD_MARKER = "KVCMAS_RAY_HEAD"  # in the environment of every process of a head `up` started: its temporary dir
STOP_GRACE_S = 2.0  # after SIGTERM; GCS and raylet take longer to drain a cluster that is being thrown away


def add_cluster_commands(sub: Any) -> None:
    """Adds `cluster up|down|status` to the `kvcmas` subcommands."""
    p = sub.add_parser("cluster", help="kvcmas on a Ray Serve cluster: up, down, status (docs/cluster.md)")
    cs = p.add_subparsers(dest="cluster", required=True)
    up = cs.add_parser("up", help="start the engine replicas and the routing ingress")
    up.add_argument("--replicas", type=int, default=None, help="engine replicas (default: 1, or the config's)")
    up.add_argument("--port", type=int, default=None, help=f"HTTP port of the ingress (default: {DEFAULT_PORT})")
    up.add_argument("--host", default=None, help=f"HTTP bind address of Serve's proxies (default: {LOOPBACK})")
    up.add_argument("--config", default=None, help="a Serve config file (YAML or JSON) of this application")
    up.add_argument("--address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else a new head)")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs the new local head offers (default: all)")
    up.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after `--`: kvcmas-server arguments for every replica (--model, -t, --calibration-dir, ...)",
    )
    up.set_defaults(func=cmd_up)
    cs.add_parser("down", help="remove the application; stop the Ray head `up` started").set_defaults(func=cmd_down)
    cs.add_parser("status", help="replicas and their health").set_defaults(func=cmd_status)


# ---------------------------------------------------------------------------------------------- state
def state_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcmas" / "cluster.json"


def read_state() -> dict[str, Any] | None:
    try:
        return dict(json.loads(state_path().read_text()))
    except (OSError, ValueError):
        return None


def _write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)


def ray_env(state: dict[str, Any]) -> dict[str, str]:
    """The environment Ray needs for the cluster the state describes. A local head is loopback only: Ray reads
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 when it is imported, and then never resolves 127.0.0.1 to this machine's
    network address."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if state.get("started_head"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if state.get("token"):
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": state["token"]}
    return env


def connect(state: dict[str, Any]) -> None:
    """Connects this process to the cluster the state describes (a no-op when already connected). For a local
    head, call it before anything imports Ray (see ray_env)."""
    os.environ.update(ray_env(state))
    try:
        import ray
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    if not ray.is_initialized():
        ray.init(address=state["address"], logging_level=logging.WARNING, log_to_driver=False, configure_logging=False)


# ---------------------------------------------------------------------------------------------- up
def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _ray_cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from ray.scripts.scripts import main; main()", *args]


def _start_head(state: dict[str, Any], num_cpus: int | None) -> None:
    """Starts a Ray head on loopback with its own temporary directory and the state's token; notes in the state
    how to reach it."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvcmas-ray-")
    state |= {"address": f"{LOOPBACK}:{port}", "temp_dir": temp_dir}
    cmd = _ray_cli(
        "start",
        "--head",
        f"--node-ip-address={LOOPBACK}",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus if num_cpus is not None else os.cpu_count() or 1}",
    )
    env = {**os.environ, **ray_env(state), HEAD_MARKER: temp_dir}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        _stop_head(state)
        raise RuntimeError(
            f"`ray start --head` failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def load_config(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(serve.start's options, the application's args) from a Serve config file (YAML or JSON; applications[0] is
    kvcmas): http_options and proxy_location are read, the rest of the top level is Serve's own business."""
    if path is None:
        return {"http_options": {}}, {}
    text = Path(path).read_text()
    try:
        import yaml

        data = yaml.safe_load(text)
    except ImportError:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a Serve config (a mapping with http_options and applications)")
    apps = data.get("applications") or [{}]
    options: dict[str, Any] = {"http_options": dict(data.get("http_options") or {})}
    if data.get("proxy_location"):
        options["proxy_location"] = data["proxy_location"]
    return options, dict(apps[0].get("args") or {})


def cmd_up(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("RAY_ADDRESS")
    state: dict[str, Any] = {"address": address, "started_head": False}
    if not address:
        state = {"started_head": True, "token": secrets.token_hex(32)}
    os.environ.update(ray_env(state))  # before Ray is imported: it reads them then
    try:
        from ray import serve
    except ImportError:
        print(f"kvcmas: error: {INSTALL_HINT}", file=sys.stderr)
        return 1
    from .serve_app import APP_NAME, build

    if read_state() is not None:
        print("kvcmas: error: a cluster is up already (kvcmas cluster down first)", file=sys.stderr)
        return 1
    start_options, config = load_config(args.config)
    http_options = start_options["http_options"]
    if args.replicas is not None:
        config["replicas"] = args.replicas
    server_args = [a for a in args.server_args if a != "--"] if args.server_args else []
    if server_args:
        config["server_args"] = server_args
    http_options["host"] = args.host or http_options.get("host", LOOPBACK)
    http_options["port"] = args.port or http_options.get("port", DEFAULT_PORT)
    app = build(config)  # bad settings fail here, before anything starts
    if state["started_head"]:
        _start_head(state, args.num_cpus)
    state["url"] = f"http://{http_options['host']}:{http_options['port']}"
    _write_state(state)
    try:
        connect(state)
        t0 = time.monotonic()
        serve.start(**start_options)
        serve.run(app, name=APP_NAME, route_prefix="/")
    except BaseException:
        _down(state)
        raise
    print(f"kvcmas cluster up: {config.get('replicas', 1)} replicas in {time.monotonic() - t0:.1f} s, {state['url']}")
    return 0


# ---------------------------------------------------------------------------------------------- down, status
def _head_processes(temp_dir: str) -> list[Any]:
    """The processes of the head `up` started: those that inherit HEAD_MARKER=temp_dir from `ray start` (the client
    server names no directory) or name the directory on their command line (GCS, raylet, monitors), and all their
    descendants (agents and workers, which rename themselves `ray::...` over their environment)."""
    import psutil

    found: dict[int, Any] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if (
                any(temp_dir in part for part in proc.info["cmdline"] or [])
                or proc.environ().get(HEAD_MARKER) == temp_dir
            ):
                found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found |= {child.pid: child for child in proc.children(recursive=True)}
    found.pop(os.getpid(), None)
    return list(found.values())


def _stop_head(state: dict[str, Any]) -> None:
    import psutil

    temp_dir = state.get("temp_dir")
    if not temp_dir:
        return
    procs = _head_processes(temp_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _down(state: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):
        connect(state)
        from ray import serve

        serve.shutdown()
    with contextlib.suppress(Exception):
        import ray

        ray.shutdown()
    if state.get("started_head"):
        _stop_head(state)
    with contextlib.suppress(FileNotFoundError):
        state_path().unlink()


def cmd_down(args: argparse.Namespace) -> int:
    state = read_state()
    if state is None:
        print("kvcmas cluster: nothing is up")
        return 0
    _down(state)
    print("kvcmas cluster down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = read_state()
    if state is None:
        print("kvcmas cluster: nothing is up")
        return 1
    try:
        with urllib.request.urlopen(state["url"] + "/health", timeout=10) as r:
            health = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: no replica is up; the body still says which
        health = json.loads(e.read() or b"{}")
    except OSError as e:
        health = {"status": "unreachable", "error": str(e)}
    except ValueError as e:
        health = {"status": "unreadable", "error": str(e)}
    print(json.dumps({"url": state["url"], "address": state["address"], "health": health}, indent=2))
    return 0 if health.get("status") == "ok" else 1
