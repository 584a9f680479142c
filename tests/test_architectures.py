"""Every architecture of cpp/engine/arch on a tiny random checkpoint made here with transformers, its special parts
switched on (GQA everywhere; YaRN; Gemma 3 with a window shorter than the prompt, mixed layer types, its own RoPE
bases and linear scaling on global layers; Phi-3 LongRoPE with partial rotary and a prompt past the short context;
SmolLM3 no-RoPE layers; Qwen3 MoE with 6 experts, 2 chosen), converted with kvcmas convert:

* logits equal transformers' at f32 over a prompt longer than the window (argmax identical, max |d| <= 1e-3), in
  one prefill and token by token;
* a span read at a shift, uncorrected, is exact under the architecture's RoPE: layer 0 (context-free) equals a fresh
  prefill at the reader's positions and every layer equals the source's rows with keys rotated by that layer's RoPE,
  to 1e-4;
* a 4-agent workflow: the first agent is identical to nonshared, later agents reuse the shared spans, and the
  recompute dial at 1 gives nonshared's logits; the kvcmas method's corrections (core vs numpy path) agree;
* llama.cpp (where installed) agrees on the same file;
* an architecture the engine lacks is refused naming itself and the supported list.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import kvcmas_convert as kconv  # noqa: E402
import kvcmas_cpp as kc  # noqa: E402
from kvcmas_convert import constants as C  # noqa: E402
from kvcmas_cpp.sharing import MethodConfig, WorkflowRunner, gsm8k_workflow, load_gsm8k  # noqa: E402
from kvcmas_cpp.sharing.evaluate import question_ids  # noqa: E402

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


def _yarn(orig: int) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig, "rope_theta": 10000.0}


# name -> (config class, model class, config overrides, GGUF architecture)
CASES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, C.ARCH_QWEN3),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "rope_parameters": _yarn(32)}, C.ARCH_QWEN3),
    "qwen3moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {
            "head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
        C.ARCH_QWEN3_MOE,
    ),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": _yarn(32)}, C.ARCH_LLAMA),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, C.ARCH_OLMO2),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, C.ARCH_SMOLLM3),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {
            "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
        C.ARCH_GEMMA3,
    ),
    "phi3": (
        "Phi3Config", "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0], "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.0],
            },
        },
        C.ARCH_PHI3,
    ),
}  # fmt: skip


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    """A byte-level BPE of N_VOCAB tokens with ChatML specials, trained on GSM8K questions and the workflow's roles."""
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


def _make(folder: Path, case: str) -> Path:
    config_name, model_name, extra, _ = CASES[case]
    torch.manual_seed(7)
    config = getattr(transformers, config_name)(**{**COMMON, **extra})
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # random norms, so a wrong mapping shows
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok = _tokenizer()
    assert len(tok) == N_VOCAB
    tok.save_pretrained(folder)
    kconv.convert(folder, folder / "model.gguf", outtype="f32", progress=False)
    return folder


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, _make(tmp_path_factory.mktemp(request.param), request.param)


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, N_VOCAB, size=n)]


@functools.lru_cache(maxsize=4)
def _reference_cached(folder: Path, ids: tuple[int, ...]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()


def _reference(folder: Path, ids: list[int]) -> np.ndarray:
    return _reference_cached(folder, tuple(ids))


def test_logits_match_transformers(case: tuple[str, Path]) -> None:
    name, folder = case
    meta = kconv.read_metadata(folder / "model.gguf")
    arch = CASES[name][3]
    assert meta[C.KEY_ARCHITECTURE] == arch
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    ids = _ids(1, PROMPT)
    ref = _reference(folder, ids)
    got = model.logits(ids)
    assert np.abs(got - ref).max() <= LOGIT_TOL, (name, float(np.abs(got - ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all(), name
    with model.new_sequence() as seq:
        seq.append(ids[:40], logits="none")
        steps = np.stack([seq.append([t], logits="last") for t in ids[40:]])
    assert np.abs(steps - ref[40:]).max() <= LOGIT_TOL, name
    if name == "gemma3":
        assert model.layer_window == [WINDOW, 0, WINDOW, WINDOW]
        assert meta["gemma3.rope.freq_base_swa"] == 10000.0
    if name == "phi3":  # the prompt runs past the short context: the long factors are what matched
        assert meta["phi3.rope.dimension_count"] == 12 and meta["phi3.rope.scaling.original_context_length"] == 32
    if name.endswith("yarn"):
        assert meta[f"{arch}.rope.scaling.type"] == "yarn"


def _rounded_reference(folder: Path, ids: list[int], outtype: str) -> np.ndarray:
    """transformers' logits with every weight matrix rounded as the converter stores it (per row, so the GGUF's
    row permutations and expert stacking round the same values): the engine must then match at f32 tolerance."""
    import gguf

    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[outtype]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim < 2:
                continue  # vectors (norms, biases) stay f32 in the file; experts may be held as one 3-D tensor
            w = p.numpy().reshape(-1, p.shape[-1])
            t = qtype if outtype != "q8_0" or w.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F16
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(p.shape)))
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize(
    "outtype", ["q8_0", pytest.param("f16", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)]
)
def test_weight_types(case: tuple[str, Path], outtype: str, tmp_path: Path) -> None:
    """The checkpoint stored as f16, bf16 and q8_0 (experts included) computes what transformers computes with the
    same rounded weights, at the f32 tolerance; and the rounding is visible (the test is not run at f32)."""
    name, folder = case
    out = tmp_path / f"{outtype}.gguf"
    kconv.convert(folder, out, outtype=outtype, vocab=False, progress=False)
    ids = _ids(1, PROMPT)
    ref = _rounded_reference(folder, ids, outtype)
    got = kc.Model(out, n_threads=2, activations="f32").logits(ids)
    assert np.abs(got - ref).max() <= LOGIT_TOL, (name, outtype, float(np.abs(got - ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all(), (name, outtype)
    assert np.abs(got - _reference(folder, ids)).max() > LOGIT_TOL, (name, outtype)


def test_shifted_span_is_exact_under_the_architectures_rope(case: tuple[str, Path]) -> None:
    """A span computed after one prefix and read uncorrected after a longer one: layer 0 equals a fresh prefill at
    the reader's positions, every layer equals the source's rows with keys moved by that layer's RoPE."""
    name, folder = case
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    a_prefix, b_prefix, span = _ids(2, 5), _ids(3, 17), _ids(4, 20)
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


def test_span_by_reference_equals_dense_prefill(case: tuple[str, Path]) -> None:
    """A reader that appends a span by reference (computed at the same position after the same prefix), then a
    tail longer than the window, gets its own dense prefill's logits: sliding layers read the span's rows through
    the run table as they read their own (gemma3: partly beyond the window; its global layer sees all of it)."""
    name, folder = case
    model = kc.Model(folder / "model.gguf", n_threads=2, activations="f32")
    prefix, span, tail = _ids(6, 7), _ids(7, 15), _ids(8, 20)
    with model.new_sequence() as writer, model.new_sequence() as dense, model.new_sequence() as reader:
        writer.append(prefix + span, logits="none")
        own = dense.append(prefix + span + tail, logits="all")[len(prefix) + len(span) :]
        reader.append(prefix, logits="none")
        reader.append_shared(writer.share(len(prefix), len(span)))
        by_reference = reader.append(tail, logits="all")
    assert np.abs(by_reference - own).max() <= 1e-5 * np.abs(own).max(), name


def test_four_agent_workflow(case: tuple[str, Path]) -> None:
    name, folder = case
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


def test_llama_cpp_agrees(case: tuple[str, Path]) -> None:
    """The converted file in llama.cpp (llama-cpp-python, where installed) gives kvcmas' logits."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e .[bench]): cannot compare with llama.cpp")
    import llama_cpp

    name, folder = case
    if name == "phi3":  # not verified: llama.cpp's phi3 vocabulary loader refuses the test's BPE (unordered_map::at)
        pytest.skip("llama.cpp does not load the phi3 test file's vocabulary")
    ids = _ids(5, PROMPT)
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


def test_ridge_corrections_core_equal_numpy(case: tuple[str, Path]) -> None:
    """The kvcmas method on every architecture: a ridge estimator fitted on exact runs, then readers reuse the
    shared spans with corrections applied inside attention. The core's factors (keys moved by each layer's own
    RoPE in C++) give the logits of the numpy reference path (rope_rotate per layer)."""
    from kvcmas_cpp.sharing import RidgeEstimator

    name, folder = case
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


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[1] / "models" / "generated" / "tiny-llama-f32.gguf"
    if not src.exists():
        pytest.skip("tiny models not generated")
    path = tmp_path / "mamba.gguf"
    path.write_bytes(src.read_bytes())
    # same length, so the file stays valid: "llama" -> "mamba" in general.architecture (keys stay llama.*)
    data = path.read_bytes()
    at = data.index(b"general.architecture") + len(b"general.architecture") + 4 + 8
    assert data[at : at + 5] == b"llama"
    path.write_bytes(data[:at] + b"mamba" + data[at + 5 :])
    with pytest.raises(Exception, match=r"unsupported architecture 'mamba' \(kvcmas runs llama, qwen2, qwen3"):
        kc.Model(path, n_threads=1)
    assert kc.supported_architectures() == list(C.ENGINE_ARCHITECTURES)


def test_bench_counts_chosen_experts_per_token_and_every_expert_per_pass(case: tuple[str, Path]) -> None:
    """`kvcmas bench core`'s weight bytes (its GB/s and its twin ratios): a decode token of the MoE reads the chosen
    experts' share of the stacked expert matrices, a prefill pass up to all of them; a dense file reads the same in
    both. Reference: the tensor sizes as gguf-py reads the file."""
    from gguf import GGUFReader

    from kvcmas_cpp.bench.core import weight_bytes_per_token

    name, folder = case
    path = folder / "model.gguf"
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:  # an untied file reads one row of the token embedding per token
        del tensors["token_embd.weight"]
    experts = sum(n for t, n in tensors.items() if "_exps." in t)
    dense = sum(tensors.values()) - experts
    used, total = (CASES[name][2].get(k) for k in ("num_experts_per_tok", "num_experts"))
    per_token = dense + (experts * used // total if experts else 0)
    assert weight_bytes_per_token(str(path)) == per_token
    assert weight_bytes_per_token(str(path), all_experts=True) == dense + experts
    assert (experts > 0) == (name == "qwen3moe")
