"""Vision towers to mmproj GGUF files: CLIP / SigLIP vision models and LLaVA-style checkpoints (tower + projector).

The file follows llama.cpp's multimodal ("clip") layout: ``general.architecture = "clip"``, ``clip.vision.*``
hyper-parameters and ``v.*`` / ``mm.*`` tensors, so the weights mean the same thing to both tools. What llama.cpp's
files leave implicit is written under ``kvcmas.vision.*``: the exact MLP and projector activations, whether the
class token reaches the projector, and the preprocessing (resize mode and sizes). ``cpp/vision/vision-names.h``
holds the same names on the C++ side.

Which hidden state feeds the projector (LLaVA's ``vision_feature_layer``) is resolved here: only the blocks up to
that layer are written, so the encoder simply runs every block it finds. Hugging Face's ``hidden_states[i]`` is
the output of block i (0 is the embeddings), which never includes the tower's post-LayerNorm; a bare SigLIP
vision model's ``last_hidden_state`` does (so it is written for ``feature_layer=None`` on a SiglipVisionModel).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from . import qwen_vision
from .convert import ConvertResult, check_output, convert, encode_tensor, input_files, temporary_output
from .errors import ConvertError
from .models import MODEL_CLASSES, text_architecture_for
from .source import CheckpointTensors, load_config

ARCH_CLIP: Final = "clip"

# llama.cpp keys (gguf-py's Keys.Clip / Keys.ClipVision)
KEY_HAS_VISION_ENCODER: Final = "clip.has_vision_encoder"
KEY_HAS_TEXT_ENCODER: Final = "clip.has_text_encoder"
KEY_HAS_LLAVA_PROJECTOR: Final = "clip.has_llava_projector"
KEY_PROJECTOR_TYPE: Final = "clip.projector_type"
KEY_USE_GELU: Final = "clip.use_gelu"
KEY_USE_SILU: Final = "clip.use_silu"
KEY_IMAGE_SIZE: Final = "clip.vision.image_size"
KEY_PATCH_SIZE: Final = "clip.vision.patch_size"
KEY_EMBEDDING_LENGTH: Final = "clip.vision.embedding_length"
KEY_FEED_FORWARD_LENGTH: Final = "clip.vision.feed_forward_length"
KEY_BLOCK_COUNT: Final = "clip.vision.block_count"
KEY_HEAD_COUNT: Final = "clip.vision.attention.head_count"
KEY_LAYER_NORM_EPS: Final = "clip.vision.attention.layer_norm_epsilon"
KEY_PROJECTION_DIM: Final = "clip.vision.projection_dim"
KEY_IMAGE_MEAN: Final = "clip.vision.image_mean"
KEY_IMAGE_STD: Final = "clip.vision.image_std"
KEY_PROJ_SCALE_FACTOR: Final = "clip.vision.projector.scale_factor"  # Gemma 3: the average pooling's side
# kvcmas keys
KEY_HIDDEN_ACT: Final = "kvcmas.vision.hidden_act"
KEY_PROJECTOR_ACT: Final = "kvcmas.vision.projector_act"
KEY_SELECT_STRATEGY: Final = "kvcmas.vision.select_strategy"
KEY_FEATURE_LAYER: Final = "kvcmas.vision.feature_layer"
KEY_MODEL_TYPE: Final = "kvcmas.vision.model_type"
KEY_RESIZE_MODE: Final = "kvcmas.vision.resize_mode"
KEY_RESIZE_SIZE: Final = "kvcmas.vision.resize_size"
KEY_RESCALE_FACTOR: Final = "kvcmas.vision.rescale_factor"
KEY_RESAMPLE: Final = "kvcmas.vision.resample"  # "bicubic" | "bilinear" (Gemma 3)
# Gemma 3's pan-and-scan (Gemma3ImageProcessor's do_pan_and_scan settings; llama.cpp has no keys for them): written
# only when the checkpoint turns it on
KEY_PAN_AND_SCAN: Final = "kvcmas.vision.pan_and_scan"  # bool
KEY_PAS_MIN_CROP_SIZE: Final = "kvcmas.vision.pan_and_scan.min_crop_size"  # uint32, pixels
KEY_PAS_MAX_NUM_CROPS: Final = "kvcmas.vision.pan_and_scan.max_num_crops"  # uint32
KEY_PAS_MIN_RATIO: Final = "kvcmas.vision.pan_and_scan.min_ratio_to_activate"  # float32
# Gemma3Processor's defaults for the settings a checkpoint leaves null
_PAS_DEFAULTS: Final = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                        "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip
# AnyRes (LLaVA-NeXT, LLaVA-OneVision): llama.cpp's keys and newline tensor, then kvcmas's
KEY_GRID_PINPOINTS: Final = "clip.vision.image_grid_pinpoints"  # int32 [h0, w0, h1, w1, ...] (HF order)
KEY_PATCH_MERGE_TYPE: Final = "clip.vision.mm_patch_merge_type"  # "spatial_unpad"
KEY_VISION_ASPECT_RATIO: Final = "kvcmas.vision.vision_aspect_ratio"  # OneVision: "anyres_max_N"
KEY_MULTI_IMAGE_VIEW: Final = "kvcmas.vision.multi_image_view"  # OneVision: "single" (mean-padded square + newline)
KEY_PAD_COLOR: Final = "kvcmas.vision.pad_color"  # int32[3]: the single view's padding, int(mean x 255) in float64
TENSOR_IMAGE_NEWLINE: Final = "model.image_newline"

ACTIVATIONS: Final = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu", "silu", "swish")
OPENAI_CLIP_MEAN: Final = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: Final = (0.26862954, 0.26130258, 0.27577711)
MMPROJ_OUTTYPES: Final = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16}

_LLAVA_ARCHS: Final = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                        "LlavaOnevisionForConditionalGeneration")  # fmt: skip
_GEMMA3_ARCH: Final = "Gemma3ForConditionalGeneration"  # SigLIP, average pooling, RMSNorm, projection
# Gemma 3's projector (transformers' names after the prefix) -> llama.cpp's; the norm is stored as 1 + w
_GEMMA3_PROJECTOR: Final = {"mm_input_projection_weight": "mm.input_projection.weight",
                            "mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight"}  # fmt: skip
_ANYRES_ARCHS: Final = ("LlavaNextForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")
_TOWER_ARCHS: Final = {"CLIPVisionModel": "clip", "SiglipVisionModel": "siglip"}
_TOWER_TYPES: Final = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}


@dataclass
class MmprojPlan:
    """Everything a conversion writes, decided from config.json and the tensor headers before any output exists."""

    model_type: str  # "clip" | "siglip"
    metadata: dict[str, Any]
    tensors: list[tuple[str, str, tuple[int, ...]]]  # (GGUF name, HF name, numpy-order shape)
    ignored: set[str] = field(default_factory=set)
    plus_one: set[str] = field(default_factory=set)  # GGUF names written as 1 + the checkpoint's values
    # GGUF name -> what makes it from its HF tensor (a slice: Qwen2.5-VL's fused QKV, its Conv3d's time steps)
    transforms: dict[str, Any] = field(default_factory=dict)


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConvertError(f"{where}: '{key}' = {value!r} must be a positive integer")
    return value


def _activation(value: Any, key: str, where: str) -> str:
    if value not in ACTIVATIONS:
        raise ConvertError(f"{where}: '{key}' = {value!r} is not supported ({', '.join(ACTIVATIONS)})")
    return str(value)


def _processor_settings(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(image processor settings, processor settings) from preprocessor_config.json (transformers 4.x) and
    processor_config.json (transformers 5: the image processor's under "image_processor"). A setting both files
    hold must agree (ConvertError naming it)."""
    image: dict[str, Any] = {}
    processor: dict[str, Any] = {}
    origin: dict[str, Path] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path}: unreadable: {e}") from e
        if not isinstance(data, dict):
            raise ConvertError(f"{path}: expected a JSON object")
        if name == "processor_config.json":
            nested = data.get("image_processor", {})
            if not isinstance(nested, dict):
                raise ConvertError(f"{path}: 'image_processor' must be a JSON object")
            processor = {k: v for k, v in data.items() if not isinstance(v, dict)}
            data = nested
        for key, value in data.items():
            if key in image and image[key] != value and key != "image_processor_type":
                raise ConvertError(
                    f"{path}: image processor setting '{key}' = {value!r} disagrees with {origin[key]} ({image[key]!r})"
                )
            image[key], origin[key] = value, path
    return image, processor


# Image processor switches kvcmas's preprocessing always applies (a checkpoint turning one off is refused).
_ALWAYS_ON: Final = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_RESAMPLE: Final = {3: "bicubic", 2: "bilinear"}  # PIL's resample numbers kvcmas runs


def _preprocessing(
    model_dir: Path, model_type: str, image_size: int, pp: dict[str, Any], resample: int = 3
) -> dict[str, Any]:
    """kvcmas.vision.* preprocessing keys and the mean/std, from the image processor settings (pp, see
    _processor_settings) or the family defaults (resample: the processor class's default filter)."""
    where = f"{model_dir} (image processor)"
    is_clip = model_type == "clip"
    mean, std = (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD) if is_clip else ((0.5,) * 3, (0.5,) * 3)
    mode, resize = ("shortest_edge", image_size) if is_clip else ("square", image_size)
    rescale = 1.0 / 255.0
    if pp:
        for key in _ALWAYS_ON:  # None: the processor class's default (on)
            if pp.get(key) not in (True, None):
                raise ConvertError(f"{where}: '{key}' = {pp[key]!r} cannot be represented (always applied)")
        resample = pp.get("resample", resample)
        if resample not in _RESAMPLE:
            raise ConvertError(f"{where}: 'resample' = {resample!r} cannot be represented (bicubic = 3, bilinear = 2)")
        mean = tuple(pp.get("image_mean", mean))
        std = tuple(pp.get("image_std", std))
        rescale = float(pp.get("rescale_factor", rescale))
        size = pp.get("size") or {}
        crop = pp.get("crop_size") or {}
        if isinstance(size, dict) and "shortest_edge" in size:
            mode, resize = "shortest_edge", int(size["shortest_edge"])
            if not pp.get("do_center_crop", True) or int(crop.get("height", image_size)) != image_size:
                raise ConvertError(f"{where}: a shortest-edge resize must be followed by a {image_size}px centre crop")
        elif isinstance(size, dict) and "height" in size:
            mode, resize = "square", int(size["height"])
            if int(size.get("width", resize)) != resize or resize != image_size:
                raise ConvertError(f"{where}: 'size' = {size} does not resize to the tower's {image_size}px square")
            if pp.get("do_center_crop") and crop and (crop.get("height"), crop.get("width")) != (resize, resize):
                raise ConvertError(f"{where}: 'crop_size' = {crop} after a square resize cannot be represented")
        elif size:
            raise ConvertError(f"{where}: 'size' = {size!r} cannot be represented (shortest_edge or height/width)")
    if len(mean) != 3 or len(std) != 3 or not all(float(s) > 0 for s in std):
        raise ConvertError(f"{model_dir}: image_mean / image_std must hold 3 values (std > 0)")
    if resize < image_size:
        raise ConvertError(f"{model_dir}: resize size {resize} is smaller than the crop {image_size}")
    return {
        KEY_IMAGE_MEAN: [float(x) for x in mean],
        KEY_IMAGE_STD: [float(x) for x in std],
        KEY_RESIZE_MODE: mode,
        KEY_RESIZE_SIZE: resize,
        KEY_RESCALE_FACTOR: rescale,
        KEY_RESAMPLE: _RESAMPLE[resample],
    }


def _pan_and_scan(pp: dict[str, Any], where: str) -> dict[str, Any]:
    """The pan-and-scan keys of a Gemma 3 image processor with do_pan_and_scan on (null settings: the processor's
    defaults)."""
    if pp["do_pan_and_scan"] is not True:
        raise ConvertError(f"{where}: 'do_pan_and_scan' = {pp['do_pan_and_scan']!r} must be true or false")
    got = {k: d if pp.get(k) is None else pp[k] for k, d in _PAS_DEFAULTS.items()}
    for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops"):
        if isinstance(got[key], bool) or not isinstance(got[key], int) or got[key] < 1:
            raise ConvertError(f"{where}: '{key}' = {got[key]!r} must be a positive integer")
    ratio = got["pan_and_scan_min_ratio_to_activate"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise ConvertError(f"{where}: 'pan_and_scan_min_ratio_to_activate' = {ratio!r} must be a positive number")
    return {
        KEY_PAN_AND_SCAN: True,
        KEY_PAS_MIN_CROP_SIZE: got["pan_and_scan_min_crop_size"],
        KEY_PAS_MAX_NUM_CROPS: got["pan_and_scan_max_num_crops"],
        KEY_PAS_MIN_RATIO: float(ratio),
    }


def _anyres(
    config: dict[str, Any], arch: str, pp: dict[str, Any], processor: dict[str, Any], image_size: int, where: str
) -> dict[str, Any]:
    """The AnyRes keys of a LLaVA-NeXT / LLaVA-OneVision checkpoint: grid pinpoints (config.json's, which the model
    uses; the image processor's must be the same), OneVision's vision_aspect_ratio and multi-image view."""
    missing = [k for k in ("image_mean", "image_std") if k not in pp]
    if missing:  # the processors' class defaults differ from the towers' families: never guess
        raise ConvertError(
            f"{where}: an AnyRes checkpoint needs its image processor's {missing} (processor_config.json or "
            "preprocessor_config.json)"
        )
    if pp.get("resample", 3) != 3:  # the tiles and views are resized bicubic
        raise ConvertError(f"{where}: 'resample' = {pp['resample']!r} cannot be represented for AnyRes (bicubic = 3)")
    pinpoints = config.get("image_grid_pinpoints")
    if not isinstance(pinpoints, list) or not pinpoints:
        raise ConvertError(f"{where}: 'image_grid_pinpoints' = {pinpoints!r} must be a non-empty list")
    flat: list[int] = []
    for p in pinpoints:
        ok = isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and x > 0 for x in p)
        if not ok or p[0] % image_size or p[1] % image_size:
            raise ConvertError(
                f"{where}: 'image_grid_pinpoints' entry {p!r} is not a [height, width] pair of multiples of the tile "
                f"size {image_size} (cannot be represented)"
            )
        flat += p
    if "image_grid_pinpoints" in pp and pp["image_grid_pinpoints"] != pinpoints:
        raise ConvertError(f"{where}: the image processor's 'image_grid_pinpoints' differ from config.json's")
    if (pp.get("crop_size") or {}).get("height", image_size) != image_size:
        raise ConvertError(f"{where}: the image processor's 'crop_size' {pp['crop_size']} is not the tile size")
    out: dict[str, Any] = {KEY_GRID_PINPOINTS: flat, KEY_PATCH_MERGE_TYPE: "spatial_unpad"}
    if arch == "LlavaOnevisionForConditionalGeneration":
        aspect = config.get("vision_aspect_ratio", "anyres_max_9")
        if processor.get("vision_aspect_ratio", aspect) != aspect:
            raise ConvertError(
                f"{where}: 'vision_aspect_ratio' {aspect!r} differs from the processor's "
                f"{processor['vision_aspect_ratio']!r}"
            )
        tail = str(aspect)[len("anyres_max_") :]
        if not str(aspect).startswith("anyres_max_") or not tail.isdigit() or int(tail) <= 0:
            raise ConvertError(f"{where}: 'vision_aspect_ratio' = {aspect!r} cannot be represented (anyres_max_N)")
        out[KEY_VISION_ASPECT_RATIO] = str(aspect)
        out[KEY_MULTI_IMAGE_VIEW] = "single"
        # from the JSON's float64 mean, as the processor computes it (the file's float32 mean can round across)
        out[KEY_PAD_COLOR] = [int(float(x) * 255) for x in pp["image_mean"]]
    return out


def _vision_prefix(tensors: CheckpointTensors) -> str:
    """What precedes the tower's ``embeddings.*`` / ``encoder.*`` tensor names: 'model.vision_tower.vision_model.'
    (LLaVA saved by transformers 5), 'vision_tower.vision_model.' (4.x), 'vision_model.' or '' (bare towers)."""
    marker = "embeddings.patch_embedding.weight"
    found = sorted(name[: -len(marker)] for name in tensors if name.endswith(marker))
    if len(found) != 1 or (found[0] and not found[0].endswith(".")):
        raise ConvertError(
            f"{tensors.model_dir}: expected exactly one vision tower (*{marker}), found {len(found)}: {found[:3]}"
        )
    return found[0]


def _projector_prefix(tensors: CheckpointTensors) -> str:
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if f"{prefix}linear_1.weight" in tensors:
            return prefix
    raise ConvertError(f"{tensors.model_dir}: no projector (multi_modal_projector.linear_1.weight) found")


def plan_mmproj(
    model_dir: Path,
    tensors: CheckpointTensors,
    feature_layer: int | None = None,
    select_strategy: str | None = None,
) -> MmprojPlan:
    """Validates config.json against the tensors and lists what the mmproj file will hold.

    ``feature_layer`` / ``select_strategy`` override the checkpoint's ``vision_feature_layer`` /
    ``vision_feature_select_strategy`` (bare vision models default to ``last_hidden_state`` and "full").
    """
    config = load_config(model_dir)
    where = str(model_dir / "config.json")
    archs = config.get("architectures") or []
    if qwen_vision.ARCHITECTURE in archs:
        return qwen_vision.plan_qwen25vl(model_dir, tensors, config, _processor_settings(model_dir)[0])
    is_llava = any(a in _LLAVA_ARCHS for a in archs)
    is_gemma3 = _GEMMA3_ARCH in archs
    if is_gemma3:
        if feature_layer is not None or select_strategy not in (None, "full"):
            raise ConvertError(f"{where}: Gemma 3 reads the tower's last hidden state (no feature layer to choose)")
        select_strategy = "full"
    if is_llava or is_gemma3:
        vcfg = config.get("vision_config")
        tcfg = config.get("text_config")
        if not isinstance(vcfg, dict) or not isinstance(tcfg, dict):
            raise ConvertError(f"{where}: a LLaVA config needs 'vision_config' and 'text_config' objects")
        model_type = _TOWER_TYPES.get(str(vcfg.get("model_type")))
        if feature_layer is None and is_llava:
            feature_layer = config.get("vision_feature_layer", -2)
        if select_strategy is None:
            select_strategy = config.get("vision_feature_select_strategy", "default")
        projector_act = _activation(config.get("projector_hidden_act", "gelu"), "projector_hidden_act", where)
    else:
        arch = next((a for a in archs if a in _TOWER_ARCHS), None)
        if arch is None:
            supported = ", ".join((*_LLAVA_ARCHS, _GEMMA3_ARCH, *_TOWER_ARCHS))
            raise ConvertError(f"{where}: unsupported architecture {archs!r} for an mmproj file ({supported})")
        vcfg, model_type, projector_act = config, _TOWER_ARCHS[arch], "gelu"
        select_strategy = select_strategy or "full"
    if model_type is None:
        raise ConvertError(f"{where}: vision tower type {vcfg.get('model_type')!r} is not supported (CLIP, SigLIP)")
    if not isinstance(feature_layer, (int, type(None))) or isinstance(feature_layer, bool):
        raise ConvertError(f"{where}: vision_feature_layer {feature_layer!r}: only a single layer is supported")
    if select_strategy not in ("default", "full"):
        raise ConvertError(f"{where}: vision_feature_select_strategy {select_strategy!r} must be 'default' or 'full'")

    vwhere = f"{where} (vision_config)" if is_llava or is_gemma3 else where
    E = _positive_int(vcfg, "hidden_size", vwhere)
    F = _positive_int(vcfg, "intermediate_size", vwhere)
    n_layer = _positive_int(vcfg, "num_hidden_layers", vwhere)
    n_head = _positive_int(vcfg, "num_attention_heads", vwhere)
    S = _positive_int(vcfg, "image_size", vwhere)
    P = _positive_int(vcfg, "patch_size", vwhere)
    if E % n_head or S < P or int(vcfg.get("num_channels", 3)) != 3:
        raise ConvertError(f"{vwhere}: hidden_size must split into heads, image_size hold a patch, and 3 channels")
    act = _activation(vcfg.get("hidden_act", "quick_gelu" if model_type == "clip" else "gelu_pytorch_tanh"),
                      "hidden_act", vwhere)  # fmt: skip
    eps = float(vcfg.get("layer_norm_eps", 1e-5 if model_type == "clip" else 1e-6))

    # Blocks to keep: hidden_states[k] is the output of block k (k = 0: the embeddings).
    post_ln = False
    if feature_layer is None:
        n_keep, post_ln = n_layer, model_type == "siglip"  # last_hidden_state
    else:
        n_keep = feature_layer if feature_layer >= 0 else n_layer + 1 + feature_layer
        if not 0 <= n_keep <= n_layer:
            raise ConvertError(f"{where}: vision_feature_layer {feature_layer} is outside the {n_layer}-layer tower")

    vm = _vision_prefix(tensors)
    G = S // P
    n_pos = G * G + (1 if model_type == "clip" else 0)
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...]) -> None:
        out.append((gguf_name, hf_name, shape))

    add("v.patch_embd.weight", vm + "embeddings.patch_embedding.weight", (E, 3, P, P))
    if vm + "embeddings.patch_embedding.bias" in tensors:
        add("v.patch_embd.bias", vm + "embeddings.patch_embedding.bias", (E,))
    if model_type == "clip":
        add("v.class_embd", vm + "embeddings.class_embedding", (E,))
        add("v.pre_ln.weight", vm + "pre_layrnorm.weight", (E,))
        add("v.pre_ln.bias", vm + "pre_layrnorm.bias", (E,))
    add("v.position_embd.weight", vm + "embeddings.position_embedding.weight", (n_pos, E))
    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
                "ffn_down": "mlp.fc2"}  # fmt: skip
    shapes = {"attn_q": (E, E), "attn_k": (E, E), "attn_v": (E, E), "attn_out": (E, E), "ln1": (E,), "ln2": (E,),
              "ffn_up": (F, E), "ffn_down": (E, F)}  # fmt: skip
    for il in range(n_keep):
        for short, hf in hf_names.items():
            w_shape = shapes[short]
            add(f"v.blk.{il}.{short}.weight", f"{vm}encoder.layers.{il}.{hf}.weight", w_shape)
            add(f"v.blk.{il}.{short}.bias", f"{vm}encoder.layers.{il}.{hf}.bias", (w_shape[0],))
    if post_ln:
        add("v.post_ln.weight", vm + "post_layernorm.weight", (E,))
        add("v.post_ln.bias", vm + "post_layernorm.bias", (E,))

    metadata: dict[str, Any] = {
        KEY_HAS_VISION_ENCODER: True,
        KEY_HAS_TEXT_ENCODER: False,
        KEY_HAS_LLAVA_PROJECTOR: is_llava,
        KEY_USE_GELU: act.startswith("gelu"),
        KEY_USE_SILU: act in ("silu", "swish"),
        KEY_IMAGE_SIZE: S,
        KEY_PATCH_SIZE: P,
        KEY_EMBEDDING_LENGTH: E,
        KEY_FEED_FORWARD_LENGTH: F,
        KEY_BLOCK_COUNT: n_keep,
        KEY_HEAD_COUNT: n_head,
        KEY_LAYER_NORM_EPS: eps,
        KEY_HIDDEN_ACT: act,
        KEY_SELECT_STRATEGY: select_strategy,
        KEY_MODEL_TYPE: model_type,
    }
    if feature_layer is not None:
        metadata[KEY_FEATURE_LAYER] = int(feature_layer)
    image_proc, processor = _processor_settings(model_dir)
    metadata.update(_preprocessing(model_dir, model_type, S, image_proc, 2 if is_gemma3 else 3))
    if image_proc.get("do_pan_and_scan") not in (None, False):
        if not is_gemma3:
            raise ConvertError(f"{where}: 'do_pan_and_scan' = {image_proc['do_pan_and_scan']!r} is Gemma 3's only")
        metadata.update(_pan_and_scan(image_proc, where))
    anyres_arch = next((a for a in archs if a in _ANYRES_ARCHS), None)
    if anyres_arch is not None:
        # pack_image_features lays out G x G rows per tile: no class token may reach the projector, none be lost
        if (model_type == "clip") != (select_strategy == "default"):
            raise ConvertError(
                f"{where}: vision_feature_select_strategy {select_strategy!r} with a {model_type} tower cannot be "
                "represented for AnyRes (the tiles' rows must be the G x G patches)"
            )
        for key in ("vision_feature_select_strategy",):
            if key in processor and processor[key] != config.get(key, select_strategy):
                raise ConvertError(f"{where}: '{key}' differs between config.json and processor_config.json")
        metadata.update(_anyres(config, anyres_arch, image_proc, processor, S, where))
        newline = next((n for n in ("model.image_newline", "image_newline") if n in tensors), None)
        if newline is None:
            raise ConvertError(f"{model_dir}: AnyRes checkpoint without its image_newline tensor")
        add(TENSOR_IMAGE_NEWLINE, newline, (_positive_int(config["text_config"], "hidden_size", where),))

    plus_one: set[str] = set()
    if is_gemma3:
        if model_type != "siglip":
            raise ConvertError(f"{where}: Gemma 3's vision tower must be SigLIP, got {vcfg.get('model_type')!r}")
        n_text = _positive_int(config["text_config"], "hidden_size", f"{where} (text_config)")
        n_tokens = _positive_int(config, "mm_tokens_per_image", where)
        side = int(round(n_tokens**0.5))
        if side * side != n_tokens or G % side:
            raise ConvertError(
                f"{where}: 'mm_tokens_per_image' = {n_tokens} must be a square whose side divides the {G} patches a "
                "side (cannot be represented)"
            )
        if (image_proc.get("image_seq_length") or processor.get("image_seq_length") or n_tokens) != n_tokens:
            raise ConvertError(f"{where}: the processor's 'image_seq_length' differs from 'mm_tokens_per_image'")
        pp = next((p for p in ("model.multi_modal_projector.", "multi_modal_projector.")
                   if f"{p}mm_input_projection_weight" in tensors), None)  # fmt: skip
        if pp is None:
            raise ConvertError(f"{model_dir}: no Gemma 3 projector (multi_modal_projector.mm_input_projection_weight)")
        add(_GEMMA3_PROJECTOR["mm_input_projection_weight"], pp + "mm_input_projection_weight", (E, n_text))
        add(_GEMMA3_PROJECTOR["mm_soft_emb_norm.weight"], pp + "mm_soft_emb_norm.weight", (E,))
        plus_one.add(_GEMMA3_PROJECTOR["mm_soft_emb_norm.weight"])
        metadata[KEY_PROJECTOR_TYPE] = "gemma3"
        metadata[KEY_PROJECTION_DIM] = n_text
        metadata[KEY_PROJ_SCALE_FACTOR] = G // side
        metadata[KEY_HAS_LLAVA_PROJECTOR] = False

    if is_llava:
        tcfg = config["text_config"]
        n_text = _positive_int(tcfg, "hidden_size", f"{where} (text_config)")
        pp = _projector_prefix(tensors)
        hidden = tensors.shape(pp + "linear_1.weight")[0]
        add("mm.0.weight", pp + "linear_1.weight", (hidden, E))
        if pp + "linear_1.bias" in tensors:
            add("mm.0.bias", pp + "linear_1.bias", (hidden,))
        add("mm.2.weight", pp + "linear_2.weight", (n_text, hidden))
        if pp + "linear_2.bias" in tensors:
            add("mm.2.bias", pp + "linear_2.bias", (n_text,))
        metadata[KEY_PROJECTOR_TYPE] = "mlp"
        metadata[KEY_PROJECTION_DIM] = n_text
        metadata[KEY_PROJECTOR_ACT] = projector_act

    check_shapes(model_dir, tensors, [(hf_name, gguf_name, shape) for gguf_name, hf_name, shape in out])
    return MmprojPlan(model_type, metadata, out, plus_one=plus_one)


def check_shapes(model_dir: Path, tensors: CheckpointTensors, expected: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """ConvertError unless each (HF name, what it is for, shape) is in the checkpoint with that shape."""
    for hf_name, purpose, shape in expected:
        tensors.require(hf_name, shape, model_dir, purpose)


@dataclass
class MmprojResult:
    """What a conversion wrote."""

    output: Path
    model_type: str
    n_tokens: int  # rows per tower input (per image; for AnyRes per tile, the image's count set by its size)
    tensors: list[tuple[str, str, tuple[int, ...]]]  # (GGUF name, type name, numpy-order shape)
    metadata: dict[str, Any]


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if key == KEY_FEATURE_LAYER:
            writer.add_int32(key, value)
        else:
            writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and all(isinstance(v, int) for v in value):
        writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.INT32)
    elif isinstance(value, list):
        writer.add_key_value(key, value, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    else:
        raise TypeError(f"metadata {key}: unsupported value {value!r}")


def convert_mmproj(
    model_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    outtype: str = "f16",
    feature_layer: int | None = None,
    select_strategy: str | None = None,
    name: str | None = None,
    overwrite: bool = False,
) -> MmprojResult:
    """Writes the mmproj GGUF of a Hugging Face vision checkpoint.

    Args:
        model_dir: a LLaVA / LLaVA-OneVision checkpoint folder (vision tower + projector; the language model's
            tensors are skipped), or a bare ``CLIPVisionModel`` / ``SiglipVisionModel`` folder (no projector).
        output: the file to write (through a temporary file renamed at the end).
        outtype: "f32" or "f16" for the matrices (vectors and embeddings stay f32).
        feature_layer: which hidden state feeds the projector (Hugging Face index; default: the checkpoint's
            ``vision_feature_layer``, or ``last_hidden_state`` for a bare tower).
        select_strategy: "default" (drop the class token) or "full" (keep it).
        name: general.name (default: the folder name).
        overwrite: replace an existing output file (``--force``).

    Raises:
        ConvertError: a message naming the file or tensor at fault.
    """
    src, out = Path(model_dir), Path(output)
    if outtype not in MMPROJ_OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one of {', '.join(MMPROJ_OUTTYPES)} for an mmproj file")
    tensors = CheckpointTensors(src) if src.is_dir() else None
    if tensors is None:
        raise ConvertError(f"{src}: not a directory (expected a Hugging Face checkpoint folder)")
    try:
        check_output(out, [src / "config.json", *(ref.path for ref in tensors.refs.values())], overwrite)
        plan = plan_mmproj(src, tensors, feature_layer, select_strategy)
        qtype = MMPROJ_OUTTYPES[outtype]
        listing: list[tuple[str, str, tuple[int, ...]]] = []
        with temporary_output(out) as tmp:
            writer = GGUFWriter(tmp, ARCH_CLIP)
            try:
                writer.add_string("general.name", name or src.resolve().name)
                writer.add_uint32("general.file_type", 1 if qtype == GGMLQuantizationType.F16 else 0)
                for key, value in plan.metadata.items():
                    _add(writer, key, value)
                types = []
                for gguf_name, _, shape in plan.tensors:
                    # Matrices (and the 4-D patch kernel) take the outtype; vectors and embedding tables stay f32.
                    is_matrix = len(shape) >= 2 and not gguf_name.startswith(("v.position_embd", "v.class_embd"))
                    t = qtype if is_matrix else GGMLQuantizationType.F32
                    types.append(t)
                    dtype = np.float16 if t == GGMLQuantizationType.F16 else np.float32
                    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    writer.add_tensor_info(gguf_name, shape, np.dtype(dtype), nbytes, raw_dtype=t)
                    listing.append((gguf_name, t.name, shape))
                writer.write_header_to_file()
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
                for (gguf_name, hf_name, _), t in zip(plan.tensors, types, strict=True):
                    data = tensors.load(hf_name)
                    if gguf_name in plan.plus_one:
                        data = np.asarray(data, dtype=np.float32) + 1.0
                    if gguf_name in plan.transforms:
                        data = np.ascontiguousarray(plan.transforms[gguf_name](data))
                    writer.write_tensor_data(encode_tensor(data, t))
            finally:
                writer.close()
            os.replace(tmp, out)
    finally:
        tensors.close()
    meta = plan.metadata
    if plan.model_type == qwen_vision.MODEL_TYPE:  # dynamic resolution: the most tokens an image can take
        factor = meta[KEY_PATCH_SIZE] * meta[qwen_vision.KEY_SPATIAL_MERGE_SIZE]
        return MmprojResult(out, plan.model_type, meta[qwen_vision.KEY_IMAGE_MAX_PIXELS] // factor**2, listing, meta)
    n_patches = (meta[KEY_IMAGE_SIZE] // meta[KEY_PATCH_SIZE] // meta.get(KEY_PROJ_SCALE_FACTOR, 1)) ** 2
    keeps_cls = plan.model_type == "clip" and meta[KEY_SELECT_STRATEGY] == "full"
    return MmprojResult(out, plan.model_type, n_patches + int(keeps_cls), listing, meta)


# ------------------------------------------------------------------------------------------ the text half of LLaVA
_TEXT_PREFIXES: Final = (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))  # fmt: skip
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                           "chat_template.jinja", "chat_template.json", "added_tokens.json")  # fmt: skip
_ST_NAMES: Final = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64"}


def extract_llava_text(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Writes the language model of a LLaVA checkpoint as a plain causal-LM checkpoint folder (config.json from
    ``text_config``, the ``model.language_model.*`` / ``lm_head.*`` tensors renamed to ``model.*`` / ``lm_head.*``
    and copied byte for byte into one safetensors file, the tokenizer files), which ``convert`` then reads."""
    src, dst = Path(model_dir), Path(out_dir)
    config = load_config(src)
    where = str(src / "config.json")
    if not any(a in (*_LLAVA_ARCHS, _GEMMA3_ARCH) for a in config.get("architectures") or []):
        raise ConvertError(f"{where}: not a LLaVA or Gemma 3 checkpoint ({', '.join((*_LLAVA_ARCHS, _GEMMA3_ARCH))})")
    tcfg = dict(config.get("text_config") or {})
    arch = text_architecture_for(str(tcfg.get("model_type")))
    if arch is None:
        supported = sorted(c.hf_model_type for c in MODEL_CLASSES.values())
        raise ConvertError(f"{where}: text model type {tcfg.get('model_type')!r} is not supported ({supported})")
    tcfg["architectures"] = [arch]
    if "tie_word_embeddings" not in tcfg and "tie_word_embeddings" in config:  # older LLaVA: at the top level
        tcfg["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(tcfg, indent=2), encoding="utf-8")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    tensors = CheckpointTensors(src)
    try:
        renamed: list[tuple[str, str]] = []
        for name in tensors:
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    renamed.append((new + name[len(old) :], name))
                    break
        if not renamed:
            raise ConvertError(f"{src}: no language-model tensors (model.language_model.*) found")
        header: dict[str, Any] = {}
        offset = 0
        for new, old in renamed:
            ref = tensors.refs[old]
            # .bin sources are read through torch as float32; safetensors sources are copied as stored.
            dtype = ref.dtype if ref.path.suffix != ".bin" else "F32"
            n = int(np.prod(ref.shape, dtype=np.int64)) * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}[dtype]
            header[new] = {"dtype": _ST_NAMES[dtype], "shape": list(ref.shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        with open(dst / "model.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _, old in renamed:
                ref = tensors.refs[old]
                if ref.path.suffix == ".bin":
                    f.write(np.ascontiguousarray(tensors.load(old), dtype="<f4").tobytes())
                    continue
                with open(ref.path, "rb") as shard:
                    shard.seek(ref.begin)
                    left = ref.end - ref.begin
                    while left > 0:
                        chunk = shard.read(min(left, 64 << 20))
                        if not chunk:
                            raise ConvertError(f"{ref.path}: ends inside tensor {old!r}")
                        f.write(chunk)
                        left -= len(chunk)
    finally:
        tensors.close()
    return dst


def convert_llava_text(
    model_dir: str | os.PathLike[str], output: str | os.PathLike[str], outtype: str = "f16", **kwargs: Any
) -> ConvertResult:
    """The text GGUF of a LLaVA checkpoint: ``extract_llava_text`` into a temporary folder beside ``output``, then
    ``convert`` (keyword arguments go to it)."""
    out = Path(output)
    source = CheckpointTensors(Path(model_dir))
    try:  # the extracted copy is checked by convert; the LLaVA checkpoint's own files must not be replaced either
        check_output(out, input_files(Path(model_dir), source), overwrite=True)
    finally:
        source.close()
    with tempfile.TemporaryDirectory(prefix=".llava-text-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        extract_llava_text(model_dir, tmp)
        kwargs.setdefault("name", Path(model_dir).resolve().name)
        return convert(tmp, out, outtype=outtype, **kwargs)


def add_mmproj_subcommand(subparsers: Any) -> None:
    """Registers ``mmproj`` (HF_DIR -o OUT.gguf) on an argparse subparsers object; ``func`` runs it."""
    p = subparsers.add_parser(
        "mmproj",
        help="write the vision tower + projector of a LLaVA / CLIP / SigLIP checkpoint as an mmproj GGUF "
        "(docs/vision.md)",
        description="Write an mmproj GGUF (llama.cpp's 'clip' layout) from a Hugging Face vision checkpoint "
        "(docs/vision.md).",
    )
    p.add_argument("model_dir", metavar="HF_DIR")
    p.add_argument("-o", "--outfile", required=True, metavar="OUT.gguf")
    p.add_argument("--outtype", default="f16", choices=list(MMPROJ_OUTTYPES))
    p.add_argument("--feature-layer", type=int, help="hidden state feeding the projector (default: from config)")
    p.add_argument("--select-strategy", choices=("default", "full"), help="drop ('default') or keep the class token")
    p.add_argument("--name", help="general.name (default: the folder name)")
    p.add_argument("--force", action="store_true", help="replace output files that exist")
    p.add_argument("--text-outfile", metavar="TEXT.gguf", help="also convert a LLaVA checkpoint's language model")
    p.add_argument("--text-outtype", default="f16", help="weight type of the text GGUF (as convert --outtype)")
    p.set_defaults(func=_run_mmproj)


def _run_mmproj(args: argparse.Namespace) -> int:
    result = convert_mmproj(args.model_dir, args.outfile, outtype=args.outtype, feature_layer=args.feature_layer,
                            select_strategy=args.select_strategy, name=args.name, overwrite=args.force)  # fmt: skip
    pinpoints = result.metadata.get(KEY_GRID_PINPOINTS)
    rows = (f"AnyRes: {result.n_tokens} rows per tile, {len(pinpoints) // 2} grid pinpoints" if pinpoints
            else f"{result.n_tokens} image tokens")  # fmt: skip
    if result.model_type == qwen_vision.MODEL_TYPE:
        rows = f"dynamic resolution: up to {result.n_tokens} image tokens"
    print(f"wrote {result.output} ({result.model_type}, {len(result.tensors)} tensors, {rows})", file=sys.stderr)
    if args.text_outfile:
        text = convert_llava_text(
            args.model_dir, args.text_outfile, outtype=args.text_outtype, progress=False, overwrite=args.force
        )
        print(f"wrote {text.output} ({text.architecture}, {len(text.tensors)} tensors)", file=sys.stderr)
    return 0
