"""Single-threaded BLAS for the estimators' small matrices: on a loaded machine OpenBLAS's thread pool makes a
[3000, 192] ridge fit 25x slower than one thread does, and the engine already uses the cores."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from collections.abc import Iterator

import numpy as np


def _openblas() -> tuple[ctypes._NamedFuncPointer, ctypes._NamedFuncPointer] | None:
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libdir, "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "")):
            setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                return setter, getter
    return None


_FUNCS = _openblas()


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Runs the block with numpy's OpenBLAS on one thread (no-op when the library is not found)."""
    if _FUNCS is None:
        yield
        return
    setter, getter = _FUNCS
    before = int(getter())
    setter(1)
    try:
        yield
    finally:
        setter(before)
