"""Fuzz target: the tokenizer (``kvcmas_cpp.tokenizer.Tokenizer``) built from the default model's GGUF metadata.

Input layout: byte 0 picks the mode, the rest is the payload.
  mode 0: payload is UTF-8 text (invalid bytes become lone surrogates): encode without specials must give ids in
          range whose decode is the text's UTF-8 bytes again, less the bytes the vocabulary has no token for (lone
          surrogates must be refused with a ValueError, never crash).
  mode 1: the same with special-token parsing and BOS/EOS: ids in range, decode and skip_special decode succeed.
  mode 2: payload is little-endian uint16 token ids (some past the vocabulary): decode raises ValueError exactly
          when an id is out of range; otherwise StreamDecoder's chunks plus flush equal decode().

    python fuzz/fuzz_tokenizer.py -max_total_time=45 fuzz/corpus/tokenizer
"""

from __future__ import annotations

import sys

import _harness
import atheris

_harness.use_source_tree_if_asked()
with atheris.instrument_imports(include=["kvcmas_cpp"]):
    from kvcmas_cpp._native import core
    from kvcmas_cpp.model import default_model_path
    from kvcmas_cpp.tokenizer import StreamDecoder, Tokenizer, byte_level_alphabet

TOKENIZER = Tokenizer.from_gguf_metadata(core.GgufFile(default_model_path()).metadata())
N_VOCAB = TOKENIZER.n_vocab
_VOCAB = {TOKENIZER.token_text(i) for i in range(N_VOCAB)}
UNREPRESENTABLE = frozenset(b for b, ch in byte_level_alphabet().items() if ch not in _VOCAB)


def _text(payload: bytes) -> str:
    return payload.decode("utf-8", errors="surrogateescape")


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def check_plain_round_trip(text: str) -> None:
    try:
        ids = TOKENIZER.encode(text, add_special=False, parse_special=False)
    except ValueError:
        if _has_surrogate(text):
            return  # text that is not valid Unicode scalar values cannot be tokenized; refusing it is the contract
        raise
    assert all(0 <= i < N_VOCAB for i in ids), ids
    back = TOKENIZER.decode(ids)
    # Bytes the vocabulary has no token for are dropped, as Hugging Face tokenizers and llama.cpp drop them (SmolLM2
    # lacks the control bytes 0x04 0x06 0x13 0x14 0x16 0x1d and the lead bytes 0xc0 0xc1 0xf1 0xf2 0xf5-0xff): a
    # character losing its lead byte comes back as one U+FFFD per remaining byte; everything else comes back.
    kept = bytes(b for b in text.encode("utf-8") if b not in UNREPRESENTABLE)
    expected = kept.decode("utf-8", errors="replace")
    assert back == expected, (text, ids, back)


def check_special_encode(text: str) -> None:
    try:
        ids = TOKENIZER.encode(text, add_special=True, parse_special=True)
    except ValueError:
        if _has_surrogate(text):
            return
        raise
    assert all(0 <= i < N_VOCAB for i in ids), ids
    TOKENIZER.decode(ids)
    TOKENIZER.decode(ids, skip_special=True)


def check_decode(payload: bytes) -> None:
    ids = [int.from_bytes(payload[i : i + 2], "little") for i in range(0, len(payload) - 1, 2)]
    out_of_range = any(i >= N_VOCAB for i in ids)
    try:
        text = TOKENIZER.decode(ids)
    except ValueError:
        assert out_of_range, ids
        return
    assert not out_of_range, ids
    stream = StreamDecoder(TOKENIZER)
    streamed = "".join(stream.feed_many(ids)) + stream.flush()
    assert streamed == text, (ids, streamed, text)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, payload = data[0] % 3, data[1:]
    if mode == 0:
        check_plain_round_trip(_text(payload))
    elif mode == 1:
        check_special_encode(_text(payload))
    else:
        check_decode(payload)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
