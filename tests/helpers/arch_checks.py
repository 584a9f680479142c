"""The architecture tests' shared parts (tests/test_architectures.py, test_arch_gptoss.py, test_quant_mxfp4.py): the
tiny checkpoints' common config and tokenizer, prompt ids, transformers' f32 logits, and the checks every
architecture passes, written once as functions of (name, converted folder)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.sharing import MethodConfig, WorkflowRunner, gsm8k_workflow, load_gsm8k
from kvcmas_cpp.sharing.evaluate import question_ids

N_VOCAB = 320
WINDOW = 8
PROMPT = 48
LOGIT_TOL = 1e-3  # max |kvcmas - transformers| at f32 (the bound)
KV_TOL = 1e-4
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
COMMON = dict(
    vocab_size=N_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """A byte-level BPE of N_VOCAB tokens with ChatML specials, trained on GSM8K questions and the workflow's roles."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # ChatML's, and Phi-3's (llama.cpp's phi3 vocabulary looks its end-of-turn token up by text)
    specials = ["<|im_start|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=N_VOCAB, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    wf = gsm8k_workflow(4)
    corpus = load_gsm8k(0, 50) + [a.role + a.user_template for a in wf.agents]
    tok.train_from_iterator(corpus, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )


def prompt_ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, N_VOCAB, size=n)]


@functools.lru_cache(maxsize=4)
def _reference_cached(folder: Path, ids: tuple[int, ...]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def reference(folder: Path, ids: list[int]) -> np.ndarray:
    return _reference_cached(folder, tuple(ids))


def check_shifted_span_is_exact(name: str, folder: Path) -> None:
    """A span computed after one prefix and read uncorrected after a longer one: layer 0 equals a fresh prefill at
    the reader's positions, every layer equals the source's rows with keys moved by that layer's RoPE."""
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    a_prefix, b_prefix, span = prompt_ids(2, 5), prompt_ids(3, 17), prompt_ids(4, 20)
    shift = len(b_prefix) - len(a_prefix)
    with model.new_sequence() as a, model.new_sequence() as b, model.new_sequence() as fresh:
        a.append(a_prefix + span, logits="none")
        b.append(b_prefix, logits="none")
        used = model.kv_bytes_in_use
        b.append_shared(a.share(len(a_prefix), len(span)))
        assert model.kv_bytes_in_use == used  # read by reference
        fresh.append(b_prefix + span, logits="none")
        ka, va = a.kv(len(a_prefix), len(span))
        kb, vb = b.kv(len(b_prefix), len(span))
        kf, vf = fresh.kv(len(b_prefix), len(span))
    for il in range(model.n_layer):
        np.testing.assert_allclose(kb[il], model.rope_rotate(ka[il], shift, il), rtol=0, atol=KV_TOL)
    np.testing.assert_array_equal(vb, va)
    np.testing.assert_allclose(kb[0], kf[0], rtol=0, atol=KV_TOL)
    np.testing.assert_allclose(vb[0], vf[0], rtol=0, atol=KV_TOL)
    assert np.abs(kb[1:] - kf[1:]).max() > 10 * KV_TOL  # deeper layers depend on the prefix: the check has teeth


def check_span_by_reference_equals_dense_prefill(name: str, folder: Path) -> None:
    """A reader that appends a span by reference (computed at the same position after the same prefix), then a
    tail longer than the window, gets its own dense prefill's logits: sliding layers read the span's rows through
    the run table as they read their own (gemma3: partly beyond the window; its global layer sees all of it)."""
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    prefix, span, tail = prompt_ids(6, 7), prompt_ids(7, 15), prompt_ids(8, 20)
    with model.new_sequence() as writer, model.new_sequence() as dense, model.new_sequence() as reader:
        writer.append(prefix + span, logits="none")
        own = dense.append(prefix + span + tail, logits="all")[len(prefix) + len(span) :]
        reader.append(prefix, logits="none")
        reader.append_shared(writer.share(len(prefix), len(span)))
        by_reference = reader.append(tail, logits="all")
    assert np.abs(by_reference - own).max() <= 1e-5 * np.abs(own).max(), name


def check_four_agent_workflow(name: str, folder: Path) -> None:
    model = kc.Model(folder / "model.gguf", n_threads=2, n_ctx=1024, activations="f32")
    wf = gsm8k_workflow(4)
    q = question_ids(model, load_gsm8k(3, 1)[0])
    exact_runner = WorkflowRunner(model, wf, MethodConfig("nonshared"), None)
    exact = exact_runner.run(q, "m", max_new_tokens=3)
    forced = [h.generated for h in exact.hops]
    shared_runner = WorkflowRunner(model, wf, MethodConfig("fullshared"), None)
    shared = shared_runner.run(q, "m", max_new_tokens=3, forced=forced, exact=exact)
    assert len(shared.hops) == 4
    np.testing.assert_array_equal(shared.hops[0].first_logits, exact.hops[0].first_logits)
    for hop in shared.hops[1:]:
        assert hop.mode == "reuse" and hop.reused_tokens >= len(q), (name, hop.agent, hop.mode)
        assert hop.computed_tokens < exact.hops[hop.agent].computed_tokens
        assert np.isfinite(hop.first_logits).all()
    # the recompute dial at 1: every shared row recomputed in the reader's context, which is nonshared
    full_runner = WorkflowRunner(model, wf, MethodConfig("fullshared", recompute=1.0), None)
    full = full_runner.run(q, "m", max_new_tokens=3, forced=forced, exact=exact)
    for hop in full.hops[1:]:
        assert hop.recomputed_tokens > 0, (name, hop.agent)
        ref = exact.hops[hop.agent].first_logits
        assert np.abs(hop.first_logits - ref).max() <= 1e-4 * np.abs(ref).max(), (name, hop.agent)
    for r in (full, shared, exact):
        r.close()
    for runner in (full_runner, shared_runner, exact_runner):
        runner.close()


def check_llama_cpp_agrees(name: str, folder: Path) -> None:
    """The converted file in llama.cpp (llama-cpp-python, where installed) gives kvcmas' logits."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e .[bench]): cannot compare with llama.cpp")
    import llama_cpp

    if name == "phi3":  # not verified: llama.cpp's phi3 vocabulary loader refuses the test's BPE (unordered_map::at)
        pytest.skip("llama.cpp does not load the phi3 test file's vocabulary")
    ids = prompt_ids(5, PROMPT)
    # f32 KV as kvcmas here (llama.cpp's default f16 KV alone moves gemma3's logits by 5e-3)
    llm = llama_cpp.Llama(
        str(folder / "model.gguf"), n_ctx=256, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0
    )
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    llm.close()
    ours = kc.Model(folder / "model.gguf", n_threads=2, activations="f32").logits(ids)
    rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert rel < 2e-3, f"{name}: llama.cpp vs kvcmas relative error {rel}"


def check_ridge_corrections_core_equal_numpy(name: str, folder: Path) -> None:
    """The kvcmas method on every architecture: a ridge estimator fitted on exact runs, then readers reuse the
    shared spans with corrections applied inside attention. The core's factors (keys moved by each layer's own
    RoPE in C++) give the logits of the numpy reference path (rope_rotate per layer)."""
    from kvcmas_cpp.sharing import RidgeEstimator

    model = kc.Model(folder / "model.gguf", n_threads=2, n_ctx=1024, activations="f32")
    wf = gsm8k_workflow(4)
    ridge = RidgeEstimator(rank=4)
    trainer = WorkflowRunner(model, wf, MethodConfig("nonshared", head=4), ridge)
    for i, text in enumerate(load_gsm8k(40, 2)):
        trainer.run(question_ids(model, text), f"train-{i}", max_new_tokens=2, ridge_training=True).close()
    trainer.close()
    ridge.fit()
    q = question_ids(model, load_gsm8k(13, 1)[0])
    exact_runner = WorkflowRunner(model, wf, MethodConfig("nonshared"), None)
    exact = exact_runner.run(q, "m", max_new_tokens=2)
    forced = [h.generated for h in exact.hops]
    hops = {}
    for path in ("core", "numpy"):
        runner = WorkflowRunner(model, wf, MethodConfig("kvcmas", head=4, apply="fused", ridge_path=path), ridge)
        res = runner.run(q, "m", max_new_tokens=2, forced=forced, exact=exact)
        hops[path] = [(h.mode, h.corr_rank, h.first_logits) for h in res.hops]
        res.close()
        runner.close()
    for a in range(1, 4):
        (mode, rank, got), (_, rank_ref, ref) = hops["core"][a], hops["numpy"][a]
        assert mode == "reuse" and rank == rank_ref > 0, (name, a, mode, rank)
        assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), (name, a)
    exact.close()
    exact_runner.close()
