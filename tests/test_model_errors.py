"""Model files that parse as GGUF but do not describe a model kvcmas can run: each is a clear error, never a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

import kvcmas_cpp as kc

E, F, H, HKV, V, L = 32, 64, 4, 2, 64, 2  # a very small llama
HD = E // H


def _write(path: Path, edit: Callable[[dict, dict], None] | None = None) -> Path:
    """Writes a tiny random llama GGUF; `edit(keys, tensors)` may change the dicts before writing."""
    rng = np.random.default_rng(0)
    keys: dict = {
        "general.architecture": "llama",
        "llama.context_length": 128,
        "llama.embedding_length": E,
        "llama.block_count": L,
        "llama.feed_forward_length": F,
        "llama.attention.head_count": H,
        "llama.attention.head_count_kv": HKV,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
    }
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((V, E)).astype(np.float32),
        "output_norm.weight": np.ones(E, np.float32),
    }
    for il in range(L):
        b = f"blk.{il}."
        tensors.update(
            {
                b + "attn_norm.weight": np.ones(E, np.float32),
                b + "ffn_norm.weight": np.ones(E, np.float32),
                b + "attn_q.weight": rng.standard_normal((H * HD, E)).astype(np.float32) * 0.1,
                b + "attn_k.weight": rng.standard_normal((HKV * HD, E)).astype(np.float32) * 0.1,
                b + "attn_v.weight": rng.standard_normal((HKV * HD, E)).astype(np.float32) * 0.1,
                b + "attn_output.weight": rng.standard_normal((E, H * HD)).astype(np.float32) * 0.1,
                b + "ffn_gate.weight": rng.standard_normal((F, E)).astype(np.float32) * 0.1,
                b + "ffn_up.weight": rng.standard_normal((F, E)).astype(np.float32) * 0.1,
                b + "ffn_down.weight": rng.standard_normal((E, F)).astype(np.float32) * 0.1,
            }
        )
    if edit is not None:
        edit(keys, tensors)
    writer = gguf.GGUFWriter(str(path), arch=str(keys.pop("general.architecture")))
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, int(value))
    for name, array in tensors.items():
        if isinstance(array, tuple):  # (raw blocks [rows, bytes], their GGML type)
            writer.add_tensor(name, array[0], raw_shape=array[0].shape, raw_dtype=array[1])
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_valid_tiny_model_runs(tmp_path: Path) -> None:
    model = kc.Model(_write(tmp_path / "ok.gguf"), n_threads=1)
    assert (model.arch, model.n_layer, model.n_embd, model.n_head_kv, model.n_vocab) == ("llama", L, E, HKV, V)
    logits = model.logits([1, 2, 3])
    assert logits.shape == (3, V) and np.all(np.isfinite(logits))


def _drop(name: str) -> Callable[[dict, dict], None]:
    return lambda keys, tensors: tensors.pop(name)


def _set(key: str, value: object) -> Callable[[dict, dict], None]:
    return lambda keys, tensors: keys.__setitem__(key, value)


def _reshape(name: str, shape: tuple[int, ...]) -> Callable[[dict, dict], None]:
    def edit(keys: dict, tensors: dict) -> None:
        tensors[name] = np.zeros(shape, np.float32)

    return edit


def _stored_as(qtype: gguf.GGMLQuantizationType) -> Callable[[dict, dict], None]:
    """blk.0.ffn_down.weight in a type kvcmas has no kernels for (random blocks, f16 scales finite); the
    feed-forward width becomes one 256-element block, so K-quant rows tile it."""

    def edit(keys: dict, tensors: dict) -> None:
        width, rng = 256, np.random.default_rng(1)
        keys["llama.feed_forward_length"] = width
        for il in range(L):
            for part, shape in (("ffn_gate", (width, E)), ("ffn_up", (width, E)), ("ffn_down", (E, width))):
                tensors[f"blk.{il}.{part}.weight"] = rng.standard_normal(shape).astype(np.float32) * 0.1
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.zeros((E, width // block_elems * block_bytes), np.uint8)  # all-zero blocks: scales of 0.0
        tensors["blk.0.ffn_down.weight"] = (blocks, qtype)

    return edit


def _sliding(pattern: object, window: int = 4) -> Callable[[dict, dict], None]:
    def edit(keys: dict, tensors: dict) -> None:
        keys["llama.attention.sliding_window"] = window
        keys["llama.attention.sliding_window_pattern"] = pattern

    return edit


def test_sliding_window_keys_load(tmp_path: Path) -> None:
    """The window applies to every layer, to the layers a bool pattern marks, or by llama.cpp's integer period."""
    for name, edit, expected in (
        ("none", None, [0, 0]),
        ("all", _set("llama.attention.sliding_window", 4), [4, 4]),
        ("bools", _sliding([False, True]), [0, 4]),
        ("period", _sliding(2), [4, 0]),
    ):
        model = kc.Model(_write(tmp_path / f"{name}.gguf", edit), n_threads=1)
        assert model.layer_window == expected, name
        assert np.all(np.isfinite(model.logits(list(range(1, 12)))))


def _rename_arch(keys: dict, tensors: dict) -> None:
    for k in [k for k in keys if k.startswith("llama.")]:
        keys["gptx." + k[len("llama.") :]] = keys.pop(k)
    keys["general.architecture"] = "gptx"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_rename_arch, "unsupported architecture 'gptx'"),
        (_drop("blk.1.ffn_down.weight"), "tensor 'blk.1.ffn_down.weight' is missing"),
        (_drop("output_norm.weight"), "tensor 'output_norm.weight' is missing"),
        (_reshape("blk.0.attn_k.weight", (HKV * HD + 1, E)), "'blk.0.attn_k.weight' should have shape"),
        (_reshape("blk.0.attn_norm.weight", (E + 2,)), "'blk.0.attn_norm.weight' should have 32 elements"),
        (_set("llama.attention.head_count_kv", 3), "not a valid grouping"),
        (_set("llama.attention.head_count", 0), "not a valid grouping"),
        (_set("llama.block_count", 100000), "block_count 100000 out of range"),
        (_set("llama.attention.layer_norm_rms_epsilon", -1.0), "layer_norm_rms_epsilon"),
        (_set("llama.rope.scaling.type", "yarn"), "rope scaling 'yarn' is not supported"),
        (lambda k, t: k.pop("llama.embedding_length"), "llama.embedding_length"),
        (_set("llama.embedding_length", "wide"), "llama.embedding_length"),
        (_set("llama.attention.sliding_window", 0), "llama.attention.sliding_window = 0 out of range"),
        (_sliding([True, False, True]), "sliding_window_pattern has 3 entries for 2 layers"),
        (_sliding(7), "sliding_window_pattern = 7 is neither a bool per layer nor a layer period"),
        (
            _stored_as(gguf.GGMLQuantizationType.Q3_K),
            "tensor 'blk.0.ffn_down.weight' has type q3_K, which kvcmas does not run (its weight types: f32, f16, "
            "q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K, bf16); a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file",
        ),
        (_stored_as(gguf.GGMLQuantizationType.IQ4_XS), "'blk.0.ffn_down.weight' has type iq4_xs, which kvcmas does"),
        (_stored_as(gguf.GGMLQuantizationType.IQ4_NL), "'blk.0.ffn_down.weight' has type iq4_nl, which kvcmas does"),
    ],
)
def test_unusable_model_files_raise(tmp_path: Path, edit: Callable[[dict, dict], None], message: str) -> None:
    path = _write(tmp_path / "bad.gguf", edit)
    with pytest.raises(kc.KvcmasError) as info:
        kc.Model(path, n_threads=1)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_non_model_files_raise(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model")
    with pytest.raises(kc.KvcmasError, match="notes.gguf"):
        kc.Model(text)
    with pytest.raises(kc.KvcmasError, match="missing.gguf"):
        kc.Model(tmp_path / "missing.gguf")
