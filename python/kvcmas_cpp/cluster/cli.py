"""`kvcmas cluster up|down|status|config`: the Serve applications of serve_app.py on a Ray cluster.

`up` deploys the Serve config config.py writes (or a file of that form, --config) with Serve's declarative deploy,
as `serve run CONFIG` does; on a running cluster it applies the change (--replicas, server arguments, a new file):
applications whose args did not change keep their replicas. `config` prints the file, for `serve deploy`.

`up` without an address (--address or RAY_ADDRESS) starts a Ray head on this machine, bound to 127.0.0.1, with usage
stats off, token authentication on (a fresh token, kept in the state file, never in ~/.ray) and its own temporary
directory; `down` ends exactly that head's processes (by pid) and removes the directory and the state file. With an
address, `up` deploys onto that cluster and `down` only removes the applications (the cluster stays). The state file
($XDG_CACHE_HOME/kvcmas/cluster.json, mode 0600) tells `status`, `down` and a later `up` where the cluster is and
what is deployed.

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

from ..arguments import documented
from .config import DEFAULT_ACTOR_OPTIONS, ENGINE_IMPORT, serve_config, settings_of

DEFAULT_PORT = 8000
INSTALL_HINT = "kvcmas cluster needs Ray Serve: pip install 'kvcmas_cpp[cluster]'"
LOOPBACK = "127.0.0.1"
HEAD_MARKER = "KVCMAS_RAY_HEAD"  # in the environment of every process of a head `up` started: its temporary dir
STOP_GRACE_S = 2.0  # after SIGTERM; GCS and raylet take longer to drain a cluster that is being thrown away


def add_cluster_commands(sub: Any) -> None:
    """Adds `cluster up|down|status|config` to the `kvcmas` subcommands."""
    p = sub.add_parser("cluster", **documented("kvcmas on a Ray Serve cluster: up, down, status, config", "cluster.md"))
    cs = p.add_subparsers(dest="cluster", required=True)
    up = cs.add_parser(
        "up",
        **documented(
            "start the engine replicas and the routing ingress; on a running cluster: apply the change", "cluster.md"
        ),
    )
    up.add_argument("--replicas", type=int, default=None, help="engine replicas (default: 1, or the config's)")
    up.add_argument("--port", type=int, default=None, help=f"HTTP port of the ingress (default: {DEFAULT_PORT})")
    up.add_argument("--host", default=None, help=f"HTTP bind address of Serve's proxies (default: {LOOPBACK})")
    up.add_argument("--config", default=None, help="a Serve config file (YAML or JSON) as `cluster config` writes")
    up.add_argument("--address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else a new head)")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs the new local head offers (default: all)")
    up.add_argument(
        "--resources", default=None, help='custom Ray resources the new local head offers, JSON: {"kvcmas_engine": 3}'
    )
    up.add_argument(
        "server_args",
        nargs=argparse.REMAINDER,
        help="after `--`: kvcmas-server arguments for every replica (--model, -t, --calibration-dir, ...)",
    )
    up.set_defaults(func=cmd_up)
    cs.add_parser(
        "down", **documented("remove the application; stop the Ray head `up` started", "cluster.md")
    ).set_defaults(func=cmd_down)
    cs.add_parser("status", **documented("replicas and their health", "cluster.md")).set_defaults(func=cmd_status)
    cf = cs.add_parser(
        "config",
        **documented("print the Serve config file (for `serve deploy`, `serve run`, `up --config`)", "cluster.md"),
    )
    cf.add_argument("--replicas", type=int, default=1, help="engine replicas (default: 1)")
    cf.add_argument("--host", default=LOOPBACK, help=f"HTTP bind address of Serve's proxies (default: {LOOPBACK})")
    cf.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})")
    cf.add_argument("--proxy-location", default=None, help="Serve's proxy_location (e.g. EveryNode)")
    cf.add_argument(
        "--engine-resource", default=None, help="a custom Ray resource each engine needs one of (one per node)"
    )
    cf.add_argument("server_args", nargs=argparse.REMAINDER, help="after `--`: kvcmas-server arguments")
    cf.set_defaults(func=cmd_config)


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


def _start_head(state: dict[str, Any], num_cpus: int | None, resources: str | None = None) -> None:
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
        *([f"--resources={resources}"] if resources else []),
    )
    env = {**os.environ, **ray_env(state), HEAD_MARKER: temp_dir}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        _stop_head(state)
        raise RuntimeError(
            f"`ray start --head` failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def load_config(path: str) -> dict[str, Any]:
    """A Serve config file (YAML or JSON); ValueError when it cannot be read as one."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    try:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not YAML: {e}") from None
    except ImportError:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a Serve config (a mapping with http_options and applications)")
    return data


def _target(args: argparse.Namespace, deployed: dict[str, Any] | None) -> dict[str, Any]:
    """The Serve config `up` deploys: the file (as it is when nothing overrides it), else what is deployed, with
    --replicas and the server arguments applied (re-written by serve_config from the file's settings)."""
    base = load_config(args.config) if args.config else deployed
    server_args = [a for a in args.server_args if a != "--"] if args.server_args else []
    if base is not None and args.replicas is None and not server_args:
        config = dict(base)
    else:
        settings = settings_of(base) if base is not None else {}
        if args.replicas is not None:
            settings["replicas"] = args.replicas
        if server_args:
            settings["server_args"] = server_args
        base = base or {}
        config = serve_config(settings, base.get("http_options"), base.get("proxy_location"))
    http = dict(config.get("http_options") or {})
    if deployed is not None:  # Serve's proxies keep the address they started with
        old = deployed["http_options"]
        if (args.host or old["host"]) != old["host"] or (args.port or old["port"]) != old["port"]:
            raise ValueError(f"the cluster serves on {old['host']}:{old['port']}: --host/--port cannot change it")
        http = dict(old)
    http["host"] = args.host or http.get("host", LOOPBACK)
    http["port"] = args.port or http.get("port", DEFAULT_PORT)
    return config | {"http_options": http}


def _deploy(config: dict[str, Any], timeout: float = 900) -> None:
    """Applies the Serve config to the connected cluster as `serve run CONFIG` does (Serve's declarative deploy:
    an application whose import path and args are unchanged keeps its replicas) and waits until every application
    runs and the ones the config dropped are gone. RuntimeError when an application fails to deploy."""
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_start(http_options=schema.http_options.model_dump(), proxy_location=schema.proxy_location)
    client.deploy_apps(schema)
    wanted = {app.name for app in schema.applications}
    deadline = time.monotonic() + timeout
    while True:
        apps = serve.status().applications
        states = {name: getattr(app.status, "value", app.status) for name, app in apps.items()}
        failed = {n: apps[n].message for n, s in states.items() if n in wanted and s == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError(f"Serve could not deploy: {failed}")
        if set(states) == wanted and set(states.values()) == {"RUNNING"}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster is not running after {timeout:.0f} s: {states}")
        time.sleep(0.5)


def cmd_up(args: argparse.Namespace) -> int:
    deployed_state = read_state()
    if deployed_state is not None:
        if args.address or args.num_cpus is not None or args.resources:
            print(
                "kvcmas: error: a cluster is up already: --address/--num-cpus/--resources apply to a new one",
                file=sys.stderr,
            )
            return 1
        state = deployed_state
    else:
        address = args.address or os.environ.get("RAY_ADDRESS")
        state = {"address": address, "started_head": False}
        if not address:
            state = {"started_head": True, "token": secrets.token_hex(32)}
    os.environ.update(ray_env(state))  # before Ray is imported: it reads them then
    try:
        from ray.serve.schema import ServeDeploySchema
    except ImportError:
        print(f"kvcmas: error: {INSTALL_HINT}", file=sys.stderr)
        return 1
    try:  # bad settings fail here, before anything starts or changes
        config = _target(args, state.get("config"))
        ServeDeploySchema.model_validate(config)
        if args.resources is not None and not isinstance(json.loads(args.resources), dict):
            raise ValueError("--resources: a JSON object of resource names and amounts")
    except ValueError as e:
        print(f"kvcmas: error: {e}", file=sys.stderr)
        return 1
    http = config["http_options"]
    t0 = time.monotonic()
    if deployed_state is not None:
        connect(state)
        before = {a["name"] for a in state["config"]["applications"]}
        _deploy(config)
        _write_state(state | {"config": config})
        after = {a["name"] for a in config["applications"]}
        print(
            f"kvcmas cluster updated in {time.monotonic() - t0:.1f} s: added {sorted(after - before)}, "
            f"removed {sorted(before - after)}; the other applications keep their replicas unless their args changed"
        )
        return 0
    if state["started_head"]:
        _start_head(state, args.num_cpus, args.resources)
    state["url"] = f"http://{http['host']}:{http['port']}"
    _write_state(state)
    try:
        connect(state)
        _deploy(config)
    except BaseException:
        _down(state)
        raise
    _write_state(state | {"config": config})
    engines = sum(a["import_path"] == ENGINE_IMPORT for a in config["applications"])
    print(f"kvcmas cluster up: {engines} replicas in {time.monotonic() - t0:.1f} s, {state['url']}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    options = dict(DEFAULT_ACTOR_OPTIONS)
    if args.engine_resource:
        options["resources"] = {args.engine_resource: 1}
    settings = {
        "replicas": args.replicas,
        "server_args": [a for a in args.server_args if a != "--"],
        "engine_actor_options": options,
    }
    try:
        config = serve_config(settings, {"host": args.host, "port": args.port}, args.proxy_location)
    except ValueError as e:
        print(f"kvcmas: error: {e}", file=sys.stderr)
        return 1
    try:
        import yaml

        class Dumper(yaml.SafeDumper):
            def ignore_aliases(self, data: Any) -> bool:  # every application written out in full
                return True

        print(yaml.dump(config, Dumper=Dumper, sort_keys=False, width=120, default_flow_style=None), end="")
    except ImportError:
        print(json.dumps(config, indent=2))  # JSON is YAML too
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
