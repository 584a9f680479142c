"""Loads the compiled core. KVCMAS_CORE_PATH may name a `_core` module built elsewhere (developer builds)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING


def _load() -> ModuleType:
    override = os.environ.get("KVCMAS_CORE_PATH")
    if override:
        spec = importlib.util.spec_from_file_location("kvcmas_cpp._core", override)
        if spec is None or spec.loader is None:
            raise ImportError(f"KVCMAS_CORE_PATH={override!r} is not a loadable extension module")
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvcmas_cpp._core"] = module
        spec.loader.exec_module(module)
        return module
    from . import _core  # type: ignore[attr-defined]

    return _core


core = _load()
if TYPE_CHECKING:  # what the core defines, spelled out so that Python error classes can subclass it

    class KvcmasError(ValueError):
        """A bad file or argument; the message names the file and the problem."""

else:
    KvcmasError = core.KvcmasError


def backends() -> dict[str, tuple[bool, str]]:
    """Backends compiled into the core: {name: (usable on this machine, why not)}. "cpu" is always there and usable;
    "cuda" is there on builds with KVCMAS_CUDA=ON and usable where a GPU and driver are."""
    listing = getattr(core, "backends", None)
    if listing is None:  # a core built before the backend seam
        return {"cpu": (True, "")}
    return {str(name): (bool(ok), str(why)) for name, (ok, why) in listing().items()}


def supported_architectures() -> list[str]:
    """The GGUF ``general.architecture`` values the core runs, in its registry's order."""
    return [str(a) for a in core.architectures()]
