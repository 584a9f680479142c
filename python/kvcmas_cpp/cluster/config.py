"""The cluster as a Ray Serve config (no Ray here): one Serve application per engine rank, one for the ingress.

Why one application per rank: Serve gives every deployment of an application one code version, a hash of the
application's import path and args (declarative deploys) or a random string (`serve.run`). Anything that changes
the application (one more engine) therefore restarts all its deployments. With one application per rank, scaling
from N to N+1 ranks adds the application `kvcmas-engine-N` and changes the ingress application's args (`replicas`);
the other engines' applications are unchanged, so Serve leaves their replicas (and the spans they hold) running.

`serve_config(settings)` writes the Serve config (the schema of `serve run` / `serve deploy` files) from kvcmas'
settings; `settings_of(config)` reads them back. Settings: replicas (int >= 1), server_args (kvcmas-server
arguments, a list of strings), engine_actor_options (Ray actor options of each engine, default {"num_cpus": 0}),
max_body_bytes (of a request through the ingress).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

APP_NAME = "kvcmas"  # the ingress application, at route "/"
ENGINE_IMPORT = "kvcmas_cpp.cluster.serve_app:engine"
INGRESS_IMPORT = "kvcmas_cpp.cluster.serve_app:ingress"
SETTINGS = frozenset({"replicas", "server_args", "engine_actor_options", "max_body_bytes"})
DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 0}


def engine_name(rank: int) -> str:
    """The application of an engine rank, and its one deployment."""
    return f"kvcmas-engine-{rank}"


class _ArgumentError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(f"server_args: {message}")


def parse_server_args(server_args: list[str]) -> argparse.Namespace:
    """kvcmas-server's arguments, parsed by its own parser (ValueError when they are refused)."""
    from ..server import add_serve_arguments

    parser = _Parser(prog="kvcmas cluster engine")
    add_serve_arguments(parser)
    return parser.parse_args(server_args)


def engine_args(args: dict[str, Any]) -> tuple[int, list[str], dict[str, Any]]:
    """(rank, server_args, actor options) of an engine application's args; ValueError when they are refused."""
    unknown = set(args) - {"rank", "server_args", "engine_actor_options"}
    if unknown:
        raise ValueError(f"unknown engine settings: {', '.join(sorted(unknown))}")
    rank = int(args["rank"])
    if rank < 0:
        raise ValueError("rank must be >= 0")
    server_args = [str(a) for a in args.get("server_args") or []]
    parse_server_args(server_args)
    return rank, server_args, dict(args.get("engine_actor_options") or DEFAULT_ACTOR_OPTIONS)


def ingress_args(args: dict[str, Any]) -> tuple[int, int | None]:
    """(replicas, max_body_bytes or None) of the ingress application's args; ValueError when they are refused."""
    unknown = set(args) - {"replicas", "max_body_bytes"}
    if unknown:
        raise ValueError(f"unknown ingress settings: {', '.join(sorted(unknown))}")
    replicas = int(args.get("replicas", 1))
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    max_body = args.get("max_body_bytes")
    return replicas, None if max_body is None else int(max_body)


def serve_config(
    settings: dict[str, Any], http_options: dict[str, Any] | None = None, proxy_location: str | None = None
) -> dict[str, Any]:
    """The Serve config (a `serve run`/`serve deploy` file's content) of the settings; ValueError when refused."""
    unknown = set(settings) - SETTINGS
    if unknown:
        raise ValueError(f"unknown cluster settings: {', '.join(sorted(unknown))}")
    ingress: dict[str, Any] = {"replicas": int(settings.get("replicas", 1))}
    if settings.get("max_body_bytes") is not None:
        ingress["max_body_bytes"] = int(settings["max_body_bytes"])
    replicas, _ = ingress_args(ingress)
    base = {
        "server_args": [str(a) for a in settings.get("server_args") or []],
        "engine_actor_options": dict(settings.get("engine_actor_options") or DEFAULT_ACTOR_OPTIONS),
    }
    engine_args({"rank": 0, **base})  # refused here, before anything starts
    apps = [
        {"name": engine_name(r), "route_prefix": None, "import_path": ENGINE_IMPORT, "args": {"rank": r, **base}}
        for r in range(replicas)
    ]
    apps.append({"name": APP_NAME, "route_prefix": "/", "import_path": INGRESS_IMPORT, "args": ingress})
    config: dict[str, Any] = {}
    if proxy_location:
        config["proxy_location"] = proxy_location
    if http_options:
        config["http_options"] = dict(http_options)
    return config | {"applications": apps}


def settings_of(config: dict[str, Any]) -> dict[str, Any]:
    """kvcmas' settings of a Serve config serve_config wrote (or one written by hand in that form): the ingress'
    replicas and max_body_bytes, rank 0's server_args and actor options. ValueError when the config is not one
    cluster: no ingress application, engine ranks other than 0..replicas-1, or engines with different settings."""
    apps = config.get("applications")
    if not isinstance(apps, list):
        raise ValueError("a Serve config needs a list of applications")
    ingresses = [a for a in apps if isinstance(a, dict) and a.get("import_path") == INGRESS_IMPORT]
    if len(ingresses) != 1:
        raise ValueError(f"a kvcmas cluster config has exactly one application with import_path {INGRESS_IMPORT}")
    replicas, max_body = ingress_args(dict(ingresses[0].get("args") or {}))
    engines = {}
    for app in apps:
        if isinstance(app, dict) and app.get("import_path") == ENGINE_IMPORT:
            rank, server_args, options = engine_args(dict(app.get("args") or {}))
            engines[rank] = (server_args, options)
    if sorted(engines) != list(range(replicas)):
        raise ValueError(f"the ingress names {replicas} ranks, the engine applications are ranks {sorted(engines)}")
    if len({repr(e) for e in engines.values()}) != 1:
        raise ValueError("the engine applications have different settings: edit the config file itself")
    server_args, options = engines[0]
    settings: dict[str, Any] = {"replicas": replicas, "server_args": server_args, "engine_actor_options": options}
    if max_body is not None:
        settings["max_body_bytes"] = max_body
    return settings
