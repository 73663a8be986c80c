"""The benchmark machinery: memory measurement, fits, reports, baseline comparison."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from attnperf import dispatch
from attnperf.bench import linear, serving, summary, sweep
from attnperf.bench.report import (
    build_report,
    compare_to_baseline,
    dtypes_plot,
    left_out_note,
    local_exponent,
    table_rows,
    verdict,
    write_report,
)
from attnperf.bench.sweep import BenchConfig, Measurement, attention_flops, fit_exponent, run_sweep
from attnperf.kernels.numba.microkernels import target_features, tile_route

KNOWN_ALLOCATION = """
import numpy as np, torch
from attnperf.bench.sweep import cpu_peak_extra_bytes
mib = 2**20
print(cpu_peak_extra_bytes(lambda: torch.ones(64 * mib // 4)))
print(cpu_peak_extra_bytes(lambda: np.ones(32 * mib // 8)))
print(cpu_peak_extra_bytes(lambda: [np.ones(8 * mib // 8) for _ in range(3)]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="peak RSS reset needs Linux /proc")
def test_peak_memory_sees_torch_and_numpy_allocations():
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(
        [sys.executable, "-c", KNOWN_ALLOCATION],
        capture_output=True, text=True, check=True, env={**__import__("os").environ, **env},
    )  # fmt: skip
    torch_bytes, numpy_bytes, list_bytes = (int(line) for line in result.stdout.split())
    mib = 2**20
    assert 64 * mib <= torch_bytes < 66 * mib
    assert 32 * mib <= numpy_bytes < 34 * mib
    assert 24 * mib <= list_bytes < 26 * mib


@pytest.mark.parametrize("call_s, warm_calls", [(0.003, 7), (0.05, 1)])
def test_a_turn_warms_for_warm_s_then_times_one_call(monkeypatch, call_s, warm_calls):
    monkeypatch.setattr(sweep, "WARM_S", 0.02)
    calls = []

    def timer(call):
        call()
        return call_s

    sweep.set_ready(timer, lambda: calls.append(None))
    try:
        assert sweep.time_turn() == call_s
    finally:
        sweep.set_ready(None)
    assert len(calls) == warm_calls + 1  # the untimed calls, then the timed one


def test_fit_exponent_recovers_a_power_law():
    lengths = [256, 512, 1024, 2048]
    slope, r2 = fit_exponent(lengths, [3e-9 * n**2 for n in lengths])
    assert slope == pytest.approx(2.0)
    assert r2 == pytest.approx(1.0)
    assert fit_exponent([256], [1.0]) is None


def test_flops_follow_the_documented_count():
    config = BenchConfig(batch=2, heads=3, head_dim=64)
    assert attention_flops(config, 128, False, "forward") == 4 * 2 * 3 * 128 * 128 * 64
    assert attention_flops(config, 128, True, "forward") == 2 * 2 * 3 * 128 * 128 * 64
    assert attention_flops(config, 128, False, "forward+backward") == 3.5 * 4 * 6 * 128**2 * 64


def test_variant_flops_count_only_the_pairs_that_take_part():
    config = BenchConfig(batch=1, heads=2, head_dim=8, window=4)
    # 10 rows, each sees min(i + 1, 4) keys: 1 + 2 + 3 + 4 * 7 = 34 pairs.
    assert attention_flops(config, 10, True, "forward") == 4 * 2 * 34 * 8
    documents = BenchConfig(batch=1, heads=1, head_dim=1, block_mask="document")
    # L = 2048: two causal documents of 1024 tokens.
    assert attention_flops(documents, 2048, False, "forward") == 4 * 2 * (1024 * 1025 // 2)


def test_a_variant_sweep_gives_sdpa_its_mask_built_once():
    config = BenchConfig(
        lengths=(64, 128), heads=2, head_dim=16, causal=(True,), window=16, softcap=None,
        alibi=True, backends=("sdpa", "reference"), rounds=1, memory=False,
    )  # fmt: skip
    points = run_sweep(config)
    assert all(p.status == "ok" and p.median_s > 0 for p in points)
    assert {p.note for p in points if p.backend == "sdpa"} == {
        "+0.0 MiB mask built once",
        "+0.1 MiB mask built once",
    }
    softcapped = run_sweep(BenchConfig(lengths=(32,), heads=2, head_dim=16, softcap=5.0,
                                       backends=("sdpa",), rounds=1, memory=False))  # fmt: skip
    assert all("softcap not supported" in p.status for p in softcapped)


def point(backend, length, median, spread=0.02):
    p = Measurement(backend, length, False, "forward", median_s=median, flops=1e9)
    p.min_s, p.max_s = median * (1 - spread / 2), median * (1 + spread / 2)
    p.times_s = [p.min_s, median, p.max_s]
    p.peak_extra_bytes = length * 1000
    return p


def test_report_ratios_and_regression_warnings():
    config = BenchConfig(lengths=(256, 512))
    base = build_report(config, [point("sdpa", 256, 1.0), point("numba", 256, 2.0)])
    entries = {b["extra_info"]["backend"]: b["extra_info"] for b in base["benchmarks"]}
    assert entries["numba"]["speed_vs_sdpa"] == pytest.approx(0.5)
    assert entries["sdpa"]["speed_vs_sdpa"] == pytest.approx(1.0)
    slower = build_report(config, [point("sdpa", 256, 1.0), point("numba", 256, 3.0)])
    warnings = compare_to_baseline(slower, base)
    assert len(warnings) == 1 and "numba L=256" in warnings[0]
    assert "0.50x -> 0.33x" in warnings[0] and "-33%" in warnings[0]
    # The whole machine 50% slower: the same-run ratio to sdpa is unchanged, nothing warns.
    machine_slower = build_report(config, [point("sdpa", 256, 1.5), point("numba", 256, 3.0)])
    assert compare_to_baseline(machine_slower, base) == []
    noisy = build_report(config, [point("sdpa", 256, 1.0), point("numba", 256, 3.0, spread=1.5)])
    assert compare_to_baseline(noisy, base) == []


def test_unsupported_points_are_reported_with_their_reason():
    config = BenchConfig(lengths=(16,), passes=("forward",), backends=("triton",), rounds=1)
    (result,) = run_sweep(config)
    assert result.status.startswith("not supported: ")
    report = build_report(config, [result])
    # A backend with nothing measured is left out of the table and named once under it.
    assert len(table_rows(report)) == 1
    assert left_out_note(report) == f"triton left out ({result.status})"
    # One with some points measured keeps its unsupported rows, each with the reason.
    measured = point("triton", 32, 1.0)
    rows = table_rows(build_report(config, [result, measured]))
    assert rows[1][-1] == result.status and left_out_note(build_report(config, [measured])) == ""


def test_growth_is_also_fitted_between_the_two_largest_lengths():
    lengths = [256, 512, 1024, 2048]
    times = [1.0, 1.2, 4.0, 16.0]  # overhead-bound at short L, then quadratic
    assert local_exponent(lengths, times) == pytest.approx(2.0)
    assert fit_exponent(lengths, times)[0] < 1.7


def test_a_tiny_sweep_writes_every_report_file(tmp_path):
    config = BenchConfig(
        lengths=(32, 64), heads=2, head_dim=16, backends=("sdpa", "reference"), rounds=2
    )
    points = run_sweep(config)
    assert all(p.status == "ok" and p.median_s > 0 for p in points)
    assert all(p.peak_extra_bytes is not None for p in points)
    report = build_report(config, points)
    written = write_report(report, tmp_path)
    assert sorted(p.name for p in written) == [
        "memory_vs_length.png", "report.json", "report.md", "time_vs_length.png",
    ]  # fmt: skip
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert {f["backend"] for f in loaded["fits"]} == {"sdpa", "reference"}
    assert "| forward | full | 32 | sdpa |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "time_vs_length.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_check_script_runs_end_to_end_under_the_interpreter(tmp_path):
    """benches/gpu_check.py at tiny sizes on CPU (TRITON_INTERPRET=1): agreement and CSV."""
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benches" / "gpu_check.py"
    csv_path = tmp_path / "gpu.csv"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, str(script), "--tiny", "--csv", str(csv_path)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "failures: 0" in result.stdout
    assert "FAIL" not in result.stdout
    header, *rows = csv_path.read_text().splitlines()
    assert header.startswith("dtype,head_dim,L,causal,pass,kernel,ms,tflops")
    linear_peers = 2 if importlib.util.find_spec("transformers") else 1  # fla: GPU only
    assert len(rows) == 2 * 2 * 1 * 2 * 2 + 10 + 6 + 6 + (linear_peers + 1) * 2  # dtypes x
    # head dims x lengths x causal x passes; the variant rows: (triton, flex, sdpa_mask) +
    # (triton, flex) x passes; decode (triton, sdpa, triton at 4 split counts); varlen
    # (triton, sdpa and triton padded) x passes; linear attention: gated delta (triton,
    # transformers) and simple GLA (triton) x passes


def test_a_gqa_sweep_runs_every_backend_that_serves_it():
    config = BenchConfig(
        lengths=(32,), heads=4, kv_heads=2, head_dim=16, passes=("forward+backward",),
        backends=("sdpa", "reference"), rounds=1,
    )  # fmt: skip
    points = run_sweep(config)
    assert [p.status for p in points] == ["ok", "ok"]
    assert all(p.median_s > 0 for p in points)


# ---------------------------------------------------------------------- --linear
@pytest.mark.skipif(dispatch.registry()["numba"].unavailable_reason() is not None,
                    reason="the --linear sweep runs numba")  # fmt: skip
def test_linear_bench_calls_run_and_agree():
    """The sweep's contenders, built as its workers build them, at a tiny T: numba's gated
    delta call gives transformers' fallback's output, and a decode turn carries its state."""
    numba = linear.LinearCall("numba", "gated delta", 70, backward=True)()
    out = numba()
    assert out.shape == (1, 70, linear.VALUE_HEADS, linear.HEAD_DIM)
    if linear.transformers_fallbacks() is not None:
        expected = linear.LinearCall("transformers", "gated delta", 70, backward=False)()()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert linear.SoftmaxCall("numba", 64, backward=False)()().shape[2] == 64
    linear.DecodeStep("numba", 2)()()  # STEPS_PER_TURN steps, the state carried


def test_linear_bench_crossover_and_flops():
    def rows(pairs):
        return [{"pass": "forward", "length": t, "call": call, "median_s": s}
                for t, timings in pairs.items() for call, s in timings.items()]  # fmt: skip

    faster_from_2048 = {1024: {"gated delta": 2.0, "softmax numba": 1.0},
                        2048: {"gated delta": 1.0, "softmax numba": 2.0},
                        4096: {"gated delta": 2.0, "softmax numba": 8.0}}  # fmt: skip
    assert linear.crossover(rows(faster_from_2048), "forward") == 2048
    never = {1024: {"gated delta": 2.0, "softmax numba": 1.0}}
    assert linear.crossover(rows(never), "forward") is None
    # fla's count at T = 64: 2 T HV (2 K V + C (K + V))
    assert linear.linear_flops(64, "forward") == 2 * 64 * 32 * (2 * 128 * 128 + 64 * 256)
    assert linear.linear_flops(64, "forward+backward") == 3.5 * linear.linear_flops(64, "forward")


def test_linear_bench_rows_give_shares_of_the_peak_and_of_sgemm(monkeypatch):
    """prefill_sweep's rows: each call's rate as a share of the fp32 FMA peak and of sgemm,
    both of the same run (the race and the rates stubbed)."""

    def race(config, calls):
        return {label: serving.Contender(label, median_s=0.5) for label in calls}

    monkeypatch.setattr(serving, "race", race)
    monkeypatch.setattr(serving, "peak_rate", lambda dtype, threads: 4e11)
    monkeypatch.setattr(serving, "sgemm_rate", lambda config: 2e11)
    monkeypatch.setattr(linear, "memory_sweep", lambda config: [])
    sweep = linear.prefill_sweep(linear.LinearConfig(lengths=(64,)), lambda message: None)
    assert sweep["peak_gflops"] == 400
    for row in sweep["rows"]:
        assert row["gflops"] == pytest.approx(row["of_peak"] * 400)
        assert row["of_sgemm"] == pytest.approx(2 * row["of_peak"])
    delta = next(r for r in sweep["rows"] if r["call"] == "gated delta")
    assert delta["of_peak"] == pytest.approx(linear.linear_flops(64, "forward") / 0.5 / 4e11)


# ---------------------------------------------------------------------- --decode, --varlen
@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_bench_peers_compute_numbas_step(tokens):
    """SDPA's two decode forms, built as the workers build them, give numba's output: one
    token without a mask, a speculative step under the bottom-right causal mask."""
    step = serving.DecodeCall("numba", 2, 40, 8, 2, 16, tokens=tokens)()()  # (B, Lq, Hq, E)
    rows = serving.SdpaDecodeCall("rows", 2, 40, 8, 2, 16, tokens)()()  # (B, H, group Lq, E)
    gqa = serving.SdpaDecodeCall("gqa", 2, 40, 8, 2, 16, tokens)()()  # (B, Hq, Lq, E)
    torch.testing.assert_close(rows.reshape(2, 8, tokens, 16).transpose(1, 2), step,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(gqa.transpose(1, 2), step, rtol=1e-5, atol=1e-5)


def test_varlen_bench_sdpa_loop_computes_the_packed_call():
    lengths = [5, 40, 17]
    packed = serving.VarlenCall("numba", "packed", lengths, 2, 16, backward=False)()()
    looped = serving.VarlenCall("sdpa", "looped", lengths, 2, 16, backward=False)()()
    torch.testing.assert_close(looped, packed, rtol=1e-5, atol=1e-5)


def test_report_gives_each_point_its_share_of_the_peak():
    point = Measurement("numba", 1024, False, "forward", median_s=0.01, min_s=0.01, max_s=0.01,
                        flops=2e9)  # fmt: skip
    report = build_report(BenchConfig(lengths=(1024,)), [point], sgemm_gflops=100.0,
                          peak_gflops=400.0)  # fmt: skip
    extra = report["benchmarks"][0]["extra_info"]
    assert extra["of_peak"] == pytest.approx(0.5) and extra["of_sgemm"] == pytest.approx(2.0)
    assert "50%" in table_rows(report)[1]


def test_the_verdict_gives_numbas_range_against_sdpa_per_dtype_and_pass(tmp_path):
    """The lines a sweep ends on: the range over L of numba's speed against SDPA's, and of
    its share of the peak, per dtype and pass, then the machine; a plot of the dtypes."""
    reports = []
    for dtype, numba_times in (("float32", (0.5, 0.8)), ("bfloat16", (0.25, 0.25))):
        points = [point("sdpa", 256, 1.0), point("sdpa", 512, 1.0)]
        points += [point("numba", 256, numba_times[0]), point("numba", 512, numba_times[1])]
        reports.append(build_report(BenchConfig(lengths=(256, 512), dtype=dtype), points,
                                    peak_gflops=10.0))  # fmt: skip
    lines = verdict(reports)
    assert lines[0] == ("numba vs SDPA, float32 forward: 1.25-2.00x SDPA's speed (L 256-512), "
                        "12-20% of the fp32 FMA peak")  # fmt: skip
    assert lines[1].startswith("numba vs SDPA, bfloat16 forward: 4.00x SDPA's speed")
    assert len(lines) == 3 and "threads" in lines[2]
    assert verdict([build_report(BenchConfig(), [point("sdpa", 256, 1.0)])]) == []
    path = dtypes_plot(reports, tmp_path / "plot.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_peak_rate_is_the_dtype_s_and_positive():
    fp32 = serving.peak_rate("float32", 1)
    assert fp32 is not None and fp32 > 1e9
    bf16 = serving.peak_rate("bfloat16", 2)
    assert bf16 is not None and bf16 > 0
    dot = "avx512bf16" in target_features()
    expected = "AMX bf16" if tile_route("bf16")[0] == "amx" else "bf16 dot" if dot else "fp32 FMA"
    assert serving.peak_kind("bfloat16") == expected
    assert serving.peak_kind("float32") == "fp32 FMA"


def test_summary_is_a_markdown_table_of_its_rows():
    rows = [{"case": "dense", "ratio": 1.25, "peer": "SDPA"},
            {"case": "decode", "ratio": None, "peer": "SDPA rows"}]  # fmt: skip
    text = summary.summary_markdown(rows, "a CPU")
    assert "| dense | 1.25x | SDPA |" in text and "| decode | - | SDPA rows |" in text
    assert len(summary.SWEEP_CASES) >= 5
