"""Random LoRA adapters for the tests. From numpy, without torch: a PEFT folder (adapter_config.json and
adapter_model.safetensors, PEFT's names and shapes) and its GGUF LoRA file (convert-lora), for tests whose reference
is the engine's own adapter path (Model.chat(adapter=)). With peft: a PEFT model over a transformers model, for
tests whose reference is transformers + peft (tests/test_lora.py, tests/test_lora_sharing.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def _dims(base_gguf: Path) -> tuple[int, int, int, int]:
    """(n_layer, n_embd, kv width, n_ff) of a llama-style GGUF model."""
    from gguf import GGUFReader

    reader = GGUFReader(str(base_gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    n_embd, n_head = value("embedding_length"), value("attention.head_count")
    return (
        value("block_count"),
        n_embd,
        n_embd // n_head * value("attention.head_count_kv"),
        value("feed_forward_length"),
    )


def write_peft_adapter(
    folder: Path, base_gguf: Path, targets: list[str], rank: int, alpha: float, seed: int, std: float = 0.05
) -> Path:
    """A PEFT LoRA folder for the base model with random A and B (normal, `std`) on `targets` of every layer."""
    from safetensors.numpy import save_file

    n_layer, n_embd, n_kv, n_ff = _dims(base_gguf)
    shapes = {  # module -> (n_out, n_in), as the HF Linear's weight
        "q_proj": ("self_attn", n_embd, n_embd),
        "k_proj": ("self_attn", n_kv, n_embd),
        "v_proj": ("self_attn", n_kv, n_embd),
        "o_proj": ("self_attn", n_embd, n_embd),
        "gate_proj": ("mlp", n_ff, n_embd),
        "up_proj": ("mlp", n_ff, n_embd),
        "down_proj": ("mlp", n_embd, n_ff),
    }
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(n_layer):
        for t in targets:
            block, n_out, n_in = shapes[t]
            name = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0.0, std, (rank, n_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0.0, std, (n_out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def make_lora_gguf(
    out: Path, base_gguf: Path, targets: list[str], rank: int, alpha: float, seed: int, std: float = 0.05
) -> Path:
    """write_peft_adapter converted to a GGUF LoRA file at `out` (its PEFT folder beside it)."""
    from kvcmas_convert.lora import convert_lora

    folder = write_peft_adapter(out.with_suffix(".peft"), base_gguf, targets, rank, alpha, seed, std)
    convert_lora(folder, base_gguf, out)
    return out


def random_peft_adapter(base: Any, folder: Path, targets: list[str], rank: int, alpha: float, seed: int) -> Any:
    """A PEFT model over a copy of `base` with a random adapter (init_lora_weights=False: A and B both random, else
    B starts at zero and the update vanishes), saved as a PEFT folder (adapter_config.json +
    adapter_model.safetensors) in `folder`; returns the PEFT model (eval mode)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    pm = get_peft_model(copy.deepcopy(base), config).eval()
    pm.save_pretrained(folder)
    return pm
