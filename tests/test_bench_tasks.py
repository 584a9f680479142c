"""The evaluation harness: accuracy mode with resume, fidelity comparison, concurrent mode, plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvcmas_cpp as kc
from kvcmas_cpp.agents import Response, ResponseStats
from kvcmas_cpp.bench import accuracy, cold_start, concurrency, report
from kvcmas_cpp.bench.tasks import get_task


def _resp(ids: list[int], logits: np.ndarray) -> Response:
    return Response("a", "", ids, "stop", ResponseStats("a", "m", "reuse", "", 1.0, 1, 1, 0), logits)


def test_compare_stops_measuring_once_prompts_diverge() -> None:
    rng = np.random.default_rng(0)
    la, lb, lc = (rng.standard_normal(10) for _ in range(3))
    exact = [_resp([1, 2], la), _resp([3], lb), _resp([4], lc)]
    other = [_resp([1, 2], la), _resp([9], lb + 0.1), _resp([4], lc)]
    rows = accuracy.compare(exact, other)
    assert [r["identical"] for r in rows] == [True, False, True]
    assert [r["aligned"] for r in rows] == [True, True, False]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-12) and rows[0]["top1"]
    assert rows[1]["kl"] == pytest.approx(0.0, abs=1e-9)  # a constant shift leaves the distribution unchanged
    assert "kl" not in rows[2]  # the third prompt holds a different upstream reply


def test_accuracy_mode_writes_jsonl_and_resumes(model: kc.Model, tmp_path: Path) -> None:
    out = tmp_path / "acc.jsonl"
    res = accuracy.accuracy(model, "gsm8k", ["fullshared"], 1, 4, 0, out, resume=False)
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and res["examples"] == 1
    rec = json.loads(lines[0])
    assert rec["id"] == "gsm8k/0" and set(rec["per_method"]) == {"nonshared", "fullshared"}
    ns = rec["per_method"]["nonshared"]
    assert all(f["identical"] for f in ns["fidelity"]) and len(ns["hops"]) == 4
    names = [r["method"] for r in res["summary"]]
    assert names == ["nonshared", "fullshared"]
    assert res["summary"][0]["identical_replies"] == 1.0 and res["summary"][0]["first_token_kl"] == 0.0
    assert res["summary"][1]["computed_tokens"] < res["summary"][0]["computed_tokens"]
    again = accuracy.accuracy(model, "gsm8k", ["fullshared"], 1, 4, 0, out, resume=True)
    assert len(out.read_text().splitlines()) == 1  # nothing recomputed
    assert again["summary"] == res["summary"]
    # resumed by (example, method): a method added later runs alone (with the nonshared reference); at recompute
    # budget 1 kvcmas' team answers exactly like nonshared's, teacher-forced top-1 100%
    more = accuracy.accuracy(model, "gsm8k", ["fullshared", "kvcmas@1"], 1, 4, 0, out, resume=True)
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[1])["per_method"]) == {"nonshared", "kvcmas@1"}
    row = {r["method"]: r for r in more["summary"]}
    # fullshared's speedup is still against the nonshared run beside it, not the re-run reference's timing
    assert row["fullshared"] == res["summary"][1]
    ref_runs = [json.loads(line)["per_method"]["nonshared"] for line in lines]
    later = [np.mean([h["ttft_ms"] for h in r["hops"][1:]]) for r in ref_runs]
    assert later[0] != later[1]  # two timings of the same reference: the pairing matters
    assert res["summary"][1]["later_ttft_speedup"] == pytest.approx(later[0] / res["summary"][1]["later_ttft_ms"])
    assert row["kvcmas@1"]["later_ttft_speedup"] == pytest.approx(later[1] / row["kvcmas@1"]["later_ttft_ms"])
    assert row["kvcmas@1"]["identical_replies"] == 1.0 and row["kvcmas@1"]["tf_top1"] == 1.0
    assert row["kvcmas@1"]["identical_with_unchanged_prompt"] == row["kvcmas@1"]["unchanged_prompt_hops"] == 3
    # identical replies among the hops whose upstream replies were all nonshared's, counted from the record
    fid = json.loads(lines[0])["per_method"]["fullshared"]["fidelity"][1:]
    unchanged = [f["identical"] for f in fid if f["aligned"]]
    assert row["fullshared"]["unchanged_prompt_hops"] == len(unchanged) >= 1
    assert row["fullshared"]["identical_with_unchanged_prompt"] == sum(unchanged)
    # the same counts per later reader, and each reader's teacher-forced top-1, from the record
    rec_fs = json.loads(lines[0])["per_method"]["fullshared"]
    readers = row["fullshared"]["per_reader"]
    assert [x["agent"] for x in readers] == [h["agent"] for h in rec_fs["hops"][1:]]
    assert [(x["unchanged_prompt_hops"], x["identical_with_unchanged_prompt"]) for x in readers] == [
        (int(f["aligned"]), int(f["aligned"] and f["identical"])) for f in fid
    ]
    assert [x["tf_top1"] for x in readers] == rec_fs["tf_top1"][1:]
    assert [x["identical_with_unchanged_prompt"] for x in row["kvcmas@1"]["per_reader"]] == [1, 1, 1]
    assert row["kvcmas@1"]["recomputed_tokens"] > 0 and row["kvcmas@1"]["vs_nonshared"]["diff"] == 0.0
    # --report: the same table from the file alone, nothing run (a method some example lacks is left out of it)
    assert accuracy.report("gsm8k", ["fullshared", "kvcmas@1"], out)["summary"] == more["summary"]
    assert accuracy.report("gsm8k", ["fullshared"], out)["summary"][1] == res["summary"][1]
    with pytest.raises(ValueError, match="no gsm8k example has results for all of nonshared, kvcomm"):
        accuracy.report("gsm8k", ["kvcomm"], out)
    with pytest.raises(ValueError, match=r"no mmlu example .* \(0 mmlu examples"):  # a file of another task
        accuracy.report("mmlu", ["fullshared"], out)
    # --report --limit N: only examples 0..N-1 (here a later example whose fullshared answer is the other way)
    later_ex = json.loads(lines[0])
    later_ex["id"] = "gsm8k/7"
    later_ex["per_method"]["fullshared"]["correct"] = not later_ex["per_method"]["fullshared"]["correct"]
    longer = tmp_path / "longer.jsonl"
    longer.write_text(out.read_text() + json.dumps(later_ex) + "\n")
    assert accuracy.report("gsm8k", ["fullshared"], longer)["examples"] == 2
    assert accuracy.report("gsm8k", ["fullshared"], longer, limit=7) == accuracy.report("gsm8k", ["fullshared"], out)
    assert accuracy.report("gsm8k", ["fullshared"], longer, limit=8)["examples"] == 2
    with pytest.raises(ValueError, match="--limit must be at least 1"):
        accuracy.report("gsm8k", ["fullshared"], longer, limit=0)
    with open(out, "a") as f:
        f.write('{"id": "gsm8k/1"}\n')
    with pytest.raises(ValueError, match=r"acc\.jsonl:3: not a result line"):
        accuracy.report("gsm8k", ["fullshared"], out)
    with pytest.raises(ValueError, match="no such results file"):
        accuracy.report("gsm8k", ["fullshared"], tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="accuracy mode runs"):
        accuracy.accuracy(model, "gsm8k", ["oracle"], 1, 4, 0, None, resume=False)


def test_numeric_references_run_nonshared_on_their_own_engine_configuration(model: kc.Model, tmp_path: Path) -> None:
    """nonshared+kv-f16 and nonshared+act-f32 are nonshared on a second model loaded with f16 K/V rows or exact
    activations: nothing shared, the same prompts, first-token logits that differ from nonshared's by numerics only
    (on the same model they would be bit-identical), KV bytes halved by f16 rows."""
    variants = ["nonshared+kv-f16", "nonshared+act-f32"]
    models = accuracy.variant_models(model, ["fullshared", *variants])
    assert set(models) == set(variants) and models["nonshared+act-f32"].activations == "f32"
    assert models["nonshared+kv-f16"].kv_row_bytes * 2 == model.kv_row_bytes
    out = tmp_path / "numeric.jsonl"
    res = accuracy.accuracy(model, "gsm8k", variants, 1, 6, 0, out, resume=False)
    per = json.loads(out.read_text())["per_method"]
    ref = per["nonshared"]
    for m in variants:
        first = per[m]["fidelity"][0]  # the first agent's prompt is always the same as nonshared's
        assert first["aligned"] and first["top1"] and 0 < first["kl"] < 1e-2
        assert all(h["mode"] in ("source", "dense") and h["corr_bytes"] == 0 for h in per[m]["hops"])
        assert [h["prompt_tokens"] for h in per[m]["hops"][:1]] == [h["prompt_tokens"] for h in ref["hops"][:1]]
        assert len(per[m]["tf_top1"]) == 4
    row = {r["method"]: r for r in res["summary"]}
    assert row["nonshared+kv-f16"]["kv_bytes_per_request"] < row["nonshared"]["kv_bytes_per_request"]
    assert row["nonshared+kv-f16"]["reuse_share"] == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        accuracy.accuracy(model, "gsm8k", ["nonshared+kv-f8"], 1, 4, 0, None, resume=False)


def test_concurrent_mode_and_plots(model: kc.Model, tmp_path: Path) -> None:
    rows = concurrency.concurrent(model, ["fullshared"], [1, 2], max_tokens=3, calibrate=0)
    assert [r["workflows"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"] and r["peak_kv_bytes"] > 0
    speed = [
        {"method": m, "shared_tokens": n, "later_ttft_ms": t, "kv_bytes_per_hop": [1 << 20] * 4}
        for m, n, t in (("nonshared", 256, 100.0), ("nonshared", 1024, 400.0), ("kvcmas", 256, 50.0))
    ]
    acc = {
        "task": "gsm8k",
        "examples": 1,
        "summary": [
            {
                "method": m,
                "accuracy": 0.5,
                "identical_replies": 1.0,
                "later_ttft_ms": t,
                "first_token_kl": kl,
                "tf_top1": 1,
            }
            for m, t, kl in (("nonshared", 100.0, 0.0), ("kvcmas", 20.0, 1e-3), ("kvcmas@0.1", 30.0, 1e-4))
        ],
    }
    files = report.plot({"speed": speed, "accuracy": acc, "concurrent": rows}, tmp_path)
    assert {f.name for f in files} == {
        "ttft_vs_shared_length.png",
        "memory_vs_agents.png",
        "accuracy_gsm8k.png",
        "pareto_gsm8k.png",
        "concurrent_ttft.png",
    }
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cold_start_mode_fits_each_edge_after_one_read(model: kc.Model) -> None:
    """Fresh estimators over new contexts: kvcmas shares cold and reads in workflow 1 only, then reuses with learned
    corrections (CALIBRATION_READS = 1); by default the reads run off the agents' path (close() here: the calls come
    back to back), under reads=eager on the next call's; both count them in the workflow's engine time. nonshared's
    speedup is 1 and every sharing row's first-token KL and top-1 are measured against it."""
    rows = {(r["method"], r["workflow"]): r for r in cold_start.cold_start(model, 96, 2, 4)}
    assert set(rows) == {(m, w) for m in cold_start.COLD_METHODS for w in (1, 2)}
    first, second = rows[("kvcmas", 1)], rows[("kvcmas", 2)]
    assert set(first["gates"]) == {"calibrating -> reuse"} and first["calibration_tokens"] > 0
    assert set(second["gates"]) == {"reuse"} and second["calibration_tokens"] == 0
    assert first["training_read_ms"] > 0 and first["training_read_ms_on_calls"] == 0
    assert first["engine_ms"] >= first["training_read_ms"] and second["training_read_ms"] == 0
    eager = rows[("kvcmas reads=eager", 1)]
    assert 0 < eager["training_read_ms_on_calls"] <= eager["training_read_ms"]
    assert rows[("nonshared", 1)]["later_ttft_speedup"] == 1.0 and rows[("nonshared", 2)]["later_kl"] == 0.0
    assert all(rows[(m, 2)]["later_kl"] > 0 for m in ("fullshared", "kvcmas", "kvcmas reads=eager"))
    assert all(r["first_identical"] for r in rows.values())  # the first agent computes its prompt: nonshared's
    assert all(0.0 <= r["later_top1"] <= 1.0 for r in rows.values())
    # a 96-token context is under the default read's bound: it reads every row, as read_rows=0 does
    assert rows[("kvcmas read_rows=0", 1)]["calibration_tokens"] == first["calibration_tokens"]
    totals = {t["method"]: t for t in cold_start.cold_start_totals(list(rows.values()))}
    assert totals["nonshared"]["engine_vs_nonshared"] == 1.0
    assert totals["kvcmas"]["training_read_ms"] == first["training_read_ms"]
    k = totals["kvcmas"]
    assert (k["ttft_speedup_1"], k["ttft_speedup_2"]) == (first["later_ttft_speedup"], second["later_ttft_speedup"])
    assert (k["kl_1"], k["kl_after"]) == (first["later_kl"], second["later_kl"])
    assert k["top1"] == (first["later_top1"] + second["later_top1"]) / 2


def test_read_rows_fidelity_fits_maps_on_a_reads_first_rows_and_applies_them_to_the_next_context(
    model: kc.Model,
) -> None:
    rows = cold_start.read_rows_fidelity(model, 96, (16, 4096, 0))
    bounded, unbounded, past, every = rows
    assert bounded["rows_fitted"] == unbounded["rows_fitted"] == 16
    assert past["rows_fitted"] == every["rows_fitted"] >= 90 and every["rows_applied"] >= 90
    assert past["residual"] == every["residual"]  # a bound past the span's rows reads every row
    # the maps as the estimator makes them leave the rows past those fitted as they are; before, they corrected them
    assert bounded["maps"].startswith("bounded") and unbounded["maps"].startswith("every row")
    assert bounded["residual_past"] == 1.0 and unbounded["residual_past"] != 1.0
    for r in rows:
        assert 0 < r["residual"] < 10 and np.isfinite(r["residual_first_512"])
        # K and V together: between the two
        assert min(r["residual_k"], r["residual_v"]) <= r["residual"] <= max(r["residual_k"], r["residual_v"])


def test_cold_start_rows_are_checked_and_nonshared_always_runs() -> None:
    assert list(cold_start.cold_rows(["kvcmas"])) == ["nonshared", "kvcmas"]
    assert list(cold_start.cold_rows(["kvcmas", "nonshared"])) == ["nonshared", "kvcmas"]
    assert list(cold_start.cold_rows(None)) == list(cold_start.COLD_METHODS)
    with pytest.raises(ValueError, match="unknown cold-start rows.*choose from"):
        cold_start.cold_rows(["kvcmas", "kvcmas fast"])


def test_bench_attention_compares_fused_with_materialized() -> None:
    from helpers.native import require_testing
    from kvcmas_cpp.bench import attention

    kernels = require_testing()
    for kv_type, tol in (("f32", 1e-5), ("f16", 2e-3)):
        r = attention.measure(kernels, 64, 8, kv_type, n_head=6, n_head_kv=2, hd=32, repeat=2)
        assert r["max_rel_diff"] < tol and r["fused_us"] > 0 and r["materialized_us"] > 0
        assert r["fused_bytes_per_agent"] == (2 * 64 * 8 + 2 * 8 * 64) * 4
        assert r["materialized_bytes_per_agent"] == 2 * 64 * 64 * (2 if kv_type == "f16" else 4)


def test_paired_interval_and_mcnemar() -> None:
    base = [True] * 10 + [False] * 10
    other = [False] * 10 + [False] * 10  # ten losses, no wins
    v = accuracy.paired(base, other)
    assert v["diff"] == pytest.approx(-0.5) and (v["wins"], v["losses"]) == (0, 10)
    assert v["mcnemar_p"] == pytest.approx(2 / 2**10)
    lo, hi = v["ci95"]
    assert lo <= -0.5 <= hi < 0
    sd = np.std([-1.0] * 10 + [0.0] * 10, ddof=1)
    assert v["questions_for_3pt"] == int(np.ceil((1.96 * sd / 0.03) ** 2))
    same = accuracy.paired(base, base)
    assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["mcnemar_p"] == 1.0


def test_harness_calibrates_on_its_own_examples_with_full_length_replies(
    default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvcmas fits the maps of the reply spans' edges on the calibration examples' replies, so those are as long as
    the evaluated replies (max_tokens) unless calibrate_tokens says otherwise (they were cut at 16 tokens: maps fitted
    on a reply's first rows then corrected 256-row replies). And the maps come from this run's calibration only: the
    harness neither loads nor writes the calibration directory (it used to load an earlier run's maps, so --calibrate
    did not take effect). The harness's own runs are observed, not replaced."""
    from kvcmas_cpp.sharing.persist import default_calibration_dir

    model = kc.Model(default_model_path, n_threads=2)  # a model of its own: a fresh estimator (shared per model)
    real = accuracy.run_workflow
    calls: list[tuple[str, int, list[Response] | list[float]]] = []

    def observed(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append((args[3], args[4], out))
        return out

    monkeypatch.setattr(accuracy, "run_workflow", observed)
    calibration = {e.question for e in accuracy.calibration_examples(get_task("gsm8k"), 1, 1)}

    def calibration_reply_lengths() -> list[int]:
        return [len(r.ids) for q, _, out in calls if q in calibration for r in out if isinstance(r, Response)]

    accuracy.accuracy(model, "gsm8k", ["kvcmas"], 1, 24, 1, None, resume=False, teacher_forced=False)
    lengths = calibration_reply_lengths()
    assert len(lengths) == 4 and 16 < max(lengths) <= 24, lengths
    written = [p for p in default_calibration_dir().rglob("*") if p.is_file()]
    assert not written, written
    calls.clear()
    accuracy.accuracy(
        model, "gsm8k", ["kvcmas"], 1, 24, 1, None, resume=False, teacher_forced=False, calibrate_tokens=5
    )
    lengths = calibration_reply_lengths()
    assert len(lengths) == 4 and max(lengths) <= 5, lengths
    calls.clear()
    with pytest.raises(ValueError, match="at least 1 reply token"):
        accuracy.accuracy(model, "gsm8k", ["kvcmas"], 1, 24, 1, None, resume=False, calibrate_tokens=0)
    assert not calls  # refused before any run
