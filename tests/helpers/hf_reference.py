"""transformers as the independent reference: logits, greedy continuations and tokenization of a GGUF file, loaded
by transformers' own GGUF reader in float32, offline; results are cached on disk (models/generated/reference-cache)
keyed by the file and the library versions. Tests reach them through conftest's `reference` fixture."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def require_transformers() -> None:
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the transformers reference needs `{module}` (pip install -e .[test])")


@functools.lru_cache(maxsize=4)
def hf_model(path: str):  # -> transformers.PreTrainedModel (imported lazily: torch is slow to import)
    """transformers' model for a GGUF file, float32, eval mode, offline. Cached (a few at a time: SmolLM2 is 0.5 GB).

    transformers' GGUF loader ignores `rope_freqs.weight`; for the tiny `llama_rope3` variant the reference's RoPE is
    rebuilt from the Llama-3 scaling parameters (transformers computes its own frequencies from them, independently
    of the factors stored in the file).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    import make_test_models as mtm  # models/ (on sys.path: tests/conftest.py)

    variant = _tiny_variant_of(p)
    if variant is not None and mtm.TINY_VARIANTS[variant].llama3_rope:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        spec = mtm.TINY_VARIANTS[variant]
        model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": spec.rope_theta, **mtm.LLAMA3_ROPE}
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    return model


def _tiny_variant_of(path: Path) -> str | None:
    import make_test_models as mtm

    for variant in mtm.TINY_VARIANTS:
        for type_name in mtm.TINY_TYPES:
            if path.name == mtm.tiny_file_name(variant, type_name):
                return variant
    return None


REFERENCE_CACHE = REPO_ROOT / "models" / "generated" / "reference-cache"


def _cache_path(kind: str, path: str | Path, payload: object, suffix: str) -> Path | None:
    """Where a reference result is kept on disk, or None when caching is off (KVCMAS_REFERENCE_CACHE=0).

    transformers' GGUF loading is slow (tens of seconds for SmolLM2: it parses the whole tokenizer metadata), so
    results are kept keyed by the file's identity (name, size, mtime), the inputs and the library versions.
    """
    if os.environ.get("KVCMAS_REFERENCE_CACHE", "1") == "0":
        return None
    import torch
    import transformers

    p = Path(path)
    st = p.stat()
    key = json.dumps([kind, p.name, st.st_size, st.st_mtime_ns, payload, transformers.__version__, torch.__version__])
    return REFERENCE_CACHE / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:24]}{suffix}"


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _save(dst: Path, write) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, dst)


def hf_logits(path: str | Path, ids: Sequence[int]) -> np.ndarray:
    """transformers' logits [len(ids), n_vocab] (float32) for one fresh sequence of token ids."""
    require_transformers()
    ids = [int(t) for t in ids]
    cached = _cache_path("logits", path, ids, ".npy")
    if cached is not None and cached.is_file():
        return np.load(cached)
    import torch

    model = hf_model(str(path))
    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long)).logits[0].float().numpy()
    if cached is not None:
        _save(cached, lambda tmp: tmp.write_bytes(_npy_bytes(out)))
    return out


def _cached_json(kind: str, path: str | Path, payload: object, compute):
    cached = _cache_path(kind, path, payload, ".json")
    if cached is not None and cached.is_file():
        return json.loads(cached.read_text())
    value = compute()
    if cached is not None:
        _save(cached, lambda tmp: tmp.write_text(json.dumps(value)))
    return value


def hf_greedy(path: str | Path, prompt_ids: Sequence[int], max_tokens: int, eos_id: int) -> list[int]:
    """transformers' greedy continuation (do_sample=False) of `prompt_ids`: new ids only, stopping after EOS."""
    require_transformers()
    prompt_ids = [int(t) for t in prompt_ids]

    def compute() -> list[int]:
        import torch

        model = hf_model(str(path))
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids], dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            )
        return [int(t) for t in out[0, len(prompt_ids) :]]

    return _cached_json("greedy", path, [prompt_ids, max_tokens, eos_id], compute)


@functools.lru_cache(maxsize=2)
def hf_tokenizer(path: str):
    """transformers' tokenizer built from a GGUF file's metadata (independent of the engine's tokenizer)."""
    require_transformers()
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    p = Path(path)
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def hf_encode(path: str | Path, text: str) -> list[int]:
    """transformers' tokenization of `text` (no special tokens added; special-token text is parsed)."""
    return _cached_json(
        "encode", path, text, lambda: [int(t) for t in hf_tokenizer(str(path)).encode(text, add_special_tokens=False)]
    )


def hf_chat_prompt_ids(path: str | Path, user_text: str) -> list[int]:
    """Token ids of the file's chat template applied to one user message, with the assistant generation prompt."""

    def compute() -> list[int]:
        tok = hf_tokenizer(str(path))
        text = tok.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
        return [int(t) for t in tok.encode(text, add_special_tokens=False)]

    return _cached_json("chat", path, user_text, compute)


def hf_token_id(path: str | Path, token: str) -> int:
    return _cached_json("token", path, token, lambda: int(hf_tokenizer(str(path)).convert_tokens_to_ids(token)))
