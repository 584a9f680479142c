"""Tokenizer export: Hugging Face tokenizer files to the standard GGUF ``tokenizer.*`` keys.

Sources, in order of preference:

* ``tokenizer.json`` with a byte-level BPE model -> ``tokenizer.ggml.model = "gpt2"``: tokens by id, merges, token
  types (added special tokens CONTROL, other added tokens USER_DEFINED) and ``tokenizer.ggml.pre``, the name of the
  pre-tokenizer (``--vocab-pre`` overrides it). llama.cpp names a pre-tokenizer after the tokenizer family it
  recognises by fingerprint: the SHA-256 of the token ids of a fixed reference text. A known fingerprint gives
  llama.cpp's name (``smollm`` for SmolLM's tokenizer, although its description is StarCoder's); an unknown one
  falls back to recognising the pre-tokenizer description.
* ``tokenizer.model`` (SentencePiece) -> ``tokenizer.ggml.model = "llama"``: pieces, scores and types read from the
  protobuf directly (the wire format is simple; no protobuf package needed), ``add_space_prefix`` from its
  normalizer spec.

Special token ids come from ``tokenizer_config.json`` (falling back to ``config.json``), ``add_bos``/``add_eos``
from the tokenizer's post-processor (or ``tokenizer_config.json``), and the chat template from
``tokenizer_config.json``, ``chat_template.jinja`` or ``chat_template.json``. The vocabulary is padded to
``config.json``'s ``vocab_size`` with UNUSED ``[PAD<i>]`` tokens, as the embedding matrix has that many rows.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import constants as C
from .constants import TokenType
from .errors import ConvertError

# Pre-tokenizer regexes as Hugging Face tokenizer.json files spell them, and llama.cpp's name for each.
_HF_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HF_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HF_WORD_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_HF_WORD_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_HF_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_HF_GPT4O_REGEX = (  # o200k: Phi-4-mini, Llama 4
    rf"[^\r\n\p{{L}}\p{{N}}]?{_HF_WORD_UPPER}*{_HF_WORD_LOWER}+{_HF_CONTRACTION}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_HF_WORD_UPPER}+{_HF_WORD_LOWER}*{_HF_CONTRACTION}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HF_TEKKEN_REGEX = (  # Mistral Nemo / Small 3.x
    rf"[^\r\n\p{{L}}\p{{N}}]?{_HF_WORD_UPPER}*{_HF_WORD_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_HF_WORD_UPPER}+{_HF_WORD_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_PRE_NAMES = {
    _HF_LLAMA3_REGEX: "llama-bpe",
    _HF_QWEN2_REGEX: "qwen2",
    _HF_GPT4O_REGEX: "gpt-4o",
    _HF_TEKKEN_REGEX: "tekken",
}

# The reference text llama.cpp's converter tokenizes to fingerprint a BPE tokenizer (whitespace runs, emoji with
# joiners, digit runs, Khmer, CJK, Cyrillic, punctuation runs, contractions in mixed case). Byte-identical to
# llama.cpp's, or no fingerprint matches.
_FINGERPRINT_TEXT = "".join((
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 \U0001f999\U0001f999 ",
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 ",
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 ",
    "?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ",
    "------======= \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 ",
    "''''''```````\"\"\"\"......!!!!!!?????? ",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
))  # fmt: skip
# Fingerprint (sha256 of str(list of token ids), special tokens included) -> llama.cpp's pre-tokenizer name, for
# the tokenizer families whose pre-tokenizer the kvcmas tokenizer implements. Values from llama.cpp's
# convert_hf_to_gguf.py; a family missing here is named from its description instead.
_FINGERPRINT_NAMES = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # starcoder2
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5 / Qwen2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",  # o200k (Phi-4-mini)
    "d353350c764d8c3b39c763113960e4fb4919bea5fbf208a0e3b22e8469dc7406": "llama4",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # cl100k (OLMo 2's vocabulary)
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
}


def tokenizer_fingerprint(path: Path) -> str | None:
    """llama.cpp's fingerprint of a tokenizer.json (see _FINGERPRINT_TEXT); None when it cannot be loaded."""
    try:
        import tokenizers
    except ImportError:
        return None
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # a file the Rust loader rejects is still described by its JSON: fall back to that
        return None
    ids = tok.encode(_FINGERPRINT_TEXT).ids
    return hashlib.sha256(str(ids).encode("utf-8")).hexdigest()


@dataclass
class VocabExport:
    """The tokenizer keys to write, as (key, value) pairs with Python values (typed when written)."""

    source: Path
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.values[C.KEY_TOKENS])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: unreadable: {e}") from e


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        try:
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConvertError(f"{model_dir / 'chat_template.jinja'}: unreadable: {e}") from e
    if template is None and (model_dir / "chat_template.json").is_file():
        template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: take "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise ConvertError(f"{model_dir}: the chat template must be a string")
    return template


def _pre_name(pre_tokenizer: Any, path: Path) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for a tokenizer.json pre-tokenizer description."""

    def flatten(node: Any) -> list[dict[str, Any]]:
        if not isinstance(node, dict):
            return []
        if node.get("type") == "Sequence":
            return [leaf for child in node.get("pretokenizers", []) for leaf in flatten(child)]
        return [node]

    parts = flatten(pre_tokenizer)
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "starcoder"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        pattern = parts[0].get("pattern", {})
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if regex in _REGEX_PRE_NAMES:
            return _REGEX_PRE_NAMES[regex]
    raise ConvertError(
        f"{path}: pre-tokenizer {json.dumps(pre_tokenizer)[:200]} is not recognised; pass "
        f"--vocab-pre NAME (a llama.cpp pre-tokenizer name such as gpt-2, llama-bpe, qwen2, gpt-4o, starcoder)"
    )


def _special_flags(post: Any, bos_id: int | None, eos_id: int | None) -> tuple[bool | None, bool | None]:
    """add_bos / add_eos from a TemplateProcessing post-processor (None when there is none to read)."""
    if not isinstance(post, dict):
        return None, None
    if post.get("type") == "Sequence":
        for child in post.get("processors", []):
            flags = _special_flags(child, bos_id, eos_id)
            if flags != (None, None):
                return flags
        return None, None
    if post.get("type") != "TemplateProcessing":
        return (False, False) if post.get("type") == "ByteLevel" else (None, None)
    single = post.get("single", [])
    specials = post.get("special_tokens", {})

    def special_id(item: Any) -> int | None:
        if not isinstance(item, dict) or "SpecialToken" not in item:
            return None
        ids = specials.get(item["SpecialToken"].get("id"), {}).get("ids", [])
        return ids[0] if ids else None

    add_bos = bool(single) and bos_id is not None and special_id(single[0]) == bos_id
    add_eos = bool(single) and eos_id is not None and special_id(single[-1]) == eos_id
    return add_bos, add_eos


def _pad(tokens: list[str | None], types: list[int], n_vocab: int, path: Path) -> list[str]:
    if len(tokens) > n_vocab:
        raise ConvertError(
            f"{path}: the tokenizer has {len(tokens)} tokens, more than config.json's vocab_size {n_vocab}"
        )
    out: list[str] = []
    for i in range(n_vocab):
        text = tokens[i] if i < len(tokens) else None
        if text is None:
            text = f"[PAD{i}]"
            if i < len(types):
                types[i] = TokenType.UNUSED
            else:
                types.append(TokenType.UNUSED)
        out.append(text)
    return out


def _from_tokenizer_json(path: Path, n_vocab: int, pre_override: str | None) -> tuple[dict[str, Any], dict[str, int]]:
    data = _read_json(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConvertError(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE only; SentencePiece "
            f"vocabularies are read from tokenizer.model)"
        )
    if model.get("byte_fallback"):
        raise ConvertError(f"{path}: a SentencePiece-style BPE (byte_fallback) needs its tokenizer.model file")
    tokens: list[str | None] = [None] * n_vocab
    types = [TokenType.NORMAL] * n_vocab
    ids: dict[str, int] = {}
    for text, i in model["vocab"].items():
        if not isinstance(i, int) or not 0 <= i < n_vocab:
            raise ConvertError(f"{path}: token {text!r} has id {i!r} outside [0, vocab_size {n_vocab})")
        tokens[i], ids[text] = text, i
    for added in data.get("added_tokens") or []:
        i, text = added.get("id"), added.get("content")
        if not isinstance(i, int) or not 0 <= i < n_vocab or not isinstance(text, str):
            raise ConvertError(f"{path}: added token {added!r} is malformed or outside vocab_size {n_vocab}")
        tokens[i], ids[text] = text, i
        types[i] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    merges = []
    for m in model.get("merges") or []:
        merges.append(m if isinstance(m, str) else " ".join(m))
    values: dict[str, Any] = {
        C.KEY_TOKENIZER_MODEL: C.TOKENIZER_MODEL_BPE,
        C.KEY_TOKENIZER_PRE: pre_override
        or _FINGERPRINT_NAMES.get(tokenizer_fingerprint(path) or "")
        or _pre_name(data.get("pre_tokenizer"), path),
        C.KEY_TOKENS: _pad(tokens, types, n_vocab, path),
        C.KEY_TOKEN_TYPE: types,
        C.KEY_MERGES: merges,
        "_post_processor": data.get("post_processor"),
    }
    return values, ids


# --- SentencePiece model (protobuf wire format) ---------------------------------------------------------------------


def _proto_fields(buf: bytes, path: Path) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message; bytes for length-delimited fields."""
    out: list[tuple[int, int, Any]] = []
    pos, n = 0, len(buf)

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= n or shift > 63:
                raise ConvertError(f"{path}: truncated or malformed SentencePiece model")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    while pos < n:
        tag = varint()
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            length = varint()
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ConvertError(f"{path}: malformed SentencePiece model (wire type {wire})")
        if pos > n:
            raise ConvertError(f"{path}: truncated SentencePiece model")
        out.append((number, wire, value))
    return out


def read_sentencepiece(path: Path) -> tuple[list[str], list[float], list[int], bool, int]:
    """Pieces, scores, types, add_dummy_prefix and model type (1 unigram, 2 BPE) of a SentencePiece model file."""
    try:
        buf = path.read_bytes()
    except OSError as e:
        raise ConvertError(f"{path}: unreadable: {e}") from e
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    add_dummy_prefix, model_type = True, 1  # protobuf defaults of NormalizerSpec / TrainerSpec
    for number, wire, value in _proto_fields(buf, path):
        if number == 1 and wire == 2:  # repeated SentencePiece { piece = 1; score = 2; type = 3 }
            piece, score, kind = "", 0.0, TokenType.NORMAL
            for f, w, v in _proto_fields(value, path):
                if f == 1 and w == 2:
                    try:
                        piece = v.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise ConvertError(f"{path}: piece {len(pieces)} is not UTF-8") from e
                elif f == 2 and w == 5:
                    (score,) = struct.unpack("<f", v)
                elif f == 3 and w == 0:
                    kind = v
            pieces.append(piece)
            scores.append(score)
            types.append(kind)
        elif number == 2 and wire == 2:  # TrainerSpec { model_type = 3 }
            for f, w, v in _proto_fields(value, path):
                if f == 3 and w == 0:
                    model_type = v
        elif number == 3 and wire == 2:  # NormalizerSpec { add_dummy_prefix = 3 }
            for f, w, v in _proto_fields(value, path):
                if f == 3 and w == 0:
                    add_dummy_prefix = bool(v)
    if not pieces:
        raise ConvertError(f"{path}: not a SentencePiece model (no pieces)")
    return pieces, scores, types, add_dummy_prefix, model_type


def _from_sentencepiece(path: Path, n_vocab: int, tok_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    pieces, scores, types, add_dummy_prefix, model_type = read_sentencepiece(path)
    if model_type != 2:
        raise ConvertError(f"{path}: SentencePiece model type {model_type} is not supported (BPE only)")
    tokens: list[str | None] = list(pieces)
    all_scores = list(scores)
    ids = {p: i for i, p in enumerate(pieces)}
    # Tokens added on top of the SentencePiece model (tokenizer_config.json's added_tokens_decoder).
    added = tok_config.get("added_tokens_decoder") or {}
    for key, info in added.items():
        i, text = int(key), _token_text(info)
        if text is None or not 0 <= i < n_vocab:
            raise ConvertError(f"{path.parent / 'tokenizer_config.json'}: added token {key} is malformed")
        if i < len(pieces):
            continue
        while len(tokens) <= i:
            tokens.append(None)
            types.append(TokenType.UNUSED)
            all_scores.append(-1000.0)
        tokens[i], ids[text] = text, i
        types[i] = TokenType.CONTROL if isinstance(info, dict) and info.get("special") else TokenType.USER_DEFINED
    padded = _pad(tokens, types, n_vocab, path)
    all_scores += [-1000.0] * (n_vocab - len(all_scores))
    values: dict[str, Any] = {
        C.KEY_TOKENIZER_MODEL: C.TOKENIZER_MODEL_SPM,
        C.KEY_TOKENIZER_PRE: "default",
        C.KEY_TOKENS: padded,
        C.KEY_SCORES: all_scores,
        C.KEY_TOKEN_TYPE: types,
        C.KEY_ADD_SPACE_PREFIX: add_dummy_prefix,
    }
    unk = [i for i, t in enumerate(types) if t == TokenType.UNKNOWN]
    if unk:
        values[C.KEY_UNK_ID] = unk[0]
    return values, ids


def export_vocab(model_dir: Path, n_vocab: int, config: dict[str, Any], pre_override: str | None = None) -> VocabExport:
    """Reads the tokenizer files of a checkpoint folder into GGUF tokenizer keys."""
    tok_config_path = model_dir / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path) if tok_config_path.is_file() else {}
    if not isinstance(tok_config, dict):
        raise ConvertError(f"{tok_config_path}: expected a JSON object")
    tj, spm = model_dir / "tokenizer.json", model_dir / "tokenizer.model"
    use_spm = spm.is_file() and (not tj.is_file() or _is_spm_style(tj))
    if use_spm:
        values, ids = _from_sentencepiece(spm, n_vocab, tok_config)
        source = spm
    elif tj.is_file():
        values, ids = _from_tokenizer_json(tj, n_vocab, pre_override)
        source = tj
    else:
        raise ConvertError(
            f"{model_dir}: no tokenizer.json or tokenizer.model (pass --no-vocab to convert without a tokenizer)"
        )
    post = values.pop("_post_processor", None)

    def special(name: str, config_key: str) -> int | None:
        text = _token_text(tok_config.get(name))
        if text is not None:
            if text not in ids:
                raise ConvertError(f"{tok_config_path}: {name} {text!r} is not in the vocabulary")
            return ids[text]
        value = config.get(config_key)
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, int) and 0 <= value < n_vocab else None

    bos, eos = special("bos_token", "bos_token_id"), special("eos_token", "eos_token_id")
    for key, token_id in ((C.KEY_BOS_ID, bos), (C.KEY_EOS_ID, eos), (C.KEY_UNK_ID, special("unk_token", "")),
                          (C.KEY_PAD_ID, special("pad_token", "pad_token_id"))):  # fmt: skip
        if token_id is not None:
            values[key] = token_id
    add_bos, add_eos = _special_flags(post, bos, eos)
    if add_bos is None:
        add_bos = bool(tok_config.get("add_bos_token", use_spm and bos is not None))
    if add_eos is None:
        add_eos = bool(tok_config.get("add_eos_token", False))
    values[C.KEY_ADD_BOS] = bool(add_bos and bos is not None)
    values[C.KEY_ADD_EOS] = bool(add_eos and eos is not None)
    template = _chat_template(model_dir, tok_config)
    if template is not None:
        values[C.KEY_CHAT_TEMPLATE] = template
    return VocabExport(source, values)


def _is_spm_style(tokenizer_json: Path) -> bool:
    """True when tokenizer.json is a SentencePiece conversion (byte fallback), so tokenizer.model is the source."""
    data = _read_json(tokenizer_json)
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and bool(model.get("byte_fallback") or model.get("type") == "Unigram")
