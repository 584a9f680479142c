"""The core's argument limits and the checks that name a bad argument before the binding sees it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._native import core

# The core takes its int arguments as C ints (int32) or size_t: a larger Python int fails in the binding with a
# TypeError that names no argument, so they are checked here first.
INT32_MAX = 2**31 - 1
SIZE_MAX = 2**64 - 1

# Threads past the cores wait on each other: on 2 cores, 32 threads decode 1.7x slower than 2, 128 threads 30x,
# and 1000 threads looked hung. More than this many per usable CPU is refused.
MAX_THREADS_PER_CPU = 4


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def check_count(name: str, value: object, most: int) -> None:
    """KvcmasError unless `value` is an int in [1, most], naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise core.KvcmasError(f"{name} must be a positive integer, got {value!r}")
    if value > most:
        raise core.KvcmasError(f"{name} {value} is too large")


def token_ids(ids: Any, where: str) -> list[int]:
    """`ids` as a list of ints, or a ValueError naming `where`: bytes (a Sequence[int], but text read in binary mode)
    and elements that are not integers (2.7 is not token 2) are refused. Ranges are checked where the ids are used."""
    if isinstance(ids, str | bytes | bytearray | memoryview):
        kind = "text" if isinstance(ids, str) else "bytes"
        raise ValueError(f"{where}: token ids are a list of ints, got {kind} (decode bytes, tokenize text)")
    try:
        out = list(ids)
    except TypeError:
        raise ValueError(f"{where}: token ids are a list of ints, got {type(ids).__name__}") from None
    odd = next((t for t in out if isinstance(t, bool) or not isinstance(t, int | np.integer)), None)
    if odd is not None:
        raise ValueError(f"{where}: token ids must be integers, got {odd!r} ({type(odd).__name__})")
    huge = next((t for t in out if abs(int(t)) > INT32_MAX), None)
    if huge is not None:  # the core checks the vocabulary's range, but only of ids a C int holds
        raise ValueError(f"{where}: token id {huge} is out of range")
    return [int(t) for t in out]
