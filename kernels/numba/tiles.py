"""The tile products the kernels call: BLAS sgemm or our micro-kernels, by a runtime flag.

The flag travels with the call (never a global frozen into cached code), so one compiled
kernel serves both routes; `tiles_flag` reads the route this process takes for fp32.
"""

from __future__ import annotations

import functools

import numpy as np

from attnperf.kernels.numba.blas import gemm
from attnperf.kernels.numba.jit import FASTMATH, any_strides, njit
from attnperf.kernels.numba.microkernels import tile_route
from attnperf.kernels.numba.packing import gemm_fp32

BLAS_TILES, OWN_TILES = 0, 1


@njit(fastmath=FASTMATH)
def product(a, b, c, alpha, beta, trans_a, trans_b, tiles):
    """c = alpha * op(a) @ op(b) + beta * c on the calling thread (blas.gemm's contract),
    by BLAS or by our micro-kernels (`tiles`: BLAS_TILES or OWN_TILES)."""
    # One type for every call, so that the products compile once, not once per caller's
    # combination of layouts, literal flags and scalar types (16 in the linear kernels,
    # seconds each).
    a, b, c = any_strides(a), any_strides(b), any_strides(c)
    alpha, beta = np.float32(alpha), np.float32(beta)
    trans_a, trans_b = bool(trans_a), bool(trans_b)
    if tiles == OWN_TILES:
        gemm_fp32(a, b, c, alpha, beta, trans_a, trans_b)
    else:
        gemm(a, b, c, alpha, beta, trans_a, trans_b)


@functools.cache
def tiles_flag() -> int:
    """OWN_TILES where our fp32 micro-kernels serve this process (`tile_route`), else
    BLAS_TILES."""
    return BLAS_TILES if tile_route("fp32")[0] == "blas" else OWN_TILES
