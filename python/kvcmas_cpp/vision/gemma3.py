"""Gemma 3's image tokens in a prompt, as its processor writes them.

The chat template writes ``<start_of_image>`` where an image goes; Gemma3Processor replaces each with
``"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"`` and tokenizes the
text once, so the newlines merge with the neighbouring text as the tokenizer decides. The image's rows then replace
the soft-token embeddings (unscaled: only token embeddings are multiplied by sqrt(n_embd)), and attend to each other
bidirectionally (BidirectionalRows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from ..model import BidirectionalRows

PROJECTOR_TYPE = "gemma3"  # clip.projector_type of a Gemma 3 mmproj
BOI = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI = "<end_of_image>"
NEWLINES = "\n\n"  # the processor's text before <start_of_image> and after <end_of_image>


def image_text(n_tokens: int) -> str:
    """What the processor writes for one image of n_tokens soft tokens."""
    return f"{NEWLINES}{BOI}{IMAGE_TOKEN * n_tokens}{EOI}{NEWLINES}"


def marker_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of <start_of_image> and <end_of_image> (ValueError when the vocabulary lacks them)."""
    out = []
    for text in (BOI, EOI):
        ids = tokenizer.encode(text, False, True)
        if len(ids) != 1:
            raise ValueError(f"the text model's vocabulary has no {text} token (a Gemma 3 mmproj needs it)")
        out.append(int(ids[0]))
    return out[0], out[1]


T = TypeVar("T")


def with_image_text(parts: Sequence[T]) -> list[T | str]:
    """Content parts with the processor's newlines around each image (BidirectionalRows) joined to the text beside
    it, as the processor's text tokenizes them (the begin / end tokens split the text there): ["a", image, "b"] ->
    ["a\n\n", image, "\n\nb"]; an image with no text beside it gets the newlines as a part of their own."""
    out: list[T | str] = []
    after_image = False
    for part in parts:
        if isinstance(part, BidirectionalRows):
            if out and isinstance(out[-1], str) and not after_image:
                out[-1] += NEWLINES
            elif after_image:
                out[-1] = str(out[-1]) + NEWLINES  # two images in a row: "<end_of_image>\n\n\n\n<start_of_image>"
            else:
                out.append(NEWLINES)
            out += [part, NEWLINES]
            after_image = True
        elif isinstance(part, str) and after_image:
            out[-1] = str(out[-1]) + part
            after_image = False
        else:
            out.append(part)
            after_image = False
    return out


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
