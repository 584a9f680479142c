"""Images for vision-language agents: safe loading, preprocessing, and the vision encoder with its feature cache.

``load_image(src)`` decodes a path / bytes / PIL image under size limits (``ImageError`` otherwise);
``preprocess(image, config)`` reproduces the CLIP / SigLIP Hugging Face processors; ``VisionEncoder(mmproj)``
runs the C++ tower + projector and caches features by image content.
"""

from __future__ import annotations

from .encoder import VisionEncoder
from .image import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PIXELS,
    SUPPORTED_FORMATS,
    ImageError,
    ImageSource,
    image_hash,
    load_image,
    to_rgb,
)
from .preprocess import PreprocessConfig, preprocess
from .qwen import QwenVisionEncoder  # registers itself: VisionEncoder(path) opens Qwen2.5-VL files as one

__all__ = [
    "DEFAULT_MAX_BYTES", "DEFAULT_MAX_PIXELS", "SUPPORTED_FORMATS", "ImageError", "ImageSource", "PreprocessConfig",
    "QwenVisionEncoder", "VisionEncoder", "image_hash", "load_image", "preprocess", "to_rgb",
]  # fmt: skip
