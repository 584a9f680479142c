"""Random-weight Qwen2.5-VL and Gemma 3 checkpoints for `kvcmas bench vision --family`, made with transformers and
converted by kvcmas' converters (the text half by ``convert``, the tower by ``convert_mmproj``).

Real sizes (``size="real"``):
- qwen2.5vl: Qwen2.5-VL's ViT (32 blocks, 1280 wide, 16 heads, windows of 112 px, full attention in blocks 7, 15,
  23, 31, the 2x2 merger) on a Qwen2.5-0.5B-shaped text model (896 wide, 24 layers, 14 heads, 2 KV heads) with
  M-RoPE (sections 8/12/12 of its 32 rotary pairs, Qwen2.5-VL's 16/24/24 scaled to the head), the processor's
  default pixel limits (dynamic resolution);
- gemma3: Gemma 3's SigLIP at 896 px (27 blocks, 1152 wide), pooled 4x4 to 256 soft tokens, on a Gemma-3-1B-shaped
  ``gemma3`` text model (1152 wide, 26 layers, 4 heads, 1 KV head of 256, sliding window 512, 5 local : 1 global).
The text models use SmolLM2's tokenizer (49,152 tokens, from the default model's GGUF) with the family's image tokens
added, so prompts tokenize as a real chat model's. ``size="tiny"`` keeps every structure at small widths (tests).
Weights are transformers' initialisation (matrices it leaves at zero drawn at 0.02): speed and memory do not depend on
their values, and the answers mean nothing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("onevision", "qwen2.5vl", "gemma3")
REAL_TOWER_LAYERS = {"qwen2.5vl": 32, "gemma3": 27}
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


@dataclass(frozen=True)
class BuiltFamily:
    """A converted random checkpoint: the text GGUF, the mmproj and what they hold."""

    text: Path
    mmproj: Path
    label: str  # the shapes, for the report
    tower_layers: int
    real_tower_layers: int

    @property
    def cut(self) -> bool:
        return self.tower_layers < self.real_tower_layers


def _tokenizer(added: tuple[str, ...]) -> tuple[Any, list[int]]:
    """SmolLM2's tokenizer and chat template (the default model's GGUF) with `added` as special tokens; their ids."""
    import os

    import transformers

    from ..model.files import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.add_special_tokens({"additional_special_tokens": list(added)})
    return tok, [int(tok.convert_tokens_to_ids(t)) for t in added]  # type: ignore[arg-type]  # one token each


def _qwen(size: str, tower_layers: int, vocab: int, ids: list[int]) -> tuple[Any, dict[str, Any], str]:
    import transformers

    start, end, image, video = ids
    text: dict[str, Any]
    tower: dict[str, Any]
    pixels: dict[str, int] | None
    if size == "tiny":
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, sections=[2, 3, 3])  # fmt: skip
        tower = dict(hidden_size=32, intermediate_size=48, num_heads=2, full=(1, 3))
        pixels = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
    else:
        text = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, sections=[8, 12, 12])  # fmt: skip
        tower = dict(hidden_size=1280, intermediate_size=3420, num_heads=16, full=(7, 15, 23, 31))
        pixels = None  # the processor's defaults: 3,136 to 12,845,056 pixels
    sections = text.pop("sections")
    full = [i for i in tower.pop("full") if i < tower_layers] or [tower_layers - 1]
    rope = {"rope_type": "default", "mrope_section": sections, "rope_theta": 1e6}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None,
                         rope_parameters=rope, **text),
        vision_config=dict(depth=tower_layers, out_hidden_size=text["hidden_size"], fullatt_block_indexes=full,
                           window_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, **tower),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    ip = transformers.Qwen2VLImageProcessorPil(**({"size": pixels} if pixels else {}))
    processor = {"image_processor": ip.to_dict(), "processor_class": "Qwen2_5_VLProcessor"}
    label = (
        f"Qwen2.5-VL ViT ({tower_layers} blocks x {tower['hidden_size']}, 2x2 merger) -> qwen2vl text "
        f"({text['num_hidden_layers']} x {text['hidden_size']}, M-RoPE {sections})"
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(config), processor, label


def _gemma3(size: str, tower_layers: int, vocab: int, ids: list[int]) -> tuple[Any, dict[str, Any], str]:
    import transformers

    boi, eoi, image = ids
    text: dict[str, Any]
    tower: dict[str, Any]
    if size == "tiny":
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        tower = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, image_size=224)
        tokens = 16
    else:  # Gemma-3-1B's text widths; the 4B / 12B / 27B checkpoints share this tower
        text = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512)  # fmt: skip
        tower = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, image_size=896)
        tokens = 256
    tcfg = transformers.Gemma3TextConfig(vocab_size=vocab, max_position_embeddings=32768, **text)
    vcfg = transformers.SiglipVisionConfig(num_hidden_layers=tower_layers, patch_size=14, vision_use_head=False,
                                           **tower)  # fmt: skip
    config = transformers.Gemma3Config(text_config=tcfg, vision_config=vcfg, mm_tokens_per_image=tokens,
                                       boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)  # fmt: skip
    side = tower["image_size"]
    ip = transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, resample=2)  # fmt: skip
    processor = {"image_processor": ip.to_dict(), "image_seq_length": tokens, "processor_class": "Gemma3Processor"}
    label = (
        f"Gemma 3 SigLIP {side} px ({tower_layers} blocks x {tower['hidden_size']}) pooled to {tokens} tokens -> "
        f"gemma3 text ({text['num_hidden_layers']} x {text['hidden_size']})"
    )
    return transformers.Gemma3ForConditionalGeneration(config), processor, label


BUILDERS: dict[str, Callable[[str, int, int, list[int]], tuple[Any, dict[str, Any], str]]] = {
    "qwen2.5vl": _qwen,
    "gemma3": _gemma3,
}


def build_family(
    family: str, folder: Path, size: str = "real", tower_layers: int | None = None, outtype: str = "f16"
) -> BuiltFamily:
    """Makes the family's random checkpoint under `folder` and converts both halves (progress lines on stderr)."""
    import time

    import torch

    from kvcmas_convert.convert import convert
    from kvcmas_convert.vision import convert_llava_text, convert_mmproj

    from .vision_towers import fill_zero_matrices

    if family not in BUILDERS:
        raise ValueError(f"family {family!r}: a random checkpoint is built for {', '.join(BUILDERS)}")
    if size not in ("real", "tiny"):
        raise ValueError(f"size must be 'real' or 'tiny', got {size!r}")
    real = REAL_TOWER_LAYERS[family] if size == "real" else 4 if family == "qwen2.5vl" else 2
    layers = real if tower_layers is None else tower_layers
    if not 1 <= layers <= real:
        raise ValueError(f"--tower-layers must be in [1, {real}] for {family}, got {layers}")
    t0 = time.perf_counter()
    tok, ids = _tokenizer(QWEN_TOKENS if family == "qwen2.5vl" else GEMMA_TOKENS)
    torch.manual_seed(0)
    print(f"building a random {family} checkpoint with transformers ({layers} tower blocks) ...", file=sys.stderr)
    model, processor, label = BUILDERS[family](size, layers, len(tok), ids)
    for cfg in (model.config, model.config.text_config):  # the tokenizer's, not the family's vocabulary's
        cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    fill_zero_matrices(model)
    ck = folder / family
    model.save_pretrained(ck)
    del model
    tok.save_pretrained(ck)
    (ck / "processor_config.json").write_text(json.dumps(processor))
    print(f"converting it ({time.perf_counter() - t0:.0f} s so far) ...", file=sys.stderr)
    text, mmproj = folder / f"{family}-text.gguf", folder / f"{family}-mmproj.gguf"
    if family == "gemma3":
        convert_llava_text(ck, text, outtype=outtype, progress=False)
    else:
        convert(ck, text, outtype=outtype, progress=False)
    convert_mmproj(ck, mmproj, outtype=outtype)
    print(f"{family} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return BuiltFamily(text, mmproj, label, layers, real)
