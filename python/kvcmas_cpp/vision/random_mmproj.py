"""Random-weight mmproj files of real tower sizes, for benchmarks (no vision-language weights are available offline).

``write_random_mmproj(path, **SIGLIP_SO400M_ONEVISION, n_embd_out=576)`` writes a LLaVA-OneVision-sized SigLIP
tower (384 px, patch 14, 729 tokens) with a projector to the default text model's width. The weights are drawn
with a fixed seed at a scale that keeps activations in a realistic range; the numbers mean nothing, the cost is
that of the real model.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# SigLIP-so400m-patch14-384 as LLaVA-OneVision uses it: 26 of its 27 blocks (vision_feature_layer -1 of a tower
# whose last block was removed), all 729 tokens, no post-LayerNorm.
SIGLIP_SO400M_ONEVISION: dict[str, Any] = dict(
    model_type="siglip", image_size=384, patch_size=14, n_embd=1152, n_ff=4304, n_layer=26, n_head=16
)
# LLaVA-OneVision's grid pinpoints: 1..6 x 1..6 tiles of 384 px (with vision_aspect_ratio "anyres_max_9").
ONEVISION_PINPOINTS: list[tuple[int, int]] = [(384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7)]
# CLIP ViT-L/14-336 as LLaVA-1.5 uses it: 23 of 24 blocks (vision_feature_layer -2), class token dropped.
CLIP_L14_336_LLAVA15: dict[str, Any] = dict(
    model_type="clip", image_size=336, patch_size=14, n_embd=1024, n_ff=4096, n_layer=23, n_head=16
)


def write_random_mmproj(
    path: str | os.PathLike[str],
    *,
    model_type: str = "siglip",
    image_size: int = 384,
    patch_size: int = 14,
    n_embd: int = 1152,
    n_ff: int = 4304,
    n_layer: int = 26,
    n_head: int = 16,
    n_embd_out: int = 576,
    outtype: str = "f16",
    seed: int = 0,
    grid_pinpoints: list[tuple[int, int]] | None = None,
    vision_aspect_ratio: str | None = None,
) -> None:
    """Writes an mmproj GGUF (tower + LLaVA MLP projector) with random weights; see the module docstring.

    grid_pinpoints ((height, width) pairs) make it an AnyRes file (LLaVA-NeXT; with ``vision_aspect_ratio``
    "anyres_max_N", LLaVA-OneVision, whose several images per prompt take the single view), with a random
    ``image_newline``. ``ONEVISION_PINPOINTS`` are OneVision's."""
    import gguf

    from .encoder import (
        KEY_GRID_PINPOINTS,
        KEY_MULTI_IMAGE_VIEW,
        KEY_PATCH_MERGE_TYPE,
        KEY_VISION_ASPECT_RATIO,
        TENSOR_IMAGE_NEWLINE,
    )

    if model_type not in ("clip", "siglip") or outtype not in ("f16", "f32"):
        raise ValueError("model_type must be 'clip' or 'siglip', outtype 'f16' or 'f32'")
    rng = np.random.default_rng(seed)
    mat_dtype = np.float16 if outtype == "f16" else np.float32
    clip = model_type == "clip"
    n_pos = (image_size // patch_size) ** 2 + (1 if clip else 0)
    w = gguf.GGUFWriter(os.fspath(path), "clip")
    w.add_string("general.name", f"random-{model_type}-{image_size}")
    w.add_uint32("general.file_type", 1 if outtype == "f16" else 0)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", not clip)
    w.add_bool("clip.use_silu", False)
    for key, value in (("image_size", image_size), ("patch_size", patch_size), ("embedding_length", n_embd),
                       ("feed_forward_length", n_ff), ("block_count", n_layer), ("attention.head_count", n_head),
                       ("projection_dim", n_embd_out)):  # fmt: skip
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5 if clip else 1e-6)
    mean, std = (
        ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]) if clip else ([0.5] * 3,) * 2
    )
    w.add_array("clip.vision.image_mean", mean)
    w.add_array("clip.vision.image_std", std)
    w.add_string("kvcmas.vision.hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh")
    w.add_string("kvcmas.vision.projector_act", "gelu")
    w.add_string("kvcmas.vision.select_strategy", "default" if clip else "full")
    w.add_string("kvcmas.vision.model_type", model_type)
    w.add_string("kvcmas.vision.resize_mode", "shortest_edge" if clip else "square")
    w.add_uint32("kvcmas.vision.resize_size", image_size)

    def mat(name: str, rows: int, cols: int, *shape: int) -> None:
        data = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(mat_dtype)
        w.add_tensor(name, data.reshape(shape) if shape else data)

    def vec(name: str, n: int, center: float = 0.0) -> None:
        w.add_tensor(name, (center + 0.05 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32))

    mat("v.patch_embd.weight", n_embd, 3 * patch_size * patch_size, n_embd, 3, patch_size, patch_size)
    if clip:
        vec("v.class_embd", n_embd)
        vec("v.pre_ln.weight", n_embd, 1.0)
        vec("v.pre_ln.bias", n_embd)
    else:
        vec("v.patch_embd.bias", n_embd)
    if grid_pinpoints:
        flat = [int(x) for pair in grid_pinpoints for x in pair]
        w.add_array(KEY_GRID_PINPOINTS, flat)  # gguf-py writes a list of ints as int32
        w.add_string(KEY_PATCH_MERGE_TYPE, "spatial_unpad")
        if vision_aspect_ratio:
            w.add_string(KEY_VISION_ASPECT_RATIO, vision_aspect_ratio)
            w.add_string(KEY_MULTI_IMAGE_VIEW, "single")
        vec(TENSOR_IMAGE_NEWLINE, n_embd_out)
    w.add_tensor("v.position_embd.weight", 0.05 * rng.standard_normal((n_pos, n_embd), dtype=np.float32))
    for il in range(n_layer):
        b = f"v.blk.{il}."
        shapes = {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_embd), "attn_v": (n_embd, n_embd),
                  "attn_out": (n_embd, n_embd), "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff)}  # fmt: skip
        for name, (rows, cols) in shapes.items():
            mat(b + name + ".weight", rows, cols)
            vec(b + name + ".bias", rows)
        for ln in ("ln1", "ln2"):
            vec(b + ln + ".weight", n_embd, 1.0)
            vec(b + ln + ".bias", n_embd)
    mat("mm.0.weight", n_embd_out, n_embd)
    vec("mm.0.bias", n_embd_out)
    mat("mm.2.weight", n_embd_out, n_embd_out)
    vec("mm.2.bias", n_embd_out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
