"""Gemma 3's image tokens in a prompt, as its processor writes them.

The chat template writes ``<start_of_image>`` where an image goes; Gemma3Processor replaces each with
``"\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image + "<end_of_image>\\n\\n"`` and tokenizes the
text once, so the newlines merge with the neighbouring text as the tokenizer decides. The image's rows then replace
the soft-token embeddings (unscaled: only token embeddings are multiplied by sqrt(n_embd)), and attend to each other
bidirectionally (BidirectionalRows).

Pan-and-scan (Gemma3ImageProcessor's ``do_pan_and_scan``, recorded in the mmproj by kvcmas_convert): an image whose
aspect ratio reaches ``min_ratio_to_activate`` is also cut into 2..``max_num_crops`` equal crops along its long side
(about one per aspect-ratio unit, none under ``min_crop_size`` px); the base image and each crop are preprocessed
and encoded as images of their own, and the processor writes ``"Here is the original image " + image_text +
" and here are some crops to help you see better " + " ".join(image_text per crop)`` (crops_text).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from ..model import BidirectionalRows

PROJECTOR_TYPE = "gemma3"  # clip.projector_type of a Gemma 3 mmproj
BOI = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI = "<end_of_image>"
NEWLINES = "\n\n"  # the processor's text before <start_of_image> and after <end_of_image>
# the mmproj keys of pan-and-scan (kvcmas_convert.vision writes them)
KEY_PAN_AND_SCAN = "kvcmas.vision.pan_and_scan"
KEY_PAS_MIN_CROP_SIZE = "kvcmas.vision.pan_and_scan.min_crop_size"
KEY_PAS_MAX_NUM_CROPS = "kvcmas.vision.pan_and_scan.max_num_crops"
KEY_PAS_MIN_RATIO = "kvcmas.vision.pan_and_scan.min_ratio_to_activate"
BEFORE_BASE = "Here is the original image "  # Gemma3Processor's text around an image with crops
BEFORE_CROPS = " and here are some crops to help you see better "


@dataclass(frozen=True)
class PanAndScan:
    """Gemma3ImageProcessor's pan-and-scan settings."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def __post_init__(self) -> None:
        if self.min_crop_size < 1 or self.max_num_crops < 1 or not self.min_ratio_to_activate > 0:
            raise ValueError(f"PanAndScan: need min_crop_size >= 1, max_num_crops >= 1, ratio > 0: {self}")

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(crops across, crops down); (0, 0) when the image gets no crops (too square, or crops too small)."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return 0, 0
        n = min(math.floor(long / short + 0.5), math.floor(long / self.min_crop_size))  # half rounds up
        n = min(self.max_num_crops, max(2, n))
        across, down = (n, 1) if width >= height else (1, n)
        if min(math.ceil(width / across), math.ceil(height / down)) < self.min_crop_size:
            return 0, 0
        return across, down

    def crops(self, image: Image.Image) -> list[Image.Image]:
        """The image's crops, row by row (the last one in a row or column cut short at the image's edge, as the
        processor's array slices are)."""
        across, down = self.grid(image.width, image.height)
        if not across:
            return []
        cw, ch = math.ceil(image.width / across), math.ceil(image.height / down)
        return [image.crop((x, y, min(x + cw, image.width), min(y + ch, image.height)))
                for y in range(0, ch * down, ch) for x in range(0, cw * across, cw)]  # fmt: skip


def read_pan_and_scan(path: str) -> PanAndScan | None:
    """The pan-and-scan settings an mmproj file records (None when it has none). ValueError names a bad value."""
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    if not value(KEY_PAN_AND_SCAN):
        return None
    size, n, ratio = (value(k) for k in (KEY_PAS_MIN_CROP_SIZE, KEY_PAS_MAX_NUM_CROPS, KEY_PAS_MIN_RATIO))
    if not isinstance(size, int) or not isinstance(n, int) or not isinstance(ratio, float):
        raise ValueError(f"{path}: {KEY_PAN_AND_SCAN} without its min_crop_size, max_num_crops, min_ratio_to_activate")
    # the ratio is stored as float32: its shortest decimal is the processor's value (1.2, not 1.2000000476837158)
    return PanAndScan(size, n, float(str(np.float32(ratio))))


def crops_text(n_tokens: int, n_crops: int) -> str:
    """What the processor writes for an image with n_crops crops (image_text when there are none)."""
    one = image_text(n_tokens)
    if not n_crops:
        return one
    return f"{BEFORE_BASE}{one}{BEFORE_CROPS}" + " ".join([one] * n_crops)


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


@functools.lru_cache(maxsize=16)
def _settings(path: str) -> PanAndScan | None:
    return read_pan_and_scan(path)


def pan_and_scan_of(enc: Any, pan_and_scan: bool | None = None) -> PanAndScan | None:
    """The settings an image gets with a VisionEncoder: its file's, unless pan_and_scan is False (or the file has
    none; a detail "low" request passes False)."""
    if pan_and_scan is False or not enc.bidirectional:
        return None
    return _settings(enc.path)


def views(enc: Any, image: Any, pan_and_scan: bool | None = None) -> list[Image.Image]:
    """The image (loaded under enc's limits) then its pan-and-scan crops: what the processor preprocesses."""
    rgb = enc.load(image)
    settings = pan_and_scan_of(enc, pan_and_scan)
    return [rgb, *(settings.crops(rgb) if settings else [])]


def pixel_values(enc: Any, image: Any, pan_and_scan: bool | None = None) -> np.ndarray:
    """[1 + n_crops, 3, S, S] float32: the processor's pixel_values for one image (base first, then the crops)."""
    return np.stack([enc.preprocess(v) for v in views(enc, image, pan_and_scan)])


def encode_views(enc: Any, image: Any, pan_and_scan: bool | None = None) -> list[np.ndarray]:
    """Each view's rows (BidirectionalRows): the base image's, then each crop's, for crops_text's soft-token runs."""
    return [enc.encode(v) for v in views(enc, image, pan_and_scan)]


def expand(text: str, n_tokens: int, n_crops: Sequence[int]) -> str:
    """A prompt with each <start_of_image> replaced by the processor's text for its image of n_crops[i] crops."""
    pieces = text.split(BOI)
    if len(pieces) - 1 != len(n_crops):
        raise ValueError(f"prompt: {len(pieces) - 1} {BOI} markers for {len(n_crops)} images")
    out = [pieces[0]]
    for n, piece in zip(n_crops, pieces[1:], strict=True):
        out += [crops_text(n_tokens, n), piece]
    return "".join(out)


def image_parts(views: Sequence[np.ndarray]) -> list[np.ndarray | str]:
    """Content parts of an image's views (encode_views) as the processor writes them, for with_image_text to add
    the newlines: [base] without crops, else [BEFORE_BASE, base, BEFORE_CROPS, crop, " ", crop, ...]."""
    if len(views) == 1:
        return [views[0]]
    out: list[np.ndarray | str] = [BEFORE_BASE, views[0], BEFORE_CROPS]
    for i, crop in enumerate(views[1:]):
        out += [" ", crop] if i else [crop]
    return out


def join_text(parts: Sequence[T | str]) -> list[T | str]:
    """Parts with neighbouring strings joined (the processor tokenizes the text between two images at once)."""
    out: list[T | str] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        else:
            out.append(part)
    return out
