"""The triton kernels compile for a real GPU (sm_90) on this machine, and fit its shared memory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")
SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "triton_compile_check.py"


def nvidia_compiler_missing() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as error:
        return f"triton without its NVIDIA backend ({error})"
    try:
        get_ptxas(90)
    except Exception as error:  # whatever stops it finding ptxas
        return f"no ptxas for triton's NVIDIA backend ({error})"
    return None


@pytest.mark.skipif(nvidia_compiler_missing() is not None, reason=str(nvidia_compiler_missing()))
def test_forward_and_backward_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Forward, preprocess, dK/dV and dQ, plain, with every variant and packed (varlen); the
    # KV-cache split and merge kernels, contiguous, paged and int8; linear attention's chunk
    # systems (before each of the next three), forward (without and with its saved states)
    # and backward.
    assert "sm_90: 24 kernels compiled, 0 failures" in result.stdout
