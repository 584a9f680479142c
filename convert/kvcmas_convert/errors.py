"""The converter's error type."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint cannot be converted (or a GGUF file cannot be updated); the message names the file or tensor."""
