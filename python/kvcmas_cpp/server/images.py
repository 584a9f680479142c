"""Images in chat requests (--mmproj): encoded once per namespace and view, and placed in the prompt.

Encoded images are kept by content, per namespace (tenant and cache_salt): agents that read the same image do not
encode it again, and a cache hit (which /metrics' kvcmas_images_encoded_total and the timing would show) never says
another tenant sent the same image. The cache is split evenly among the tenants, each making room from its own, and
bounded by count (IMAGE_CACHE) and bytes (--image-cache-bytes: an AnyRes view is thousands of rows).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from ..model import Model
from .backend import Segment
from .config import IMAGE_CACHE, IMAGE_DECODES
from .metrics import Metrics
from .schemas import ChatCompletionRequest, ImagePart
from .sessions import Namespace
from .validation import ApiError


class ImagePrompts:
    """The server's image encoder (a kvcmas_cpp.vision.VisionEncoder) with its cache."""

    def __init__(self, model: Model, vision: Any, metrics: Metrics, n_tenants: int, cache_bytes: int) -> None:
        self.model, self.vision, self.metrics = model, vision, metrics
        self.n_tenants, self.cache_bytes = n_tenants, cache_bytes
        self._decodes = asyncio.Semaphore(IMAGE_DECODES)
        self._images: OrderedDict[tuple[Namespace, str, str | None], np.ndarray] = OrderedDict()  # LRU

    async def encode(self, data: bytes, namespace: Namespace, view: str | None = None) -> np.ndarray:
        """The image's embeddings [n, n_embd] in a view (VisionEncoder.view_for), from the cache when the same bytes
        came before in that view."""
        key = (namespace, hashlib.sha256(data).hexdigest(), view)
        if key not in self._images:
            try:
                async with self._decodes:  # bounded concurrency: each decode may hold its decoded bytes
                    encoded: np.ndarray = await run_in_threadpool(self.vision.encode, data, view)
            except ValueError as e:  # ImageError, KvcmasError: unusable image
                raise ApiError(400, f"image_url: {e}", "invalid_image", "messages") from None
            self._images[key] = encoded
            self.metrics.bump("images_encoded")
            n_tenants = max(1, self.n_tenants)
            count_cap, byte_cap = max(1, IMAGE_CACHE // n_tenants), self.cache_bytes // n_tenants
            own = [k for k in self._images if k[0].tenant == namespace.tenant]  # oldest first; the new one last
            held = sum(self._images[k].nbytes for k in own)
            while len(own) > 1 and (len(own) > count_cap or held > byte_cap):
                held -= self._images[own[0]].nbytes
                del self._images[own.pop(0)]
        self._images.move_to_end(key)
        return self._images[key]

    async def prompt(
        self, body: ChatCompletionRequest, image_data: list[bytes], namespace: Namespace
    ) -> tuple[list[dict[str, Any]], list[Segment]]:
        """A chat with images as (messages whose contents hold the images' embeddings between their texts, for a
        sharing session; the rendered prompt as text-id and embedding segments, for a plain prefill)."""
        # AnyRes models: detail "low", and OneVision's rule for several images per prompt, take the single view
        details = [p.image_url.detail for m in body.messages if isinstance(m.content, list) for p in m.content
                   if isinstance(p, ImagePart)]  # fmt: skip
        views = [self.vision.view_for(len(image_data), detail) for detail in details]
        images = [await self.encode(data, namespace, view) for data, view in zip(image_data, views, strict=True)]
        # Gemma 3: each image's pan-and-scan crops after it (none with detail "low")
        crops = [await self._crops(data, d) for data, d in zip(image_data, details, strict=True)]
        marker = f"<kvcmas-image-{uuid.uuid4().hex}>"
        n_images = 0

        def mark(url: str) -> str:
            nonlocal n_images
            n_images += 1
            return f"{marker}{n_images - 1}{marker}"

        marked = body.plain_messages(mark)
        messages: list[dict[str, Any]] = []
        for msg in marked:
            pieces = msg["content"].split(marker)  # text, index, text, index, ..., text
            if len(pieces) == 1:
                messages.append(msg)
                continue
            parts: list[str | np.ndarray] = [images[int(p)] if i % 2 else p for i, p in enumerate(pieces)]
            if any(crops):
                from ..vision import gemma3

                spliced: list[str | np.ndarray] = []
                for i, p in enumerate(pieces):
                    spliced += gemma3.image_parts([images[int(p)], *crops[int(p)]]) if i % 2 else [p]
                parts = gemma3.join_text(spliced)
            messages.append({**msg, "content": [p for p in parts if not isinstance(p, str) or p]})
        text = await run_in_threadpool(self.model.apply_chat_template, marked, True)
        # the model's own tokens around an image (Qwen2.5-VL: <|vision_start|> ... <|vision_end|>), as its template
        # writes them for an image part
        before, after = self.vision.image_tokens
        for i in range(n_images):
            text = text.replace(f"{marker}{i}{marker}", f"{before}{marker}{i}{marker}{after}")
        tok = self.model.tokenizer
        if self.vision.bidirectional:  # Gemma 3: its processor's image text, the prompt tokenized once
            return messages, await run_in_threadpool(self._gemma3_segments, text, marker, images, crops)
        segments: list[Segment] = []
        for i, piece in enumerate(text.split(marker)):
            if i % 2:
                segments.append(images[int(piece)])
                continue
            ids = await run_in_threadpool(tok.encode, piece, False, True)
            if i == 0 and tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
                ids = [tok.bos_id, *ids]
            segments.append(ids)
        return messages, segments

    async def _crops(self, data: bytes, detail: str | None) -> list[np.ndarray]:
        """A Gemma 3 image's pan-and-scan crops' rows (none when the mmproj has no pan-and-scan or detail is "low")."""
        from ..vision import gemma3

        if gemma3.pan_and_scan_of(self.vision, detail != "low") is None:
            return []
        try:
            async with self._decodes:
                views = await run_in_threadpool(gemma3.encode_views, self.vision, data)
        except ValueError as e:
            raise ApiError(400, f"image_url: {e}", "invalid_image", "messages") from None
        return views[1:]

    def _gemma3_segments(
        self, text: str, marker: str, images: list[np.ndarray], crops: list[list[np.ndarray]]
    ) -> list[Segment]:
        """The rendered prompt with each image marker replaced by Gemma 3's image text (vision.gemma3; with its
        crops' after it), tokenized once; the soft-token runs replaced by the images' and crops' rows."""
        from ..vision import gemma3

        pieces = text.split(marker)
        expanded = "".join(
            gemma3.crops_text(len(images[int(p)]), len(crops[int(p)])) if i % 2 else p for i, p in enumerate(pieces)
        )
        images = [rows for image, extra in zip(images, crops, strict=True) for rows in (image, *extra)]
        tok = self.model.tokenizer
        ids = tok.encode(expanded, False, True)
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id, *ids]
        return list(gemma3.segments(ids, gemma3.image_token_id(tok), images))
