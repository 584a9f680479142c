"""Tokenizer built from GGUF metadata, matching llama.cpp's tokenization.

Two vocabulary families are supported:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. Text is split by the pre-tokenizer regexes that llama.cpp
  uses for ``tokenizer.ggml.pre`` (applied one after another; matches *and* the text between matches become
  pieces), mapped to the GPT-2 byte alphabet and merged by rank with the HF ``tokenizers`` BPE model.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE over scores. Spaces become "▁", a space is prefixed to
  each text fragment that starts the input or follows a special token (``add_space_prefix``), adjacent symbols are
  merged highest-score first, and characters outside the vocabulary fall back to ``<0xXX>`` byte tokens. The merge
  table for ``tokenizers`` is derived from the vocabulary: every split of a token into two vocabulary tokens is a
  merge, ranked by the score of the merged token.

Special tokens are found in the text before the model runs, like llama.cpp's ``tokenizer_st_partition``: tokens of
type USER_DEFINED (4) always, CONTROL (3) and UNKNOWN (2) only with ``parse_special=True``; longer tokens are
searched first.
"""

from __future__ import annotations

import codecs
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

from .tokenizer_vocab import (
    CHAR_TO_BYTE,
    DEFAULT_ADD_BOS,
    PRE_TOKENIZER_REGEXES,
    SUPPORTED_PRE_TOKENIZERS,
    SpecialToken,
    TokenizerError,
    TokenType,
    build_byte_level_bpe,
    build_spm_bpe,
    byte_level_alphabet,
    end_of_generation,
    metadata_value,
    optional_token_id,
    parse_byte_token,
    special_tokens,
)

__all__ = [
    "SUPPORTED_PRE_TOKENIZERS",
    "StreamDecoder",
    "TokenType",
    "Tokenizer",
    "TokenizerError",
    "byte_level_alphabet",
]

# Text fragments at least this long are encoded with the GIL released (tokenizers' encode_batch does, encode
# does not): one large /tokenize request must not stall every other thread of the server meanwhile.
_GIL_FREE_CHARS = 4096
_SPACE_ESCAPE = "\u2581"  # "▁", SentencePiece's visible space
_C_ISSPACE = " \t\n\v\f\r"


class Tokenizer:
    """Encodes text to token ids and back, as llama.cpp does for the same GGUF vocabulary.

    Build it with :meth:`from_gguf_metadata`. Ids are plain ``int`` in ``[0, n_vocab)``.
    """

    def __init__(
        self,
        *,
        model: str,
        pre: str | None,
        tokens: list[str],
        token_types: list[int],
        hf: HfTokenizer,
        bos_id: int | None,
        eos_id: int | None,
        eot_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        specials: list[SpecialToken],
        chat_template: str | None,
    ) -> None:
        """Internal: use :meth:`from_gguf_metadata`."""
        self._model = model
        self._pre = pre
        self._tokens = tokens
        self._types = token_types
        self._hf = hf
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._eot_id = eot_id
        self._eog_ids = eog_ids
        self._add_bos = add_bos
        self._add_eos = add_eos
        self._add_space_prefix = add_space_prefix
        self._specials = specials
        self._chat_template = chat_template
        self._piece_cache: dict[int, bytes] = {}

    # --- construction ---------------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Builds the tokenizer from a GGUF metadata mapping (``GgufFile(path).metadata()``).

        Raises TokenizerError naming the key when the vocabulary is missing or malformed, or when the tokenizer model
        or pre-tokenizer is not supported.
        """
        model = meta.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise TokenizerError("GGUF metadata has no 'tokenizer.ggml.model' string: the file holds no vocabulary")
        tokens_raw = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens_raw, list) or not tokens_raw or not isinstance(tokens_raw[0], str):
            raise TokenizerError("GGUF metadata 'tokenizer.ggml.tokens' must be a non-empty list of strings")
        n_vocab = len(tokens_raw)
        # llama.cpp gives empty token strings a placeholder text so that they stay distinct and never match.
        tokens = list(tokens_raw)
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.tokens'[{i}] is not a string: {t!r:.40}")
            if not t:
                tokens[i] = f"[EMPTY_{i}]"

        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            token_types = [TokenType.NORMAL] * n_vocab
        else:
            if not isinstance(types, list) or len(types) < n_vocab:
                raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.token_type' must list at least {n_vocab} types")
            try:
                token_types = [int(t) for t in types[:n_vocab]]
            except (TypeError, ValueError):
                raise TokenizerError("GGUF metadata 'tokenizer.ggml.token_type' must hold integers") from None

        pre = meta.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.pre' must be a string, got {pre!r}")

        bos_id = optional_token_id(meta, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = optional_token_id(meta, "tokenizer.ggml.eos_token_id", n_vocab)
        unk_id = optional_token_id(meta, "tokenizer.ggml.unknown_token_id", n_vocab)

        if model == "gpt2":
            if pre is None or pre == "default":
                raise TokenizerError(
                    "byte-level BPE vocabulary without a known 'tokenizer.ggml.pre': llama.cpp falls back to a "
                    "degraded default split that this tokenizer does not reproduce; re-convert the model"
                )
            if pre not in PRE_TOKENIZER_REGEXES:
                raise TokenizerError(
                    f"unsupported 'tokenizer.ggml.pre' = {pre!r} for a byte-level BPE vocabulary; supported: "
                    + ", ".join(SUPPORTED_PRE_TOKENIZERS)
                )
            hf = build_byte_level_bpe(meta, tokens, pre)
            add_space_prefix = False
            add_bos_default = pre in DEFAULT_ADD_BOS
            add_eos_default = False
        elif model == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) < n_vocab:
                raise TokenizerError(f"GGUF metadata 'tokenizer.ggml.scores' must list at least {n_vocab} scores")
            unk_text = tokens[unk_id] if unk_id is not None else None
            try:
                score_values = [float(s) for s in scores[:n_vocab]]
            except (TypeError, ValueError):
                raise TokenizerError("GGUF metadata 'tokenizer.ggml.scores' must hold numbers") from None
            hf = build_spm_bpe(tokens, score_values, unk_text)
            add_space_prefix = True
            add_bos_default = True
            add_eos_default = False
        else:
            raise TokenizerError(f"unsupported 'tokenizer.ggml.model' = {model!r}; supported: 'gpt2', 'llama'")

        add_space_prefix = bool(metadata_value(meta, "tokenizer.ggml.add_space_prefix", add_space_prefix))
        add_bos = bool(metadata_value(meta, "tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(metadata_value(meta, "tokenizer.ggml.add_eos_token", add_eos_default))
        if add_bos and bos_id is None:
            raise TokenizerError("'tokenizer.ggml.add_bos_token' is true but the vocabulary has no valid BOS id")
        if add_eos and eos_id is None:
            raise TokenizerError("'tokenizer.ggml.add_eos_token' is true but the vocabulary has no valid EOS id")

        eot_id, eog_ids = end_of_generation(meta, tokens, token_types, eos_id, n_vocab)

        name = str(metadata_value(meta, "general.name", "")).lower()
        specials = special_tokens(tokens, token_types, phi3_strip=("phi-3" in name or "phi3" in name))

        chat_template = meta.get("tokenizer.chat_template")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TokenizerError("GGUF metadata 'tokenizer.chat_template' must be a string")

        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=token_types,
            hf=hf,
            bos_id=bos_id,
            eos_id=eos_id,
            eot_id=eot_id,
            eog_ids=eog_ids,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            specials=specials,
            chat_template=chat_template or None,
        )

    # --- properties -----------------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self._tokens)

    @property
    def model(self) -> str:
        """``tokenizer.ggml.model``: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)."""
        return self._model

    @property
    def pre(self) -> str | None:
        """``tokenizer.ggml.pre``, the pre-tokenizer name (None when absent)."""
        return self._pre

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence token id, or None."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """End-of-sequence token id, or None."""
        return self._eos_id

    @property
    def eot_id(self) -> int | None:
        """End-of-turn token id (from metadata or recognised by its text, e.g. ``<|im_end|>``), or None."""
        return self._eot_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """All ids that end generation (EOS, EOT, EOM and the end-like control tokens llama.cpp recognises)."""
        return self._eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether ``encode(add_special=True)`` prepends BOS."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """Whether ``encode(add_special=True)`` appends EOS."""
        return self._add_eos

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template from ``tokenizer.chat_template`` (or the one set in its place), or None."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        """Replaces the file's template (llama.cpp's --chat-template-file); None or "": ChatML."""
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"a chat template must be a string, got {type(template).__name__}")
        self._chat_template = template or None

    def token_text(self, token_id: int) -> str:
        """The vocabulary string of a token (byte-level / "▁"-escaped form, as stored in the GGUF file)."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """The GGUF token type of a token (see :class:`TokenType`)."""
        return self._types[self._check_id(token_id)]

    def special_text(self, token_id: int | None) -> str:
        """The literal text of a token as written in prompts (e.g. "<|im_start|>"), "" for None.

        Used to pass ``bos_token`` / ``eos_token`` to chat templates.
        """
        if token_id is None:
            return ""
        return self.token_to_piece(token_id, special=True).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """True for CONTROL and UNKNOWN tokens (what ``decode(skip_special=True)`` leaves out)."""
        return self._types[self._check_id(token_id)] in (TokenType.CONTROL, TokenType.UNKNOWN)

    # --- encoding -------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenizes ``text``.

        add_special: prepend BOS / append EOS as the vocabulary asks (``add_bos`` / ``add_eos``).
        parse_special: recognise CONTROL tokens such as ``<|im_start|>`` written in the text; without it they are
        tokenized as plain text (USER_DEFINED tokens are recognised either way, as in llama.cpp).
        Raises ValueError for text holding lone surrogates (e.g. from JSON "\\ud800"): it has no UTF-8 form.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"encode(): text holds a lone surrogate {text[e.start]!r} at index {e.start}"
                ) from None
        out: list[int] = []
        if add_special and self._add_bos:
            assert self._bos_id is not None
            out.append(self._bos_id)
        is_prev_special = True  # SentencePiece prefixes a space to the first fragment and to those after specials
        for fragment in self._partition(text, parse_special):
            if isinstance(fragment, int):
                out.append(fragment)
                is_prev_special = True
                continue
            if self._model == "llama":
                if self._add_space_prefix and is_prev_special:
                    fragment = " " + fragment
                fragment = fragment.replace(" ", _SPACE_ESCAPE)
            if len(fragment) < _GIL_FREE_CHARS:
                out.extend(self._hf.encode(fragment, add_special_tokens=False).ids)
            else:  # encode holds the GIL throughout (seconds for megabytes); encode_batch lets other threads run
                out.extend(self._hf.encode_batch([fragment], add_special_tokens=False)[0].ids)
            is_prev_special = False
        if add_special and self._add_eos:
            assert self._eos_id is not None
            out.append(self._eos_id)
        return out

    def split_special(self, text: str) -> list[str | int]:
        """text as its raw-text pieces and the ids of the special tokens written in it (what encode with
        parse_special=True reads as one token each)."""
        return self._partition(text, True)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Splits text into raw-text fragments and special token ids (llama.cpp's tokenizer_st_partition)."""
        fragments: list[str | int] = [text] if text else []
        for special in self._specials:
            if not (special.always or parse_special) or special.text not in text:
                continue
            result: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special.text not in fragment:
                    result.append(fragment)
                    continue
                rest = fragment
                while True:
                    pos = rest.find(special.text)
                    if pos < 0:
                        if rest:
                            result.append(rest)
                        break
                    left = rest[:pos]
                    if special.lstrip:
                        left = left.rstrip(_C_ISSPACE)
                    if left:
                        result.append(left)
                    result.append(special.token_id)
                    rest = rest[pos + len(special.text) :]
                    if special.rstrip:
                        rest = rest.lstrip(_C_ISSPACE)
            fragments = result
        return fragments

    # --- decoding -------------------------------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> int:
        """The id as a plain int (numpy integers are accepted); ValueError naming it when it is not a valid id."""
        try:
            index = operator.index(token_id) if not isinstance(token_id, bool) else None
        except TypeError:
            index = None
        if index is None:
            raise ValueError(f"token id {token_id!r} is not an integer")
        if not 0 <= index < len(self._tokens):
            raise ValueError(f"token id {index} is out of range for a vocabulary of {len(self._tokens)} tokens")
        return index

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for; may be part of a UTF-8 character (byte tokens, split byte-level tokens).

        CONTROL / UNKNOWN tokens give their text when ``special`` is true and b"" otherwise. No leading space is
        removed (see :meth:`decode`).
        """
        token_id = self._check_id(token_id)
        if not special and self._types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN):
            return b""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._compute_piece(token_id)
            self._piece_cache[token_id] = piece
        return piece

    def _compute_piece(self, token_id: int) -> bytes:
        text = self._tokens[token_id]
        ttype = self._types[token_id]
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if ttype == TokenType.BYTE:
            byte = parse_byte_token(text)
            return text.encode("utf-8") if byte is None else bytes([byte])
        if ttype != TokenType.NORMAL:
            return b""  # UNUSED / UNDEFINED tokens render as nothing, as in llama.cpp
        if self._model == "llama":
            return text.replace(_SPACE_ESCAPE, " ").encode("utf-8")
        out = bytearray()
        for ch in text:
            byte = CHAR_TO_BYTE.get(ch)
            if byte is None:
                out += ch.encode("utf-8")  # not a byte-level character: keep it rather than lose text
            else:
                out.append(byte)
        return bytes(out)

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated token pieces; with ``add_space_prefix`` the space encoding put before the first text is
        removed (the first non-special piece loses one leading space)."""
        out = bytearray()
        strip_space = self._add_space_prefix
        for raw_id in ids:
            token_id = self._check_id(raw_id)
            piece = self.token_to_piece(token_id, special=not skip_special)
            if strip_space and self._types[token_id] not in (TokenType.CONTROL, TokenType.UNKNOWN):
                if piece.startswith(b" "):
                    piece = piece[1:]
                strip_space = False
            out += piece
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of a token sequence. Invalid UTF-8 (e.g. a cut-off character) becomes U+FFFD.

        Raises ValueError naming the first id outside ``[0, n_vocab)``.
        """
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    ``feed(id)`` returns the text that became complete with this token (possibly ""); ``flush()`` returns what is
    left at the end of the stream, with an unfinished character as U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        """skip_special: drop CONTROL / UNKNOWN tokens from the text instead of rendering their names."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Adds one token; returns newly completed text."""
        piece = self._tokenizer.token_to_piece(token_id, special=not self._skip_special)
        return self._decoder.decode(piece, final=False)

    def feed_many(self, ids: Iterable[int]) -> Iterator[str]:
        """Yields the non-empty text chunks completed by each of ``ids``."""
        for token_id in ids:
            text = self.feed(token_id)
            if text:
                yield text

    def flush(self) -> str:
        """Ends the stream: returns held-back bytes (an incomplete character becomes U+FFFD) and resets."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
