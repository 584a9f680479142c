"""Model files that parse as GGUF but do not describe a model kvcmas can run: each is a clear error, never a crash.
And the weight types of the smaller llama.cpp files, which run."""

from __future__ import annotations

import functools
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


def _stored_as(qtype: gguf.GGMLQuantizationType, blocks: np.ndarray | None = None) -> Callable[[dict, dict], None]:
    """Every layer's ffn_down.weight [E, 256] stored as `blocks` of `qtype` (default: all zero); the feed-forward
    width becomes one 256-element block, so K-quant rows tile it."""

    def edit(keys: dict, tensors: dict) -> None:
        width, rng = 256, np.random.default_rng(1)
        keys["llama.feed_forward_length"] = width
        for il in range(L):
            for part, shape in (("ffn_gate", (width, E)), ("ffn_up", (width, E))):
                tensors[f"blk.{il}.{part}.weight"] = rng.standard_normal(shape).astype(np.float32) * 0.1
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((E, width // block_elems * block_bytes), np.uint8) if blocks is None else blocks[il]
            tensors[f"blk.{il}.ffn_down.weight"] = (raw, qtype)

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
        (_set("llama.rope.scaling.type", "dynamic"), "rope scaling 'dynamic' is not supported"),
        (_set("llama.rope.scaling.type", "yarn"), "metadata key 'llama.rope.scaling.factor' is missing"),
        (lambda k, t: k.pop("llama.embedding_length"), "llama.embedding_length"),
        (_set("llama.embedding_length", "wide"), "llama.embedding_length"),
        (_set("llama.attention.sliding_window", 0), "llama.attention.sliding_window = 0 out of range"),
        (_sliding([True, False, True]), "sliding_window_pattern has 3 entries for 2 layers"),
        (_sliding(7), "sliding_window_pattern = 7 is neither a bool per layer nor a layer period"),
        (
            _stored_as(gguf.GGMLQuantizationType.IQ2_XXS),
            "tensor 'blk.0.ffn_down.weight' has type iq2_xxs, which kvcmas does not run (its weight types: f32, f16, "
            "q4_0, q4_1, q5_0, q5_1, q8_0, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs, bf16, mxfp4); a Q4_K_M, "
            "Q5_K_M, "
            "Q6_K or Q8_0 file",
        ),
        (_stored_as(gguf.GGMLQuantizationType.TQ1_0), "'blk.0.ffn_down.weight' has type tq1_0, which kvcmas does"),
        (_stored_as(gguf.GGMLQuantizationType.TQ2_0), "'blk.0.ffn_down.weight' has type tq2_0, which kvcmas does"),
    ],
)
def test_unusable_model_files_raise(tmp_path: Path, edit: Callable[[dict, dict], None], message: str) -> None:
    path = _write(tmp_path / "bad.gguf", edit)
    with pytest.raises(kc.KvcmasError) as info:
        kc.Model(path, n_threads=1)
    assert message in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_low_bit_weight_types_run_as_their_dequantization(tmp_path: Path, qtype: str) -> None:
    """The types of Q2_K, Q3_K_M and IQ4_XS files (IQ4_NL stands in for rows that are not whole 256-blocks there):
    a model whose ffn_down weights are random blocks of the type computes the logits of the same model with those
    weights stored as f32 (gguf-py's dequantization), in prefill and in decode steps."""
    q = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(int(q))
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q]
    blocks = rng.integers(0, 256, size=(L, E, 256 // block_elems, block_bytes), dtype=np.uint8)
    # the f16 scale (and Q2_K's min) of every block: small and finite
    halves = {"Q2_K": [slice(-4, -2), slice(-2, None)], "Q3_K": [slice(-2, None)]}.get(qtype, [slice(0, 2)])
    for at in halves:
        values = rng.uniform(-0.004, 0.004, blocks.shape[:3]).astype(np.float16)
        blocks[..., at] = values.view(np.uint8).reshape(*blocks.shape[:3], 2)
    blocks = blocks.reshape(L, E, -1)
    dense = [gguf.quants.dequantize(blocks[il], q).reshape(E, 256).astype(np.float32) for il in range(L)]

    def as_f32(keys: dict, tensors: dict) -> None:
        _stored_as(q, blocks)(keys, tensors)
        for il in range(L):
            tensors[f"blk.{il}.ffn_down.weight"] = dense[il]

    path = _write(tmp_path / "low.gguf", _stored_as(q, blocks))
    low, low_q8 = kc.Model(path, n_threads=1, activations="f32"), kc.Model(path, n_threads=1)
    ref = kc.Model(_write(tmp_path / "f32.gguf", as_f32), n_threads=1)
    ids = list(range(1, 40))
    want = ref.logits(ids)
    std = float(np.std(want))
    without = kc.Model(_write(tmp_path / "zero.gguf", _stored_as(q)), n_threads=1).logits(ids)  # ffn_down all zero
    assert float(np.abs(want - without).max()) > 0.05 * std  # these weights move the logits far past the tolerance
    np.testing.assert_allclose(low.logits(ids), want, rtol=0, atol=1e-4 * std)

    def decode_steps(model: kc.Model) -> np.ndarray:  # one token at a time after a prompt
        with model.new_sequence() as seq:
            seq.append(ids[:20], logits="none")
            return np.stack([seq.append([t]) for t in ids[20:]])

    for model in (low, ref):
        np.testing.assert_allclose(decode_steps(model), want[20:], rtol=0, atol=1e-4 * std)
    steps = decode_steps(low_q8)  # 8-bit activations (every low-bit type has such kernels): close, not exact
    assert float(np.sqrt(np.mean((steps - want[20:]) ** 2))) < 2e-3 * std
    assert np.array_equal(steps.argmax(-1), want[20:].argmax(-1))


def test_non_model_files_raise(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model")
    with pytest.raises(kc.KvcmasError, match="notes.gguf"):
        kc.Model(text)
    with pytest.raises(kc.KvcmasError, match="missing.gguf"):
        kc.Model(tmp_path / "missing.gguf")


def _vocabulary(chat_template: str, tokenizer_model: str = "llama") -> Callable[[dict, dict], None]:
    """A SentencePiece-style vocabulary (<unk>, <s>, </s>, byte tokens) and this chat template."""

    def edit(keys: dict, tensors: dict) -> None:
        keys["tokenizer.ggml.model"] = tokenizer_model
        keys["tokenizer.ggml.tokens"] = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(V - 3)]
        keys["tokenizer.ggml.scores"] = [0.0] * V
        keys["tokenizer.ggml.token_type"] = [2, 3, 3] + [6] * (V - 3)
        keys["tokenizer.ggml.bos_token_id"] = 1
        keys["tokenizer.ggml.eos_token_id"] = 2
        keys["tokenizer.chat_template"] = chat_template

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (None, "GGUF metadata has no 'tokenizer.ggml.model' string"),
        (_vocabulary("", tokenizer_model="t5"), "unsupported 'tokenizer.ggml.model' = 't5'"),
        (_vocabulary("{% for m in messages %}{{ m['content'] }{% endfor %}"), "chat template syntax error at line 1"),
        (_vocabulary("{{ raise_exception('no such role') }}"), "chat template raised an error: no such role"),
    ],
)
def test_bad_vocabularies_and_chat_templates_are_kvcmas_errors_naming_the_file(
    tmp_path: Path, edit: Callable[[dict, dict], None] | None, message: str
) -> None:
    """They were TokenizerError / ChatTemplateError, plain ValueErrors that `except kc.KvcmasError` missed, and did
    not say which file. They name it by its file name, not its path (a server shows them to clients)."""
    path = _write(tmp_path / "bad.gguf", edit)
    model = kc.Model(path, n_threads=1)
    with pytest.raises(kc.KvcmasError) as info:
        model.chat([{"role": "user", "content": "hi"}], max_tokens=1)
    assert str(info.value).startswith(f"{Path(path).name}: {message}"), str(info.value)


def test_bad_chat_messages_are_kvcmas_errors_naming_the_message(tmp_path: Path) -> None:
    """Bad shapes were a ChatTemplateError that `except kc.KvcmasError` missed, or (text, None, tool_calls that are
    not calls) an AttributeError / TypeError from the tool rendering."""
    model = kc.Model(_write(tmp_path / "ok.gguf", _vocabulary("")), n_threads=1)
    for messages, message in (
        ([{"role": "user", "content": 5}], "messages[0]['content'] must be a string or a list of text parts, got int"),
        ([{"content": "hi"}], "messages[0]['role'] must be a non-empty string"),
        ("hi", "messages must be a list of dicts, got str"),
        (None, "messages must be a list of dicts, got NoneType"),
        ([5], "messages[0] must be a dict with 'role' and 'content', got int"),
    ):
        for render in (functools.partial(model.chat, max_tokens=1), model.apply_chat_template):
            with pytest.raises(kc.KvcmasError) as info:
                render(messages)
            assert str(info.value).startswith(message), str(info.value)  # the messages' fault, not the file's
    with pytest.raises(kc.KvcmasError, match=r"^messages\[0\]\['tool_calls'\] must be a list of \{'function'"):
        model.chat([{"role": "assistant", "content": None, "tool_calls": [5]}], max_tokens=1)
