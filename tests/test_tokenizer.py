"""Tokenizer tests against llama.cpp's vocabulary test vectors and against transformers on the default model.

The vectors (ggml-vocab-NAME.gguf with .inp / .out) come from llama.cpp's models/ folder and are fetched into
models/generated/vocab/ by `python models/fetch_vocab.py`. llama.cpp's test-tokenizer-0 splits the .inp file on
"\\n__ggml_vocab_test__\\n", reads one line of space-separated ids per case from .out, and tokenizes with
add_special=False, parse_special=False; the ids were produced by the models' original HF tokenizers.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcmas_cpp._native import core
from kvcmas_cpp.tokenizer import StreamDecoder, Tokenizer, TokenizerError, TokenType

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_DIR = Path(os.environ.get("KVCMAS_VOCAB_DIR", REPO_ROOT / "models" / "generated" / "vocab"))
HF_CACHE_DIR = REPO_ROOT / "models" / "generated" / "hf-tokenizer-smollm2"
SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocabularies whose every test vector we reproduce exactly.
CLAIMED_VOCABS = [
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "gpt-2",
    "qwen2",
    "qwen35",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "falcon",
    "deepseek-coder",
]


@functools.cache
def _metadata(path: Path) -> dict[str, Any]:
    return core.GgufFile(str(path)).metadata()


@functools.cache
def vocab_tokenizer(name: str) -> Tokenizer:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `python models/fetch_vocab.py` to fetch llama.cpp's vocab test files")
    return Tokenizer.from_gguf_metadata(_metadata(path))


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    """(input text, expected ids) pairs, parsed the way llama.cpp's test-tokenizer-0 does."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    raw = Path(str(base) + ".inp").read_bytes().decode("utf-8")
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = Path(str(base) + ".out").read_bytes().decode("utf-8").split("\n")
    assert len(lines) >= len(inputs), f"{base}.out has fewer lines than {base}.inp has cases"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, lines, strict=False)]


@pytest.fixture(scope="module")
def smollm2(default_model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_metadata(default_model_path))


@pytest.fixture(scope="module")
def hf_smollm2(default_model_path: Path) -> Any:
    """transformers' tokenizer converted from the same GGUF file (cached under models/generated/: the GGUF
    conversion takes ~20 s, loading the saved tokenizer.json well under a second)."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stat = default_model_path.stat()
    stamp = f"{default_model_path.name} {stat.st_size} {stat.st_mtime_ns} transformers {transformers.__version__}\n"
    stamp_file = HF_CACHE_DIR / "SOURCE"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        return transformers.AutoTokenizer.from_pretrained(str(HF_CACHE_DIR))
    hf = transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    shutil.rmtree(HF_CACHE_DIR, ignore_errors=True)
    hf.save_pretrained(str(HF_CACHE_DIR))
    stamp_file.write_text(stamp)
    return hf


# --- llama.cpp test vectors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLAIMED_VOCABS)
def test_llama_cpp_vectors(name: str) -> None:
    tok = vocab_tokenizer(name)
    cases = read_vectors(name)
    assert len(cases) >= 40
    failures = []
    for text, expected in cases:
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != expected:
            failures.append(f"{text[:60]!r}: got {got[:16]}, expected {expected[:16]}")
    assert not failures, f"{len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("name", CLAIMED_VOCABS)
def test_round_trip(name: str) -> None:
    """decode(encode(x)) == x: byte-level BPE is lossless, and SentencePiece's prefix space is removed again."""
    tok = vocab_tokenizer(name)
    for text, _ in read_vectors(name):
        ids = tok.encode(text, add_special=False, parse_special=False)
        assert tok.decode(ids) == text
        with_bos = tok.encode(text, add_special=True, parse_special=False)
        assert tok.decode(with_bos, skip_special=True) == text


def test_vectors_exercise_hard_cases() -> None:
    """The vectors include cases that need byte fallback, multi-token characters and long whitespace runs."""
    cases = dict(read_vectors("llama-bpe")) if (VOCAB_DIR / "ggml-vocab-llama-bpe.gguf.inp").is_file() else {}
    if not cases:
        pytest.skip("vocab test files missing: run `python models/fetch_vocab.py`")
    assert any(len(t) > 0 and t.isspace() and len(t) >= 3 for t in cases)
    assert any(any(ord(c) > 0xFFFF for c in t) for t in cases)  # emoji outside the BMP
    spm = vocab_tokenizer("llama-spm")
    byte_tokens = {i for i in range(spm.n_vocab) if spm.token_type(i) == TokenType.BYTE}
    assert any(set(ids) & byte_tokens for ids in dict(read_vectors("llama-spm")).values())


def test_unsupported_vocabularies_are_refused() -> None:
    if not (VOCAB_DIR / "ggml-vocab-bert-bge.gguf").is_file():
        pytest.skip("vocab test files missing: run `python models/fetch_vocab.py`")
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata(_metadata(VOCAB_DIR / "ggml-vocab-bert-bge.gguf"))
    meta = dict(_metadata(VOCAB_DIR / "ggml-vocab-gpt-2.gguf"))
    meta["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(meta)
    del meta["tokenizer.ggml.pre"]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre"):
        Tokenizer.from_gguf_metadata(meta)


def test_malformed_metadata() -> None:
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": []})
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(base)
    with pytest.raises(TokenizerError, match="no separating space"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.merges": ["ab"]})
    with pytest.raises(TokenizerError, match="token_type"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1]})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    # A merge naming a string outside the vocabulary is dropped, as it can never yield a token.
    tok = Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.merges": ["a b", "x y"]})
    assert tok.encode("ab") == [2]
    assert tok.encode("ba") == [1, 0]


# --- special tokens, BOS / EOS ----------------------------------------------------------------------------------


def test_special_tokens_parse_only_when_asked(smollm2: Tokenizer) -> None:
    im_start = smollm2.encode("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and smollm2.token_type(im_start[0]) == TokenType.CONTROL
    as_text = smollm2.encode("<|im_start|>", add_special=False, parse_special=False)
    assert len(as_text) > 1 and im_start[0] not in as_text
    assert smollm2.decode(as_text) == "<|im_start|>" == smollm2.decode(im_start)
    assert smollm2.decode(im_start, skip_special=True) == ""


def test_user_defined_tokens_always_match() -> None:
    tok = vocab_tokenizer("qwen2")
    user_ids = [i for i in range(tok.n_vocab) if tok.token_type(i) == TokenType.USER_DEFINED]
    assert user_ids
    uid = user_ids[0]
    text = "x" + tok.token_text(uid) + "y"
    for parse_special in (False, True):
        ids = tok.encode(text, add_special=False, parse_special=parse_special)
        assert uid in ids
        assert tok.decode(ids) == text


def test_spm_space_prefix_after_special_tokens() -> None:
    """llama.cpp prefixes a space to the first text fragment and to every fragment after a special token."""
    tok = vocab_tokenizer("llama-spm")
    assert tok.eos_id is not None and tok.bos_id is not None
    eos_text = tok.special_text(tok.eos_id)
    got = tok.encode(f"Hello{eos_text}world", add_special=False, parse_special=True)
    assert got == tok.encode("Hello", add_special=False) + [tok.eos_id] + tok.encode("world", add_special=False)


def test_add_special_follows_metadata(smollm2: Tokenizer) -> None:
    spm = vocab_tokenizer("llama-spm")
    assert spm.add_bos and spm.encode("Hi")[0] == spm.bos_id == 1
    assert spm.encode("Hi", add_special=False)[0] != spm.bos_id
    assert spm.encode("", add_special=True) == [1] and spm.encode("", add_special=False) == []
    # llama-bpe has no add_bos_token key: llama.cpp's default for the llama3 pre-tokenizer is to add BOS.
    bpe = vocab_tokenizer("llama-bpe")
    assert bpe.add_bos and bpe.encode("Hi")[0] == bpe.bos_id == 128000
    # SmolLM2 says add_bos_token = false.
    assert not smollm2.add_bos
    assert smollm2.encode("Hi") == smollm2.encode("Hi", add_special=False)


def test_end_of_generation_ids(smollm2: Tokenizer) -> None:
    im_end = smollm2.encode("<|im_end|>", add_special=False)
    endoftext = smollm2.encode("<|endoftext|>", add_special=False)
    assert len(im_end) == 1 and len(endoftext) == 1
    assert smollm2.eot_id == im_end[0]
    assert smollm2.eos_id in smollm2.eog_ids
    assert {im_end[0], endoftext[0]} <= smollm2.eog_ids
    im_start = smollm2.encode("<|im_start|>", add_special=False)[0]
    assert im_start not in smollm2.eog_ids
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template


# --- decoding ---------------------------------------------------------------------------------------------------


def test_decode_rejects_bad_ids(smollm2: Tokenizer) -> None:
    n = smollm2.n_vocab
    ids = smollm2.encode("numpy ids work too")
    assert smollm2.decode(np.asarray(ids, dtype=np.int32)) == smollm2.decode(ids) == "numpy ids work too"
    for not_an_id in (1.0, "3", None, True):
        with pytest.raises(ValueError, match="not an integer"):
            smollm2.decode([not_an_id])  # type: ignore[list-item]
    for bad in (n, -1, n + 1000):
        with pytest.raises(ValueError, match=str(bad)):
            smollm2.decode([1, bad])
        with pytest.raises(ValueError, match=str(bad)):
            smollm2.token_to_piece(bad)


def test_stream_decoder_holds_partial_characters() -> None:
    tok = vocab_tokenizer("llama-bpe")
    text = "Llamas 🦙 and emoji 😀😁, CJK 我想在apple工作, Cyrillic нещо, done."
    ids = tok.encode(text, add_special=False)
    pieces = [tok.token_to_piece(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == text

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    assert not all(valid(p) for p in pieces), "the text should contain characters split across tokens"

    def complete_prefix(b: bytes) -> str:
        # The longest prefix of b that is whole UTF-8 characters (an incomplete character has at most 3 bytes).
        for cut in range(len(b), max(len(b) - 4, -1), -1):
            if valid(b[:cut]):
                return b[:cut].decode("utf-8")
        raise AssertionError(f"no valid prefix in {b!r}")

    decoder = StreamDecoder(tok)
    emitted = ""
    for k, token_id in enumerate(ids):
        emitted += decoder.feed(token_id)
        assert emitted == complete_prefix(b"".join(pieces[: k + 1]))
    assert decoder.flush() == ""
    assert emitted == text


def test_stream_decoder_flushes_incomplete_character() -> None:
    tok = vocab_tokenizer("llama-spm")
    first_byte = tok.encode("🦙", add_special=False)
    byte_ids = [i for i in first_byte if tok.token_type(i) == TokenType.BYTE]
    assert len(byte_ids) == 4  # U+1F999 has no token: four <0xXX> byte tokens
    decoder = StreamDecoder(tok)
    assert [decoder.feed(i) for i in byte_ids[:2]] == ["", ""]
    assert decoder.flush() == "\ufffd"
    assert [decoder.feed(i) for i in byte_ids] == ["", "", "", "🦙"]


# --- SmolLM2 (the default model) vs transformers ----------------------------------------------------------------

SMOLLM2_TEXTS = [
    "Hello world",
    " Hello World!",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<|im_end|><|im_start|>",
    "12345 numbers 3.14159 and 1,000,000",
    "  leading  spaces\t\ttabs\n\n\nnewlines   ",
    "émoji 🦙😀 中文 Ελληνικά нещо на Български",
    "don't won't I'm they'll WE'RE",
    "def f(x):\n    return x**2  # comment\n",
    "</s><s> [INST] <<SYS>>",
    "<|im_start|> spaced <|im_end|>\n",
    "",
]


def test_smollm2_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any) -> None:
    for text in SMOLLM2_TEXTS:
        ours = smollm2.encode(text, add_special=False, parse_special=True)
        assert ours == hf_smollm2.encode(text, add_special_tokens=False), text
        assert smollm2.encode(text, add_special=True) == hf_smollm2.encode(text, add_special_tokens=True), text
        assert smollm2.decode(ours) == hf_smollm2.decode(ours, clean_up_tokenization_spaces=False) == text
    assert smollm2.bos_id == hf_smollm2.bos_token_id
    assert smollm2.eos_id == hf_smollm2.eos_token_id
    assert smollm2.n_vocab == len(hf_smollm2)


def test_smollm2_long_text_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any) -> None:
    """Every module docstring of the standard library's json package, joined: varied English, code and symbols."""
    import json
    import json.decoder
    import json.encoder

    text = "\n\n".join(m.__doc__ or "" for m in (json, json.decoder, json.encoder, sys))
    assert len(text) > 2000
    ours = smollm2.encode(text, add_special=False)
    assert ours == hf_smollm2.encode(text, add_special_tokens=False)
    assert smollm2.decode(ours) == text
