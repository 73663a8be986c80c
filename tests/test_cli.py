"""The command line: `python -m attnperf` and the `attnperf` console script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnperf import dispatch

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
