"""Loads the compiled core. KVCMAS_CORE_PATH may name a `_core` module built elsewhere (developer builds).

`testing_module()` loads `_testing` (the kernels and backend ops one by one, for tests and kernel benchmarks), built
only with the CMake option KVCMAS_TESTING_MODULE=ON; production code never needs it."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING


def _load_file(name: str, path: str, source: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvcmas_cpp.{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{source}={path!r} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"kvcmas_cpp.{name}"] = module
    spec.loader.exec_module(module)
    return module


def _load() -> ModuleType:
    override = os.environ.get("KVCMAS_CORE_PATH")
    if override:
        return _load_file("_core", override, "KVCMAS_CORE_PATH")
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


TESTING_HINT = (
    "build it with the CMake option KVCMAS_TESTING_MODULE=ON (on by default in developer cmake builds; "
    "scripts/setup.sh --test or --bench for the installed package)"
)


def testing_module() -> ModuleType:
    """The `_testing` extension module: beside KVCMAS_CORE_PATH's `_core` when that is set, else in the package.
    ImportError, saying how to build it, where it was not built."""
    if "kvcmas_cpp._testing" in sys.modules:
        return sys.modules["kvcmas_cpp._testing"]
    override = os.environ.get("KVCMAS_CORE_PATH")
    if override:
        found = sorted(Path(override).parent.glob("_testing*.so"))
        if not found:
            raise ImportError(f"kvcmas_cpp._testing is not built beside KVCMAS_CORE_PATH={override!r}: {TESTING_HINT}")
        return _load_file("_testing", str(found[0]), "KVCMAS_CORE_PATH")
    try:
        from . import _testing  # type: ignore[attr-defined]
    except ImportError as e:
        raise ImportError(f"kvcmas_cpp._testing is not built ({e}): {TESTING_HINT}") from e
    return _testing
