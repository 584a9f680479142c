"""How GGUF tokenizer metadata becomes the parts of a Tokenizer (tokenizer.py): the pre-tokenizer regexes per
``tokenizer.ggml.pre``, the BPE model (byte-level, or SentencePiece-style with merges derived from scores), the special
tokens found in text before the model runs, and the end-of-turn / end-of-generation ids, as llama.cpp decides them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from ._native import KvcmasError


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
# GPT-4o's o200k split (Phi-4-mini, Llama 4): a word is an optional leading non-letter, a cased run (upper then
# lower, or lower only) and an optional contraction; digits in threes; "/" joins a punctuation run's line breaks.
_UPPER_RUN = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER_RUN = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken (Mistral Nemo / Small 3.x): GPT-4o's word classes without contractions, single digits.
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}*{_LOWER_RUN}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_RUN}+{_LOWER_RUN}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_FALCON_PUNCT = r"[\p{P}\$\+<=>\^~\|`]+"
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]

# Pre-tokenizer name -> regexes applied in sequence. Every split is checked against llama.cpp's test vectors
# (tests/test_tokenizer.py) or, for "smollm", against transformers on SmolLM2, and for "gpt-4o", "tekken" and the
# cl100k split ("dbrx") against HF tokenizers on the regex the models' tokenizer.json carry; "llama3", "llama-v3",
# "falcon3" and "deepseek-r1-qwen" are names llama.cpp treats exactly like "llama-bpe" / "qwen2", "llama4" like
# "gpt-4o", "olmo" (OLMo 1) like "gpt-2". "dbrx" (the cl100k vocabulary OLMo 2 files carry) and "smaug-bpe" split as
# "llama-bpe" but merge every piece (no whole-piece lookup) and add no BOS by default.
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "gpt-2": [_GPT2],
    "mpt": [_GPT2],
    "olmo": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "falcon3": [_LLAMA3],
    "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "gpt-4o": [_GPT4O],
    "llama4": [_GPT4O],
    "tekken": [_TEKKEN],
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
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3", "tekken"}
# llama.cpp's default add_bos for BPE vocabularies without tokenizer.ggml.add_bos_token.
DEFAULT_ADD_BOS = {"llama-bpe", "llama3", "llama-v3", "falcon3", "tekken"}

SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(PRE_TOKENIZER_REGEXES))

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
CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


@dataclass(frozen=True)
class SpecialToken:
    token_id: int
    text: str
    lstrip: bool
    rstrip: bool
    always: bool  # USER_DEFINED: recognised even without parse_special


def metadata_value(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return default if value is None else value


def optional_token_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    """A token id from the metadata, or None when absent or out of range (llama.cpp ignores bad ids)."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenizerError(f"GGUF metadata {key!r} must be an integer token id, got {value!r}")
    return value if 0 <= value < n_vocab else None


def parse_byte_token(text: str) -> int | None:
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


def build_byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], pre: str) -> HfTokenizer:
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
        hf_pre.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZER_REGEXES[pre]
    ]
    steps.append(hf_pre.ByteLevel(add_prefix_space=False, use_regex=False))
    hf.pre_tokenizer = hf_pre.Sequence(steps)
    return hf


def build_spm_bpe(tokens: list[str], scores: list[float], unk_text: str | None) -> HfTokenizer:
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


def special_tokens(tokens: list[str], token_types: list[int], phi3_strip: bool) -> list[SpecialToken]:
    """Tokens recognised in raw text, longest first (ties in id order)."""
    ids = [i for i, t in enumerate(token_types) if t in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)]
    ids.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
    out = []
    for i in ids:
        text = tokens[i]
        # llama.cpp: for Phi-3 every special token eats the whitespace after it, except <unk>, <s>, <|endoftext|>.
        rstrip = phi3_strip and text not in ("<unk>", "<s>", "<|endoftext|>")
        out.append(
            SpecialToken(
                token_id=i, text=text, lstrip=False, rstrip=rstrip, always=token_types[i] == TokenType.USER_DEFINED
            )
        )
    return out


def end_of_generation(
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

    eot_id = optional_token_id(meta, "tokenizer.ggml.eot_token_id", n_vocab)
    if eot_id is None:
        eot_id = by_text(_EOT_TEXTS)
        force_control(eot_id)
    eom_id = optional_token_id(meta, "tokenizer.ggml.eom_token_id", n_vocab)
    if eom_id is None:
        eom_id = by_text(_EOM_TEXTS)
        force_control(eom_id)

    eog: set[int] = set()
    for kind, candidates in _FIM_TEXTS.items():
        fim_id = optional_token_id(meta, f"tokenizer.ggml.fim_{kind}_token_id", n_vocab)
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
