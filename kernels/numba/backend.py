"""The numba backend's declaration: what it serves, and its launchers."""

from __future__ import annotations

import torch

from attnperf.backend import FEATURES, Capabilities, FusedBackend
from attnperf.kernels.numba.attention import (
    numba_attention_backward,
    numba_attention_forward,
    numba_forward_for,
)
from attnperf.kernels.numba.jit import MISSING
from attnperf.kernels.numba.kvcache import numba_kvcache_forward, numba_kvcache_step
from attnperf.kernels.numba.linear import numba_linear_backward, numba_linear_forward


class NumbaBackend(FusedBackend):
    name = "numba"
    description = "fused tiled online-softmax CPU kernel (Numba, BLAS tiles), O(tile) memory"
    capabilities = Capabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        max_head_dim=None,
        features=frozenset(FEATURES) - {"dropout", "kvcache_backward", "func_grad"},
    )

    forward = staticmethod(numba_attention_forward)
    backward = staticmethod(numba_attention_backward)
    forward_for = staticmethod(numba_forward_for)
    kvcache_forward = staticmethod(numba_kvcache_forward)
    kvcache_step = staticmethod(numba_kvcache_step)
    linear_forward = staticmethod(numba_linear_forward)
    linear_backward = staticmethod(numba_linear_backward)

    def unavailable_reason(self) -> str | None:
        return MISSING


BACKEND = NumbaBackend()
