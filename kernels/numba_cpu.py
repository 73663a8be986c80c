"""The numba backend: a fused, tiled FlashAttention-style CPU kernel (forward and backward).

Query tiles x key tiles, scores from BLAS sgemm on tiles, softmax kept online in base 2
(running max and sum, the accumulator rescaled as the max grows), logsumexp saved for the
backward pass, which recomputes the probabilities tile by tile. Extra memory is O(tile)
per thread, never O(L x S) (except the float mask's own gradient, which is L x S by nature).

The sgemm is the MKL one inside torch's own library where torch exports it (x86-64 builds),
else scipy's OpenBLAS. Kernels call it by a name of ours, bound to an address at the first
call, so that the code cached on disk does not depend on which one serves.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnperf.backend import Capabilities, FusedBackend
from attnperf.inputs import AttentionInputs

try:
    import numba
    import scipy  # noqa: F401  (scipy's BLAS serves when torch exports no sgemm)
    from llvmlite import binding as llvm_binding
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    _MISSING = None
except ImportError as error:
    numba = None
    _MISSING = f"numba and scipy are needed ({error}); pip install 'attnperf[cpu]'"


def _njit(**options):
    """numba.njit with an on-disk cache; without numba the plain function (never run)."""
    if numba is None:
        return lambda function: function
    return numba.njit(cache=True, nogil=True, **options)


prange = numba.prange if numba is not None else range
if numba is None:  # the kernels below are never run then; their helpers only need names

    def intrinsic(function):
        return function


SGEMM_SYMBOL = "attnperf_sgemm"
BLAS_THREADS_SYMBOL = "attnperf_blas_set_num_threads_local"


@intrinsic
def fortran_sgemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """sgemm_(&trans_a, &trans_b, &m, ..., c, &ldc): BLAS's Fortran interface, column-major."""
    sig = types.void(
        types.boolean, types.boolean, types.intp, types.intp, types.intp, types.float32, a,
        types.intp, b, types.intp, types.float32, c, types.intp,
    )  # fmt: skip

    def codegen(context, builder, signature, args):
        by_reference = []
        for value, kind in zip(args, signature.args, strict=True):
            if isinstance(kind, types.Array):  # a matrix: its data pointer
                by_reference.append(context.make_array(kind)(context, builder, value).data)
                continue
            if kind == types.boolean:  # a transpose flag: 'T' or 'N'
                char = ir.IntType(8)
                value = builder.select(value, char(ord("T")), char(ord("N")))
            elif kind == types.intp:  # Fortran INTEGER of an LP64 BLAS: 32 bits
                value = builder.trunc(value, ir.IntType(32))
            slot = cgutils.alloca_once(builder, value.type)
            builder.store(value, slot)
            by_reference.append(slot)
        function_type = ir.FunctionType(ir.VoidType(), [value.type for value in by_reference])
        function = cgutils.get_or_insert_function(builder.module, function_type, SGEMM_SYMBOL)
        builder.call(function, by_reference)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def set_blas_threads_local(typingctx, count):
    """Set the calling thread's BLAS thread count (MKL_Set_Num_Threads_Local): the old one."""
    sig = types.int32(types.int32)

    def codegen(context, builder, signature, args):
        int32 = ir.IntType(32)
        function_type = ir.FunctionType(int32, [int32])
        function = cgutils.get_or_insert_function(
            builder.module, function_type, BLAS_THREADS_SYMBOL
        )
        return builder.call(function, args)

    return sig, codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (vectorises, unlike a view)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def maxnum(typingctx, a, b):
    """LLVM's maxnum: the larger of two float32, NaN ignored; LLVM vectorises its reductions."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        float32 = ir.FloatType()
        function_type = ir.FunctionType(float32, [float32, float32])
        function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.maxnum.f32")
        return builder.call(function, args)

    return sig, codegen


# Tile sizes: of 64/128/256 x 128/256/512, 128 x 512 was as fast as any, causal or not,
# forward or backward, at L = 2048 and 4096 on a 2-core AVX-512 machine (same-run ratios to
# sdpa); square tiles lost up to 30% causal too: a causal query tile stops its last key tile
# at its own diagonal, so wide key tiles waste at most a triangle.
BLOCK_M = 128
BLOCK_N = 512
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
# Reassociation and contraction let LLVM vectorise the row loops; no "nnan"/"ninf", so
# NaN and inf propagate as in SDPA.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
# 2**f = exp(f * ln 2) for f in [-0.5, 0.5]: Taylor terms ln2^i / i!, error < 1e-8 relative.
# float32 constants, or the polynomial is evaluated in float64 at half the vector width.
EXP2_COEFFS = tuple(np.float32(LN2**i / math.factorial(i)) for i in range(8))
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


@_njit(fastmath=FASTMATH)
def gemm(a, b, c, alpha, beta, trans_a, trans_b):
    """c = alpha * op(a) @ op(b) + beta * c for 2-D float32 views with unit column stride,
    on the calling thread only (inside prange loops: no oversubscription).

    A row-major c is the column-major c.T = op(b).T @ op(a).T: BLAS gets b before a.
    """
    rows, cols = c.shape
    inner = a.shape[0] if trans_a else a.shape[1]
    if rows == 0 or cols == 0:
        return
    if inner == 0:  # an empty product is 0 (and BLAS refuses the leading dimension 0)
        for r in range(rows):
            for col in range(cols):
                c[r, col] = beta * c[r, col] if beta != 0 else 0.0
        return
    blas_threads = set_blas_threads_local(1)  # ~20 ns, against ~30 us for a tile's product
    fortran_sgemm(
        trans_b, trans_a, cols, rows, inner, np.float32(alpha), b, b.strides[0] // 4, a,
        a.strides[0] // 4, np.float32(beta), c, c.strides[0] // 4,
    )  # fmt: skip
    set_blas_threads_local(blas_threads)


@_njit(fastmath=FASTMATH)
def row_maximum(row, cols, start):
    """max(start, row[:cols]); NaN scores are passed over (their exp2 makes the row NaN)."""
    m = start
    for c in range(cols):
        m = maxnum(m, row[c])
    return m


@_njit(fastmath=FASTMATH)
def exp2_shifted(row, cols, shift, factor):
    """row[c] <- 2 ** (row[c] - shift) * factor in place, vectorised (no libm call); returns
    the sum.

    2**n is built in a float's exponent field; results below 2**-126 flush to 0 (they
    vanish next to the row's max, which maps to 1). NaN stays NaN.
    """
    c0, c1, c2, c3, c4, c5, c6, c7 = EXP2_COEFFS
    total = np.float32(0.0)
    for c in range(cols):
        t = row[c] - shift
        clamped = t if t > -127.0 else np.float32(-127.0)  # -inf and NaN clamp too
        n = np.floor(clamped + np.float32(0.5))
        f = clamped - n
        p = c7
        p = p * f + c6
        p = p * f + c5
        p = p * f + c4
        p = p * f + c3
        p = p * f + c2
        p = p * f + c1
        p = p * f + c0
        y = p * float32_from_bits((np.int32(n) + 127) << 23) * factor
        y = y if t == t else t
        row[c] = y
        total += y
    return total


@_njit()
def split_index(item, heads, tiles):
    """(batch, head, tile) of a flat prange index (prange indices are unsigned)."""
    item = np.int64(item)
    return item // (heads * tiles), (item // tiles) % heads, item % tiles


@_njit(fastmath=FASTMATH)
def base2_bias(value):
    """A float mask's value in base 2: finite stays finite (finfo.min, a common "masked"
    value, times log2(e) would overflow to -inf and empty a row that SDPA averages)."""
    scaled = np.float32(value * LOG2E)
    if np.isfinite(value):
        return min(max(scaled, -FLOAT32_MAX), FLOAT32_MAX)
    return scaled


@_njit(fastmath=FASTMATH)
def mask_scores(s, mask, mask_kind, b, h, i0, j0, rows, cols, causal):
    """Apply the mask (times log2(e): scores are in base 2) and causality to one tile;
    a causal tile left of the diagonal is left as it is."""
    if mask_kind == MASK_FLOAT:
        for r in range(rows):
            for c in range(cols):
                s[r, c] += base2_bias(mask[b, h, i0 + r, j0 + c])
    elif mask_kind == MASK_BOOL:
        for r in range(rows):
            for c in range(cols):
                if not mask[b, h, i0 + r, j0 + c]:
                    s[r, c] += -np.inf  # like SDPA: a NaN score stays NaN
    if causal and j0 + cols > i0 + 1:  # top-left aligned: row i sees keys 0..i
        for r in range(rows):
            for c in range(max(i0 + r + 1 - j0, 0), cols):
                s[r, c] = -np.inf


@_njit(parallel=True, fastmath=FASTMATH)
def online_softmax_forward(q, k, v, mask, mask_kind, causal, scale, out, stats, block_m, block_n):
    """out (B, Hq, L, Ev) and stats (B, Hq, L, 2): each row's base-2 max and its sum of
    2 ** (score - max); fp32 q, k, v with unit stride along E."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    q_tiles = (q_len + block_m - 1) // block_m
    scale2 = scale * LOG2E
    for item in prange(batch * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        hk = h // group
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        q_tile = q[b, h, i0 : i0 + rows]
        s = np.empty((rows, block_n), np.float32)
        acc = np.zeros((rows, value_dim), np.float32)
        row_max = np.full(rows, -np.inf, np.float32)
        row_sum = np.zeros(rows, np.float32)
        shift = np.zeros(rows, np.float32)
        kv_end = min(kv_len, i0 + rows) if causal else kv_len
        for j0 in range(0, kv_end, block_n):
            cols = min(block_n, kv_end - j0)
            gemm(q_tile, k[b, hk, j0 : j0 + cols], s[:, :cols], scale2, 0.0, False, True)
            mask_scores(s, mask, mask_kind, b, h, i0, j0, rows, cols, causal)
            for r in range(rows):
                new_max = row_maximum(s[r], cols, row_max[r])
                # A row with nothing allowed so far shifts by 0: its exp2 stays 0, not NaN.
                shift[r] = new_max if new_max != -np.inf else 0.0
                alpha = 2.0 ** (row_max[r] - shift[r]) if row_max[r] != -np.inf else 0.0
                row_max[r] = new_max
                row_sum[r] = row_sum[r] * alpha + exp2_shifted(s[r], cols, shift[r], 1.0)
                for e in range(value_dim):
                    acc[r, e] *= alpha
            gemm(s[:, :cols], v[b, hk, j0 : j0 + cols], acc, 1.0, 1.0, False, False)
        for r in range(rows):
            # Fully masked rows (sum 0) give 0; so does their backward (p = 2**x * 0).
            inv = 1.0 / row_sum[r] if row_sum[r] != 0 else 0.0
            for e in range(value_dim):
                out[b, h, i0 + r, e] = acc[r, e] * inv
            stats[b, h, i0 + r, 0] = shift[r]
            stats[b, h, i0 + r, 1] = row_sum[r]


@_njit(fastmath=FASTMATH)
def probabilities(q_tile, k_tile, p, mask, mask_kind, b, h, i0, j0, causal, scale2, stats):
    """p[:rows, :cols] <- P of one (query tile, key tile), from the rows' saved max and sum
    (stats[i0:i0 + rows]): kept apart, they hold the sum where max + log2(sum) would round
    it away (scores near finfo.min).

    `p` is a C-contiguous buffer: its rows are C-contiguous too, which the exp2 loop needs
    to vectorise (a [:rows, :cols] view's rows are not typed so).
    """
    rows, cols = q_tile.shape[0], k_tile.shape[0]
    gemm(q_tile, k_tile, p[:rows, :cols], scale2, 0.0, False, True)
    mask_scores(p, mask, mask_kind, b, h, i0, j0, rows, cols, causal)
    for r in range(rows):
        total = stats[i0 + r, 1]
        exp2_shifted(p[r], cols, stats[i0 + r, 0], 1.0 / total if total != 0 else 0.0)


@_njit(fastmath=FASTMATH)
def score_gradients(p, dp, delta, rows, cols):
    """dp <- dS = P * (dP - delta) on [:rows, :cols] of C-contiguous buffers."""
    for r in range(rows):
        d = delta[r]
        p_row, dp_row = p[r], dp[r]
        for c in range(cols):
            dp_row[c] = p_row[c] * (dp_row[c] - d)


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dq(
    q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, dq, dmask, block_m, block_n
):
    """dq += (and the float mask's gradient dS, when dmask is L x S) per query tile."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    q_tiles = (q_len + block_m - 1) // block_m
    scale2 = scale * LOG2E
    want_dmask = dmask.shape[2] == q_len and dmask.shape[3] == kv_len
    for item in prange(batch * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        hk = h // group
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        q_tile = q[b, h, i0 : i0 + rows]
        do_tile = grad_out[b, h, i0 : i0 + rows]
        p_buffer = np.empty((rows, block_n), np.float32)
        ds_buffer = np.empty((rows, block_n), np.float32)
        kv_end = min(kv_len, i0 + rows) if causal else kv_len
        for j0 in range(0, kv_end, block_n):
            cols = min(block_n, kv_end - j0)
            k_tile, v_tile = k[b, hk, j0 : j0 + cols], v[b, hk, j0 : j0 + cols]
            ds = ds_buffer[:, :cols]
            probabilities(
                q_tile, k_tile, p_buffer, mask, mask_kind, b, h, i0, j0, causal, scale2, stats[b, h]
            )
            gemm(do_tile, v_tile, ds, 1.0, 0.0, False, True)
            score_gradients(p_buffer, ds_buffer, delta[b, h, i0 : i0 + rows], rows, cols)
            if want_dmask:
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            gemm(ds, k_tile, dq[b, h, i0 : i0 + rows], scale, 1.0, False, False)


@_njit(fastmath=FASTMATH)
def key_tile_gradients(
    q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, dq, dk, dv, dmask,
    b, hk, j0, cols, block_m, p_buffer, ds_buffer, with_dq,
):  # fmt: skip
    """dk, dv += those of keys j0..j0+cols of head hk, over the query heads of its group.

    With `with_dq`, also dq += dS K and, when dmask is L x S, dS into dmask: the caller owns
    every query row of the group then, so no other thread writes them.
    """
    q_heads, q_len = q.shape[1], q.shape[2]
    group = q_heads // k.shape[1]
    scale2 = scale * LOG2E
    want_dmask = with_dq and dmask.shape[2] == q_len and dmask.shape[3] == k.shape[2]
    k_tile, v_tile = k[b, hk, j0 : j0 + cols], v[b, hk, j0 : j0 + cols]
    dk_tile, dv_tile = dk[b, hk, j0 : j0 + cols], dv[b, hk, j0 : j0 + cols]
    q_start = j0 if causal else 0  # rows above j0 see none of these keys
    for h in range(hk * group, (hk + 1) * group):
        for i0 in range(q_start - q_start % block_m, q_len, block_m):
            rows = min(block_m, q_len - i0)
            q_tile, do_tile = q[b, h, i0 : i0 + rows], grad_out[b, h, i0 : i0 + rows]
            p, ds = p_buffer[:rows, :cols], ds_buffer[:rows, :cols]
            probabilities(
                q_tile, k_tile, p_buffer, mask, mask_kind, b, h, i0, j0, causal, scale2, stats[b, h]
            )
            gemm(p, do_tile, dv_tile, 1.0, 1.0, True, False)
            gemm(do_tile, v_tile, ds, 1.0, 0.0, False, True)
            score_gradients(p_buffer, ds_buffer, delta[b, h, i0 : i0 + rows], rows, cols)
            gemm(ds, q_tile, dk_tile, scale, 1.0, True, False)
            if with_dq:
                if want_dmask:
                    dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
                gemm(ds, k_tile, dq[b, h, i0 : i0 + rows], scale, 1.0, False, False)


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dkdv(
    q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, dk, dv, block_m, block_n
):
    """dk, dv += per key tile, summed over every query head of the key/value head's group."""
    batch, kv_heads, kv_len = k.shape[0], k.shape[1], k.shape[2]
    kv_tiles = (kv_len + block_n - 1) // block_n
    unused = np.zeros((1, 1, 1, 1), np.float32)
    for item in prange(batch * kv_heads * kv_tiles):
        b, hk, tile = split_index(item, kv_heads, kv_tiles)
        j0 = tile * block_n
        cols = min(block_n, kv_len - j0)
        p_buffer = np.empty((block_m, cols), np.float32)
        ds_buffer = np.empty((block_m, cols), np.float32)
        key_tile_gradients(
            q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, unused, dk, dv,
            unused, b, hk, j0, cols, block_m, p_buffer, ds_buffer, False,
        )  # fmt: skip


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_fused(
    q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, dq, dk, dv, dmask,
    block_m, block_n,
):  # fmt: skip
    """dq, dk, dv += (and dS into an L x S dmask) in one pass: P and dP are computed once.

    One prange item per (batch, key/value head) owns every query head of its group, so its
    dq updates need no atomics; worth it when there are enough items for the threads.
    """
    batch, kv_heads, kv_len = k.shape[0], k.shape[1], k.shape[2]
    for item in prange(batch * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        p_buffer = np.empty((block_m, block_n), np.float32)
        ds_buffer = np.empty((block_m, block_n), np.float32)
        for j0 in range(0, kv_len, block_n):
            key_tile_gradients(
                q, k, v, mask, mask_kind, causal, scale, stats, grad_out, delta, dq, dk, dv,
                dmask, b, hk, j0, min(block_n, kv_len - j0), block_m, p_buffer, ds_buffer,
                True,
            )  # fmt: skip


def _as_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _mask_for_kernel(inputs: AttentionInputs) -> tuple[np.ndarray, int]:
    """The mask as a strided array (broadcast dims keep stride 0) and its kind."""
    mask = inputs.attn_mask
    if mask is None:
        return np.zeros((1, 1, 1, 1), np.float32), MASK_NONE
    if mask.dtype == torch.bool:
        return _as_numpy(mask), MASK_BOOL
    # Convert only the mask's own elements, then broadcast again: never a full-size copy.
    compact = mask.detach()
    for dim in range(4):
        if compact.stride(dim) == 0:
            compact = compact.narrow(dim, 0, 1)
    return _as_numpy(compact.float().expand(mask.shape)), MASK_FLOAT


BLAS_CHOICES = ("auto", "torch", "scipy")


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _torch_mkl() -> tuple[int, int] | None:
    """Addresses of sgemm_ and MKL_Set_Num_Threads_Local in torch's library, if exported."""
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            library = ctypes.CDLL(str(path))
            return _address(library.sgemm_), _address(library.MKL_Set_Num_Threads_Local)
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _keep_blas_threads():
    """A C callback that leaves BLAS's threads alone: scipy's OpenBLAS is pinned from
    outside (threadpoolctl). Cached: the kernels call its code for the process's lifetime."""
    return numba.cfunc(types.int32(types.int32))(lambda count: np.int32(0))


def _scipy_openblas() -> tuple[int, int]:
    """Addresses of scipy's sgemm and of a no-op thread setter (a C callback, no GIL)."""
    import scipy.linalg.cython_blas

    capsule = scipy.linalg.cython_blas.__pyx_capi__["sgemm"]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    sgemm = api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))
    return sgemm, _keep_blas_threads().address


@functools.cache
def setup() -> tuple[str, object]:
    """Bind the kernels' BLAS and pick the threading layer, once, at the first call.

    Returns the BLAS's name and what pins it to one thread from outside (None where gemm
    pins it itself, per calling thread). torch's MKL serves where torch exports it, else
    scipy's OpenBLAS; ATTNPERF_NUMBA_BLAS=torch|scipy insists on one. Numba's "workqueue"
    layer is its own pthread pool: no second OpenMP runtime to fight torch's OpenMP pool. A
    layer chosen by the user (NUMBA_THREADING_LAYER) is respected.
    """
    choice = os.environ.get("ATTNPERF_NUMBA_BLAS", "auto")
    if choice not in BLAS_CHOICES:
        raise ValueError(f"ATTNPERF_NUMBA_BLAS must be one of {BLAS_CHOICES}, got {choice!r}")
    mkl = _torch_mkl() if choice != "scipy" else None
    if mkl is None and choice == "torch":
        raise RuntimeError("ATTNPERF_NUMBA_BLAS=torch, but torch's library exports no MKL sgemm_")
    if mkl is not None:
        name, (sgemm, set_threads), controller = "torch's MKL", mkl, None
    else:
        from threadpoolctl import ThreadpoolController

        name, (sgemm, set_threads) = "scipy's OpenBLAS", _scipy_openblas()
        controller = ThreadpoolController()
    llvm_binding.add_symbol(SGEMM_SYMBOL, sgemm)
    llvm_binding.add_symbol(BLAS_THREADS_SYMBOL, set_threads)
    if numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "workqueue"
    return name, controller


# Numba's workqueue pool serves one parallel region at a time and aborts the process when
# two Python threads enter it at once: calls from threads take turns (each uses every
# thread anyway; the lock costs well under a microsecond against a call's milliseconds).
_PARALLEL_REGION = threading.Lock()


def _run_parallel(kernel, *args) -> None:
    """Run a prange kernel on torch's thread count, BLAS on one thread inside it."""
    _, controller = setup()
    pinned = controller.limit(limits=1, user_api="blas") if controller else nullcontext()
    with _PARALLEL_REGION, pinned:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        kernel(*args)


def _float32_array(shape: tuple[int, ...], zero: bool = False) -> tuple[Tensor, np.ndarray]:
    """A new fp32 torch tensor and a numpy view of its memory for the kernels to write.

    The view is made from the address, not by Tensor.numpy(), which would pin the storage
    (a result that `resize_` refuses, unlike SDPA's); the tensor outlives every kernel call.
    """
    tensor = (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32)
    if tensor.numel() == 0:
        return tensor, np.zeros(shape, np.float32)
    memory = (ctypes.c_float * tensor.numel()).from_address(tensor.data_ptr())
    return tensor, np.ctypeslib.as_array(memory).reshape(shape)


def _fp32(tensor: Tensor) -> np.ndarray:
    """An fp32 array of `tensor` for the kernels: a view where BLAS can read it in place
    (fp32, unit stride along the head dim, rows apart: a (B, L, H, E) tensor viewed as
    (B, H, L, E), say), else an fp32 contiguous copy."""
    tensor = tensor.detach()
    in_place = (
        tensor.dtype == torch.float32
        and tensor.stride(-1) == 1
        and tensor.stride(-2) >= max(tensor.shape[-1], 1)
    )
    return _as_numpy(tensor if in_place else tensor.to(torch.float32).contiguous())


def numba_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, L, Ev) in the inputs' dtype, softmax stats (B, Hq, L, 2) fp32: each
    row's base-2 max and sum, 0 and 0 for a row that sees no key)."""
    q, k, v = _fp32(inputs.query), _fp32(inputs.key), _fp32(inputs.value)
    mask, mask_kind = _mask_for_kernel(inputs)
    no_work = not inputs.has_pairs  # then zeros: no key is seen
    out, out_array = _float32_array((*q.shape[:3], v.shape[3]), zero=no_work)
    stats, stats_array = _float32_array((*q.shape[:3], 2), zero=no_work)
    if not no_work:
        _run_parallel(
            online_softmax_forward, q, k, v, mask, mask_kind, inputs.is_causal, inputs.scale,
            out_array, stats_array, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    return out.to(inputs.dtype), stats


def fused_backward_pays(items: int, threads: int) -> bool:
    """Whether the one-pass backward beats the two passes for `items` (batch, kv head) pairs.

    The one pass computes 5 tile products per (query tile, key tile), the two passes 7 (P and
    dP twice), but it has only `items` to share out: it pays while they keep at least 3/4 of
    the threads busy. Measured at L = 2048, 8 query heads, 2 threads: 1 kv head, two passes
    1.05-1.17x faster; 2 kv heads, the one pass 1.43-1.58x faster.
    """
    return items > 0 and items / (threads * math.ceil(items / threads)) >= 0.75


def numba_attention_backward(
    inputs: AttentionInputs,
    out: Tensor,
    stats: Tensor,
    grad_out: Tensor,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) in the inputs' dtypes, by FlashAttention-2 recomputation.

    `fused`: one pass over (batch, kv head) items, or a dq pass and a dk/dv pass over tiles;
    None picks the fused pass where it pays (`fused_backward_pays`).
    """
    q, k, v = _fp32(inputs.query), _fp32(inputs.key), _fp32(inputs.value)
    mask, mask_kind = _mask_for_kernel(inputs)
    do = _fp32(grad_out)
    delta = _as_numpy((grad_out.detach().float() * out.float()).sum(-1).contiguous())
    stats = _as_numpy(stats.contiguous())
    (dq, dq_array), (dk, dk_array), (dv, dv_array) = (
        _float32_array(t.shape, zero=True) for t in (q, k, v)
    )
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask, dmask_array = _float32_array(mask.shape if want_dmask else (1, 1, 1, 1), zero=True)
    if fused is None:
        fused = fused_backward_pays(inputs.batch * inputs.kv_heads, torch.get_num_threads())
    if inputs.has_pairs:
        common = (q, k, v, mask, mask_kind, inputs.is_causal, inputs.scale, stats, do, delta)
        blocks = (BLOCK_M, BLOCK_N)
        if fused:
            grads = dq_array, dk_array, dv_array, dmask_array
            _run_parallel(attention_backward_fused, *common, *grads, *blocks)
        else:
            _run_parallel(attention_backward_dq, *common, dq_array, dmask_array, *blocks)
            _run_parallel(attention_backward_dkdv, *common, dk_array, dv_array, *blocks)
    dmask = dmask.to(inputs.attn_mask.dtype) if want_dmask else None
    return dq.to(inputs.dtype), dk.to(inputs.dtype), dv.to(inputs.dtype), dmask


class NumbaBackend(FusedBackend):
    name = "numba"
    description = "fused tiled online-softmax CPU kernel (Numba, BLAS tiles), O(tile) memory"
    capabilities = Capabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        max_head_dim=None,
        bool_mask=True,
        float_mask=True,
        causal=True,
        gqa=True,
        dropout=False,
        backward=True,
    )

    forward = staticmethod(numba_attention_forward)
    backward = staticmethod(numba_attention_backward)

    def unavailable_reason(self) -> str | None:
        return _MISSING


BACKEND = NumbaBackend()
