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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from ._native import KvcmasError

__all__ = ["SUPPORTED_PRE_TOKENIZERS", "StreamDecoder", "TokenType", "Tokenizer", "TokenizerError"]


class TokenizerError(KvcmasError):
    """The GGUF tokenizer metadata is missing, malformed or describes an unsupported tokenizer (a KvcmasError, as
    every bad model file is)."""


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (the GGUF / llama.cpp token types)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --- pre-tokenizer regexes (Oniguruma syntax, as used by HF `tokenizers`) ------------------------------------------
# Facts from llama.cpp's llm_tokenizer_bpe and the models' tokenizer.json files. "(?i:...)" contractions are spelled
# out per letter as llama.cpp does, so Unicode case folding (e.g. U+212A KELVIN SIGN) does not change the split.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_FALCON_PUNCT = r"[\p{P}\$\+<=>\^~\|`]+"
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]

# Pre-tokenizer name -> regexes applied in sequence. Every split is checked against llama.cpp's test vectors
# (tests/test_tokenizer.py) or, for "smollm", against transformers on SmolLM2; "llama3", "llama-v3", "falcon3" and
# "deepseek-r1-qwen" are names llama.cpp treats exactly like "llama-bpe" / "qwen2".
_PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "gpt-2": [_GPT2],
    "mpt": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "falcon3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
    "qwen35": [_QWEN35],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "falcon": [_FALCON_PUNCT, _GPT2, r"[0-9][0-9][0-9]"],
    "deepseek-coder": _DEEPSEEK_CODER,
}
# llama.cpp matches whole pre-tokenizer pieces against the vocabulary before merging for these.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3"}
# llama.cpp's default add_bos for BPE vocabularies without tokenizer.ggml.add_bos_token.
_DEFAULT_ADD_BOS = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZER_REGEXES))

# Token texts llama.cpp treats as end-of-turn / end-of-generation / FIM markers (forcing them to CONTROL type).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
            "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
            "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
            "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}  # fmt: skip

# Text fragments at least this long are encoded with the GIL released (tokenizers' encode_batch does, encode
# does not): one large /tokenize request must not stall every other thread of the server meanwhile.
_GIL_FREE_CHARS = 4096
_SPACE_ESCAPE = "\u2581"  # "▁", SentencePiece's visible space
_C_ISSPACE = " \t\n\v\f\r"


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = byte_level_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


@dataclass(frozen=True)
class _SpecialToken:
    token_id: int
    text: str
    lstrip: bool
    rstrip: bool
    always: bool  # USER_DEFINED: recognised even without parse_special


def _get(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return default if value is None else value


def _optional_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    """A token id from the metadata, or None when absent or out of range (llama.cpp ignores bad ids)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenizerError(f"GGUF metadata {key!r} must be an integer token id, got {value!r}")
    return value if 0 <= value < n_vocab else None


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
        specials: list[_SpecialToken],
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

        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", n_vocab)
        unk_id = _optional_id(meta, "tokenizer.ggml.unknown_token_id", n_vocab)

        if model == "gpt2":
            if pre is None or pre == "default":
                raise TokenizerError(
                    "byte-level BPE vocabulary without a known 'tokenizer.ggml.pre': llama.cpp falls back to a "
                    "degraded default split that this tokenizer does not reproduce; re-convert the model"
                )
            if pre not in _PRE_TOKENIZER_REGEXES:
                raise TokenizerError(
                    f"unsupported 'tokenizer.ggml.pre' = {pre!r} for a byte-level BPE vocabulary; supported: "
                    + ", ".join(SUPPORTED_PRE_TOKENIZERS)
                )
            hf = _build_byte_level_bpe(meta, tokens, pre)
            add_space_prefix = False
            add_bos_default = pre in _DEFAULT_ADD_BOS
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
            hf = _build_spm_bpe(tokens, score_values, unk_text)
            add_space_prefix = True
            add_bos_default = True
            add_eos_default = False
        else:
            raise TokenizerError(f"unsupported 'tokenizer.ggml.model' = {model!r}; supported: 'gpt2', 'llama'")

        add_space_prefix = bool(_get(meta, "tokenizer.ggml.add_space_prefix", add_space_prefix))
        add_bos = bool(_get(meta, "tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(_get(meta, "tokenizer.ggml.add_eos_token", add_eos_default))
        if add_bos and bos_id is None:
            raise TokenizerError("'tokenizer.ggml.add_bos_token' is true but the vocabulary has no valid BOS id")
        if add_eos and eos_id is None:
            raise TokenizerError("'tokenizer.ggml.add_eos_token' is true but the vocabulary has no valid EOS id")

        eot_id, eog_ids = _end_of_generation(meta, tokens, token_types, eos_id, n_vocab)

        name = str(_get(meta, "general.name", "")).lower()
        specials = _special_tokens(tokens, token_types, phi3_strip=("phi-3" in name or "phi3" in name))

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
            byte = _parse_byte_token(text)
            return text.encode("utf-8") if byte is None else bytes([byte])
        if ttype != TokenType.NORMAL:
            return b""  # UNUSED / UNDEFINED tokens render as nothing, as in llama.cpp
        if self._model == "llama":
            return text.replace(_SPACE_ESCAPE, " ").encode("utf-8")
        out = bytearray()
        for ch in text:
            byte = _CHAR_TO_BYTE.get(ch)
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


def _parse_byte_token(text: str) -> int | None:
    """Byte value of a "<0xAB>" token; None when the text has another form."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    # Later duplicates win, as in llama.cpp's token_to_id map.
    return dict(zip(tokens, range(len(tokens)), strict=True))


def _split_merge(line: str) -> tuple[str, str]:
    """Splits "a b" into ("a", "b") at the first space after position 0, as llama.cpp does."""
    pos = line.find(" ", 1)
    if pos < 0:
        raise TokenizerError(f"BPE merge {line!r} in 'tokenizer.ggml.merges' has no separating space")
    return line[:pos], line[pos + 1 :]


def _build_byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], pre: str) -> HfTokenizer:
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list) or (merges_raw and not isinstance(merges_raw[0], str)):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.merges' must be a list of strings for a BPE vocabulary")
    vocab = _vocab_dict(tokens)
    try:
        merges = [_split_merge(m) if m.startswith(" ") or " " not in m else tuple(m.split(" ", 1)) for m in merges_raw]
    except (AttributeError, TypeError):
        raise TokenizerError("GGUF metadata 'tokenizer.ggml.merges' must be a list of strings") from None
    if len(set(merges_raw)) != len(merges_raw):
        merges = list(dict.fromkeys(merges))  # llama.cpp keeps the first (lowest) rank of a repeated merge
    try:
        bpe = hf_models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    except Exception:
        # Some merge names a string that is not a token; such a merge can never produce a token: drop it.
        merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
        bpe = hf_models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    hf = HfTokenizer(bpe)
    steps: list[hf_pre.PreTokenizer] = [
        hf_pre.Split(Regex(pattern), behavior="isolated") for pattern in _PRE_TOKENIZER_REGEXES[pre]
    ]
    steps.append(hf_pre.ByteLevel(add_prefix_space=False, use_regex=False))
    hf.pre_tokenizer = hf_pre.Sequence(steps)
    return hf


def _build_spm_bpe(tokens: list[str], scores: list[float], unk_text: str | None) -> HfTokenizer:
    """BPE equivalent of llama.cpp's SentencePiece merging: a merge for every split of a token into two tokens,
    higher score of the merged token first (ties: lower id first)."""
    vocab = _vocab_dict(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for text, token_id in vocab.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    bpe = hf_models.BPE(vocab=vocab, merges=merges, unk_token=unk_text, byte_fallback=True, fuse_unk=False)
    return HfTokenizer(bpe)


def _special_tokens(tokens: list[str], token_types: list[int], phi3_strip: bool) -> list[_SpecialToken]:
    """Tokens recognised in raw text, longest first (ties in id order)."""
    ids = [i for i, t in enumerate(token_types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)]
    ids.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
    out = []
    for i in ids:
        text = tokens[i]
        # llama.cpp: for Phi-3 every special token eats the whitespace after it, except <unk>, <s>, <|endoftext|>.
        rstrip = phi3_strip and text not in ("<unk>", "<s>", "<|endoftext|>")
        out.append(
            _SpecialToken(
                token_id=i, text=text, lstrip=False, rstrip=rstrip, always=token_types[i] == TokenType.USER_DEFINED
            )
        )
    return out


def _end_of_generation(
    meta: Mapping[str, Any], tokens: list[str], token_types: list[int], eos_id: int | None, n_vocab: int
) -> tuple[int | None, frozenset[int]]:
    """EOT id and the end-of-generation set, following llama.cpp's rules (metadata ids plus recognised texts).

    Tokens recognised by text are forced to CONTROL type in ``token_types`` (llama.cpp does the same), so they are
    only parsed from text with ``parse_special``.
    """
    index = _vocab_dict(tokens)

    def by_text(candidates: Sequence[str]) -> int | None:
        for text in candidates:
            if text in index:
                return index[text]
        return None

    def force_control(token_id: int | None) -> None:
        if token_id is not None and token_types[token_id] != TokenType.CONTROL:
            token_types[token_id] = TokenType.CONTROL

    eot_id = _optional_id(meta, "tokenizer.ggml.eot_token_id", n_vocab)
    if eot_id is None:
        eot_id = by_text(_EOT_TEXTS)
        force_control(eot_id)
    eom_id = _optional_id(meta, "tokenizer.ggml.eom_token_id", n_vocab)
    if eom_id is None:
        eom_id = by_text(_EOM_TEXTS)
        force_control(eom_id)

    eog: set[int] = set()
    for kind, candidates in _FIM_TEXTS.items():
        fim_id = _optional_id(meta, f"tokenizer.ggml.fim_{kind}_token_id", n_vocab)
        if fim_id is None:
            fim_id = by_text(candidates)
            force_control(fim_id)
        if fim_id is not None and kind in ("pad", "rep", "sep"):
            eog.add(fim_id)
    for text in _EOG_TEXTS:
        token_id = index.get(text)
        if token_id is not None:
            eog.add(token_id)
            force_control(token_id)
    # gpt-oss style vocabularies: "<|end|>" ends a message, not the generation, when "<|return|>"/"<|call|>" exist.
    if "<|end|>" in index and (
        ("<|return|>" in index and "<|call|>" in index) or ("<|calls|>" in index and "<|flush|>" in index)
    ):
        eog.discard(index["<|end|>"])
        token_types[index["<|end|>"]] = TokenType.USER_DEFINED
    for token_id in (eos_id, eot_id, eom_id):
        if token_id is not None:
            eog.add(token_id)
    return eot_id, frozenset(eog)


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
