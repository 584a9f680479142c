"""LoRA adapters (issue 49, items 1-3): random PEFT adapters of the default model (SmolLM2-135M exported to f32)
made here with peft + transformers, converted by `convert-lora`, loaded beside the base and run by the engine.

References are independent: transformers + peft's logits (f32) for the same adapter, and llama.cpp's (where
llama-cpp-python is installed) for the converted file. The engine's batches mix sequences of several adapters and of
none; each sequence must get exactly what it gets alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc

pytest.importorskip("peft")
gguf = pytest.importorskip("gguf")
from helpers.lora import ALL_LINEAR, ATTENTION, random_peft_adapter  # noqa: E402
from kvcmas_convert.errors import ConvertError  # noqa: E402
from kvcmas_convert.lora import convert_lora  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
# name: (target modules, rank, alpha, seed)
CASES = {"attn_r4": (ATTENTION, 4, 8, 1), "all_r16": (ALL_LINEAR, 16, 24, 2)}
SCALES = (1.0, 0.5)
PROMPT = "The planner splits the task; the critic checks each step and names the first wrong one."


@dataclass
class PeftAdapter:
    folder: Path
    gguf: Path
    rank: int
    targets: list[str]
    logits: dict[float, np.ndarray]  # transformers + peft at each scale, [len(ids), n_vocab]
    greedy: list[int]  # transformers + peft's greedy continuation (scale 1)


@pytest.fixture(scope="module")
def f32_path(reference_models) -> Path:
    return reference_models["F32"]


@pytest.fixture(scope="module")
def model(f32_path: Path) -> kc.Model:
    return kc.Model(f32_path, n_threads=2, activations="f32")


@pytest.fixture(scope="module")
def ids(model: kc.Model) -> list[int]:
    return model.tokenize(PROMPT)


def _peft_logits(pm, ids: list[int], scale: float) -> np.ndarray:
    import torch
    from peft.tuners.lora import LoraLayer

    for module in pm.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("default", scale)  # scaling = scale · alpha / r, as the engine computes it
    with torch.no_grad():
        return pm(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def adapters(reference, f32_path: Path, ids: list[int], tmp_path_factory) -> dict[str, PeftAdapter]:
    """Each case as a PEFT folder (random A and B: init_lora_weights=False, else B starts at zero and the update
    vanishes), its transformers + peft references, and the converted GGUF file."""
    import torch

    base = reference.model(str(f32_path))
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for name, (targets, rank, alpha, seed) in CASES.items():
        folder = root / name
        pm = random_peft_adapter(base, folder, targets, rank, alpha, seed)
        logits = {s: _peft_logits(pm, ids, s) for s in SCALES}
        _peft_logits(pm, ids, 1.0)
        with torch.no_grad():
            gen = pm.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        greedy = [int(t) for t in gen[0, len(ids) :]]
        del pm
        path = root / f"{name}.gguf"
        convert_lora(folder, f32_path, path)
        out[name] = PeftAdapter(folder, path, rank, targets, logits, greedy)
    return out


@pytest.fixture(scope="module")
def loaded(model: kc.Model, adapters: dict[str, PeftAdapter]) -> kc.Model:
    for name, a in adapters.items():
        model.load_adapter(a.gguf, name=name)
    return model


# ------------------------------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scale", SCALES)
def test_logits_equal_transformers_peft(loaded: kc.Model, adapters, ids: list[int], case: str, scale: float) -> None:
    """Attention-only rank 4 and all-linear rank 16, at scales 1 and 0.5: argmax identical, max |Δ| <= 1e-3."""
    ref = adapters[case].logits[scale]
    with loaded.new_sequence() as seq:
        loaded.set_sequence_adapter(seq, case, scale)
        got = seq.append(ids, logits="all")
    base = loaded.logits(ids)
    assert np.abs(ref - base).max() > 0.5, "the adapter changes nothing: the comparison would prove nothing"
    np.testing.assert_array_equal(got.argmax(axis=1), ref.argmax(axis=1))
    assert np.abs(got - ref).max() <= 1e-3


def test_adapter_info_and_scale_zero(loaded: kc.Model, adapters, ids: list[int]) -> None:
    """The file's alpha, ranks and matrices are reported; scale 0 is the base model bit for bit."""
    a = loaded.adapters["all_r16"]
    assert (a.alpha, a.max_rank, a.n_matrices) == (24.0, 16, 7 * loaded.n_layer)
    assert loaded.adapters["attn_r4"].n_matrices == 4 * loaded.n_layer
    assert a.bytes == 4 * 16 * loaded.n_layer * sum(n_in + n_out for n_in, n_out in _shapes(loaded).values())
    with loaded.new_sequence() as seq:
        loaded.set_sequence_adapter(seq, "all_r16", 0.0)
        np.testing.assert_array_equal(seq.append(ids, logits="all"), loaded.logits(ids))


def _shapes(model: kc.Model) -> dict[str, tuple[int, int]]:
    E, F = model.n_embd, model.n_ff
    qd, kd = model.n_head * model.head_dim, model.n_head_kv * model.head_dim
    return {"q": (E, qd), "k": (E, kd), "v": (E, kd), "o": (qd, E), "gate": (E, F), "up": (E, F), "down": (F, E)}


def test_generate_and_chat_with_adapter(loaded: kc.Model, adapters, ids: list[int]) -> None:
    """generate(adapter=) continues greedily as transformers + peft does; chat passes it on; an unknown name is a
    clear error before anything runs; the sequence it used is gone afterwards."""
    n_seqs = loaded.n_sequences
    out = loaded.generate(ids, max_tokens=8, temperature=0, adapter="all_r16")
    want = adapters["all_r16"].greedy
    eos = loaded.tokenizer.eog_ids
    assert out.tokens == [t for t in want[: len(out.tokens)]] and (len(out.tokens) == 8 or want[len(out.tokens)] in eos)
    assert loaded.n_sequences == n_seqs
    messages = [{"role": "user", "content": "Name one prime number."}]
    plain = loaded.chat(messages, max_tokens=6, temperature=0)
    tuned = loaded.chat(messages, max_tokens=6, temperature=0, adapter="all_r16", adapter_scale=1.0)
    assert tuned.tokens != plain.tokens
    with pytest.raises(kc.adapters.UnknownAdapterError, match="'critic'.*'attn_r4'"):
        loaded.generate(ids, max_tokens=2, adapter="critic")
    with pytest.raises(ValueError, match="adapter_scale"):
        loaded.generate(ids, max_tokens=2, adapter="attn_r4", adapter_scale=float("nan"))


# ------------------------------------------------------------------------------------------------ mixed batches


# one sequence of a batch: (adapter or None, scale, prompt ids, decode token ids)
BatchPlan = list[tuple[str | None, float, list[int], list[int]]]


def batch_logits(model: kc.Model, plan: BatchPlan, members: list[int]) -> dict[int, list[np.ndarray]]:
    """The logits of plan's members run as one batch: plan[i] = (adapter, scale, prompt, decode tokens); each
    member's prompt, then one decode step per token, {member: [logits per step]}."""
    seqs = {i: model.new_sequence() for i in members}
    out: dict[int, list[np.ndarray]] = {i: [] for i in members}
    try:
        for i in members:
            model.set_sequence_adapter(seqs[i], plan[i][0], plan[i][1])
        for k in range(1 + len(plan[members[0]][3])):  # the prompts, then the decode steps
            batch = [(seqs[i], plan[i][2] if k == 0 else [plan[i][3][k - 1]]) for i in members]
            for i, logits in zip(members, model.decode_batch(batch), strict=True):
                out[i].append(logits)
    finally:
        for s in seqs.values():
            s.close()
    return out


def assert_batch_gives_each_its_alone_logits(model: kc.Model, plan: BatchPlan) -> dict[int, list[np.ndarray]]:
    """Every sequence of plan gets, bit for bit, the logits in the mixed batch that it gets alone."""
    mixed = batch_logits(model, plan, list(range(len(plan))))
    for i in range(len(plan)):
        alone = batch_logits(model, plan, [i])[i]
        for step, (a, m) in enumerate(zip(alone, mixed[i], strict=True)):
            np.testing.assert_array_equal(m, a, err_msg=f"sequence {i} ({plan[i][0]}), step {step}")
    return mixed


def test_mixed_batch_gives_each_sequence_its_own_logits(loaded: kc.Model, ids: list[int]) -> None:
    """Base, adapter a and adapter b sequences (different prompts and scales) in one batch, a prompt each and then
    decode steps: each sequence's logits are bit-identical to the ones it gets alone (CPU)."""
    plan = [(None, 1.0, ids, [11, 22]), ("attn_r4", 1.0, ids[3:], [33, 44]), ("all_r16", 0.5, ids[::-1], [55, 66])]
    mixed = assert_batch_gives_each_its_alone_logits(loaded, plan)
    assert not np.array_equal(mixed[0][0], batch_logits(loaded, plan, [1])[1][0])


# ------------------------------------------------------------------------------------ over a quantized base, threads


@pytest.fixture(scope="module")
def quantized(reference_models, adapters: dict[str, PeftAdapter]) -> kc.Model:
    """The Q8_0 re-export with the adapters: their factors stored i8 (per-row scales), as over every quantized base."""
    m = kc.Model(reference_models["Q8_0"], n_threads=2)
    for name, a in adapters.items():
        m.load_adapter(a.gguf, name=name)
    return m


def _adapted_logits(model: kc.Model, name: str, ids: list[int], scale: float = 1.0) -> np.ndarray:
    with model.new_sequence() as seq:
        model.set_sequence_adapter(seq, name, scale)
        return seq.append(ids, logits="all")


@pytest.mark.parametrize("case", list(CASES))
def test_i8_factors_over_a_quantized_base_add_little_to_its_own_error(
    quantized: kc.Model, loaded: kc.Model, adapters, ids: list[int], case: str
) -> None:
    """Over the Q8_0 base the factors are stored i8: the adapted logits differ from transformers + peft (f32) by little
    more than the quantized base's own logits differ from the f32 base's. Measured (max / mean |Δ|): base 0.815 /
    0.112; adapted with i8 factors attn_r4 1.100 / 0.179, all_r16 1.011 / 0.147; the same with f32 factors (a build
    storing them so) 1.040 / 0.154 and 1.047 / 0.150: the adapted network's own quantization error, i8 adding little."""
    f32_bytes, i8_bytes = loaded.adapters[case].bytes, quantized.adapters[case].bytes
    assert i8_bytes < f32_bytes / 3  # a byte per value and a scale per row, against four bytes per value
    ref = adapters[case].logits[1.0]
    got = _adapted_logits(quantized, case, ids)
    base_err = np.abs(quantized.logits(ids) - loaded.logits(ids))
    err = np.abs(got - ref)
    print(f"{case}: adapted {err.max():.4f} / {err.mean():.5f}; base {base_err.max():.4f} / {base_err.mean():.5f}")
    assert err.max() <= 1.5 * base_err.max() and err.mean() <= 1.75 * base_err.mean()


def test_same_logits_at_one_and_two_threads(quantized: kc.Model, reference_models, adapters, ids: list[int]) -> None:
    """An adapted prompt (its LoRA products split over the threads) and decode steps give the same bits with 1 thread
    as with 2."""
    one = kc.Model(reference_models["Q8_0"], n_threads=1)
    one.load_adapter(adapters["all_r16"].gguf, name="all_r16")

    def run(model: kc.Model) -> list[np.ndarray]:
        with model.new_sequence() as seq:
            model.set_sequence_adapter(seq, "all_r16", 0.5)
            out = [seq.append(ids, logits="all")]
            for t in (11, 22):
                out.append(seq.append([t]))
        return out

    for a, b in zip(run(one), run(quantized), strict=True):
        np.testing.assert_array_equal(a, b)


def test_forks_inherit_the_adapter_and_unload_waits_for_its_sequences(loaded: kc.Model, ids: list[int]) -> None:
    with loaded.new_sequence() as seq:
        loaded.set_sequence_adapter(seq, "attn_r4", 0.5)
        seq.append(ids[:-1], logits="none")
        with seq.fork() as child:
            assert child.adapter == (loaded.adapters["attn_r4"].id, 0.5)
            np.testing.assert_array_equal(child.append(ids[-1:]), seq.append(ids[-1:]))
        with pytest.raises(kc.KvcmasError, match="in use by sequence"):
            loaded.unload_adapter("attn_r4")
    assert "attn_r4" in loaded.adapters


# --------------------------------------------------------------------------------------------------- bad adapters


def _write(path: Path, tensors: dict[str, np.ndarray], arch: str = "llama", **keys: object) -> Path:
    """A hand-made adapter file: general.type / adapter.type / adapter.lora.alpha as given (None: left out)."""
    meta = {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": 8.0, **keys}
    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif value is not None:
            w.add_float32(key, float(value))
    for name, data in tensors.items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_adapters_are_clear_errors_and_load_nothing(
    loaded: kc.Model, f32_path: Path, tiny_models, adapters, tmp_path: Path
) -> None:
    model = loaded
    E, qd = model.n_embd, model.n_head * model.head_dim
    rng = np.random.default_rng(0)
    good = {
        "blk.0.attn_q.weight.lora_a": rng.standard_normal((4, E)),
        "blk.0.attn_q.weight.lora_b": rng.standard_normal((qd, 4)),
    }
    cases = {
        "not a LoRA adapter: general.type is 'model'": f32_path,
        "adapter.lora.alpha is missing": _write(tmp_path / "no_alpha.gguf", good, **{"adapter.lora.alpha": None}),
        "adapter type 'control_vector' is not supported": _write(
            tmp_path / "cvec.gguf", good, **{"adapter.type": "control_vector"}
        ),
        "the adapter is for architecture 'qwen2'": _write(tmp_path / "qwen2.gguf", good, arch="qwen2"),
        "do not fit 'blk.0.attn_q.weight'": _write(
            tmp_path / "shape.gguf", {**good, "blk.0.attn_q.weight.lora_a": rng.standard_normal((4, E + 32))}
        ),
        "has no 'blk.0.attn_q.weight.lora_b'": _write(
            tmp_path / "half.gguf", {"blk.0.attn_q.weight.lora_a": good["blk.0.attn_q.weight.lora_a"]}
        ),
        "adapts 'token_embd.weight', which kvcmas does not adapt": _write(
            tmp_path / "embd.gguf", {**good, "token_embd.weight.lora_a": rng.standard_normal((4, 64))}
        ),
        "not a LoRA factor": _write(
            tmp_path / "other.gguf", {**good, "blk.0.attn_q.weight": rng.standard_normal((4, 4))}
        ),
        "cannot open": tmp_path / "missing.gguf",
    }
    before = model.adapters
    for message, path in cases.items():
        with pytest.raises(kc.KvcmasError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            model.load_adapter(path, name="bad")
        assert str(path) in str(info.value)
        assert model.adapters == before
    # an adapter of another base: the converted SmolLM2 adapter in the tiny llama, and its PEFT folder for it
    tiny = kc.Model(tiny_models[("llama", "F32")], n_threads=1)
    with pytest.raises(kc.KvcmasError, match=f"has {tiny.n_layer} layers: the adapter is for another model"):
        tiny.load_adapter(adapters["attn_r4"].gguf)
    assert tiny.adapters == {}
    with pytest.raises(ConvertError, match="does not have"):
        convert_lora(adapters["attn_r4"].folder, tiny_models[("llama", "F32")], tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(ValueError, match="'attn_r4' is loaded already"):
        model.load_adapter(adapters["attn_r4"].gguf, name="attn_r4")


def test_convert_lora_refuses_what_it_cannot_write(adapters, f32_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "dora"
    folder.mkdir()
    src = adapters["attn_r4"].folder
    (folder / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    for key, value, message in [
        ("use_dora", True, "use_dora"),
        ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
        ("lora_alpha", None, "lora_alpha"),
        ("peft_type", "IA3", "is not LORA"),
    ]:
        (folder / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ConvertError, match=message):
            convert_lora(folder, f32_path, tmp_path / "out.gguf")
    with pytest.raises(ConvertError, match="is an adapter, not a base model"):
        convert_lora(src, adapters["attn_r4"].gguf, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_cli_convert_lora(adapters, f32_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "convert-lora", str(adapters["all_r16"].folder), "--base"]
    proc = subprocess.run([*cmd, str(f32_path), "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 16, alpha 24" in proc.stderr
    assert out.read_bytes() == adapters["all_r16"].gguf.read_bytes()


# ------------------------------------------------------------------------------------------------------ llama.cpp


def test_converted_adapter_agrees_with_llama_cpp(loaded: kc.Model, adapters, f32_path: Path, ids, tmp_path) -> None:
    """llama.cpp loads the converted file (llama_cpp's lora API) and its logits agree with the engine's."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/setup.sh --bench)")
    shim = tmp_path / "noamx.so"  # this VM faults on the AMX tiles a native llama.cpp build uses (bench/noamx.c)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(shim), str(REPO_ROOT / "bench" / "noamx.c"), "-ldl"],
                   check=True)  # fmt: skip
    case, scale = "all_r16", 0.5
    out = tmp_path / "llama.npy"
    script = (
        "import sys, json, numpy as np, llama_cpp; ids = json.loads(sys.argv[3]); "
        "llm = llama_cpp.Llama(model_path=sys.argv[1], lora_path=sys.argv[2], lora_scale=float(sys.argv[5]), "
        "n_ctx=len(ids) + 8, n_threads=2, logits_all=True, verbose=False); llm.eval(ids); "
        "np.save(sys.argv[4], np.array(llm.scores[: len(ids)], dtype=np.float32))"
    )
    args = [str(f32_path), str(adapters[case].gguf), json.dumps(ids), str(out), str(scale)]
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = np.load(out)
    with loaded.new_sequence() as seq:
        loaded.set_sequence_adapter(seq, case, scale)
        ours = seq.append(ids, logits="all")
    np.testing.assert_array_equal(ours.argmax(axis=1), theirs.argmax(axis=1))
    assert np.abs(ours - theirs).max() <= 0.1  # llama.cpp keeps f16 K/V rows (measured: 0.03)
    assert np.abs(loaded.logits(ids) - theirs).max() > 10 * np.abs(ours - theirs).max()  # llama.cpp applied it


# ---------------------------------------------------------------------------------------------------------- bench


def test_bench_lora_reports_each_case(tiny_models, tmp_path: Path) -> None:
    """`kvcmas bench lora`: its random adapter loads and changes the logits; the table has the four cases and each
    adapter row's ratio is its time over the base row's."""
    from kvcmas_cpp.bench.lora import bench_lora, write_random_adapter

    path = str(tiny_models[("llama", "F32")])
    model = kc.Model(path, n_threads=1, activations="f32")
    write_random_adapter(path, 8, tmp_path / "r.gguf", seed=0)
    model.load_adapter(tmp_path / "r.gguf", name="r")
    assert model.adapters["r"].n_matrices == 7 * model.n_layer and model.adapters["r"].max_rank == 8
    with model.new_sequence() as seq:
        model.set_sequence_adapter(seq, "r")
        tuned = seq.append([5, 6, 7])
    assert np.abs(tuned - model.logits([5, 6, 7])[-1]).max() > 1e-3
    rows = bench_lora(path, rank=8, threads=1, prompt=4, gen=2, batch=2)
    assert [r["case"] for r in rows] == [
        "base, 1 sequence",
        "rank-8 adapter, 1 sequence",
        "base, batch of 2",
        "2 rank-8 adapters, batch of 2",
    ]
    for base, tuned_row in (rows[0:2], rows[2:4]):
        assert tuned_row["vs_base"] == pytest.approx(tuned_row["ms_per_step"] / base["ms_per_step"])


@pytest.mark.parametrize("weight_type", ["Q4_1", "Q8_0", "F32"])
@pytest.mark.parametrize("n_tok", [1, 4, 40])
def test_adapted_matmul_in_one_job_equals_matmul_then_lora_add(weight_type: str, n_tok: int) -> None:
    """Backend::matmul_multi_lora (the CPU decode path runs the base rows and the adapters' products in one parallel
    job) gives the bits of matmul_multi followed by lora_add, at 1 and 2 threads, for decode (1 and 4 rows, several
    adapters in the batch, one matrix with no adapter) and prefill (40 rows, the two calls)."""
    from helpers.native import testing

    mtm = pytest.importorskip("make_test_models")
    rng = np.random.default_rng(n_tok)
    n_in, outs = 576, (576, 192, 1536)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    datas, type_id = [], 0
    for n_out in outs:
        data, qtype = mtm.encode((rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32), weight_type)
        datas.append(np.ascontiguousarray(data).view(np.uint8).ravel())
        type_id = int(qtype)
    products = []
    for p, n_out in enumerate(outs):
        groups = []
        for g, rank in enumerate([16, 8, 16] if p != 1 else []):  # K-like: no adapter adapts it
            rows = np.arange(g, n_tok, 3, dtype=np.int32)
            a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            b = (rng.standard_normal((n_out, rank)) * 0.05).astype(np.float32)
            groups.append((a, b, rows, rng.uniform(0.5, 2, len(rows)).astype(np.float32)))
        products.append((np.zeros((n_tok, n_out), np.float32), groups))
    for threads in (1, 2):
        ops = testing.BackendOps("cpu", threads)
        ops.set_activations("q8")
        fused = ops.matmul_lora_products(type_id, datas, x, products, "i8")
        base = ops.matmul_multi(type_id, datas, n_in, list(outs), x)
        for (_, groups), got, y in zip(products, fused, base, strict=True):
            want = ops.lora_add(x, y, groups, "i8") if groups else y
            np.testing.assert_array_equal(got, want)
        if threads == 1:
            one_thread = fused
        else:
            for got, alone in zip(fused, one_thread, strict=True):
                np.testing.assert_array_equal(got, alone)


def test_mixed_batch_over_a_quantized_base_in_one_matmul_path(quantized: kc.Model, ids: list[int]) -> None:
    """Over the Q8_0 base (8-bit activations, i8 factors, 2 threads: the adapters' products in the base matmul's job)
    base, attn_r4 and all_r16 sequences in one batch each get their alone bits, prompts included, as long as the batch
    and each sequence alone take the same matmul path: here prompts of 5 tokens, 15 rows together, under the 17 of
    the decode path. (A prompt alone under 17 rows but over it in a batch goes from the decode kernels to the integer
    prefill GEMM, whose activations are quantized differently: docs/adapters.md.)"""
    plan = [
        (name, 1.0, ids[5 * i : 5 * i + 5], [100 + i, 107 + i]) for i, name in enumerate((None, "attn_r4", "all_r16"))
    ]
    assert_batch_gives_each_its_alone_logits(quantized, plan)
