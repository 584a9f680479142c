"""Names the converter writes, checked against llama.cpp itself (llama-cpp-python, where installed).

Architecture names, tensor names and RoPE types are checked in tests/test_architectures.py
(`test_llama_cpp_agrees`: llama.cpp loads each converted file and gives kvcmas' logits, which a wrong name or RoPE
pairing would not). Here: OLMo 2's pre-tokenizer name. llama.cpp's converter has no OLMo 2 entry of its own; the
cl100k fingerprint its files hash to is named "dbrx" there (convert_hf_to_gguf.py, ref databricks/dbrx-base), and
llama.cpp splits "dbrx" with Llama 3's regex. A vocabulary exported under that name must tokenize in llama.cpp as in
kvcmas.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (pip install -e .[bench])", allow_module_level=True)

import gguf  # noqa: E402

from helpers.tokenizer_corpus import MULTILINGUAL, PRE_FAMILIES, build_pre_family, varied_strings  # noqa: E402
from kvcmas_convert.vocab import export_vocab  # noqa: E402
from kvcmas_cpp.tokenizer import Tokenizer  # noqa: E402


def _vocab_only_gguf(meta: dict, path: Path) -> Path:
    """A llama file with the tokenizer keys of `meta` and no tensors (llama.cpp loads it with vocab_only)."""
    w = gguf.GGUFWriter(path, "llama")
    for key in ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        w.add_uint32(f"llama.{key}", 64)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in meta.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif value and isinstance(value[0], str):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dbrx_pre_tokenizer_splits_as_llama_cpp(tmp_path: Path) -> None:
    import llama_cpp

    hf = build_pre_family("dbrx", tmp_path)
    meta = export_vocab(tmp_path, hf.get_vocab_size(), {}, PRE_FAMILIES["dbrx"][2]).values
    assert meta["tokenizer.ggml.pre"] == "dbrx"
    ours = Tokenizer.from_gguf_metadata(meta)
    llm = llama_cpp.Llama(str(_vocab_only_gguf(meta, tmp_path / "vocab.gguf")), vocab_only=True, verbose=False)
    strings = MULTILINGUAL + varied_strings(500, seed=5)
    differ = [
        s
        for s in strings
        if llm.tokenize(s.encode(), add_bos=False, special=False)
        != ours.encode(s, add_special=False, parse_special=False)
    ]
    assert not differ, f"{len(differ)} of {len(strings)} strings split otherwise in llama.cpp, first {differ[0]!r}"
    # the strings tell the name apart: llama.cpp under another name ("qwen2": digits one by one) splits otherwise
    other = {**meta, "tokenizer.ggml.pre": "qwen2"}
    llm2 = llama_cpp.Llama(str(_vocab_only_gguf(other, tmp_path / "other.gguf")), vocab_only=True, verbose=False)
    assert any(
        llm2.tokenize(s.encode(), add_bos=False, special=False) != ours.encode(s, add_special=False) for s in strings
    )
