"""The Python Model API on the default model: properties, text, generation, streaming, stops, timings, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvcmas_cpp as kc


@pytest.fixture(scope="module")
def model(default_model_path: str) -> kc.Model:
    return kc.Model(default_model_path, n_threads=2, n_ctx=1024)


def test_properties_match_the_file(model: kc.Model, default_model_path: str) -> None:
    import gguf

    reader = gguf.GGUFReader(default_model_path)

    def field(key: str) -> int:
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    assert model.arch == "llama"
    assert model.n_layer == field("llama.block_count")
    assert model.n_embd == field("llama.embedding_length")
    assert model.n_head == field("llama.attention.head_count")
    assert model.n_head_kv == field("llama.attention.head_count_kv")
    assert model.n_ctx_train == field("llama.context_length")
    assert model.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert model.n_ctx == 1024
    assert model.n_threads == 2


def test_tokenize_round_trip(model: kc.Model) -> None:
    text = "Kvcmas shares KV caches between agents: 12 + 30 = 42."
    ids = model.tokenize(text, add_special=False)
    assert ids and all(0 <= t < model.n_vocab for t in ids)
    assert model.detokenize(ids) == text


def test_greedy_generation_follows_argmax_of_recomputed_logits(model: kc.Model) -> None:
    prompt = model.tokenize("The three primary colors are", add_special=True)
    out = model.generate(prompt, max_tokens=8, temperature=0.0)
    assert isinstance(out, kc.Completion)
    assert len(out.tokens) >= 1
    # Decode-path tokens must be what a prefill over the whole text picks at each step.
    full = model.logits(prompt + out.tokens)
    picked = [int(t) for t in np.argmax(full[len(prompt) - 1 : -1], axis=1)]
    assert picked == out.tokens
    assert out.text == model.detokenize(out.tokens)


def test_stream_equals_non_stream(model: kc.Model) -> None:
    kwargs = {"max_tokens": 24, "temperature": 0.0}
    whole = model.generate("Once upon a time", **kwargs)
    chunks = list(model.generate("Once upon a time", stream=True, **kwargs))
    assert "".join(c.text for c in chunks) == whole.text
    assert [c.token for c in chunks if c.token is not None] == whole.tokens
    assert chunks[-1].finish_reason == whole.finish_reason and chunks[-1].timings is not None
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_max_tokens_and_timings(model: kc.Model) -> None:
    out = model.generate("Count: one, two, three,", max_tokens=5, temperature=0.0)
    assert out.finish_reason == "length" and len(out.tokens) == 5
    t = out.timings
    assert t.prompt_tokens == len(model.tokenize("Count: one, two, three,")) and t.reused_tokens == 0
    assert t.generated_tokens == 5 and t.prompt_ms > 0 and t.ttft_ms == t.prompt_ms
    assert t.generation_ms > 0 and t.generation_tokens_per_s > 0 and t.prompt_tokens_per_s > 0
    assert set(t.as_dict()) >= {"prompt_ms", "prompt_tokens_per_s", "generation_tokens_per_s", "reused_tokens"}


def test_stop_string_cuts_the_text(model: kc.Model) -> None:
    free = model.generate("List the days of the week: Monday,", max_tokens=24, temperature=0.0)
    assert len(free.text) > 12
    stop = free.text[6:10]
    first = free.text.find(stop)
    cut = model.generate("List the days of the week: Monday,", max_tokens=24, temperature=0.0, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:first]
    streamed = "".join(
        c.text
        for c in model.generate(
            "List the days of the week: Monday,", max_tokens=24, temperature=0.0, stop=[stop], stream=True
        )
    )
    assert streamed == cut.text


def test_seeded_sampling_is_reproducible(model: kc.Model) -> None:
    kwargs = {"max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = model.generate("Write a word:", seed=7, **kwargs)
    b = model.generate("Write a word:", seed=7, **kwargs)
    assert a.tokens == b.tokens
    others = {tuple(model.generate("Write a word:", seed=s, **kwargs).tokens) for s in range(8, 12)}
    assert len(others | {tuple(a.tokens)}) > 1


def test_chat_uses_the_template_and_stops_at_end_of_turn(model: kc.Model) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    text = model.apply_chat_template(messages)
    assert "<|im_start|>user\nSay hello.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = model.chat(messages, max_tokens=64, temperature=0.0)
    assert out.text.strip()
    assert "<|im_end|>" not in out.text
    if out.finish_reason == "stop":
        assert len(out.tokens) < 64


def test_continuing_a_sequence_reports_reused_tokens(model: kc.Model) -> None:
    with model.new_sequence() as seq:
        seq.append(model.tokenize("A long shared context about apples and pears."), logits="none")
        n = len(seq)
        out = model.generate(" Apples are", max_tokens=3, temperature=0.0, sequence=seq)
        assert out.timings.reused_tokens == n
        assert len(seq) >= n + len(model.tokenize(" Apples are", add_special=False))


def test_bad_arguments_raise(model: kc.Model, tmp_path) -> None:
    with pytest.raises(kc.KvcmasError, match="missing.gguf"):
        kc.Model(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="n_threads"):
        kc.Model(tmp_path / "x.gguf", n_threads=0)
    with pytest.raises(ValueError, match="max_tokens"):
        model.generate("x", max_tokens=-1)
    with pytest.raises(ValueError, match=f"kv_budget 10 bytes holds no KV block .*{model.kv_block_bytes} bytes"):
        kc.Model(model.path, kv_budget=10)  # a server started with it refused every request
    with pytest.raises(ValueError, match="out of range|id"):
        model.detokenize([model.n_vocab + 5])
    with pytest.raises(ValueError):
        model.generate("x", temperature=-1.0)


def test_int_arguments_past_the_cores_types_are_clear_errors(model: kc.Model) -> None:
    """Ints past the core's C types (int32, size_t) failed in the binding with a TypeError naming no argument, and
    any thread count was taken (1000 threads on 2 cores looked hung)."""
    from kvcmas_cpp.model import MAX_THREADS_PER_CPU, usable_cpus

    for kwargs, message in (
        ({"n_ctx": 10**10}, "n_ctx 10000000000 is too large"),
        ({"n_ctx": 2**31}, "n_ctx 2147483648 is too large"),
        ({"n_threads": 2**31}, "n_threads 2147483648 is too large"),
        ({"kv_budget": 2**64}, "kv_budget 18446744073709551616 is too large"),
        ({"n_threads": MAX_THREADS_PER_CPU * usable_cpus() + 1}, f"at most {MAX_THREADS_PER_CPU * usable_cpus()}\\)"),
    ):
        with pytest.raises(kc.KvcmasError, match=message):
            kc.Model(model.path, **kwargs)
    with model.new_sequence() as seq:
        seq.append([1, 2, 3], logits="none")
        with pytest.raises(kc.KvcmasError, match=r"kv: positions \[0, 1099511627776\) are outside the sequence"):
            seq.kv(0, 2**40)
        with pytest.raises(kc.KvcmasError, match="corr_row0 1099511627776 is outside the correction's rows"):
            seq.append_shared(seq.share(0, 2), None, 2**40)
        with pytest.raises(ValueError, match="append: token id 1099511627776 is out of range"):
            seq.append([2**40])
        assert len(seq) == 3


def test_generation_ends_at_the_context_with_length(model: kc.Model) -> None:
    """max_tokens past the context ends the reply where the sequence is full, finish_reason 'length' (it raised
    'context overflow' after generating every token, and the reply was lost); the argument errors name themselves."""
    small = kc.Model(model.path, n_threads=2, n_ctx=64)
    prompt = small.tokenize("Count from one to one hundred:")
    out = small.generate(
        prompt, max_tokens=10**6, temperature=0, logit_bias={t: -100.0 for t in small.tokenizer.eog_ids}
    )
    assert out.finish_reason == "length" and len(out.tokens) == 64 - len(prompt), (out.finish_reason, len(out.tokens))
    with pytest.raises(ValueError, match="stop must be a string or a list of strings, got int"):
        small.generate("x", max_tokens=2, stop=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 0, got 2.5"):
        small.generate("x", max_tokens=2.5)  # type: ignore[arg-type]


def test_a_prompt_past_the_context_is_refused_before_any_compute(model: kc.Model) -> None:
    """A prompt longer than n_ctx is refused by size before a row is computed (generate used to prefill 8,192 rows
    and then stop with the core's 'context overflow: sequence 0 ... 512 more'); a prompt that leaves no room for one
    generated token is refused too. A sequence's append checks the whole call up front the same way."""
    prompt = model.tokenize(" word" * (model.n_ctx + 600))
    before = model.n_sequences, model.kv_bytes_in_use
    start = time.perf_counter()
    says = rf"generate: the prompt is {len(prompt)} tokens, and the context \(n_ctx\) is {model.n_ctx} tokens"
    with pytest.raises(ValueError, match=says):
        model.generate(prompt, max_tokens=4)
    with pytest.raises(ValueError, match=rf"the prompt is {model.n_ctx} tokens"):
        model.generate(prompt[: model.n_ctx], max_tokens=4)
    with model.new_sequence() as seq:
        seq.append(prompt[:100], logits="none")
        with pytest.raises(ValueError, match=rf"the prompt is {model.n_ctx - 100} tokens after the sequence's 100"):
            model.generate(prompt[100 : model.n_ctx], max_tokens=1, sequence=seq)
        with pytest.raises(kc.KvcmasError, match=rf"context overflow: {model.n_ctx} tokens after the sequence's 100"):
            seq.append(prompt[: model.n_ctx])
        assert len(seq) == 100 and model.sequence_rows(seq.id) == 100
    assert time.perf_counter() - start < 2.0  # nothing of the 8K-token prompts was computed
    assert (model.n_sequences, model.kv_bytes_in_use) == before
    assert model.generate(prompt[: model.n_ctx - 1], max_tokens=4).finish_reason == "length"  # one token fits


def test_token_ids_must_be_integers(model: kc.Model) -> None:
    """bytes are a Sequence[int]: text read in binary mode was generated from as token ids (b"hello" gave '|||');
    2.7 was truncated to token 2. Every entry that takes ids refuses them, naming itself."""
    seq = model.new_sequence()
    calls = {
        "generate": lambda ids: model.generate(ids, max_tokens=1),
        "append": lambda ids: seq.append(ids),
        "reserve": lambda ids: seq.reserve(ids),
        "decode_batch": lambda ids: model.decode_batch([(seq, ids)]),
    }
    for where, call in calls.items():
        for bad, says in ((b"hello", "got bytes"), ([1, 2.7], r"must be integers, got 2\.7"), (7, "got int")):
            with pytest.raises(ValueError, match=f"{where}: .*{says}"):
                call(bad)
    with pytest.raises(ValueError, match="append: .*got text"):
        seq.append("hello")  # type: ignore[arg-type]
    assert len(seq) == 0 and seq.reserved == 0  # nothing was appended or reserved
    assert seq.append(np.array([1, 2], np.int32)) is not None  # numpy integers are ids
    seq.close()


def test_default_model_path_points_at_the_wheel() -> None:
    path = kc.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
