"""The converter (convert/kvcmas_convert): Hugging Face checkpoints -> GGUF, checked against independent references.

* Logits: tiny fixed-seed random checkpoints saved by transformers (Llama, Mistral, Qwen2; one file and sharded;
  F32 and BF16) are converted to every outtype, loaded in kvcmas, and compared with transformers in float32.
* Tokenizers: real tokenizers trained here (byte-level BPE with three pre-tokenizers, saved as
  PreTrainedTokenizerFast with a chat template; a SentencePiece BPE model) are exported to GGUF and the kvcmas
  tokenizer built from that metadata must equal the Hugging Face tokenizer (or sentencepiece) on 2,000 varied
  strings each.
* ``kvcmas.*`` settings: written with defaults / flag overrides, read back through the engine's GGUF reader, updated
  in place by ``gguf set`` with the tensor data untouched.
* Errors: each bad input gives a ConvertError naming the file or tensor, and leaves no output (nor temporary) file.
* Constants: the Python names, the C++ header cpp/engine/gguf-names.h and the names cpp/engine/model.cpp reads agree.
* llama.cpp (llama-cpp-python, when importable): loads converted files; its logits agree with kvcmas.
"""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("kvcmas_convert") is None:
    sys.path.insert(0, str(REPO / "convert"))

import kvcmas_convert as kc  # noqa: E402
from kvcmas_convert import constants as C  # noqa: E402
from kvcmas_convert.cli import main as convert_main  # noqa: E402
from kvcmas_convert.vocab import _pre_name, export_vocab  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
kvcmas_cpp = pytest.importorskip("kvcmas_cpp")
from helpers.tokenizer_corpus import (  # noqa: E402
    GPT4O_REGEX,
    LLAMA3_REGEX,
    MULTILINGUAL,
    PRE_FAMILIES,
    QWEN2_REGEX,
    TEKKEN_REGEX,
    build_pre_family,
    split_byte_level_bpe,
    train_corpus,
    varied_strings,
)
from kvcmas_cpp._native import core  # noqa: E402
from kvcmas_cpp.tokenizer import Tokenizer  # noqa: E402

N_STRINGS = 2000
HAVE_SENTENCEPIECE = importlib.util.find_spec("sentencepiece") is not None
SPECIALS = {
    "gpt2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "spm": ["<unk>", "<s>", "</s>"],
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _build_bpe(kind: str, folder: Path) -> None:
    """Trains a byte-level BPE (vocab 400) and saves it as a PreTrainedTokenizerFast with a chat template."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = SPECIALS[kind]
    if kind == "gpt2":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = split_byte_level_bpe(LLAMA3_REGEX if kind == "llama3" else QWEN2_REGEX, kind == "llama3")
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(train_corpus(), trainer)
    if kind == "llama3":
        bos = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bos, eos = (specials[0], specials[1]) if kind == "llama3" else (None, specials[0])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(folder)


def _build_spm(folder: Path) -> None:
    """Trains a SentencePiece BPE model with byte fallback (Llama's settings) and writes tokenizer.model."""
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [s.replace("\n", " ") for s in train_corpus()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=600, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=0.9995, minloglevel=2,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "LlamaTokenizer",
    }))  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for kind in ("gpt2", "llama3", "qwen2"):
        _build_bpe(kind, root / kind)
        dirs[kind] = root / kind
    if HAVE_SENTENCEPIECE:
        _build_spm(root / "spm")
        dirs["spm"] = root / "spm"
    else:  # the Mistral checkpoints then carry a byte-level BPE; test_sentencepiece_round_trip skips
        dirs["spm"] = dirs["gpt2"]
    return dirs


# (architecture, source dtype, sharded, tokenizer, extra config)
CHECKPOINTS: dict[str, tuple[str, str, bool, str, dict[str, Any]]] = {
    "llama-f32": ("llama", "float32", False, "llama3", {}),
    "llama-bf16-sharded-rope3": ("llama", "bfloat16", True, "gpt2", {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral-bf16": ("mistral", "bfloat16", False, "spm", {"head_dim": 32}),
    "mistral-f32-sharded": ("mistral", "float32", True, "spm", {}),
    "qwen2-f32-tied": ("qwen2", "float32", False, "qwen2", {"tie_word_embeddings": True}),
    "qwen2-bf16-sharded": ("qwen2", "bfloat16", True, "qwen2", {}),
}  # fmt: skip
_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
N_VOCAB = 640  # > every tokenizer: the converter pads the vocabulary to the embedding rows


def save_checkpoint(folder: Path, key: str, tokenizer_dirs: dict[str, Path]) -> Path:
    arch, dtype, sharded, tok, extra = CHECKPOINTS[key]
    torch.manual_seed(1234)
    config = getattr(transformers, _CONFIGS[arch])(
        vocab_size=N_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5, **extra,
    )  # fmt: skip
    model = getattr(transformers, _MODELS[arch])(config).to(getattr(torch, dtype))
    with torch.no_grad():  # norms are initialised to 1: make them random so a wrong mapping shows
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="40KB" if sharded else "50GB")
    for f in tokenizer_dirs[tok].iterdir():
        shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer_dirs: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {key: save_checkpoint(root / key, key, tokenizer_dirs) for key in CHECKPOINTS}


def reference_logits(folder: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def no_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".gguf", ".tmp"))


IDS = [1, 17, 300, 5, 99, 250, 8, 8, 42, 613, 3, 120]
# max |kvcmas - transformers| / max |transformers| per outtype (bf16 from a BF16 checkpoint is lossless). Measured:
# f16 9e-4, bf16 8.5e-3, q8_0 4e-2, q4_0 0.28 (the engine also quantises activations for the block types; the
# weights themselves are checked more tightly in test_weights_round_trip).
TOLERANCE = {"f32": 1e-4, "f16": 5e-3, "bf16": 3e-2, "q8_0": 0.1, "q4_0": 0.5}
# max |dequantised GGUF weight - checkpoint weight| / max |checkpoint weight|, per tensor
WEIGHT_TOLERANCE = {"f32": 0.0, "f16": 1e-3, "bf16": 4e-3, "q8_0": 8e-3, "q4_0": 0.15}
CASES = [
    ("llama-f32", "f32"), ("llama-f32", "f16"), ("llama-f32", "bf16"), ("llama-f32", "q8_0"), ("llama-f32", "q4_0"),
    ("llama-bf16-sharded-rope3", "f32"), ("mistral-bf16", "bf16"), ("mistral-f32-sharded", "q8_0"),
    ("qwen2-f32-tied", "f16"), ("qwen2-f32-tied", "q4_0"), ("qwen2-bf16-sharded", "f32"),
]  # fmt: skip


# ------------------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize(("key", "outtype"), CASES)
def test_logits_match_transformers(checkpoints: dict[str, Path], tmp_path: Path, key: str, outtype: str) -> None:
    folder = checkpoints[key]
    out = tmp_path / f"{key}.{outtype}.gguf"
    kc.convert(folder, out, outtype=outtype, progress=False)
    assert no_leftovers(tmp_path) == [out.name]
    ref = reference_logits(folder, IDS)
    got = kvcmas_cpp.Model(out, n_threads=2).logits(IDS)
    assert got.shape == ref.shape == (len(IDS), N_VOCAB)
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    lossless = outtype == "f32" or (outtype == "bf16" and CHECKPOINTS[key][1] == "bfloat16")
    assert rel <= (TOLERANCE["f32"] if lossless else TOLERANCE[outtype]), f"{key} {outtype}: relative error {rel}"
    if outtype in ("f32", "f16"):
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_pytorch_bin_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A pytorch_model.bin checkpoint (read with torch) converts to the same GGUF as its safetensors twin."""
    folder = _copy(checkpoints["qwen2-f32-tied"], tmp_path / "bin")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    kc.convert(folder, tmp_path / "bin.gguf", outtype="f16", name="m", progress=False)
    kc.convert(checkpoints["qwen2-f32-tied"], tmp_path / "st.gguf", outtype="f16", name="m", progress=False)
    assert (tmp_path / "bin.gguf").read_bytes() == (tmp_path / "st.gguf").read_bytes()


@pytest.mark.parametrize("outtype", list(WEIGHT_TOLERANCE))
def test_weights_round_trip(checkpoints: dict[str, Path], tmp_path: Path, outtype: str) -> None:
    """Each GGUF tensor, dequantised by gguf-py and un-permuted, equals its checkpoint tensor within its type's
    quantisation error."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    folder = checkpoints["qwen2-f32-tied"] if outtype == "q4_0" else checkpoints["llama-f32"]
    original = load_file(folder / "model.safetensors")
    n_head = {"attn_q": 4, "attn_k": 2}
    permute = (folder / "config.json").read_text().find("LlamaForCausalLM") >= 0
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight",
    }
    blk = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
           "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # fmt: skip
    out = tmp_path / "w.gguf"
    kc.convert(folder, out, outtype=outtype, progress=False)
    tensors = GGUFReader(out).tensors
    assert len(tensors) == len(original) - (
        "lm_head.weight" in original and "output.weight" not in {t.name for t in tensors}
    )
    for t in tensors:
        data = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name in names:
            ref = original[names[t.name]]
        else:
            _, il, part, kind = t.name.split(".")
            ref = original[f"model.layers.{il}.{blk[part]}.{kind}"]
            if permute and part in n_head:  # undo the rotate-half -> pairwise reordering
                data = data.reshape(n_head[part], -1, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        assert data.shape == ref.shape, t.name
        err = float(np.abs(data - ref).max() / np.abs(ref).max())
        tol = 0.0 if t.tensor_type.name == "F32" else WEIGHT_TOLERANCE[outtype]
        if t.tensor_type.name == "Q8_0":
            tol = max(tol, WEIGHT_TOLERANCE["q8_0"])
        assert err <= tol, f"{outtype} {t.name} ({t.tensor_type.name}): relative error {err}"


def test_written_layout(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Tensor types per outtype, tied output omitted, sharded input read completely, rope_freqs for llama3 rope."""
    from gguf import GGUFReader

    shards = list(checkpoints["qwen2-bf16-sharded"].glob("model-*.safetensors"))
    assert len(shards) > 2 and (checkpoints["qwen2-bf16-sharded"] / "model.safetensors.index.json").is_file()
    out = tmp_path / "q.gguf"
    kc.convert(checkpoints["qwen2-f32-tied"], out, outtype="q4_0", progress=False)
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert "output.weight" not in types and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.1.ffn_down.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    out2 = tmp_path / "l.gguf"
    kc.convert(checkpoints["llama-bf16-sharded-rope3"], out2, outtype="bf16", progress=False)
    reader = GGUFReader(out2)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "BF16" and types["rope_freqs.weight"] == "F32"
    factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    # transformers' llama3 frequencies are the default ones divided by these factors
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.AutoConfig.from_pretrained(checkpoints["llama-bf16-sharded-rope3"])
    scaled = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double().numpy()
    default = 1.0 / 50000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(factors, default / scaled, rtol=1e-5)
    assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[-1] == 8.0  # kept, smoothed, scaled


def test_streaming_memory(tmp_path: Path) -> None:
    """Peak Python/numpy memory while converting stays near the largest tensor, far below the model size."""
    import tracemalloc

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    largest = 512 * 128 * 4
    total = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))
    assert total > 40 * largest
    tracemalloc.start()
    try:
        kc.convert(tmp_path / "ckpt", tmp_path / "m.gguf", outtype="q8_0", vocab=False, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * largest + (1 << 20), f"peak {peak} bytes for a largest tensor of {largest} (model {total})"


# --------------------------------------------------------------------------------------------------- tokenizers
@pytest.mark.parametrize("kind", ["gpt2", "llama3", "qwen2"])
def test_bpe_tokenizer_round_trip(checkpoints: dict[str, Path], tmp_path: Path, kind: str) -> None:
    key = {"gpt2": "llama-bf16-sharded-rope3", "llama3": "llama-f32", "qwen2": "qwen2-f32-tied"}[kind]
    out = tmp_path / "v.gguf"
    kc.convert(checkpoints[key], out, outtype="f16", progress=False)
    meta = core.GgufFile(str(out)).metadata()
    assert meta["tokenizer.ggml.pre"] == {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2"}[kind]
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    ours = Tokenizer.from_gguf_metadata(meta)
    hf = transformers.AutoTokenizer.from_pretrained(checkpoints[key])
    assert ours.add_bos == (kind == "llama3")
    strings = varied_strings(N_STRINGS, seed=11, specials=SPECIALS[kind])
    expected = hf(strings, add_special_tokens=True)["input_ids"]
    mismatches = [(s, e, ours.encode(s)) for s, e in zip(strings, expected, strict=True) if ours.encode(s) != e]
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"
    for ids in expected[:500]:
        assert ours.decode(ids) == hf.decode(ids)
    messages = [{"role": "user", "content": "hi there"}]
    model = kvcmas_cpp.Model(out, n_threads=1)
    assert model.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# The split of each family's tokenizer.json as Hugging Face spells it, and the name llama.cpp gives the files.
@pytest.mark.parametrize("name", sorted(PRE_FAMILIES))
def test_pre_tokenizer_families_match_hf_tokenizers(tmp_path: Path, name: str) -> None:
    """A byte-level BPE on each family's split, exported by the converter: the kvcmas tokenizer built from the
    exported metadata gives HF tokenizers' ids on multilingual text (digits, contractions, CJK, combining marks,
    emoji, whitespace runs, slashes before line breaks)."""
    hf = build_pre_family(name, tmp_path)
    override = PRE_FAMILIES[name][2]
    meta = export_vocab(tmp_path, hf.get_vocab_size(), {}, override).values
    assert meta[C.KEY_TOKENIZER_PRE] == name
    ours = Tokenizer.from_gguf_metadata(meta)
    assert ours.pre == name and ours.add_bos is False
    strings = MULTILINGUAL + varied_strings(N_STRINGS, seed=13)
    mismatches = []
    for s in strings:
        expected = hf.encode(s, add_special_tokens=False).ids
        got = ours.encode(s, add_special=False, parse_special=False)
        if got != expected:
            mismatches.append((s, expected, got))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"
    n_ids = sum(len(ours.encode(s, add_special=False)) for s in MULTILINGUAL)
    assert n_ids < 0.75 * sum(len(s.encode()) for s in MULTILINGUAL)  # merges ran
    for s in MULTILINGUAL:
        assert ours.decode(ours.encode(s, add_special=False)) == s
    # The texts tell the splits apart: the same vocabulary under another family's split gives other ids.
    other = Tokenizer.from_gguf_metadata({**meta, C.KEY_TOKENIZER_PRE: "qwen2" if name == "dbrx" else "llama-bpe"})
    assert any(other.encode(s, add_special=False) != ours.encode(s, add_special=False) for s in MULTILINGUAL)


def test_pre_tokenizer_names_the_converter_writes_are_supported() -> None:
    """Every name the converter can write (by fingerprint or by description) is one the kvcmas tokenizer splits;
    an unknown name is refused naming itself and the supported list."""
    from kvcmas_convert.vocab import _FINGERPRINT_NAMES, _REGEX_PRE_NAMES
    from kvcmas_cpp.tokenizer import SUPPORTED_PRE_TOKENIZERS, TokenizerError

    written = {"gpt-2", "starcoder", *_FINGERPRINT_NAMES.values(), *_REGEX_PRE_NAMES.values()}
    assert written <= set(SUPPORTED_PRE_TOKENIZERS), written - set(SUPPORTED_PRE_TOKENIZERS)
    assert {"gpt-4o", "dbrx", "qwen2", "llama-bpe", "smollm", "deepseek-r1-qwen", "tekken"} <= written
    for regex, name in ((GPT4O_REGEX, "gpt-4o"), (TEKKEN_REGEX, "tekken"), (LLAMA3_REGEX, "llama-bpe")):
        description = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}  # fmt: skip
        assert _pre_name(description, Path("tokenizer.json")) == name
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": []}  # fmt: skip
    with pytest.raises(TokenizerError, match=r"'kimi-k2'.*supported: .*gpt-4o"):
        Tokenizer.from_gguf_metadata(meta)


def test_real_vocabulary_matches_llama_cpp_converter(default_model_path: Path, tmp_path: Path) -> None:
    """SmolLM2's 49k vocabulary: GGUF (written by llama.cpp's converter) -> transformers -> save_pretrained -> our
    export gives back the same tokens, types, merges, special ids and chat template."""
    hf = transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    hf.save_pretrained(tmp_path)
    original = core.GgufFile(str(default_model_path)).metadata()
    exported = export_vocab(tmp_path, len(original[C.KEY_TOKENS]), {}).values
    for key in (C.KEY_TOKENIZER_MODEL, C.KEY_TOKENIZER_PRE, C.KEY_TOKENS, C.KEY_TOKEN_TYPE, C.KEY_MERGES,
                C.KEY_BOS_ID, C.KEY_EOS_ID, C.KEY_PAD_ID, C.KEY_ADD_BOS, C.KEY_CHAT_TEMPLATE):  # fmt: skip
        assert exported.get(key) == original.get(key), key
    # llama.cpp names SmolLM2's tokenizer by its fingerprint; its description alone would read as another
    assert original[C.KEY_TOKENIZER_PRE] == exported[C.KEY_TOKENIZER_PRE] == "smollm"
    pre = json.loads((tmp_path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert _pre_name(pre, tmp_path / "tokenizer.json") == "gpt-2"


def test_sentencepiece_round_trip(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    if not HAVE_SENTENCEPIECE:
        pytest.skip("the sentencepiece package (trainer and reference tokenizer) is not installed")
    import sentencepiece as spm

    folder = checkpoints["mistral-bf16"]
    out = tmp_path / "spm.gguf"
    kc.convert(folder, out, outtype="f16", progress=False)
    meta = core.GgufFile(str(out)).metadata()
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.unknown_token_id"] == 0
    ours = Tokenizer.from_gguf_metadata(meta)
    ref = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert [ours.token_text(i) for i in range(ref.get_piece_size())] == [
        ref.id_to_piece(i) for i in range(ref.get_piece_size())
    ]
    strings = varied_strings(N_STRINGS, seed=12)
    mismatches = []
    for s in strings:
        expected = [1, *ref.encode(s)]
        got = ours.encode(s, parse_special=False)
        if got != expected:
            mismatches.append((s, expected, got))
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]!r}"
    for s in strings[:300]:
        ids = ref.encode(s)
        assert ours.decode(ids) == ref.decode(ids)


# --------------------------------------------------------------------------------------------- kvcmas.* settings
def test_kvcmas_settings_defaults_and_types() -> None:
    settings = kc.kvcmas_settings({})
    assert settings["rank_k"] == settings["rank_v"] == 32 and settings["first_layer"] == 1
    assert settings["anchor_pool_size"] == 10 and settings["anchor_window"] == 5
    assert settings["gate_threshold"] == pytest.approx(0.3) and settings["chain"] is True
    assert kc.kvcmas_settings({"kvcmas.rank_k": 8, "kvcmas.chain": False, "kvcmas.future_key": "x"})["rank_k"] == 8
    for bad in ({"kvcmas.rank_k": -1}, {"kvcmas.rank_k": "8"}, {"kvcmas.chain": "yes"},
                {"kvcmas.gate_threshold": float("nan")}, {"kvcmas.gate_top_p": 2.0}):  # fmt: skip
        with pytest.raises(kc.ConvertError, match=next(iter(bad))):
            kc.kvcmas_settings(bad)


def test_kvcmas_keys_written_read_and_updated(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "k.gguf"
    rc = convert_main(
        [
            str(checkpoints["qwen2-f32-tied"]),
            "-o",
            str(out),
            "--outtype",
            "f32",
            "--no-progress",
            "--kvcmas-rank",
            "16",
            "--kvcmas-gate-threshold",
            "0.45",
            "--kvcmas-chain",
            "false",
        ]
    )
    assert rc == 0
    meta = core.GgufFile(str(out)).metadata()  # the engine's own GGUF reader
    settings = kc.kvcmas_settings(meta)
    assert settings["rank_k"] == settings["rank_v"] == 16 and settings["chain"] is False
    assert settings["gate_threshold"] == pytest.approx(0.45) and settings["anchor_pool_size"] == 10
    assert set(k for k in meta if k.startswith("kvcmas.")) == {s.key for s in C.KVCMAS_SETTINGS}
    logits_before = kvcmas_cpp.Model(out, n_threads=1).logits(IDS[:4])

    from gguf import GGUFReader

    before = {t.name: np.array(t.data) for t in GGUFReader(out).tensors}
    assert convert_main(["gguf", "set", str(out), "kvcmas.rank_k=8", "first_layer=2", "chain=true"]) == 0
    meta2 = core.GgufFile(str(out)).metadata()
    settings2 = kc.kvcmas_settings(meta2)
    assert (settings2["rank_k"], settings2["rank_v"], settings2["first_layer"], settings2["chain"]) == (8, 16, 2, True)
    assert {k: v for k, v in meta2.items() if not k.startswith("kvcmas.")} == {
        k: v for k, v in meta.items() if not k.startswith("kvcmas.")
    }
    after = {t.name: np.array(t.data) for t in GGUFReader(out).tensors}
    assert before.keys() == after.keys() and all(np.array_equal(before[n], after[n]) for n in before)
    np.testing.assert_array_equal(kvcmas_cpp.Model(out, n_threads=1).logits(IDS[:4]), logits_before)
    assert no_leftovers(tmp_path) == ["k.gguf"]

    # bad updates: an error, the file unchanged
    raw = out.read_bytes()
    for bad in (["rank_k=abc"], ["nope=1"], ["rank_k"], ["gate_top_p=3"]):
        assert convert_main(["gguf", "set", str(out), *bad]) == 1
        assert "error:" in capsys.readouterr().err
    assert out.read_bytes() == raw and no_leftovers(tmp_path) == ["k.gguf"]

    assert convert_main(["gguf", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "kvcmas.rank_k" in shown and "blk.1.ffn_down.weight" in shown and "tokenizer.ggml.tokens" in shown

    # a cut-off copy (header only, or data missing) and a file that is not GGUF: the error names what is wrong
    for size in (100, len(raw) - 1000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(raw[:size])
        assert convert_main(["gguf", "show", str(cut)]) == 1
        assert f"truncated or corrupt ({size} bytes" in capsys.readouterr().err
    (tmp_path / "text.gguf").write_text("hello world")
    assert convert_main(["gguf", "show", str(tmp_path / "text.gguf")]) == 1
    assert "not a GGUF file (it starts with b'hell'" in capsys.readouterr().err


def test_add_subcommands_on_another_cli(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """What kvcmas_cpp.cli does: register convert / gguf on its own parser and dispatch through ``func``."""
    import argparse

    from kvcmas_convert.cli import add_subcommands

    parser = argparse.ArgumentParser(prog="kvcmas")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "c.gguf"
    args = parser.parse_args(
        [
            "convert",
            str(checkpoints["llama-f32"]),
            "-o",
            str(out),
            "--outtype",
            "q4_0",
            "--no-progress",
            "--kvcmas-first-layer",
            "3",
        ]
    )
    assert args.func(args) == 0
    args = parser.parse_args(["gguf", "set", str(out), "anchor_window=7"])
    assert args.func(args) == 0
    settings = kc.kvcmas_settings(kvcmas_cpp.Model(out, n_threads=1).metadata)
    assert (settings["first_layer"], settings["anchor_window"]) == (3, 7)


def test_dry_run_and_module_entry_point(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "dry.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "kvcmas_convert", str(checkpoints["llama-f32"]), "-o", str(out), "--dry-run",
         "--outtype", "q8_0", "--kvcmas-rank-v", "4"],
        cwd=REPO / "convert", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "blk.1.attn_k.weight" in proc.stdout and "Q8_0" in proc.stdout and "kvcmas.rank_v = 4" in proc.stdout
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------- errors
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_safetensors(folder: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(path: Path, n_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:n_bytes])


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


ERROR_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "unknown architecture": (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
                             r"unsupported architecture GPT2LMHeadModel"),
    "missing tensor": (lambda d: _rewrite_safetensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       r"'model\.layers\.1\.mlp\.up_proj\.weight'.*missing"),
    "unexpected tensor": (lambda d: _rewrite_safetensors(
        d, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)})),
        r"model\.safetensors: unexpected tensor.*'model\.layers\.0\.extra\.weight'"),
    "shape mismatch": (lambda d: _edit_config(d, intermediate_size=128),
                       r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[96, 64\]"),
    "corrupt weights": (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"),
                        r"model\.safetensors: not a safetensors file"),
    "truncated weights": (lambda d: _truncate(d / "model.safetensors", 4000),
                          r"model\.safetensors: .*(exceeds|inconsistent)"),
    "missing config": (lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
    "unreadable config": (lambda d: (d / "config.json").write_text("{"), r"config\.json: unreadable"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"no weights found"),
    "unknown pre-tokenizer": (
        lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace(
            '"use_regex":true', '"use_regex":false').replace('"use_regex": true', '"use_regex": false')),
        r"tokenizer\.json: pre-tokenizer .* is not recognised"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_leave_no_output(checkpoints: dict[str, Path], tmp_path: Path, case: str) -> None:
    prepare, message = ERROR_CASES[case]
    source = "llama-bf16-sharded-rope3" if case == "unknown pre-tokenizer" else "qwen2-f32-tied"
    folder = _copy(checkpoints[source], tmp_path / "ckpt")
    prepare(folder)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(kc.ConvertError, match=message):
        kc.convert(folder, out_dir / "model.gguf", progress=False)
    assert no_leftovers(out_dir) == []


def test_sharded_index_errors(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = _copy(checkpoints["mistral-f32-sharded"], tmp_path / "ckpt")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(kc.ConvertError, match=re.escape(shard.name) + ".*missing"):
        kc.convert(folder, tmp_path / "m.gguf", progress=False)
    assert no_leftovers(tmp_path) == []


def test_failure_while_writing_keeps_old_output(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the header is written removes the temporary file and leaves an existing output as it was."""
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous")
    calls = {"n": 0}
    original = kc.convert.__globals__["CheckpointTensors"].load

    def failing_load(self: Any, name: str) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 6:
            raise kc.ConvertError(f"simulated read failure of {name}")
        return original(self, name)

    monkeypatch.setattr(kc.convert.__globals__["CheckpointTensors"], "load", failing_load)
    with pytest.raises(kc.ConvertError, match="simulated read failure"):
        kc.convert(checkpoints["llama-f32"], out, progress=False, overwrite=True)
    assert out.read_bytes() == b"previous" and no_leftovers(tmp_path) == ["m.gguf"]


def test_bad_arguments(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(kc.ConvertError, match="outtype"):
        kc.convert(checkpoints["llama-f32"], tmp_path / "x.gguf", outtype="q5_k")
    with pytest.raises(kc.ConvertError, match="kvcmas.rank_k"):
        kc.convert(checkpoints["llama-f32"], tmp_path / "x.gguf", kvcmas={"rank_k": -3})
    with pytest.raises(kc.ConvertError, match="does not exist"):
        kc.convert(checkpoints["llama-f32"], tmp_path / "nodir" / "x.gguf")
    with pytest.raises(kc.ConvertError, match="no such file"):
        kc.set_values(tmp_path / "absent.gguf", {"kvcmas.rank_k": 1})
    assert no_leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------ output safety
def _digests(folder: Path) -> dict[str, bytes]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).digest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_never_replaces_its_own_inputs(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """An output that is one of the files being read (any shard, the index, config or tokenizer; through a symlinked
    file or folder, or a hard link) is refused, with --force too, and every input stays byte for byte."""
    import os

    folder = _copy(checkpoints["mistral-f32-sharded"], tmp_path / "ckpt")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    before = _digests(folder)
    (tmp_path / "link.gguf").symlink_to(shards[-1])
    (tmp_path / "dir-link").symlink_to(folder, target_is_directory=True)
    os.link(shards[1], tmp_path / "hard.gguf")
    targets = [
        *shards, folder / "model.safetensors.index.json", folder / "config.json", folder / "tokenizer.model",
        tmp_path / "link.gguf", tmp_path / "dir-link" / shards[0].name, tmp_path / "hard.gguf",
        folder / "config.json" / "inside.gguf",
    ]  # fmt: skip
    for out in targets:
        with pytest.raises(kc.ConvertError, match=r"(is|lies inside) the input file .*write the output elsewhere"):
            kc.convert(folder, out, outtype="f32", progress=False, overwrite=True)
        assert convert_main([str(folder), "-o", str(out), "--force", "--no-progress"]) == 1
    assert _digests(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "dir-link", "hard.gguf", "link.gguf"]
    # the folder itself is a fine place for the output
    kc.convert(folder, folder / "model.gguf", outtype="f32", progress=False)
    assert {k: v for k, v in _digests(folder).items() if k != "model.gguf"} == before


def test_existing_output_needs_force(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous")
    with pytest.raises(kc.ConvertError, match=r"m\.gguf: exists \(pass --force to replace it\)"):
        kc.convert(checkpoints["qwen2-f32-tied"], out, progress=False)
    assert convert_main([str(checkpoints["qwen2-f32-tied"]), "-o", str(out), "--no-progress"]) == 1
    assert "pass --force" in capsys.readouterr().err and out.read_bytes() == b"previous"
    assert convert_main([str(checkpoints["qwen2-f32-tied"]), "-o", str(out), "--no-progress", "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF" and no_leftovers(tmp_path) == ["m.gguf"]


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of 75 MB (f32): converting it to q4_0 takes seconds, time to signal it mid-write."""
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("large")
    E, F, L, V = 256, 768, 20, 2048
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": E, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": 4, "max_position_embeddings": 256,
    }))  # fmt: skip
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((V, E), np.float32),
        "lm_head.weight": rng.standard_normal((V, E), np.float32),
        "model.norm.weight": np.ones(E, np.float32),
    }
    shapes = {
        "self_attn.q_proj": (E, E),
        "self_attn.k_proj": (E, E),
        "self_attn.v_proj": (E, E),
        "self_attn.o_proj": (E, E),
        "mlp.gate_proj": (F, E),
        "mlp.up_proj": (F, E),
        "mlp.down_proj": (E, F),
    }
    for il in range(L):
        for name, shape in shapes.items():
            tensors[f"model.layers.{il}.{name}.weight"] = rng.standard_normal(shape, np.float32)
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{il}.{name}.weight"] = np.ones(E, np.float32)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _default_signals() -> None:
    """In the child: the default dispositions (a background shell starts its jobs with SIGINT ignored)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_mid_write_leaves_no_temporary(large_checkpoint: Path, tmp_path: Path, signame: str) -> None:
    """A real conversion signalled while its temporary file is being filled: the process ends by that signal, the
    temporary file is gone and the previous output is untouched."""
    import os
    import signal
    import time

    out = tmp_path / "m.gguf"
    out.write_bytes(b"previous")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "convert"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcmas_convert", str(large_checkpoint), "-o", str(out), "--outtype", "q4_0",
         "--no-vocab", "--no-progress", "--force"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_default_signals,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        tmp = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
            try:
                if found and found[0].stat().st_size > (2 << 20):  # header written, tensors being written
                    tmp = found[0]
                    break
            except FileNotFoundError:  # renamed into place meanwhile: the assertion below reports it
                break
            time.sleep(0.005)
        assert tmp is not None and proc.poll() is None, "the conversion ended before it could be signalled"
        proc.send_signal(getattr(signal, signame))
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -getattr(signal, signame), (proc.returncode, err[-2000:])
    assert not tmp.exists() and out.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_metadata_keys_as_llama_cpp_writes_them(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """general.quantization_version on every output, and the head size whenever config.json gives head_dim, under
    gguf-py's key names."""
    import gguf

    for key, outtype in (("llama-f32", "f32"), ("mistral-bf16", "bf16"), ("qwen2-f32-tied", "f16"),
                         ("mistral-f32-sharded", "q8_0"), ("qwen2-f32-tied", "q4_0")):  # fmt: skip
        config = json.loads((checkpoints[key] / "config.json").read_text())
        out = tmp_path / f"{key}.{outtype}.gguf"
        kc.convert(checkpoints[key], out, outtype=outtype, progress=False)
        meta = kc.read_metadata(out)
        arch = meta[gguf.Keys.General.ARCHITECTURE]
        assert meta[gguf.Keys.General.QUANTIZATION_VERSION] == gguf.GGML_QUANT_VERSION, (key, outtype)
        assert meta[gguf.Keys.General.FILE_TYPE] == int(kc.OUTTYPES[outtype][1])
        k_len, v_len = (gguf.Keys.Attention.KEY_LENGTH.format(arch=arch),
                        gguf.Keys.Attention.VALUE_LENGTH.format(arch=arch))  # fmt: skip
        if config.get("head_dim") is not None:
            assert meta[k_len] == meta[v_len] == config["head_dim"], key
        else:
            assert k_len not in meta and v_len not in meta, key
    # a head_dim equal to hidden / heads is still written (the Llama checkpoints carry one)
    llama = json.loads((checkpoints["llama-f32"] / "config.json").read_text())
    assert llama["head_dim"] == llama["hidden_size"] // llama["num_attention_heads"]
    assert kc.read_metadata(tmp_path / "llama-f32.f32.gguf")["llama.attention.key_length"] == llama["head_dim"]


# ---------------------------------------------------------------------------------------------------- constants
def _camel(name: str) -> str:
    return "k" + "".join(p.capitalize() for p in name.lower().split("_"))


def test_constants_agree_with_cpp() -> None:
    header = (REPO / "cpp" / "engine" / "gguf-names.h").read_text()
    cpp = dict(re.findall(r'inline constexpr char (\w+)\[\] = "([^"]*)";', header))
    py = {
        _camel(n): getattr(C, n)
        for n in dir(C)
        if re.fullmatch(
            r"(KEY|ARCH_KEY|TENSOR|BLK)_\w+|BLOCK_PREFIX|ARCH_(?!KEY)\w+|KVCMAS_PREFIX"
            r"|TYPE_ADAPTER|ADAPTER_TYPE_LORA|LORA_SUFFIX_[AB]",  # adapter files (llama.cpp's LoRA GGUF)
            n,
        )
        and isinstance(getattr(C, n), str)
    }
    py.update({_camel("KVCMAS_" + s.key.split(".", 1)[1]): s.key for s in C.KVCMAS_SETTINGS})
    assert cpp == py

    # The engine and the architecture files spell no name themselves: every one comes from the header.
    engine = [REPO / "cpp" / "engine" / "model.cpp", *sorted((REPO / "cpp" / "engine" / "arch").glob("*.cpp"))]
    for path in engine:
        text = path.read_text()
        assert not re.findall(r'"[a-z_]+\.(?:weight|bias)"', text), f"{path.name} spells a tensor name"
        assert not re.findall(r'\ba \+ "([^"]+)"', text), f"{path.name} spells a metadata key"

    # One architecture list: each registry line names an arch file's Architecture, each file registers a header
    # name, and those names are the converter's ENGINE_ARCHITECTURES, in registry order.
    arch_dir = REPO / "cpp" / "engine" / "arch"
    registry = (arch_dir / "registry.cpp").read_text()
    listed = re.findall(r"&(kArch\w+)", registry.split("kArchitectures[]", 1)[1])
    entry = re.compile(r"extern const Architecture (kArch\w+) = \{ gguf_names::(kArch\w+),")
    registered = {var: cpp[name] for path in arch_dir.glob("*.cpp") for var, name in entry.findall(path.read_text())}
    assert [registered[v] for v in listed] == list(C.ENGINE_ARCHITECTURES)
    assert set(C.ENGINE_ARCHITECTURES) <= {v for k, v in cpp.items() if re.fullmatch(r"kArch[A-Z]\w*", k)}
    assert kvcmas_cpp.supported_architectures() == list(C.ENGINE_ARCHITECTURES)


def test_constants_are_gguf_py_names() -> None:
    """The standard names are llama.cpp's, as gguf-py spells them."""
    import gguf

    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    assert names[T.TOKEN_EMBD] + ".weight" == C.TENSOR_TOKEN_EMBD
    assert names[T.OUTPUT] + ".weight" == C.TENSOR_OUTPUT and names[T.ROPE_FREQS] + ".weight" == C.TENSOR_ROPE_FREQS
    for suffix, tensor in ((C.BLK_ATTN_Q, T.ATTN_Q), (C.BLK_FFN_DOWN, T.FFN_DOWN), (C.BLK_ATTN_NORM, T.ATTN_NORM)):
        assert C.block_tensor(3, suffix) == names[tensor].format(bid=3) + ".weight"
    K = gguf.Keys
    assert C.KEY_TOKENS == K.Tokenizer.LIST and C.KEY_MERGES == K.Tokenizer.MERGES
    assert C.KEY_CHAT_TEMPLATE == K.Tokenizer.CHAT_TEMPLATE and C.KEY_ADD_BOS == K.Tokenizer.ADD_BOS
    assert K.Attention.LAYERNORM_RMS_EPS.format(arch="llama") == "llama." + C.ARCH_KEY_RMS_EPS
    assert K.Rope.FREQ_BASE.format(arch="llama") == "llama." + C.ARCH_KEY_ROPE_FREQ_BASE


# ---------------------------------------------------------------------------------------------------- llama.cpp
def test_llama_cpp_loads_converted_files(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e .[bench]): cannot check llama.cpp loading")
    import llama_cpp

    for key in ("llama-f32", "mistral-bf16", "qwen2-f32-tied"):
        out = tmp_path / f"{key}.gguf"
        kc.convert(checkpoints[key], out, outtype="f32", progress=False)
        llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
        llm.eval(IDS)
        theirs = np.array(llm.scores[: len(IDS)])
        ours = kvcmas_cpp.Model(out, n_threads=2).logits(IDS)
        rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
        assert rel < 2e-3, f"{key}: llama.cpp vs kvcmas relative error {rel}"
        text = "Hello wörld,  it's 2024!\n\tcode: x = 1"
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == kvcmas_cpp.Model(out).tokenize(text)
        llm.close()
