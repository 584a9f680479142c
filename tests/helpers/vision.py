"""Random weights for the vision towers the tests build with transformers."""

from __future__ import annotations

from typing import Any


def randomize_weights(model: Any, seed: int) -> None:
    """Weights far from transformers' near-zero init, so every part of the network moves the output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
