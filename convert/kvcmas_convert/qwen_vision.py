"""The vision half of Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) as an mmproj GGUF, in llama.cpp's layout
(``clip.projector_type = "qwen2.5vl_merger"``): the Conv3d patch kernel as two Conv2d kernels (``v.patch_embd.weight``
and ``.weight.1``, one per time step), the fused QKV split into ``attn_q`` / ``attn_k`` / ``attn_v``, RMSNorms
``ln1`` / ``ln2``, the SwiGLU ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, the merger's norm ``v.post_ln`` and MLP
``mm.0`` / ``mm.2``. Which blocks attend fully is ``clip.vision.wa_layer_indexes`` (and llama.cpp's
``n_wa_pattern`` when they are every n-th); dynamic resolution is ``clip.vision.image_min_pixels`` / ``_max_pixels``.
``cpp/vision/qwen-vision-encoder.h`` reads the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from .errors import ConvertError
from .source import CheckpointTensors

ARCHITECTURE: Final = "Qwen2_5_VLForConditionalGeneration"
PROJECTOR_TYPE: Final = "qwen2.5vl_merger"
MODEL_TYPE: Final = "qwen2.5vl"
KEY_N_WA_PATTERN: Final = "clip.vision.n_wa_pattern"
KEY_WA_LAYER_INDEXES: Final = "clip.vision.wa_layer_indexes"
KEY_WINDOW_SIZE: Final = "clip.vision.window_size"
KEY_SPATIAL_MERGE_SIZE: Final = "clip.vision.spatial_merge_size"
KEY_IMAGE_MIN_PIXELS: Final = "clip.vision.image_min_pixels"
KEY_IMAGE_MAX_PIXELS: Final = "clip.vision.image_max_pixels"
KEY_TEMPORAL_PATCH_SIZE: Final = "kvcmas.vision.temporal_patch_size"
KEY_ROPE_THETA: Final = "kvcmas.vision.rope_theta"
# Qwen2VLImageProcessor's defaults (its class attributes), used when the checkpoint has no processor settings
DEFAULT_MIN_PIXELS: Final = 56 * 56
DEFAULT_MAX_PIXELS: Final = 28 * 28 * 1280
BICUBIC: Final = 3  # PIL's resample number: the processor's filter, the only one kvcmas runs for this tower


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConvertError(f"{where}: '{key}' = {value!r} must be a positive integer")
    return value


def _pixels(pp: dict[str, Any], where: str) -> tuple[int, int]:
    """(min_pixels, max_pixels) of the image processor: size's shortest_edge / longest_edge (transformers 5), else
    min_pixels / max_pixels (4.x)."""
    size = pp.get("size") or {}
    lo = size.get("shortest_edge", pp.get("min_pixels", DEFAULT_MIN_PIXELS))
    hi = size.get("longest_edge", pp.get("max_pixels", DEFAULT_MAX_PIXELS))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not 0 < lo <= hi:
        raise ConvertError(f"{where}: min / max pixels {lo!r} / {hi!r} are not a range of positive integers")
    return lo, hi


def plan_qwen25vl(model_dir: Path, tensors: CheckpointTensors, config: dict[str, Any], pp: dict[str, Any]) -> Any:
    """The MmprojPlan of a Qwen2.5-VL checkpoint (pp: its image processor settings); ConvertError naming what
    cannot be represented."""
    from .vision import (
        _ALWAYS_ON,
        KEY_BLOCK_COUNT,
        KEY_EMBEDDING_LENGTH,
        KEY_FEED_FORWARD_LENGTH,
        KEY_HAS_TEXT_ENCODER,
        KEY_HAS_VISION_ENCODER,
        KEY_HEAD_COUNT,
        KEY_HIDDEN_ACT,
        KEY_IMAGE_MEAN,
        KEY_IMAGE_SIZE,
        KEY_IMAGE_STD,
        KEY_LAYER_NORM_EPS,
        KEY_MODEL_TYPE,
        KEY_PATCH_SIZE,
        KEY_PROJECTION_DIM,
        KEY_PROJECTOR_TYPE,
        KEY_RESCALE_FACTOR,
        KEY_USE_GELU,
        KEY_USE_SILU,
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
        MmprojPlan,
        check_shapes,
    )  # fmt: skip

    where = f"{model_dir / 'config.json'} (vision_config)"
    vcfg, tcfg = config.get("vision_config"), config.get("text_config")
    if not isinstance(vcfg, dict) or not isinstance(tcfg, dict):
        raise ConvertError(f"{model_dir}: a {ARCHITECTURE} config needs 'vision_config' and 'text_config' objects")
    E = _int(vcfg, "hidden_size", where)
    F = _int(vcfg, "intermediate_size", where)
    depth = _int(vcfg, "depth", where)
    n_head = _int(vcfg, "num_heads", where)
    P = _int(vcfg, "patch_size", where, 14)
    T = _int(vcfg, "temporal_patch_size", where, 2)
    m = _int(vcfg, "spatial_merge_size", where, 2)
    window = _int(vcfg, "window_size", where, 112)
    n_out = _int(vcfg, "out_hidden_size", where)
    n_text = _int(tcfg, "hidden_size", f"{model_dir / 'config.json'} (text_config)")
    if n_out != n_text:
        raise ConvertError(f"{where}: out_hidden_size {n_out} is not the text model's hidden_size {n_text}")
    if T != 2 or int(vcfg.get("in_channels", 3)) != 3:
        raise ConvertError(f"{where}: temporal_patch_size {T} / in_channels: kvcmas runs 2 and 3")
    if E % (4 * n_head):
        raise ConvertError(f"{where}: hidden_size {E} must split into {n_head} heads of a multiple of 4")
    if window < P * m or window % (P * m):
        raise ConvertError(f"{where}: window_size {window} must be a multiple of patch_size x spatial_merge_size")
    if vcfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConvertError(f"{where}: hidden_act {vcfg.get('hidden_act')!r} cannot be represented (silu)")
    rope = vcfg.get("rope_parameters") or {}
    theta_value = rope.get("rope_theta", vcfg.get("rope_theta"))
    theta = float(theta_value) if theta_value is not None else 10000.0
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConvertError(f"{where}: rope type {rope.get('rope_type')!r} cannot be represented (axial)")
    full = vcfg.get("fullatt_block_indexes", [])
    if not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < depth for i in full):
        raise ConvertError(f"{where}: fullatt_block_indexes {full!r} must list blocks of the {depth}-block tower")
    for key in _ALWAYS_ON:  # None: the processor class's default (on)
        if pp.get(key) not in (True, None):
            raise ConvertError(f"{model_dir} (image processor): '{key}' = {pp[key]!r} cannot be represented")
    if pp.get("resample", BICUBIC) != BICUBIC:
        raise ConvertError(f"{model_dir} (image processor): 'resample' = {pp['resample']!r} (bicubic = 3 only)")
    for key, want in (("patch_size", P), ("temporal_patch_size", T), ("merge_size", m)):
        if key in pp and pp[key] != want:
            raise ConvertError(f"{model_dir} (image processor): '{key}' = {pp[key]!r}, the tower has {want}")
    min_pixels, max_pixels = _pixels(pp, f"{model_dir} (image processor)")
    mean, std = tuple(pp.get("image_mean", OPENAI_CLIP_MEAN)), tuple(pp.get("image_std", OPENAI_CLIP_STD))
    if len(mean) != 3 or len(std) != 3 or not all(float(s) > 0 for s in std):
        raise ConvertError(f"{model_dir}: image_mean / image_std must hold 3 values (std > 0)")

    vm = next((p for p in ("model.visual.", "visual.") if p + "patch_embed.proj.weight" in tensors), None)
    if vm is None:
        raise ConvertError(f"{model_dir}: no vision tower (model.visual.patch_embed.proj.weight) found")
    out: list[tuple[str, str, tuple[int, ...]]] = []
    transforms: dict[str, Any] = {}
    sources: dict[str, tuple[int, ...]] = {}  # HF tensors read, with their expected shapes

    def add(gguf_name: str, hf: str, shape: tuple[int, ...], source_shape: tuple[int, ...] | None = None,
            transform: Any = None) -> None:  # fmt: skip
        out.append((gguf_name, vm + hf, shape))
        sources[vm + hf] = source_shape or shape
        if transform is not None:
            transforms[gguf_name] = transform

    kernel = (E, 3, T, P, P)
    add("v.patch_embd.weight", "patch_embed.proj.weight", (E, 3, P, P), kernel, lambda w: w[:, :, 0])
    add("v.patch_embd.weight.1", "patch_embed.proj.weight", (E, 3, P, P), kernel, lambda w: w[:, :, 1])
    for il in range(depth):
        b = f"blocks.{il}."
        for j, short in enumerate(("attn_q", "attn_k", "attn_v")):
            rows = slice(j * E, (j + 1) * E)
            add(f"v.blk.{il}.{short}.weight", b + "attn.qkv.weight", (E, E), (3 * E, E), lambda w, r=rows: w[r])
            add(f"v.blk.{il}.{short}.bias", b + "attn.qkv.bias", (E,), (3 * E,), lambda w, r=rows: w[r])
        add(f"v.blk.{il}.attn_out.weight", b + "attn.proj.weight", (E, E))
        add(f"v.blk.{il}.attn_out.bias", b + "attn.proj.bias", (E,))
        add(f"v.blk.{il}.ln1.weight", b + "norm1.weight", (E,))
        add(f"v.blk.{il}.ln2.weight", b + "norm2.weight", (E,))
        for short, hf, shape in (("ffn_gate", "gate_proj", (F, E)), ("ffn_up", "up_proj", (F, E)),
                                 ("ffn_down", "down_proj", (E, F))):  # fmt: skip
            add(f"v.blk.{il}.{short}.weight", f"{b}mlp.{hf}.weight", shape)
            add(f"v.blk.{il}.{short}.bias", f"{b}mlp.{hf}.bias", (shape[0],))
    merged = E * m * m
    add("v.post_ln.weight", "merger.ln_q.weight", (E,))
    add("mm.0.weight", "merger.mlp.0.weight", (merged, merged))
    add("mm.0.bias", "merger.mlp.0.bias", (merged,))
    add("mm.2.weight", "merger.mlp.2.weight", (n_out, merged))
    add("mm.2.bias", "merger.mlp.2.bias", (n_out,))
    check_shapes(model_dir, tensors, [(hf, hf, shape) for hf, shape in sources.items()])

    metadata: dict[str, Any] = {
        KEY_HAS_VISION_ENCODER: True,
        KEY_HAS_TEXT_ENCODER: False,
        KEY_PROJECTOR_TYPE: PROJECTOR_TYPE,
        KEY_USE_GELU: False,
        KEY_USE_SILU: True,
        KEY_PATCH_SIZE: P,
        KEY_IMAGE_SIZE: 560,  # llama.cpp's clip loader requires it (its warm-up image side), as its converter writes
        KEY_EMBEDDING_LENGTH: E,
        KEY_FEED_FORWARD_LENGTH: F,
        KEY_BLOCK_COUNT: depth,
        KEY_HEAD_COUNT: n_head,
        KEY_LAYER_NORM_EPS: 1e-6,  # Qwen2.5-VL's RMSNorms (fixed in its code)
        KEY_PROJECTION_DIM: n_out,
        KEY_HIDDEN_ACT: "silu",
        KEY_MODEL_TYPE: MODEL_TYPE,
        KEY_WA_LAYER_INDEXES: sorted(full),
        KEY_WINDOW_SIZE: window,
        KEY_SPATIAL_MERGE_SIZE: m,
        KEY_IMAGE_MIN_PIXELS: min_pixels,
        KEY_IMAGE_MAX_PIXELS: max_pixels,
        KEY_TEMPORAL_PATCH_SIZE: T,
        KEY_ROPE_THETA: theta,
        KEY_IMAGE_MEAN: [float(x) for x in mean],
        KEY_IMAGE_STD: [float(x) for x in std],
        KEY_RESCALE_FACTOR: float(pp.get("rescale_factor", 1.0 / 255.0)),
    }
    if full and sorted(full) == [i for i in range(depth) if (i + 1) % (full[0] + 1) == 0]:
        metadata[KEY_N_WA_PATTERN] = full[0] + 1  # llama.cpp's form: every n-th block attends fully
    return MmprojPlan(MODEL_TYPE, metadata, out, transforms=transforms)
