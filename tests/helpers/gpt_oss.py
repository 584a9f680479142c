"""The tiny random gpt-oss checkpoint of tests/test_arch_gptoss.py and tests/test_quant_mxfp4.py: GQA, 6 experts with
2 chosen, biases, sinks, alternating sliding-window layers, YaRN without truncation, experts large enough that the
SwiGLU clamps; and transformers' logits with its matrices rounded as a GGUF type stores them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import kvcmas_convert as kconv
from helpers.arch_checks import COMMON, WINDOW, tokenizer

CONFIG: dict[str, Any] = dict(
    COMMON, intermediate_size=32, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
    sliding_window=WINDOW,
    rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0,
    },
)  # fmt: skip
EXPERT_GAIN = 6.0  # experts' weights scaled so that some gate / up values pass the clamp at 7


def random_model(gain: float = EXPERT_GAIN, **changes: Any) -> Any:
    import torch
    import transformers

    torch.manual_seed(7)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **changes}))
    with torch.no_grad():  # random norms, biases and sinks, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.ndim == 1 or "bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            if "experts.gate_up_proj" in name and not name.endswith("bias"):
                p.mul_(gain)
    return model


def converted(out: Path, gain: float = EXPERT_GAIN, **changes: Any) -> Path:
    random_model(gain, **changes).save_pretrained(out)
    tokenizer().save_pretrained(out)
    kconv.convert(out, out / "model.gguf", outtype="f32", progress=False)
    return out


def rounded_reference(folder: Path, ids: list[int], qtype: Any, experts_only: bool = False) -> np.ndarray:
    """transformers' logits with the weight matrices (or only the experts') rounded to qtype by gguf-py along the
    rows the GGUF file stores: a matrix's input dimension (the experts' [X, in, out] transposed)."""
    import gguf
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith("bias") or (experts_only and p.ndim != 3):
                continue  # norms, biases (the experts' stacked ones too) and sinks stay f32 in the file
            w = p.numpy().transpose(0, 2, 1) if p.ndim == 3 else p.numpy()
            back = gguf.quants.dequantize(
                gguf.quants.quantize(np.ascontiguousarray(w).reshape(-1, w.shape[-1]), qtype), qtype
            )
            back = back.reshape(w.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back.transpose(0, 2, 1) if p.ndim == 3 else back)))
        return model(torch.tensor([ids])).logits[0].numpy()
