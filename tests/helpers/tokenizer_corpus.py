"""Tokenizer test inputs shared by tests/test_convert.py and tests/test_arch_names.py: varied strings (words in many
scripts, code, odd whitespace, numbers, specials), a training corpus, the regex splits of the byte-level BPE families
(Llama 3, Qwen2, gpt-4o, tekken) and small BPEs trained on them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
    r"|\s+"
)


_WORDS = [
    "the", "model", "reads", "a", "shared", "context", "and", "every", "agent", "reuses", "its", "cache", "while",
    "corrections", "keep", "outputs", "close", "to", "dense", "prefill", "so", "latency", "drops", "and", "memory",
    "stays", "small", "don't", "I'M", "you'll", "we've", "THEY'RE", "it's", "naïve", "café", "façade", "über",
    "straße", "ñandú", "Ωmega", "θέμα", "русский", "текст", "中文字符", "日本語のテキスト", "한국어", "العربية", "हिन्दी"
]  # fmt: skip
_CODE = [
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { s += a[i]; }", "if x != None and y >= 3:",
    "#include <vector>\n", "    \t  indent\t\ttabs", "lambda: {'k': [1, 2, 3]}", "SELECT * FROM t WHERE id=42;",
    "x=1e-5;y=0x1F;z=1_000_000", "```python\nprint('hi')\n```", "a->b::c<<d>>e", "<div class=\"x\">&amp;</div>",
]  # fmt: skip
_ODD = ["  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "🙂", "👨‍👩‍👧", "🚀🚀", "1234567", "3.14159", "$100", "...",
        "—", "«»", "½", "\u00a0", "\u200b", "ﬁ", "K", "é", "ǅ", "𝔘𝔫𝔦", "ÅΩ"]  # fmt: skip


def varied_strings(n: int, seed: int, specials: list[str] | None = None) -> list[str]:
    """n strings mixing words, unicode, code, numbers, whitespace runs and (optionally) special tokens."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(_WORDS))
            elif r < 0.6:
                parts.append(rng.choice(_CODE))
            elif r < 0.8:
                parts.append(rng.choice(_ODD))
            elif r < 0.9:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
            elif specials:
                parts.append(rng.choice(specials))
            else:
                parts.append(rng.choice(_WORDS).upper())
            parts.append(rng.choice([" ", " ", "", "  ", "\n", ", ", ". "]))
        text = "".join(parts)
        out.append(text[: rng.randint(1, len(text))] if rng.random() < 0.2 else text)
    return out


def train_corpus() -> list[str]:
    return [s for s in varied_strings(3000, seed=7) if s.strip()] + _CODE + _WORDS


def split_byte_level_bpe(regex: str, ignore_merges: bool) -> Any:
    """An untrained byte-level BPE whose pre-tokenizer is a regex split, as Llama 3 / Qwen / Phi-4 files spell it."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    return tok


GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (regex, ignore_merges, --vocab-pre override): Phi-4-mini ("gpt-4o"), OLMo 2 (the cl100k split under
# llama.cpp's "dbrx" name, given by fingerprint for the real file), Mistral Small 3.x ("tekken").
PRE_FAMILIES = {
    "gpt-4o": (GPT4O_REGEX, False, None),
    "dbrx": (LLAMA3_REGEX, False, "dbrx"),
    "tekken": (TEKKEN_REGEX, True, None),
}
MULTILINGUAL = [
    "HelloWorld iPhone XMLHttpRequest camelCaseName ALLCAPS's DON'T He'S we'VE", "path/to/file\n/usr/bin\r\n",
    "12345678901 3.14159 1,000,000 ٣٤٥ १२३", "नमस्ते दुनिया हिन्दी", "สวัสดีครับ", "Việt Nam tiếng Việt",
    "中文字符和标点。你好，世界！", "日本語のテキスト、カタカナ", "한국어 텍스트입니다", "العربية النص", "עברית",
    "emoji 🙂👨‍👩‍👧🚀🚀 flags 🇫🇷🇯🇵", "tabs\t\tand   spaces    \n\n\n  end  ", "e\u0301 n\u0303 combining",
    "Ωmega θέμα русский ТЕКСТ Straße ÜBER", "x=1e-5;y=0x1F;z=1_000_000 // comment\n",
]  # fmt: skip


def build_pre_family(name: str, folder: Path) -> Any:
    from tokenizers import pre_tokenizers, trainers

    regex, ignore_merges, _ = PRE_FAMILIES[name]
    tok = split_byte_level_bpe(regex, ignore_merges)
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(train_corpus() + MULTILINGUAL * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok
