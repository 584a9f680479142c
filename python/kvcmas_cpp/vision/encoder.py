"""The vision encoder as agents use it: images in, image-token embeddings out, each image encoded once."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from PIL import Image

from .._native import core
from .image import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_DECODE_BYTES,
    DEFAULT_MAX_PIXELS,
    ImageSource,
    image_hash,
    load_image,
)
from .preprocess import PreprocessConfig, preprocess


class VisionEncoder:
    """A CLIP / SigLIP tower and LLaVA projector from an mmproj GGUF, with a feature cache keyed by image content.

    ``encode`` loads the image (any ``load_image`` source), hashes its decoded pixels, and returns the cached
    features when the same picture was encoded before, so an image shared by many agents is encoded once.

    Args:
        mmproj_path: the mmproj GGUF (written by ``kvcmas_convert.vision.convert_mmproj`` or llama.cpp).
        n_threads: compute threads (default: all cores).
        cache_size: most images whose features are kept (least recently used dropped first); 0 disables caching.
        max_pixels, max_bytes, max_decode_bytes: limits for images loaded from paths / bytes (see ``load_image``).
    """

    def __init__(
        self,
        mmproj_path: str | os.PathLike[str],
        n_threads: int | None = None,
        cache_size: int = 16,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
    ) -> None:
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads <= 0):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.path = os.fspath(mmproj_path)
        self._core: Any = core.VisionEncoder(self.path, n_threads or 0)
        self.config = PreprocessConfig.from_encoder(self._core)
        self.cache_size = cache_size
        self.max_pixels = max_pixels
        self.max_bytes = max_bytes
        self.max_decode_bytes = max_decode_bytes
        self.encode_count = 0  # images actually run through the tower (cache misses)
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # cache + encode: concurrent readers of one image wait for one encode

    n_tokens = property(lambda self: int(self._core.n_tokens), doc="image tokens per image")
    n_embd = property(lambda self: int(self._core.n_embd_out), doc="width of the output rows (text model's n_embd)")
    image_size = property(lambda self: int(self._core.image_size), doc="input side in pixels")
    has_projector = property(lambda self: bool(self._core.has_projector), doc="whether the file has a projector")
    model_type = property(lambda self: str(self._core.model_type), doc="'clip' or 'siglip'")

    def load(self, image: ImageSource) -> Image.Image:
        """The image decoded to RGB under this encoder's limits (raises ImageError)."""
        return load_image(
            image, max_pixels=self.max_pixels, max_bytes=self.max_bytes, max_decode_bytes=self.max_decode_bytes
        )

    def image_hash(self, image: ImageSource) -> str:
        """Content hash of the decoded pixels: the cache key (equal for the same picture as a file, bytes or PIL)."""
        return image_hash(self.load(image))

    def preprocess(self, image: ImageSource) -> np.ndarray:
        """The tower's input [3, image_size, image_size] float32."""
        return preprocess(self.load(image), self.config)

    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Runs the tower (and projector) on preprocessed pixels [3, S, S]; no cache. -> [n_tokens, n_embd]."""
        return self._core.encode(np.ascontiguousarray(pixels, dtype=np.float32))

    def encode(self, image: ImageSource) -> np.ndarray:
        """Image-token embeddings [n_tokens, n_embd] float32 (read-only; shared between callers via the cache)."""
        rgb = self.load(image)
        key = image_hash(rgb)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            features = self.encode_pixels(preprocess(rgb, self.config))
            features.setflags(write=False)
            self.encode_count += 1
            if self.cache_size > 0:
                self._cache[key] = features
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return features

    def check_text_model(self, n_embd: int) -> None:
        """Raises ValueError unless the features fit a text model of width n_embd."""
        if not self.has_projector:
            raise ValueError(f"{self.path}: has no projector; its features cannot be fed to a text model")
        if self.n_embd != n_embd:
            raise ValueError(f"{self.path}: projects to n_embd {self.n_embd}, the text model has {n_embd}")

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def __repr__(self) -> str:
        return (
            f"VisionEncoder({self.path!r}, {self.model_type}, {self.image_size}px, {self.n_tokens} tokens x "
            f"{self.n_embd})"
        )
