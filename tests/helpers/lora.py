"""Random PEFT LoRA adapters of a transformers model, as the LoRA tests make them (tests/test_lora.py,
tests/test_lora_sharing.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


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
