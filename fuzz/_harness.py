"""Shared setup for the atheris fuzz targets in this folder.

Each target is a script: ``python fuzz/fuzz_<name>.py [libFuzzer flags] [corpus dirs]``. The package is imported from
the installed wheel, or from ``python/`` when ``KVCMAS_CORE_PATH`` names a developer build of the core (e.g. the
AddressSanitizer build of scripts/ci-sanitize.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def use_source_tree_if_asked() -> None:
    """Puts ``python/`` first on sys.path when a developer build of the core is named by KVCMAS_CORE_PATH."""
    if os.environ.get("KVCMAS_CORE_PATH"):
        sys.path.insert(0, str(REPO_ROOT / "python"))


def scratch_dir() -> Path:
    """A RAM-backed folder for files the targets write (tmpfs when the machine has /dev/shm)."""
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="kvcmas-fuzz-", dir=base))
