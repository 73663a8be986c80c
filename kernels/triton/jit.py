"""Triton, guarded: the decorators, the interpreter switch, and what every launcher passes."""

from __future__ import annotations

import functools
import os

import torch

from attnperf.inputs import AttentionInputs

try:
    import triton
    import triton.language as tl

    MISSING = None
except ImportError as error:
    triton = tl = None
    MISSING = f"triton is not installed ({error}); pip install 'attnperf[gpu]'"

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
MAX_HEAD_DIM = 256


def on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host table (the sequences' starts and lengths) on the kernels' device. A copy
    from the host waits for the device's stream to drain, and the GPU then idles while the
    host prepares the next call (an eighth of a short forward's time). So the tables of recent calls
    stay on the device: a repeated shape launches without a copy."""
    if device.type != "cuda" or table.numel() == 0:
        return table.to(device)
    return _kept_on_device(device, table.dtype, tuple(table.shape), table.numpy().tobytes())


@functools.lru_cache(maxsize=256)
def _kept_on_device(device: torch.device, dtype, shape: tuple, data: bytes) -> torch.Tensor:
    # Never written: the kernels only read their tables.
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).to(device)


def jit(function):
    return triton.jit(function) if triton is not None else function


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def autotune(**kwargs):
    if triton is None:
        return lambda function: function
    return triton.autotune(**kwargs)


def kernel_flags(inputs: AttentionInputs) -> dict:
    return {
        "BLOCK_D": max(next_power_of_2(inputs.head_dim), 16),
        "BLOCK_DV": max(next_power_of_2(inputs.value_dim), 16),
        # The interpreter's low-precision dot is wrong: widen to fp32 there only.
        "WIDEN_DOT": INTERPRET,
        # fp32 inputs are computed in IEEE fp32, not TF32, so they match SDPA's fp32.
        "IEEE": inputs.dtype == torch.float32,
    }


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter casts fp32 to bf16 by truncation: there, results are stored in fp32
    and rounded by torch."""
    return torch.float32 if INTERPRET and dtype == torch.bfloat16 else dtype
