"""The server's LoRA adapters: loading `--lora` files at start, and which adapter (and scale) a request runs with.

A request picks an adapter as vLLM does, by naming it in `"model"`, or as llama.cpp does, by the per-request
`"lora": [{"id": 0, "scale": 0.5}]` (ids: the adapters' places in load order, as GET /lora-adapters lists them).
Unlike llama.cpp, no adapter applies to a request that asks for none, and a request runs with one adapter at most
(the engine gives each sequence one). A tenant limited to some adapters (`adapters=` in --api-key-file) is refused the
others (403). A chat request with an adapter joins its workflow's sharing session as an agent of its role and adapter
(spans other agents computed with other adapters are read through the method: sharing/adapter_views.py); the prefix
cache serves only rows computed with the same adapter and scale (kvcmas_cpp.prefix_cache).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._native import KvcmasError
from ..adapters import Adapter
from ..model import Model
from .schemas import LoraChoice
from .validation import ApiError


def parse_lora_flag(spec: str) -> tuple[str | None, str]:
    """`--lora NAME=PATH` or `--lora PATH` (named by the file's stem): (name or None, path)."""
    if "=" in spec and not os.path.exists(spec):
        name, path = spec.split("=", 1)
        if not name or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH or PATH")
        return name, path
    return None, spec


@dataclass(frozen=True)
class Pick:
    """What a request runs with: an adapter's name and (engine id, scale), or the base model (None, None)."""

    name: str | None = None
    adapter: tuple[int, float] | None = None

    @property
    def named(self) -> tuple[str, float] | None:
        """(name, scale), as a session's agent takes it (AgentSession.prefill_plan); None for the base model."""
        return None if self.name is None or self.adapter is None else (self.name, self.adapter[1])


BASE = Pick()  # the base model, no adapter


class ServedAdapters:
    """The adapters a server serves, in load order (the `lora` field's ids), and the requests' choice among them."""

    def __init__(self, model: Model, base_id: str, base_names: set[str], flags: tuple[str, ...] = ()) -> None:
        """Loads each `--lora` flag's file onto the model (ValueError naming the flag and the problem; adapters the
        model holds already are served too, first)."""
        for spec in flags:
            name, path = parse_lora_flag(spec)
            shown = name if name is not None else Path(path).stem
            if shown in base_names:
                raise ValueError(f"--lora {spec}: the adapter name {shown!r} is the base model's id; name it NAME=PATH")
            if not os.path.isfile(path):
                raise ValueError(f"--lora {spec}: no such file: {path}")
            try:
                model.load_adapter(path, name=name)
            except (KvcmasError, ValueError) as e:
                raise ValueError(f"--lora {spec}: {e}") from None
        self.base_id, self.base_names = base_id, base_names
        self.list: list[Adapter] = sorted(model.adapters.values(), key=lambda a: a.id)
        self.by_name = {a.name: a for a in self.list}

    def check_limits(self, limits: dict[str, frozenset[str]]) -> None:
        """ValueError when a tenant's `adapters=` names an adapter the server does not serve (a typo would else
        silently forbid it)."""
        for tenant, names in limits.items():
            unknown = sorted(names - set(self.by_name))
            if unknown:
                served = ", ".join(map(repr, self.by_name)) or "none"
                raise ValueError(
                    f"--api-key-file: tenant {tenant!r} may use adapter {unknown[0]!r}, which no --lora "
                    f"loads (served: {served})"
                )

    def reply_model(self, name: str | None) -> str | None:
        """The model id a reply reports for a request naming `name`: the adapter's name, None for the base."""
        return name if name in self.by_name else None

    def allowed(self, tenant: str | None, limits: dict[str, frozenset[str]]) -> list[Adapter]:
        """The adapters a tenant may use (every one when it has no limit)."""
        only = limits.get(tenant) if tenant is not None else None
        return [a for a in self.list if only is None or a.name in only]

    def pick(
        self,
        model_field: str | None,
        lora_field: list[LoraChoice] | None,
        tenant: str | None,
        limits: dict[str, frozenset[str]],
    ) -> Pick:
        """The adapter a request runs with (see the module's docstring). Raises ApiError: 404 for an unknown name
        or id (400 for an unknown model when no adapter is served, as before adapters), 400 for two adapters or a
        conflict between the fields, 403 for an adapter the tenant may not use."""
        name: str | None = None
        scale = 1.0
        if model_field is not None and model_field not in self.base_names:
            if model_field not in self.by_name:
                if not self.list:
                    raise ApiError(
                        400,
                        f"unknown model '{model_field}': this server serves '{self.base_id}'",
                        "model_not_found",
                        "model",
                    )
                served = ", ".join(repr(a.name) for a in self.list)
                raise ApiError(
                    404,
                    f"the model '{model_field}' does not exist: this server serves '{self.base_id}' and the "
                    f"adapters {served}",
                    "model_not_found",
                    "model",
                )
            name = model_field
        if lora_field is not None:
            bad = next((c.id for c in lora_field if c.id >= len(self.list)), None)
            if bad is not None:
                raise ApiError(
                    404,
                    f"lora: no adapter has id {bad}; this server has {len(self.list)} (GET /lora-adapters)",
                    "adapter_not_found",
                    "lora",
                )
            applied = {c.id: float(c.scale) for c in lora_field if c.scale != 0}
            if len(applied) > 1:
                raise ApiError(400, "lora: a request runs with one adapter at most", "invalid_value", "lora")
            if applied:
                ((aid, scale),) = applied.items()
                named = self.list[aid].name
                if name is not None and name != named:
                    raise ApiError(
                        400,
                        f"lora: adapter id {aid} is {named!r}, but model names the adapter {name!r}",
                        "invalid_value",
                        "lora",
                    )
                name = named
        if name is None:
            return BASE
        only = limits.get(tenant) if tenant is not None else None
        if only is not None and name not in only:
            allowed = ", ".join(repr(a) for a in sorted(only)) or "none"
            raise ApiError(
                403, f"the adapter {name!r} is not allowed for this API key (allowed: {allowed})", "adapter_forbidden"
            )
        return Pick(name, (self.by_name[name].id, scale))

    def cards(self, allowed: list[Adapter], created: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters (vLLM's shape: root is the file, parent the base model's id)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "kvcmas",
                "root": a.path,
                "parent": self.base_id,
                "meta": {"lora_alpha": a.alpha, "max_rank": a.max_rank, "n_matrices": a.n_matrices, "bytes": a.bytes},
            }
            for a in allowed
        ]

    def lora_list(self, allowed: list[Adapter]) -> list[dict[str, Any]]:
        """GET /lora-adapters, as llama.cpp's server lists them (scale: what a request that names one gets)."""
        return [{"id": self.list.index(a), "name": a.name, "path": a.path, "scale": 1.0} for a in allowed]
