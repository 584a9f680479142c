"""The progress bar of long benchmark runs (on stderr, gone when done)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
