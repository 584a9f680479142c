"""Sliding-window attention: random Mistral and Qwen2 checkpoints whose window is shorter than the prompt, converted
to GGUF and run in kvcmas, against transformers (eager and sdpa) beyond the window; and shared spans read by
reference, against the reader's own dense prefill.

A query at position p attends to the keys in (p - window, p] (transformers' and llama.cpp's convention). With L
layers, position p's logits depend on the tokens in (p - L·(window - 1), p] only: the tests use that to show that a
shared span (with a correction, at another position) read beyond the window is not attended.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvcmas_convert as kconv  # noqa: E402
import kvcmas_cpp as kc  # noqa: E402
from kvcmas_cpp._native import core  # noqa: E402

WINDOW = 8
N_LAYER = 3
N_VOCAB = 320
RECEPTIVE = N_LAYER * (WINDOW - 1)  # positions this far past a token no longer depend on it
F32_TOLERANCE = 1e-5  # max |kvcmas - transformers| / max |transformers|; measured about 7e-7


def _save(folder: Path, arch: str, **extra: object) -> Path:
    torch.manual_seed(21)
    config_class, model_class = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=N_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=N_LAYER, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5, **extra,
    )  # fmt: skip
    model = model_class(config)
    with torch.no_grad():  # random norms, so a wrong mapping shows
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    kconv.convert(folder, folder / "model.gguf", outtype="f32", vocab=False, progress=False)
    return folder


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("mistral-swa"), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # layer 0 attends to everything, layers 1 and 2 slide (transformers: layers >= max_window_layers)
    return _save(
        tmp_path_factory.mktemp("qwen2-swa"), "qwen2", use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1,
    )  # fmt: skip


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, N_VOCAB, size=n)]


def _reference(folder: Path, ids: list[int], attn: str = "eager", **overrides: object) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn, **overrides
    )
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_mistral_beyond_the_window_matches_transformers(mistral: Path, attn: str) -> None:
    """A 48-token prompt with a window of 8, in one prefill (blocks of 16 queries, each with its own window start)
    and token by token; the same prompt without the window differs, so the window is what is being checked."""
    meta = kconv.read_metadata(mistral / "model.gguf")
    assert meta["llama.attention.sliding_window"] == WINDOW and "llama.attention.sliding_window_pattern" not in meta
    ids = _ids(1, 48)
    ref = _reference(mistral, ids, attn)
    model = kc.Model(mistral / "model.gguf", n_threads=2)
    assert model.layer_window == [WINDOW] * N_LAYER
    got = model.logits(ids)
    assert _rel(got, ref) <= F32_TOLERANCE
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    with model.new_sequence() as seq:
        seq.append(ids[:5], logits="none")
        steps = np.stack([seq.append([t], logits="last") for t in ids[5:]])
    assert _rel(steps, ref[5:]) <= F32_TOLERANCE
    dense = _reference(mistral, ids, attn, sliding_window=None)
    assert _rel(dense[:WINDOW], ref[:WINDOW]) <= F32_TOLERANCE  # inside the window: the same model
    assert _rel(dense[WINDOW:], ref[WINDOW:]) > 0.05  # beyond it, the window changes the logits


def test_mistral_window_with_f16_kv(mistral: Path) -> None:
    ids = _ids(2, 40)
    ref = _reference(mistral, ids)
    got = kc.Model(mistral / "model.gguf", n_threads=2, kv_type="f16").logits(ids)
    assert _rel(got, ref) <= 2e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_windowed_and_full_layers_match_transformers(qwen2: Path, attn: str) -> None:
    meta = kconv.read_metadata(qwen2 / "model.gguf")
    assert meta["qwen2.attention.sliding_window"] == WINDOW
    assert meta["qwen2.attention.sliding_window_pattern"] == [False, True, True]
    model = kc.Model(qwen2 / "model.gguf", n_threads=2)
    assert model.layer_window == [0, WINDOW, WINDOW]
    ids = _ids(3, 44)
    ref = _reference(qwen2, ids, attn)
    got = model.logits(ids)
    assert _rel(got, ref) <= F32_TOLERANCE and (got.argmax(-1) == ref.argmax(-1)).all()


def test_shared_span_at_its_own_position_equals_dense_prefill(mistral: Path) -> None:
    """A reader that appends a span by reference (computed at the same position after the same prefix) gets its own
    dense prefill's logits, and both match transformers, with the span partly inside and partly beyond the window."""
    model = kc.Model(mistral / "model.gguf", n_threads=2)
    prefix, span, tail = _ids(4, 13), _ids(5, 21), _ids(6, 30)
    ref = _reference(mistral, prefix + span + tail)[len(prefix) + len(span) :]
    with model.new_sequence() as writer, model.new_sequence() as dense, model.new_sequence() as reader:
        writer.append(prefix + span, logits="none")
        shared = writer.share(len(prefix), len(span))
        own = dense.append(prefix + span + tail, logits="all")[len(prefix) + len(span) :]
        reader.append(prefix, logits="none")
        reader.append_shared(shared)
        by_reference = reader.append(tail, logits="all")
    assert _rel(by_reference, own) <= F32_TOLERANCE
    assert _rel(by_reference, ref) <= F32_TOLERANCE


def _garbage_correction(model: kc.Model, n: int, rank: int) -> object:
    """A large random low-rank correction of a span's KV on every layer from 1: visible wherever it is attended."""
    rng = np.random.default_rng(7)
    kd = model.n_head_kv * 16
    corr = core.KvCorrection(n, rank, kd, model.n_layer)
    for il in range(1, model.n_layer):
        a_k, a_v = (rng.standard_normal((n, rank)).astype(np.float32) * 3 for _ in range(2))
        b_k, b_v = (rng.standard_normal((rank, kd)).astype(np.float32) * 3 for _ in range(2))
        corr.set_layer(il, a_k, b_k, a_v, b_v)
    return corr


@pytest.mark.parametrize("corrected", [False, True])
def test_shared_span_beyond_the_window_is_not_attended(mistral: Path, corrected: bool) -> None:
    """A span computed elsewhere (after another prefix, so other KV, at another position: a shifted run), read by
    reference with or without a large correction: positions whose window (through all layers) lies past the span
    give the reader's own dense prefill's logits, and transformers'; positions that still reach it do not. (The span
    is shorter than the receptive field, so its last rows still depend on the prefix it was computed after.)"""
    model = kc.Model(mistral / "model.gguf", n_threads=2)
    prefix, other_prefix, span, tail = _ids(8, 11), _ids(9, 17), _ids(10, 10), _ids(11, RECEPTIVE + 12)
    start = len(prefix) + len(span)
    ref = _reference(mistral, prefix + span + tail)[start:]
    with model.new_sequence() as writer, model.new_sequence() as dense, model.new_sequence() as reader:
        writer.append(other_prefix + span, logits="none")
        shared = writer.share(len(other_prefix), len(span))
        own = dense.append(prefix + span + tail, logits="all")[start:]
        reader.append(prefix, logits="none")
        if corrected:
            reader.append_shared(shared, _garbage_correction(model, len(span), rank=4))
        else:
            reader.append_shared(shared)
        segments = model.sequence_segments(reader.id)
        assert segments[1]["shared"] and segments[1]["shift"] == len(prefix) - len(other_prefix)
        got = reader.append(tail, logits="all")
    late = slice(RECEPTIVE, None)
    assert _rel(got[late], own[late]) <= F32_TOLERANCE
    assert _rel(got[late], ref[late]) <= F32_TOLERANCE
    assert _rel(got[: WINDOW - 1], own[: WINDOW - 1]) > (0.1 if corrected else 1e-3)  # these still read the span


def test_window_longer_than_the_sequence_changes_nothing(tmp_path: Path) -> None:
    """Mistral's default window (4096) never bites in a short prompt: the logits are the full-attention ones."""
    folder = _save(tmp_path / "m", "mistral")  # transformers' default sliding_window
    assert kconv.read_metadata(folder / "model.gguf")["llama.attention.sliding_window"] == 4096
    ids = _ids(12, 40)
    got = kc.Model(folder / "model.gguf", n_threads=2).logits(ids)
    assert _rel(got, _reference(folder, ids, sliding_window=None)) <= F32_TOLERANCE


def test_converter_window_keys(tmp_path: Path) -> None:
    """What config.json says -> the GGUF keys (gguf-py's names): Qwen2 without use_sliding_window has none, Mistral
    with sliding_window null has none, explicit layer_types decide per layer."""
    import gguf

    qwen = _save(tmp_path / "q", "qwen2", use_sliding_window=False, sliding_window=WINDOW)
    key = gguf.Keys.Attention.SLIDING_WINDOW.format(arch="qwen2")
    assert key not in kconv.read_metadata(qwen / "model.gguf")
    assert kc.Model(qwen / "model.gguf", n_threads=1).layer_window == [0] * N_LAYER
    nowin = _save(tmp_path / "n", "mistral", sliding_window=None)
    assert gguf.Keys.Attention.SLIDING_WINDOW.format(arch="llama") not in kconv.read_metadata(nowin / "model.gguf")
    typed = _save(tmp_path / "t", "qwen2", use_sliding_window=True, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
    meta = kconv.read_metadata(typed / "model.gguf")
    assert meta[gguf.Keys.Attention.SLIDING_WINDOW.format(arch="qwen2")] == 5
    assert meta[gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="qwen2")] == [True, False, True]
    assert kc.Model(typed / "model.gguf", n_threads=1).layer_window == [5, 0, 5]
    ids = _ids(13, 30)
    assert _rel(kc.Model(typed / "model.gguf", n_threads=2).logits(ids), _reference(typed, ids)) <= F32_TOLERANCE
