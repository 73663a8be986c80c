"""The command line: `python -m attnperf` and the `attnperf` console script."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnperf import cli, dispatch, warmup
from attnperf.bench import summary

SCRIPT = Path(sys.executable).parent / "attnperf"


def run(*args, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=300, check=False)


@pytest.mark.parametrize(
    "command",
    [[sys.executable, "-m", "attnperf"], [str(SCRIPT)]],
    ids=["python-m", "console-script"],
)
def test_info_prints_every_backend(command, tmp_path):
    if not os.path.exists(command[0]):
        pytest.skip(f"console script not installed at {command[0]}")
    result = run(*command, "info", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name, backend in dispatch.registry().items():
        line = next(line for line in result.stdout.splitlines() if line.startswith(name + " "))
        reason = backend.unavailable_reason()
        assert ("available" if reason is None else f"unavailable: {reason}") in line


def test_smoke_runs_every_available_backend(tmp_path):
    result = run(sys.executable, "-m", "attnperf", "smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for name, backend in dispatch.registry().items():
        if backend.unavailable_reason() is None:
            assert f"{name}" in result.stdout and "MISMATCH" not in result.stdout


def test_unknown_command_fails_with_usage(tmp_path):
    result = run(sys.executable, "-m", "attnperf", "frobnicate", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_bench_refuses_kv_heads_that_do_not_divide_heads(tmp_path):
    result = run(sys.executable, "-m", "attnperf", "bench", "--heads", "8", "--kv-heads", "3",
                 cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    assert "--kv-heads must divide --heads (8), got 3" in result.stderr


BAD_OPTIONS = {
    "negative_length": (["bench", "--lengths", "-5"], "--lengths: expected a whole number >= 1"),
    "zero_length": (["bench", "--lengths", "0"], "--lengths: expected a whole number >= 1"),
    "unknown_backend": (["bench", "--backends", "nosuch"], "invalid choice: 'nosuch'"),
    "negative_rounds": (["bench", "--rounds", "-1"], "--rounds: expected a whole number >= 1"),
    "zero_rounds": (["bench", "--rounds", "0"], "--rounds: expected a whole number >= 1"),
    "negative_threads": (["bench", "--threads", "-1"], "--threads: expected a whole number"),
    "unwritable_out": (["bench", "--out", "/proc/attnperf/x"], "--out /proc/attnperf/x: cannot"),
    "missing_baseline": (["bench", "--baseline", "nothing.json"], "cannot read it"),
    "corrupt_baseline": (["bench", "--baseline", "corrupt.json"], "not an attnperf bench report"),
    "wrong_layout_baseline": (["bench", "--baseline", "layout.json"], "a benchmark without"),
    "unknown_device": (["bench", "--device", "tpu"], "expected cpu or cuda"),
    "zero_window": (["bench", "--window", "0"], "--window: expected a whole number >= 1"),
    "zero_softcap": (["bench", "--softcap", "0"], "--softcap: expected a finite number > 0"),
    "nan_softcap": (["bench", "--softcap", "nan"], "--softcap: expected a finite number > 0"),
    "unknown_layout": (["bench", "--block-mask", "diagonal"], "invalid choice: 'diagonal'"),
}


@pytest.mark.parametrize("args, message", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options_get_one_line_and_status_2_before_any_work(args, message, tmp_path):
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "layout.json").write_text('{"benchmarks": [{"extra_info": {"backend": "x"}}]}')
    result = run(sys.executable, "-m", "attnperf", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "bench-report").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
@pytest.mark.parametrize("command", ["bench", "smoke"])
def test_cuda_without_a_gpu_is_refused_clearly(command, tmp_path):
    result = run(sys.executable, "-m", "attnperf", command, "--device", "cuda", cwd=tmp_path)
    assert result.returncode == 2
    assert "no CUDA GPU is visible to torch here" in result.stderr


def test_bench_sweeps_fp32_and_bf16_by_default_each_in_its_report(tmp_path):
    result = run(sys.executable, "-m", "attnperf", "bench", "--backends", "sdpa", "--lengths",
                 "32", "--pass", "forward", "--rounds", "1", "--out", "out",
                 cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for folder, dtype in (("out", "float32"), ("out/bfloat16", "bfloat16")):
        report = json.loads((tmp_path / folder / "report.json").read_text())
        assert report["config"]["dtype"] == dtype
        assert f"attnperf bench: {dtype}" in result.stdout
    # Not a terminal: a line a step, for a log.
    assert "[1/4] float32 sdpa L=32 forward (time)" in result.stdout
    assert "[4/4] bfloat16 sdpa L=32 forward (memory)" in result.stdout


@pytest.mark.parametrize(
    "dtype, quick, expected",
    [(None, False, ("float32", "bfloat16")), (None, True, ("float32",)),
     (["float16"], False, ("float16",)), (["bfloat16", "float32", "bfloat16"], True,
                                           ("bfloat16", "float32"))],
)  # fmt: skip
def test_bench_dtypes_are_asked_or_fp32_and_bf16(dtype, quick, expected):
    assert cli.bench_dtypes(argparse.Namespace(dtype=dtype, quick=quick)) == expected


@pytest.mark.parametrize(("args", "rounds"), [([], summary.ROUNDS), (["--rounds", "2"], 2)])
def test_bench_summary_takes_its_own_rounds_unless_asked(args, rounds, monkeypatch):
    """`--summary` times summary.ROUNDS rounds a case (3, the sweep's default, left its short
    point at the mercy of this VM's slow spells); --rounds still rules."""
    asked = []

    def rows(rounds, threads, on_progress):
        asked.append(rounds)
        return []

    monkeypatch.setattr(summary, "summary_rows", rows)
    assert cli.main(["bench", "--summary", *args]) == 0
    assert asked == [rounds] and summary.ROUNDS > 3


def test_warmup_runs_its_jobs_in_workers_and_says_each_as_it_ends():
    """A job is public calls in a spawned process, which compile (or load) the kernels a
    user's calls of that kind run; the cheapest job stands for them here."""
    lines = []
    job = "float32 under a mask (bool, float)"
    for _ in range(2):
        assert warmup.warmup((job,), 1, lines.append) > 0
    assert re.fullmatch(rf"\[1/1\] {re.escape(job)}: (cached already|compiled in \d+ s)", lines[0])
    assert lines[1] == f"[1/1] {job}: cached already"  # compiled once, on disk since


def test_warmup_compiles_float32_and_bfloat16_unless_asked_for_all(monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(warmup, "warmup", lambda names, workers, say: asked.append(names) or 1.0)
    assert cli.main(["warmup"]) == 0 and cli.main(["warmup", "--all"]) == 0
    assert [names[0].split(":")[0] for names in asked] == ["float32", "float32"]
    assert asked[0] == warmup.DEFAULT_JOBS and asked[1] == tuple(warmup.JOBS)
    assert "done in" in capsys.readouterr().out
