"""kvcmas: a llama.cpp-style inference engine for multi-agent serving with cross-agent KV sharing."""

from __future__ import annotations

__version__ = "0.1.0"

from ._native import KvcmasError

__all__ = ["KvcmasError", "__version__"]
