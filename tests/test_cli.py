"""The `kvcmas` command line, run for real in subprocesses on the default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

import kvcmas_cpp as kc


def kvcmas(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "kvcmas_cpp.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_generate_prints_the_greedy_answer_and_timings(model: kc.Model, default_model_path: str) -> None:
    out = kvcmas("generate", "What is 2 + 2?", "-n", "12", "-t", "2", "--timings", "--no-stream")
    assert out.returncode == 0, out.stderr
    expected = model.chat([{"role": "user", "content": "What is 2 + 2?"}], max_tokens=12, temperature=0.0)
    assert out.stdout.rstrip("\n") == expected.text
    assert "prompt:" in out.stderr and "tok/s" in out.stderr


def test_generate_streams_the_same_text(model: kc.Model) -> None:
    streamed = kvcmas("generate", "Name a fruit.", "-n", "10", "-t", "2")
    whole = kvcmas("generate", "Name a fruit.", "-n", "10", "-t", "2", "--no-stream")
    assert streamed.returncode == 0 and whole.returncode == 0
    assert streamed.stdout == whole.stdout


def test_raw_generation_continues_the_text(model: kc.Model) -> None:
    out = kvcmas("generate", "--raw", "The capital of France is", "-n", "6", "-t", "2", "--no-stream")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == model.generate("The capital of France is", max_tokens=6, temperature=0.0).text


def test_chat_reads_turns_from_stdin() -> None:
    out = kvcmas("chat", "-n", "8", "-t", "2", stdin="Hello!\n\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("> ") and len(out.stdout.strip()) > 2


def test_chat_drops_a_bad_turn_and_goes_on() -> None:
    """A line that is not UTF-8 is reported and dropped; the next turn is answered as if it had not been sent."""
    turns = b"\xff\xfe not text\nHello!\n\n"
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "chat", "-n", "8", "-t", "2"]
    out = subprocess.run(cmd, input=turns, capture_output=True, timeout=300, check=False)
    stderr = out.stderr.decode(errors="replace")
    assert out.returncode == 0 and "that message was dropped, the chat goes on" in stderr, stderr
    alone = kvcmas("chat", "-n", "8", "-t", "2", stdin="Hello!\n\n")
    answer = alone.stdout.split("> ")[1]
    assert answer.strip() and out.stdout.decode().split("> ")[2] == answer  # the same answer as without it


def test_bench_core_json_has_the_measured_fields(default_model_path: str) -> None:
    out = kvcmas("bench", "core", "--threads", "1", "--prompt", "16", "--gen", "4", "--rounds", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 1 and rows[0]["engine"] == "kvcmas"
    assert rows[0]["prefill_tok_s"] > 0 and rows[0]["decode_tok_s"] > 0 and rows[0]["peak_rss_mb"] > 50
    # What the file really holds, not what its name says: bytes per storage type of its matrices, as gguf-py reads them.
    reader = gguf.GGUFReader(default_model_path)
    mix: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            mix[t.tensor_type.name] = mix.get(t.tensor_type.name, 0) + int(t.n_bytes)
    assert rows[0]["weight_bytes_per_type"] == mix
    assert rows[0]["file_type"] == gguf.LlamaFileType(reader.fields["general.file_type"].contents()).name[7:]


def test_bench_core_times_by_cpu_time_on_request() -> None:
    """--clock cpu: the rates divide by the engine process's CPU time (time a wait does not count), and the table
    says so."""
    from kvcmas_cpp.bench.core import CLOCKS, CoreResult, format_table

    out = kvcmas("bench", "core", "--threads", "1", "--prompt", "16", "--gen", "4", "--rounds", "1", "--clock", "cpu",
                 "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["clock"] == "cpu" and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    fields = {k: v for k, v in row.items() if k in CoreResult.__dataclass_fields__}
    assert "tokens per second of CPU time" in format_table([CoreResult(**fields)])
    assert "CPU time" not in format_table([CoreResult(**{**fields, "clock": "wall"})])
    t_cpu, t_wall = CLOCKS["cpu"](), CLOCKS["wall"]()
    time.sleep(0.3)
    assert CLOCKS["cpu"]() - t_cpu < 0.1 <= 0.3 <= CLOCKS["wall"]() - t_wall


def test_bench_core_counts_only_the_chosen_experts_per_decode_token(tmp_path: Path) -> None:
    """A mixture of experts' decode step reads expert_used_count of expert_count stacked expert matrices; the other
    matrices whole, the untied embedding one row (not counted)."""
    from kvcmas_cpp.bench.core import weight_bytes_per_token

    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_uint32("qwen3moe.expert_count", 8)
    w.add_uint32("qwen3moe.expert_used_count", 2)
    shapes = {"token_embd.weight": (50, 16), "output.weight": (50, 16), "blk.0.attn_q.weight": (16, 16),
              "blk.0.ffn_gate_inp.weight": (8, 16), "blk.0.ffn_up_exps.weight": (8, 32, 16)}  # fmt: skip
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    dense = 4 * (50 * 16 + 16 * 16 + 8 * 16)
    assert weight_bytes_per_token(str(path)) == dense + 4 * 8 * 32 * 16 * 2 // 8


@pytest.fixture(scope="module")
def cut_model(default_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model cut off after 3 MB (a download interrupted in its tensor data)."""
    path = tmp_path_factory.mktemp("cut") / "cut.gguf"
    with open(default_model_path, "rb") as f:
        path.write_bytes(f.read(3_000_000))
    return path


def test_benchmarks_refuse_bad_input_before_any_run(cut_model: Path) -> None:
    """Each used to end in a traceback (a worker's, a ZeroDivisionError, numpy's), some after a progress bar."""
    small = ("--prompt", "16", "--gen", "4", "--rounds", "1")
    cases = [
        (("core", "--threads", "0", *small), 2, "argument --threads: must be a positive integer, got 0"),
        (("core", "--prompt", "0"), 2, "argument --prompt: must be a positive integer, got 0"),
        (("core", "--rounds", "x"), 2, "argument --rounds: not an integer: 'x'"),
        (("core", "--model", str(cut_model), *small), 1, "lies past the end of the file (3000000 bytes"),
        (("agents", "--shared-tokens", "0"), 2, "argument --shared-tokens: must be a positive integer, got 0"),
        (("agents", "--questions", "-1"), 2, "argument --questions: must be 0 or more, got -1"),
        (("agents", "--shared-tokens", "", "--questions", "0"), 1, "nothing to measure: --shared-tokens is empty"),
        (("agents", "--concurrent", "2,x"), 2, "argument --concurrent: not an integer: 'x'"),
        (("attention", "--repeat", "0"), 2, "argument --repeat: must be a positive integer, got 0"),
        (("attention", "--ranks", ","), 2, "argument --ranks: needs one or more positive integers"),
    ]
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        cases.append((("core", "--compare", "llama-cpp", *small), 1, "--compare llama-cpp needs llama-cpp-python"))
    for args, status, message in cases:
        out = kvcmas("bench", *args)
        assert out.returncode == status and message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and "%|" not in out.stderr  # refused before any progress bar


def test_a_failed_benchmark_worker_reports_its_last_error_line(cut_model: Path) -> None:
    from kvcmas_cpp.bench import core as bench
    from kvcmas_cpp.errors import CommandError

    with pytest.raises(CommandError, match=r"kvcmas benchmark failed on .*cut\.gguf \(exit status 1\): .*lies past"):
        bench._measure("kvcmas", str(cut_model), 1, 16, 4, "f16:q8")


def test_bench_serve_reports_a_server_it_cannot_use(cut_model: Path, default_model_path: str) -> None:
    """A server it starts that exits, and a --url server that refuses its key: one error line each."""
    from helpers.server import ServerProcess

    out = kvcmas("bench", "serve", "--model", str(cut_model), timeout=180)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "kvcmas-server exited with 1 before it served: " in out.stderr and "lies past the end" in out.stderr
    srv = ServerProcess(str(default_model_path), "--api-key", "s3cret")
    try:
        out = kvcmas("bench", "serve", "--url", srv.url, "--api-key", "wrong", timeout=180)
    finally:
        srv.stop()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{srv.url}/v1/models answered HTTP 401: check --api-key" in out.stderr


def test_bad_model_path_is_a_clear_error(tmp_path) -> None:
    out = kvcmas("generate", "hi", "-m", str(tmp_path / "nope.gguf"))
    assert out.returncode == 1
    assert "nope.gguf" in out.stderr and "Traceback" not in out.stderr


def test_too_large_context_or_thread_counts_are_one_error_line(default_model_path: str) -> None:
    """-c/-t past a C int ended in nanobind's TypeError traceback; -t 1000 on 2 cores ran for minutes."""
    from kvcmas_cpp.model import MAX_THREADS_PER_CPU, usable_cpus

    too_many = str(MAX_THREADS_PER_CPU * usable_cpus() + 1)
    for command, option, value, message in (
        ("generate", "-c", "10000000000", "n_ctx 10000000000 is too large"),
        ("generate", "-t", "10000000000", "n_threads 10000000000 is too large"),
        ("generate", "-t", too_many, f"n_threads {too_many} is more than {MAX_THREADS_PER_CPU} per CPU"),
        ("serve", "-c", "10000000000", "n_ctx 10000000000 is too large"),
        ("serve", "-t", "10000000000", "n_threads 10000000000 is too large"),
    ):
        prompt = ("--raw", "hi") if command == "generate" else ()
        out = kvcmas(command, "-m", default_model_path, option, value, *prompt, timeout=60)
        assert out.returncode == 1 and f"kvcmas: error: {message}" in out.stderr, (command, option, out.stderr)
        assert "Traceback" not in out.stderr


def test_output_paths_are_checked_before_any_work(tmp_path: Path) -> None:
    """A folder, or a file in a missing folder, failed only when written, after the whole run (kvcmas run
    --calibration: '[Errno 21] Is a directory: '.../.adir.gguf.5_azx2s9.tmp' -> 'adir.gguf'')."""
    folder = tmp_path / "adir.gguf"
    folder.mkdir()
    a_file = tmp_path / "plot.png"
    a_file.write_text("")
    missing = tmp_path / "nodir" / "x.out"
    calibrate_one = ("run", "--questions", "1", "-n", "4", "--calibrate", "1")
    for args, message in (
        ((*calibrate_one, "--calibration", str(folder)), f"argument --calibration: {folder}: is a directory (give"),
        (("run", "--calibration", str(missing)), f"argument --calibration: {missing.parent}: output folder does not"),
        (("bench", "agents", "--out", str(folder)), f"argument --out: {folder}: is a directory"),
        (("bench", "agents", "--plot", str(a_file)), f"argument --plot: {a_file}: is a file, not a directory"),
        (("bench", "serve", "--json", str(missing)), f"argument --json: {missing.parent}: output folder does not"),
    ):
        out = kvcmas(*args, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_bench_agents_refuses_counts_that_would_run_nothing() -> None:
    """Refused at once (before the model loads and calibrates): --limit 0 used to calibrate for 30 s, then print a
    table of NaNs."""
    for args, message in (
        (("--calibrate-tokens", "0"), "--calibrate-tokens must be at least 1"),
        (("--limit", "0"), "--limit must be at least 1 example, got 0"),
        (("--max-tokens", "0"), "--max-tokens must be at least 1, got 0"),
        (("--calibrate", "-1"), "--calibrate must be 0 or more examples, got -1"),
    ):
        out = kvcmas("bench", "agents", "--task", "gsm8k", "--method", "kvcmas", *args)
        assert out.returncode == 1 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "calibration:" not in out.stderr  # no progress bar


def test_bench_agents_refuses_a_numeric_reference_outside_the_accuracy_mode() -> None:
    out = kvcmas("bench", "agents", "--method", "nonshared,nonshared+kv-f16", "--questions", "1")
    assert out.returncode == 2 and "needs --task" in out.stderr and "Traceback" not in out.stderr


def test_bench_agents_speed_only_measures_the_fitted_corrections() -> None:
    """--questions 0 skips the fidelity part, not the fitting: the speed part's kvcmas readers apply a correction of
    the ridge rank per chained edge (an unfitted estimator would read the spans uncorrected, as fullshared, and
    report its speed as kvcmas'); without training questions it is an error, not such a measurement."""
    common = ("bench", "agents", "--questions", "0", "--gen-tokens", "4", "--shared-tokens", "64", "--decode", "1")
    out = kvcmas(*common, "--train", "1", "--method", "nonshared,kvcmas,kvcmas@0.25", "--json", "--threads", "2")
    assert out.returncode == 0, out.stderr
    rows = {r["method"]: r for r in json.loads(out.stdout)["speed"]}
    for m in ("kvcmas", "kvcmas@0.25"):
        assert rows[m]["modes"][1:] == ["reuse"] * 3
        ranks = rows[m]["corr_rank"]
        assert ranks[0] == 0 and 0 < ranks[1] < ranks[2] < ranks[3], ranks  # the chain's factors grow per edge
        assert rows[m]["corr_bytes"] > 0
    assert rows["kvcmas@0.25"]["computed_tokens"][1] > rows["kvcmas"]["computed_tokens"][1]
    bad = kvcmas(*common, "--train", "0", "--method", "nonshared,kvcmas")
    assert bad.returncode == 2 and "(--train 1 or more)" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_agents_report_reads_a_resumable_run_without_running(tmp_path: Path) -> None:
    out_file = str(tmp_path / "acc.jsonl")
    common = ("bench", "agents", "--task", "gsm8k", "--method", "fullshared", "--out", out_file, "--json")
    run = kvcmas(*common, "--limit", "1", "--max-tokens", "4", "--calibrate", "0", "--threads", "2")
    assert run.returncode == 0, run.stderr
    rep = kvcmas(*common, "--report", "--model", str(tmp_path / "no-model-is-loaded.gguf"))
    assert rep.returncode == 0, rep.stderr
    assert json.loads(rep.stdout)["accuracy"] == json.loads(run.stdout)["accuracy"]
    # --limit reaches the report (question 0 is below 1, so the same table); the text table names each later reader
    limited = kvcmas(*common[:-1], "--report", "--limit", "1")
    assert limited.returncode == 0, limited.stderr
    readers = json.loads(run.stdout)["accuracy"]["summary"][1]["per_reader"]
    line = "; ".join(
        f"{x['agent']} {x['identical_with_unchanged_prompt']} of {x['unchanged_prompt_hops']}, "
        f"{100 * x['tf_top1']:.2f}%"
        for x in readers
    )
    assert len(readers) == 3 and f"- fullshared: {line}\n" in limited.stdout
    bad_limit = kvcmas(*common, "--report", "--limit", "0")
    assert bad_limit.returncode != 0 and "--limit must be at least 1" in bad_limit.stderr
    assert "Traceback" not in bad_limit.stderr
    for partial in (("--task", "gsm8k"), ("--out", out_file)):  # it never falls back to running a benchmark
        bad = kvcmas("bench", "agents", *partial, "--report")
        assert bad.returncode != 0 and "--report reads an accuracy run's file" in bad.stderr
        assert "Traceback" not in bad.stderr


def test_embeddings_in_place_of_tokens_give_the_same_logits(reference_models) -> None:
    """The forward pass accepts input vectors (image features later): token-embedding rows equal token ids."""
    import gguf

    path = reference_models["F32"]
    model = kc.Model(path, n_threads=2)
    reader = gguf.GGUFReader(path)
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    ids = [504, 3458, 282, 4649, 314]
    rows = np.asarray(table.data)[ids].astype(np.float32)
    with model.new_sequence() as a, model.new_sequence() as b:
        by_id = a.append(ids, logits="last")
        by_vector = b.append_embeddings(rows, logits=True)
        np.testing.assert_array_equal(by_vector, by_id)
        # mixed: ids, then vectors, then ids
        with model.new_sequence() as c:
            c.append(ids[:2], logits="none")
            c.append_embeddings(rows[2:4])
            np.testing.assert_array_equal(c.append(ids[4:], logits="last"), by_id)
    with pytest.raises(ValueError, match="expected shape"):
        model.new_sequence().append_embeddings(np.zeros((2, 7), np.float32))


def test_run_main_job_runs_the_team_under_both_methods(tmp_path: Path) -> None:
    saved = tmp_path / "corrections.npz"
    out = kvcmas("run", "--questions", "1", "-n", "8", "--calibrate", "2", "-t", "2", "--calibration", str(saved))
    assert out.returncode == 0, out.stderr
    assert "Question 0:" in out.stdout and "reference answer: 18" in out.stdout  # GSM8K test line 0
    for agent in ("Math Solver", "Mathematical Analyst", "Programming Expert", "Decision Maker"):
        assert f"| 0 | {agent} | nonshared |" in out.stdout and f"| 0 | {agent} | kvcmas |" in out.stdout
    # after calibrating on two questions, kvcmas' later agents read the shared spans instead of computing them
    assert "| 0 | Mathematical Analyst | kvcmas | reuse |" in out.stdout
    assert "| kvcmas |" in out.stdout.split("summary")[1]
    # fidelity beside speed: per agent whether kvcmas' answer and reply equal nonshared's
    assert "answer as nonshared" in out.stdout and "| answer = nonshared | reply = nonshared |" in out.stdout
    assert saved.is_file() and "saved to" in out.stderr
    # a second run loads the saved corrections: no calibration, the same kvcmas replies
    again = kvcmas("run", "--questions", "1", "-n", "8", "--calibrate", "2", "-t", "2", "--calibration", str(saved))
    assert again.returncode == 0, again.stderr
    assert "loaded from" in again.stderr
    rows = [ln for ln in out.stdout.splitlines() if "| kvcmas |" in ln and ln.startswith("| 0 |")]
    rows2 = [ln for ln in again.stdout.splitlines() if "| kvcmas |" in ln and ln.startswith("| 0 |")]
    strip = [r.split("|")[2:5] + r.split("|")[6:8] for r in rows]  # agent, method, mode, computed, reused
    assert strip == [r.split("|")[2:5] + r.split("|")[6:8] for r in rows2]


def test_run_calibrates_on_replies_as_long_as_the_demos(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvcmas run` fits kvcmas' maps on calibration replies of the demo's length (-n), not cut at 16 tokens: the maps
    of the reply spans' edges correct replies that long. The demo's own team runs are observed, not replaced."""
    import argparse

    from kvcmas_cpp.bench import demo

    real = demo.run_team
    calls: list[tuple[str, int, list[int]]] = []

    def observed(model, task, method, example, max_tokens, *rest, **kw):  # type: ignore[no-untyped-def]
        out = real(model, task, method, example, max_tokens, *rest, **kw)
        calls.append((example.id, max_tokens, [len(r.ids) for r in out]))
        return out

    monkeypatch.setattr(demo, "run_team", observed)
    p = argparse.ArgumentParser()
    demo.add_run_arguments(p)
    assert demo.run_demo(p.parse_args(["--questions", "1", "-n", "24", "--calibrate", "1", "-t", "2"])) == 0
    assert [c[0] for c in calls] == [f"gsm8k/{demo.CALIBRATION_OFFSET}", "gsm8k/0", "gsm8k/0"], calls
    _, calibration_tokens, calibration_reply_lengths = calls[0]  # then the question under each method
    assert calibration_tokens == 24, calls
    assert 16 < max(calibration_reply_lengths) <= 24, calls


def test_run_at_recompute_budget_one_answers_like_nonshared() -> None:
    out = kvcmas("run", "--questions", "1", "-n", "6", "--calibrate", "0", "-t", "2", "--recompute", "1")
    assert out.returncode == 0, out.stderr
    assert "DIFFERENT answer" not in out.stdout and "reply differs" not in out.stdout
    row = next(ln for ln in out.stdout.split("summary")[1].splitlines() if ln.startswith("| kvcmas |"))
    assert "| 3/3 | 3/3 | 0.0e+00 (3) |" in row  # answers, replies, first-token KL of the 3 later agents


def test_gguf_show_through_the_kvcmas_command(default_model_path: str) -> None:
    out = kvcmas("gguf", "show", default_model_path, "--no-tensors")
    assert out.returncode == 0, out.stderr
    assert "general.architecture" in out.stdout and "'llama'" in out.stdout


def test_gguf_show_and_set_say_a_folder_is_a_folder(tmp_path: Path) -> None:
    """They said 'no such file' for a folder; the engine's wording (generate -m DIR) is the one they now use."""
    folder = tmp_path / "adir.gguf"
    folder.mkdir()
    for args in (
        ("gguf", "show", str(folder)),
        ("gguf", "set", str(folder), "kvcmas.rank_k=8"),
        ("generate", "-m", str(folder), "hi"),
    ):
        out = kvcmas(*args, timeout=60)
        assert out.returncode == 1, (args, out.stderr)
        assert f"kvcmas: error: {folder}: is a directory, not a GGUF file" in out.stderr, (args, out.stderr)


def test_output_into_a_closed_pipe_ends_quietly_like_unix_tools(tmp_path: Path) -> None:
    """`kvcmas gguf show X | head -5` ended with 'kvcmas: error: [Errno 32] Broken pipe'. Now it exits as a process
    that SIGPIPE ended does (status 141 in the shell), saying nothing."""
    import gguf

    path = tmp_path / "many-keys.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for i in range(5000):  # ~300 KB of listing: more than a pipe holds, so the writer meets the closed end
        writer.add_string(f"test.key_{i:05d}", "a value")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    cmd = [sys.executable, "-m", "kvcmas_cpp.cli", "gguf", "show", str(path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == str(path)
        proc.stdout.close()  # what `head` does once it has its lines
        stderr = proc.stderr.read()
        assert proc.wait(timeout=60) == 141, stderr
    assert stderr == ""


def test_run_with_an_image_in_the_shared_context(tmp_path: Path) -> None:
    pytest.importorskip("skimage")
    import skimage

    from kvcmas_cpp.vision.random_mmproj import write_random_mmproj

    bad = kvcmas("run", "--image", "x.png")
    assert bad.returncode == 1 and "--image and --mmproj go together" in bad.stderr
    mmproj = tmp_path / "mmproj.gguf"
    write_random_mmproj(mmproj, image_size=56, n_embd=64, n_ff=128, n_layer=2, n_head=4, n_embd_out=576)
    photo = Path(skimage.__file__).parent / "data" / "chelsea.png"
    out = kvcmas(
        "run",
        "--questions",
        "1",
        "-n",
        "4",
        "--calibrate",
        "0",
        "-t",
        "2",
        "--image",
        str(photo),
        "--mmproj",
        str(mmproj),
    )
    assert out.returncode == 0, out.stderr
    assert "image tokens per agent prompt" in out.stderr
    assert "| 0 | Mathematical Analyst | kvcmas | reuse |" in out.stdout


def test_kvcmas_and_the_server_take_the_engine_options_alike() -> None:
    """--kv-type, --device and --activations come from one helper in both command lines (kvcmas_cpp.arguments)."""
    import argparse

    from kvcmas_cpp.arguments import engine_options
    from kvcmas_cpp.cli import build_parser
    from kvcmas_cpp.server.cli import add_serve_arguments

    server = argparse.ArgumentParser()
    add_serve_arguments(server)
    options = ["--kv-type", "f16", "--device", "cuda:1", "--activations", "f32"]
    parsed = [build_parser().parse_args(["generate", "hi", *options]), server.parse_args(options)]
    want = {"kv_type": "f16", "device": "cuda:1", "activations": "f32"}
    assert [engine_options(a) for a in parsed] == [want, want]
    defaults = [build_parser().parse_args(["generate", "hi"]), server.parse_args([])]
    assert [engine_options(a) for a in defaults] == [{"kv_type": "f32", "device": "cpu", "activations": "q8"}] * 2
    for parser, argv in ((build_parser(), ["generate", "hi"]), (server, [])):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--kv-type", "q4"])
