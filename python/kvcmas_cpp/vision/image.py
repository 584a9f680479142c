"""Loading untrusted images: size limits before decoding, a whitelist of formats, and one error type.

Every way an input can be unusable (not an image, an unsupported format, truncated or corrupt data, zero size,
more pixels than allowed, a decompression bomb, more bytes than allowed) raises ``ImageError``, a ``ValueError``,
with a message naming the problem. Decoding is Pillow's; dimensions are checked from the header before any pixel
data is decoded, so a small file that declares a huge image costs nothing.
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from typing import Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .._native import KvcmasError

DEFAULT_MAX_PIXELS = 40_000_000  # width x height (a 40 MP photo); Pillow's own bomb limit is 89 MP
DEFAULT_MAX_BYTES = 64 << 20  # encoded size
DEFAULT_MAX_DECODE_BYTES = 512 << 20  # memory decoding may take (decoded_bytes); a 40 MP RGB photo needs ~480 MB
# Pillow keeps a pointer and bookkeeping per row: a 1-pixel-wide image of n rows costs far more than n bytes.
_ROW_BYTES = 8
SUPPORTED_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Image.Image]


# File signatures of the supported formats: an unidentifiable file that starts like one is reported as corrupt.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
)  # fmt: skip


def _sniff(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for magic, fmt in _SIGNATURES if data.startswith(magic)), None)


class ImageError(KvcmasError):
    """An image input that cannot be used; the message says why (and names the file when there is one)."""


def _describe(src: object) -> str:
    if isinstance(src, (str, os.PathLike)):
        return os.fspath(src)
    if isinstance(src, Image.Image):
        return "PIL image"
    return "image bytes"


def _check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what}: the image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(
            f"{what}: {width}x{height} = {width * height} pixels is more than the limit of {max_pixels} "
            "(max_pixels; a decompression bomb or simply too large)"
        )


def decoded_bytes(width: int, height: int, mode: str) -> int:
    """Memory that decoding an image takes at its peak, from its header: the decoded frame (Pillow stores 1, 2 or 4
    bytes per pixel by mode, plus a row pointer per row) and two RGB frames (the conversion and the copy handed out;
    Pillow stores RGB in 4 bytes per pixel). Measured within ~15% on PNGs of 1x10M to 10Mx1 pixels."""
    pixel = 4 if Image.getmodebands(mode) > 1 or mode in ("I", "F") else (2 if mode.startswith("I;16") else 1)
    return height * (width * pixel + _ROW_BYTES) + 2 * height * (width * 4 + _ROW_BYTES)


def to_rgb(image: Image.Image) -> Image.Image:
    """The image as 8-bit RGB; transparency is composited onto white (as Hugging Face's convert_to_rgb does)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(
    src: ImageSource,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_decode_bytes: int = DEFAULT_MAX_DECODE_BYTES,
) -> Image.Image:
    """Decodes an image from a path, encoded bytes or a PIL image into a loaded 8-bit RGB PIL image.

    EXIF orientation is applied; animated formats give their first frame; alpha is composited onto white.

    Args:
        src: a file path, the encoded bytes of a file, or a PIL image.
        max_pixels: most width x height accepted (checked from the header, before decoding).
        max_bytes: most encoded bytes accepted (paths and bytes).
        max_decode_bytes: most memory decoding may take (decoded_bytes, from the header, before decoding).

    Raises:
        ImageError: the input is unreadable, not a supported image, corrupt or truncated, or over a limit.
        TypeError: src is none of the accepted types.
    """
    if max_pixels <= 0 or max_bytes <= 0 or max_decode_bytes <= 0:
        raise ValueError(
            f"max_pixels, max_bytes and max_decode_bytes must be positive, got {max_pixels}, {max_bytes} and "
            f"{max_decode_bytes}"
        )
    what = _describe(src)
    if isinstance(src, Image.Image):
        _check_size(src.width, src.height, max_pixels, what)
        try:
            src.load()
            return to_rgb(src).copy()
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageError(f"{what}: cannot read the image data: {e}") from e
    if isinstance(src, (str, os.PathLike)):
        try:
            size = os.path.getsize(src)
            if size > max_bytes:
                raise ImageError(f"{what}: {size} bytes is more than the limit of {max_bytes} (max_bytes)")
            with open(src, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as e:
            raise ImageError(f"{what}: cannot read the file: {e.strerror or e}") from e
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        raise TypeError(f"an image must be a path, bytes or a PIL image, not {type(src).__name__}")
    if len(data) > max_bytes:
        raise ImageError(f"{what}: {len(data)} bytes is more than the limit of {max_bytes} (max_bytes)")
    if not data:
        raise ImageError(f"{what}: empty (zero bytes)")
    with warnings.catch_warnings():
        # Our own max_pixels check replaces Pillow's warning; its hard limit (DecompressionBombError) still holds.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
        except UnidentifiedImageError as e:
            fmt = _sniff(data)
            if fmt is not None:
                raise ImageError(f"{what}: corrupt {fmt} file (Pillow cannot parse its header)") from e
            raise ImageError(f"{what}: not an image in a supported format ({', '.join(SUPPORTED_FORMATS)})") from e
        except Image.DecompressionBombError as e:
            raise ImageError(f"{what}: refused as a decompression bomb: {e}") from e
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageError(f"{what}: truncated or corrupt image header: {e}") from e
        _check_size(image.width, image.height, max_pixels, what)
        need = decoded_bytes(image.width, image.height, image.mode)
        if need > max_decode_bytes:
            raise ImageError(
                f"{what}: decoding {image.width}x{image.height} {image.mode} pixels would take about {need >> 20} MiB, "
                f"more than the limit of {max_decode_bytes >> 20} MiB (max_decode_bytes)"
            )
        try:
            image.seek(0)
            image.load()
            upright: Image.Image = ImageOps.exif_transpose(image) or image
            return to_rgb(upright).copy()
        except Image.DecompressionBombError as e:
            raise ImageError(f"{what}: refused as a decompression bomb: {e}") from e
        except (OSError, ValueError, SyntaxError, EOFError, IndexError, KeyError, TypeError) as e:
            # Pillow reports truncated / corrupt data as OSError ("image file is truncated"), SyntaxError (broken
            # chunks) or, in some decoders, other plain exceptions.
            raise ImageError(f"{what}: truncated or corrupt image data: {e}") from e


def image_hash(image: Image.Image) -> str:
    """Content hash (SHA-256 hex) of an image's decoded RGB pixels and size: equal for equal pictures, whatever
    file format or object they came in."""
    rgb = to_rgb(image)
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(np.asarray(rgb, dtype=np.uint8).tobytes())
    return h.hexdigest()
