"""Gemma 3's image tokens in a prompt, as its processor writes them.

The chat template writes ``<start_of_image>`` where an image goes; Gemma3Processor replaces each with
``"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"`` and tokenizes the
text once, so the newlines merge with the neighbouring text as the tokenizer decides. The image's rows then replace
the soft-token embeddings (unscaled: only token embeddings are multiplied by sqrt(n_embd)), and attend to each other
bidirectionally (BidirectionalRows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..model import BidirectionalRows

PROJECTOR_TYPE = "gemma3"  # clip.projector_type of a Gemma 3 mmproj
BOI = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI = "<end_of_image>"
BEFORE_IMAGE = f"\n\n{BOI}"  # the processor's text before and after an image's soft tokens
AFTER_IMAGE = f"{EOI}\n\n"


def image_text(n_tokens: int) -> str:
    """What the processor writes for one image of n_tokens soft tokens."""
    return BEFORE_IMAGE + IMAGE_TOKEN * n_tokens + AFTER_IMAGE


def image_token_id(tokenizer: Any) -> int:
    """The soft token's id in a Gemma 3 vocabulary (ValueError when the tokenizer has no such single token)."""
    ids = tokenizer.encode(IMAGE_TOKEN, False, True)
    if len(ids) != 1:
        raise ValueError(f"the text model's vocabulary has no {IMAGE_TOKEN} token (a Gemma 3 mmproj needs it)")
    return int(ids[0])


def segments(ids: Sequence[int], image_id: int, images: Sequence[np.ndarray]) -> list[list[int] | np.ndarray]:
    """A tokenized prompt split at its runs of image soft tokens, each run replaced by the next image's rows (as
    BidirectionalRows): [text ids, rows, text ids, ...]. ValueError unless there is one run per image, as long as
    its rows."""
    out: list[list[int] | np.ndarray] = []
    text: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] != image_id:
            text.append(int(ids[i]))
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == image_id:
            j += 1
        if k >= len(images) or len(images[k]) != j - i:
            rows = "none left" if k >= len(images) else f"{len(images[k])} rows"
            raise ValueError(f"prompt: a run of {j - i} image tokens for image {k} ({rows})")
        out += [text, np.asarray(images[k]).view(BidirectionalRows)]
        text, i, k = [], j, k + 1
    if k != len(images):
        raise ValueError(f"prompt: {k} image token runs for {len(images)} images")
    out.append(text)
    return [seg for seg in out if len(seg)]
