"""The vision encoder as agents use it: images in, image-token embeddings out, each image encoded once."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image

from .._native import core
from ..model import BidirectionalRows
from .anyres import ANYRES, SINGLE, VIEWS, AnyResConfig, n_rows, pack, pad_to_square, parse_vision_aspect_ratio, tiles
from .image import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DECODE_BYTES,
    DEFAULT_MAX_PIXELS,
    ImageSource,
    image_hash,
    load_image,
)
from .preprocess import PreprocessConfig, normalize, preprocess, square

# AnyRes keys and tensor of an mmproj file (llama.cpp's names, then kvcmas's; kvcmas_convert.vision writes them)
KEY_GRID_PINPOINTS = "clip.vision.image_grid_pinpoints"  # int32 [h0, w0, h1, w1, ...]
KEY_PATCH_MERGE_TYPE = "clip.vision.mm_patch_merge_type"  # "spatial_unpad" with pinpoints
KEY_VISION_ASPECT_RATIO = "kvcmas.vision.vision_aspect_ratio"  # OneVision's "anyres_max_N"
KEY_MULTI_IMAGE_VIEW = "kvcmas.vision.multi_image_view"  # "single": OneVision's view of each of several images
KEY_PAD_COLOR = "kvcmas.vision.pad_color"  # int32[3]: the single view's padding (default: int(mean x 255))
TENSOR_IMAGE_NEWLINE = "model.image_newline"


QWEN25VL_PROJECTOR = "qwen2.5vl_merger"  # clip.projector_type of a Qwen2.5-VL file (vision/qwen.py)
# Encoders of the projector types with a tower of their own (clip.projector_type -> class), registered by their
# modules (vision/qwen.py), which the package imports: VisionEncoder(path) opens any mmproj file as its class
ENCODER_CLASSES: dict[str, type[VisionEncoder]] = {}


def _projector_type(path: str) -> str | None:
    """clip.projector_type of an mmproj file (None when absent or the file unreadable: the core says why)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields.get("clip.projector_type")
    except Exception:  # noqa: BLE001  (the C++ loader reports a bad file with its reason)
        return None
    return None if field is None else str(field.contents())


def _read_anyres(path: str, core_encoder: Any, mean: tuple[float, ...]) -> tuple[AnyResConfig | None, Any, bool]:
    """(AnyRes settings, image_newline [n_embd_out] float32, several images take the single view) from an mmproj
    file; (None, None, False) for a file without grid pinpoints. Raises ValueError naming what is wrong."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    pinpoints = value(KEY_GRID_PINPOINTS)
    if pinpoints is None:
        return None, None, False
    where = f"{path}: {KEY_GRID_PINPOINTS}"
    if not isinstance(pinpoints, list) or len(pinpoints) < 2 or len(pinpoints) % 2:
        raise ValueError(f"{where} must hold (height, width) pairs, got {pinpoints!r}")
    merge = value(KEY_PATCH_MERGE_TYPE)
    if merge != "spatial_unpad":
        raise ValueError(f"{path}: {KEY_PATCH_MERGE_TYPE} = {merge!r}; only 'spatial_unpad' is supported")
    aspect = value(KEY_VISION_ASPECT_RATIO)
    multi = value(KEY_MULTI_IMAGE_VIEW)
    if multi not in (None, "anyres", SINGLE):
        raise ValueError(f"{path}: {KEY_MULTI_IMAGE_VIEW} = {multi!r} is not 'anyres' or 'single'")
    newline = next((t for t in reader.tensors if t.name == TENSOR_IMAGE_NEWLINE), None)
    n_out = int(core_encoder.n_embd_out)
    if newline is None or newline.data.size != n_out:
        raise ValueError(f"{path}: AnyRes needs the tensor {TENSOR_IMAGE_NEWLINE} of {n_out} values")
    image_size, patch = int(core_encoder.image_size), int(core_encoder.patch_size)
    pad = value(KEY_PAD_COLOR) or [int(m * 255) for m in mean]
    if len(pad) != 3 or not all(0 <= int(c) <= 255 for c in pad):
        raise ValueError(f"{path}: {KEY_PAD_COLOR} = {pad!r} is not an 8-bit RGB colour")
    config = AnyResConfig(
        grid_pinpoints=tuple((int(pinpoints[i]), int(pinpoints[i + 1])) for i in range(0, len(pinpoints), 2)),
        tile=image_size,
        grid=image_size // patch,
        max_tiles=None if aspect is None else parse_vision_aspect_ratio(str(aspect)),
        pad_color=(int(pad[0]), int(pad[1]), int(pad[2])),
    )
    return config, np.array(newline.data, dtype=np.float32).reshape(n_out), multi == SINGLE


class VisionEncoder:
    """A CLIP / SigLIP tower and LLaVA projector from an mmproj GGUF, with a feature cache keyed by image content.

    ``encode`` loads the image (any ``load_image`` source), hashes its decoded pixels, and returns the cached
    features when the same picture was encoded before, so an image shared by many agents is encoded once.

    Args:
        mmproj_path: the mmproj GGUF (written by ``kvcmas_convert.vision.convert_mmproj`` or llama.cpp).
        n_threads: compute threads (default: all cores).
        backend: the backend that runs the tower: "cpu" (default), "cuda" or "cuda:N" where the build and the
            machine have one (one they cannot run is refused, naming it).
        cache_size: most images whose features are kept (least recently used dropped first); 0 disables caching.
        max_pixels, max_bytes, max_decode_bytes: limits for images loaded from paths / bytes (see ``load_image``).
    """

    def __new__(cls, mmproj_path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> VisionEncoder:
        # A Qwen2.5-VL file opens as its own encoder (vision/qwen.py), so every caller takes any mmproj file.
        if cls is VisionEncoder:
            cls = ENCODER_CLASSES.get(_projector_type(os.fspath(mmproj_path)) or "", cls)
        return super().__new__(cls)

    def __init__(
        self,
        mmproj_path: str | os.PathLike[str],
        n_threads: int | None = None,
        cache_size: int = 16,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
        backend: str = "cpu",
    ) -> None:
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads <= 0):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.path = os.fspath(mmproj_path)
        if not isinstance(backend, str):
            raise ValueError(f"backend must be a backend name such as 'cpu' or 'cuda', got {backend!r}")
        self._open(n_threads or 0, backend)
        self.cache_size = cache_size
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self.max_decode_bytes = max_decode_bytes
        self.encode_count = 0  # images actually run through the tower (cache misses)
        self._cache: OrderedDict[tuple[str, str | None], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # cache + encode: concurrent readers of one image wait for one encode

    def _open(self, n_threads: int, backend: str) -> None:
        """Loads the tower (self._core) on `backend` and the preprocessing settings of the file."""
        self._core: Any = core.VisionEncoder(self.path, n_threads, backend)
        self.config = PreprocessConfig.from_encoder(self._core)
        # float64 of the file's float32 mean: the processor's int(mean x 255) for the single view's padding
        self.anyres, self.image_newline, self.multi_image_single = _read_anyres(
            self.path, self._core, tuple(float(m) for m in self._core.image_mean)
        )
        if self.anyres is not None and (self.config.resize_size != self.image_size or not self.has_projector):
            raise ValueError(f"{self.path}: AnyRes needs a projector and a resize size equal to the tile size")

    backend = property(lambda self: str(self._core.backend), doc="the backend that runs the tower ('cpu', 'cuda')")
    n_tokens = property(lambda self: int(self._core.n_tokens), doc="tower rows per tower input (the base view's)")
    max_batch = property(
        lambda self: int(self._core.max_batch), doc="most tower inputs one batched pass runs (encode_pixels splits)"
    )
    n_embd = property(lambda self: int(self._core.n_embd_out), doc="width of the output rows (text model's n_embd)")
    image_size = property(lambda self: int(self._core.image_size), doc="input side in pixels")
    has_projector = property(lambda self: bool(self._core.has_projector), doc="whether the file has a projector")
    model_type = property(lambda self: str(self._core.model_type), doc="'clip' or 'siglip'")
    projector_type = property(
        lambda self: str(self._core.projector_type), doc="'mlp' (LLaVA), 'gemma3', or '' (no projector)"
    )
    pool_kernel = property(
        lambda self: int(self._core.pool_kernel), doc="side of the projector's average pooling of rows (Gemma 3: 4)"
    )
    bidirectional = property(
        lambda self: self.projector_type == "gemma3", doc="an image's rows attend to each other (Gemma 3)"
    )

    # The text a prompt puts before and after an image's rows (special tokens of the model's chat template).
    image_tokens: tuple[str, str] = ("", "")

    def load(self, image: ImageSource) -> Image.Image:
        """The image decoded to RGB under this encoder's limits (raises ImageError)."""
        return load_image(
            image, max_pixels=self.max_pixels, max_bytes=self.max_bytes, max_decode_bytes=self.max_decode_bytes
        )

    def image_hash(self, image: ImageSource) -> str:
        """Content hash of the decoded pixels: the cache key (equal for the same picture as a file, bytes or PIL)."""
        return image_hash(self.load(image))

    def view_for(self, n_images: int = 1, detail: str | None = None) -> str | None:
        """The view an image gets in a prompt of n_images images with an OpenAI ``detail`` hint: None for a model
        with one view; for AnyRes, SINGLE with ``detail="low"`` or (OneVision) among several images, else ANYRES."""
        if self.anyres is None:
            return None
        if detail == "low" or (n_images > 1 and self.multi_image_single):
            return SINGLE
        return ANYRES

    def _check_view(self, view: str | None) -> str | None:
        if view is None:
            return ANYRES if self.anyres is not None else None
        if self.anyres is None or view not in VIEWS:
            choices = "None" if self.anyres is None else f"None, {', '.join(map(repr, VIEWS))}"
            raise ValueError(f"view {view!r}: {self.path} takes {choices}")
        return view

    def n_image_tokens(self, width: int, height: int, view: str | None = None) -> int:
        """Rows encode() gives for an image of width x height in a view (default: ANYRES when the file has it)."""
        view = self._check_view(view)
        if view is None or self.anyres is None:
            return self.n_tokens
        return n_rows(height, width, self.anyres, view)

    def preprocess(self, image: ImageSource, view: str | None = None) -> np.ndarray:
        """The tower's inputs: [3, S, S] float32 for a model with one view; [n, 3, S, S] for an AnyRes view (the
        base view first, then the tiles row by row; one padded square for SINGLE), as the processor's
        pixel_values."""
        view = self._check_view(view)
        rgb = self.load(image)
        if view is None or self.anyres is None:
            return preprocess(rgb, self.config)
        s = self.image_size
        if view == SINGLE:
            views = [square(pad_to_square(rgb, self.anyres.pad_color), s)]
        else:
            views = [square(rgb, s), *tiles(rgb, self.anyres)]
        return np.stack([normalize(v, self.config) for v in views])

    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Runs the tower (and projector) on preprocessed pixels [3, S, S] (-> [n_tokens, n_embd]) or [n, 3, S, S]
        (-> [n, n_tokens, n_embd]: AnyRes's crops in one batched pass, the same values as one pass per input); no
        cache, no AnyRes packing."""
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        if pixels.ndim == 4:
            return self._core.encode_batch(pixels).reshape(len(pixels), self.n_tokens, self.n_embd)
        return self._core.encode(pixels)

    def _features(self, rgb: Image.Image, view: str | None) -> np.ndarray:
        pixels = self.preprocess(rgb, view)
        if view is None or self.anyres is None:
            rows = self.encode_pixels(pixels)
            return rows.view(BidirectionalRows) if self.bidirectional else rows
        rows = self.encode_pixels(pixels)
        assert self.image_newline is not None
        if view == SINGLE:
            return np.concatenate([rows[0], self.image_newline[None]])
        return pack(rows[0], rows[1:], rgb.height, rgb.width, self.anyres, self.image_newline)

    def encode(self, image: ImageSource, view: str | None = None) -> np.ndarray:
        """Image-token embeddings [n_image_tokens(w, h, view), n_embd] float32 (read-only; shared between callers
        via the cache, keyed by the pixels and the view; BidirectionalRows for Gemma 3). view: see ``view_for``;
        default ANYRES when the file has it."""
        view = self._check_view(view)
        rgb = self.load(image)
        key = (image_hash(rgb), view)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            features = self._features(rgb, view)
            features.setflags(write=False)
            self.encode_count += 1
            if self.cache_size > 0:
                self._cache[key] = features
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return features

    def check_text_model(self, n_embd: int, tokenizer: Any = None) -> None:
        """Raises ValueError unless the features fit a text model of width n_embd (and, for Gemma 3, whose tokenizer
        has the image soft token)."""
        if not self.has_projector:
            raise ValueError(f"{self.path}: has no projector; its features cannot be fed to a text model")
        if self.n_embd != n_embd:
            raise ValueError(f"{self.path}: projects to n_embd {self.n_embd}, the text model has {n_embd}")
        if self.bidirectional and tokenizer is not None:
            from . import gemma3

            gemma3.image_token_id(tokenizer)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def __repr__(self) -> str:
        return (
            f"VisionEncoder({self.path!r}, {self.model_type}, {self.image_size}px, {self.n_tokens} tokens x "
            f"{self.n_embd})"
        )
