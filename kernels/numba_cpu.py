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

from attnperf.backend import FEATURES, Capabilities, FusedBackend
from attnperf.inputs import AttentionInputs
from attnperf.layouts import EMPTY as LAYOUT_EMPTY
from attnperf.layouts import FULL as LAYOUT_FULL
from attnperf.serving import KVCacheInputs

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
    """numba.njit with an on-disk cache; without numba the plain function (never run).

    error_model="numpy": IEEE division (inf/NaN, no ZeroDivisionError branch), which lets
    loops that divide vectorise (the softcap's tanh was 10x slower without).
    """
    if numba is None:
        return lambda function: function
    return numba.njit(cache=True, nogil=True, error_model="numpy", **options)


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
# A band bounded on both sides (a sliding window): a tile sees its rows' window plus a
# triangle on each side, which smaller tiles shrink. Forward: 64 x 512 was 5-25% faster
# than 128 x 512 at windows of 128 to 1024 keys, L = 8192 (64 x 256 no better). Backward,
# which walks a key tile's query rows: 64 x 128 was 1.5-1.9x faster than 64 x 512 at
# windows of 256 and 1024, L = 4096 (of 32/64/128 x 128/256/512).
BANDED_BLOCK_M = 64
BANDED_BACKWARD_BLOCK_N = 128
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
def exp2(t):
    """2 ** t in float32 without a libm call, so that loops over it vectorise.

    2**n is built in a float's exponent field; results below 2**-126 flush to 0. NaN stays
    NaN; t must be below 128.
    """
    c0, c1, c2, c3, c4, c5, c6, c7 = EXP2_COEFFS
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
    y = p * float32_from_bits((np.int32(n) + 127) << 23)
    return y if t == t else t


@_njit(fastmath=FASTMATH)
def exp2_shifted(row, cols, shift, factor):
    """row[c] <- 2 ** (row[c] - shift) * factor in place, vectorised; returns the sum."""
    total = np.float32(0.0)
    for c in range(cols):
        y = exp2(row[c] - shift) * factor
        row[c] = y
        total += y
    return total


@_njit(fastmath=FASTMATH)
def tanh(x):
    """tanh in float32, vectorisable: Cephes' tanhf (an odd polynomial below 0.625, else
    1 - 2 / (e^2|x| + 1)); within 2 ulps of libm's."""
    a = min(abs(x), np.float32(10.0))  # tanh(10) rounds to 1 in float32
    e = exp2(a * np.float32(2 * LOG2E))
    large = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    large = large if x >= 0 else -large
    z = x * x
    p = np.float32(-5.70498872745e-3)
    p = p * z + np.float32(2.06390887954e-2)
    p = p * z - np.float32(5.37397155531e-2)
    p = p * z + np.float32(1.33314422036e-1)
    p = p * z - np.float32(3.33332819422e-1)
    small = p * z * x + x
    return small if a < 0.625 else large


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


# ---------------------------------------------------------------------------- the variant
# A call's variant lowered once (`lower_variant`) into one tuple that every kernel passes on:
# (mask, mask_kind, left, right, sequences, softcap2, alibi2, kinds, partial_index, partial,
#  block_q, block_k). The band is left/right around each row's diagonal i + offset
# (UNBOUNDED when open); sequences (B, 6) is attnperf.inputs.Sequences' table (slot, q_start,
# q_len, k_start, k_len, offset), one row per batch entry for a plain call: row indices i, j
# are within a sequence, its arrays' rows start at q_start, k_start of batch entry `slot`;
# softcap2 = softcap * log2(e), 0 without; alibi2 (B, Hq) = slopes * log2(e), empty
# without; the block layout broadcast to (B, Hq, QB, KB), block_q = 0 without.
UNBOUNDED = 1 << 40
SKIP, MASKED, UNMASKED = 0, 1, 2  # what a (query tile, key tile) needs from the structure


@_njit()
def sequence(variant, b):
    """(slot, q_start, q_len, k_start, k_len) of sequence b."""
    row = variant[4][b]
    return row[0], row[1], row[2], row[3], row[4]


@_njit()
def longest(variant, column):
    """The largest q_len (column 2) or k_len (4) of the sequences."""
    sequences = variant[4]
    result = 0
    for b in range(sequences.shape[0]):
        result = max(result, sequences[b, column])
    return result


@_njit()
def key_range(variant, b, i0, rows, kv_len):
    """[first, end) of the keys that query rows i0 .. i0 + rows - 1 may see in the band."""
    left, right, offset = variant[2], variant[3], variant[4][b, 5]
    # Whole multiples of 16 keys (the band masks the extra ones): BLAS runs faster on them.
    first = max(i0 + offset - left, 0) // 16 * 16
    end = min((i0 + rows - 1 + offset + right + 1 + 15) // 16 * 16, kv_len)
    return first, max(end, first)


@_njit()
def query_range(variant, b, j0, cols, q_len):
    """[first, end) of the query rows that may see keys j0 .. j0 + cols - 1 in the band."""
    left, right, offset = variant[2], variant[3], variant[4][b, 5]
    first = max(j0 - offset - right, 0)
    end = min(j0 + cols - 1 - offset + left + 1, q_len)
    return first, max(end, first)


@_njit()
def tile_structure(variant, b, h, i0, rows, j0, cols):
    """SKIP, MASKED or UNMASKED: what the band and the block layout leave of one tile."""
    left, right, offset = variant[2], variant[3], variant[4][b, 5]
    # Key j's distance right of row i's diagonal, j - (i + offset), over the tile:
    nearest = j0 - (i0 + rows - 1) - offset
    farthest = j0 + cols - 1 - i0 - offset
    result = UNMASKED if nearest >= -left and farthest <= right else MASKED
    kinds, block_q, block_k = variant[7], variant[10], variant[11]
    if block_q == 0:
        return result
    seen = False
    for qb in range(i0 // block_q, (i0 + rows - 1) // block_q + 1):
        for kb in range(j0 // block_k, (j0 + cols - 1) // block_k + 1):
            kind = kinds[b, h, qb, kb]
            seen = seen or kind != LAYOUT_EMPTY
            if kind != LAYOUT_FULL:
                result = MASKED
    return result if seen else SKIP


@_njit()
def key_tiles(variant, b, h, i0, rows, kv_len, block_n):
    """The key tiles that query rows i0 .. i0 + rows - 1 must visit, as (j0, cols,
    structure) with structure MASKED or UNMASKED: the tile range of the band, without the
    tiles that the block layout leaves empty."""
    tiles = []
    first, end = key_range(variant, b, i0, rows, kv_len)
    for j0 in range(first, end, block_n):
        cols = min(block_n, end - j0)
        structure = tile_structure(variant, b, h, i0, rows, j0, cols)
        if structure != SKIP:
            tiles.append((j0, cols, structure))
    return tiles


@_njit(fastmath=FASTMATH)
def modify_scores(s, variant, b, h, i0, j0, rows, cols, structure, dtanh):
    """Scores of one tile (base 2, scaled) in place: softcap, attn_mask, ALiBi, and, for a
    MASKED tile, the band and the block layout (-inf outside them).

    With a softcap and `dtanh` of the tile's size, also dtanh <- 1 - tanh^2, the softcap's
    gradient factor for the backward.
    """
    mask, mask_kind, left, right, sequences, softcap2, alibi2 = variant[:7]
    offset = sequences[b, 5]
    if softcap2 != 0:
        inverse = np.float32(1.0) / softcap2
        for r in range(rows):
            s_row = s[r]
            if dtanh.shape[0] >= rows:  # two loops, so that each vectorises
                dtanh_row = dtanh[r]
                for c in range(cols):
                    t = tanh(s_row[c] * inverse)
                    s_row[c] = softcap2 * t
                    dtanh_row[c] = np.float32(1.0) - t * t
            else:
                for c in range(cols):
                    s_row[c] = softcap2 * tanh(s_row[c] * inverse)
    if mask_kind == MASK_FLOAT:
        for r in range(rows):
            for c in range(cols):
                s[r, c] += base2_bias(mask[b, h, i0 + r, j0 + c])
    elif mask_kind == MASK_BOOL:
        for r in range(rows):
            for c in range(cols):
                if not mask[b, h, i0 + r, j0 + c]:
                    s[r, c] += -np.inf  # like SDPA: a NaN score stays NaN
    if alibi2.shape[0] > 0:
        slope = alibi2[b, h]
        for r in range(rows):
            distance = j0 - (i0 + r) - offset
            s_row = s[r]
            for c in range(cols):
                s_row[c] -= slope * abs(distance + c)
    if structure != MASKED:
        return
    for r in range(rows):  # the band: key j for row i iff -left <= j - (i + offset) <= right
        distance = j0 - (i0 + r) - offset
        for c in range(0, min(max(-left - distance, 0), cols)):
            s[r, c] = -np.inf
        for c in range(max(right - distance + 1, 0), cols):
            s[r, c] = -np.inf
    kinds, partial_index, partial, block_q, block_k = variant[7:]
    if block_q == 0:
        return
    for qb in range(i0 // block_q, (i0 + rows - 1) // block_q + 1):
        r0, r1 = max(qb * block_q - i0, 0), min((qb + 1) * block_q - i0, rows)
        for kb in range(j0 // block_k, (j0 + cols - 1) // block_k + 1):
            c0, c1 = max(kb * block_k - j0, 0), min((kb + 1) * block_k - j0, cols)
            kind = kinds[b, h, qb, kb]
            if kind == LAYOUT_FULL:
                continue
            block = partial[max(partial_index[b, h, qb, kb], 0)]
            for r in range(r0, r1):
                for c in range(c0, c1):
                    if kind == LAYOUT_EMPTY or not block[i0 + r - qb * block_q,
                                                         j0 + c - kb * block_k]:  # fmt: skip
                        s[r, c] = -np.inf


@_njit(fastmath=FASTMATH)
def online_softmax_rescale(s, rows, cols, acc, row_max, row_sum, shift):
    """The online softmax's step before acc += P V: s[:rows, :cols] <- P = 2 ** (s - the
    rows' new max), their max and sum updated, acc rescaled to the new max."""
    for r in range(rows):
        new_max = row_maximum(s[r], cols, row_max[r])
        # A row with nothing allowed so far shifts by 0: its exp2 stays 0, not NaN.
        shift[r] = new_max if new_max != -np.inf else 0.0
        alpha = 2.0 ** (row_max[r] - shift[r]) if row_max[r] != -np.inf else 0.0
        row_max[r] = new_max
        row_sum[r] = row_sum[r] * alpha + exp2_shifted(s[r], cols, shift[r], 1.0)
        for e in range(acc.shape[1]):
            acc[r, e] *= alpha


@_njit(fastmath=FASTMATH)
def online_softmax_tiles(
    q_tile, k, v, variant, b, h, i0, rows, kv_len, scale2, block_n, s, acc, row_max, row_sum,
    shift,
):  # fmt: skip
    """The online softmax (unnormalised acc, row_max, row_sum, shift) of query rows i0 ..
    i0 + rows - 1 (q_tile) of head h, over the key tiles they see of k, v (S, E)."""
    no_dtanh = np.empty((0, 0), np.float32)
    for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
        gemm(q_tile, k[j0 : j0 + cols], s[:, :cols], scale2, 0.0, False, True)
        modify_scores(s, variant, b, h, i0, j0, rows, cols, structure, no_dtanh)
        online_softmax_rescale(s, rows, cols, acc, row_max, row_sum, shift)
        gemm(s[:, :cols], v[j0 : j0 + cols], acc, 1.0, 1.0, False, False)


@_njit(parallel=True, fastmath=FASTMATH)
def online_softmax_forward(q, k, v, variant, scale, out, stats, block_m, block_n):
    """out (B, Hq, L, Ev) and stats (B, Hq, L, 2): each row's base-2 max and its sum of
    2 ** (score - max); fp32 q, k, v with unit stride along E."""
    q_heads, kv_heads, value_dim = q.shape[1], k.shape[1], v.shape[3]
    group = q_heads // kv_heads
    q_tiles = (longest(variant, 2) + block_m - 1) // block_m
    scale2 = scale * LOG2E
    for item in prange(variant[4].shape[0] * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        slot, q0, q_len, k0, kv_len = sequence(variant, b)
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        if rows <= 0:  # past this sequence's end
            continue
        s = np.empty((rows, block_n), np.float32)
        acc = np.zeros((rows, value_dim), np.float32)
        row_max = np.full(rows, -np.inf, np.float32)
        row_sum = np.zeros(rows, np.float32)
        shift = np.zeros(rows, np.float32)
        hk = h // group
        online_softmax_tiles(
            q[slot, h, q0 + i0 : q0 + i0 + rows], k[slot, hk, k0 : k0 + kv_len],
            v[slot, hk, k0 : k0 + kv_len], variant, b, h, i0, rows, kv_len, scale2, block_n, s,
            acc, row_max, row_sum, shift,
        )  # fmt: skip
        for r in range(rows):
            # Rows that see no key (sum 0) give 0; so does their backward (p = 2**x * 0).
            inv = 1.0 / row_sum[r] if row_sum[r] != 0 else 0.0
            for e in range(value_dim):
                out[slot, h, q0 + i0 + r, e] = acc[r, e] * inv
            stats[slot, h, q0 + i0 + r, 0] = shift[r]
            stats[slot, h, q0 + i0 + r, 1] = row_sum[r]


@_njit(fastmath=FASTMATH)
def cached_scores(q_rows, page, first_row, cols, s, scale2):
    """s[h, r, j] <- scale2 * q_rows[h, r] . page[first_row + j, h] for j < cols: every
    head's scores of a tile of keys, one cache row (all heads side by side) at a time.

    A decode step has a few query rows per head: BLAS's small-M products ran it at ~13 GB/s
    of K and V (S = 16k, 32/8 heads, E = 128, 2 threads), these loops faster (they need a
    C-contiguous cache to vectorise along E).
    """
    heads, rows, dim = q_rows.shape
    for j in range(cols):
        keys = page[first_row + j]
        for h in range(heads):
            key = keys[h]
            for r in range(rows):
                query = q_rows[h, r]
                total = np.float32(0.0)
                for e in range(dim):
                    total += query[e] * key[e]
                s[h, r, j] = total * scale2


@_njit(fastmath=FASTMATH)
def cached_values(p, page, first_row, cols, acc):
    """acc[h, r] += sum_j p[h, r, j] * page[first_row + j, h] for j < cols."""
    heads, rows, dim = acc.shape
    for j in range(cols):
        values = page[first_row + j]
        for h in range(heads):
            value = values[h]
            for r in range(rows):
                weight = p[h, r, j]
                out = acc[h, r]
                for e in range(dim):
                    out[e] += weight * value[e]


@_njit(parallel=True, fastmath=FASTMATH)
def kvcache_forward_splits(
    q, k_pages, v_pages, block_table, variant, scale, block_n, partial_out, partial_stats
):
    """Split-K attention of q (B, Hq, Lq, E) over a paged KV cache (pages (P, page_size, H,
    E), block_table (B, pages)): split s of sequence b covers the s-th of equal chunks of
    the keys its rows see, into partial_out (splits, B, Hq, Lq, Ev), unnormalised, and
    partial_stats (splits, B, Hq, Lq, 2), each row's base-2 max and sum.

    An item walks its keys in tiles, each cache row with all its heads: memory is read in
    order (a head at a time, its rows a page apart, defeats the prefetchers). The query rows
    of a key/value head's group go through its keys together (FlashAttention's "pack GQA"):
    K and V are read once.
    """
    splits = partial_out.shape[0]
    batch, q_heads, q_len, head_dim = q.shape
    page_size, kv_heads, value_dim = k_pages.shape[1], k_pages.shape[2], v_pages.shape[3]
    group = q_heads // kv_heads
    rows = group * q_len
    scale2 = scale * LOG2E
    no_dtanh = np.empty((0, 0), np.float32)
    for item in prange(batch * splits):
        b, _, split = split_index(item, 1, splits)
        slot = variant[4][b, 0]  # the sequence's batch entry: rows may be reordered
        q_rows = np.empty((kv_heads, rows, head_dim), np.float32)
        for hk in range(kv_heads):
            for g in range(group):
                q_rows[hk, g * q_len : (g + 1) * q_len] = q[slot, hk * group + g]
        s = np.empty((kv_heads, rows, block_n), np.float32)
        acc = np.zeros((kv_heads, rows, value_dim), np.float32)
        row_max = np.full((kv_heads, rows), -np.inf, np.float32)
        row_sum = np.zeros((kv_heads, rows), np.float32)
        shift = np.zeros((kv_heads, rows), np.float32)
        k_start, kv_len = variant[4][b, 3], variant[4][b, 4]
        first, end = key_range(variant, b, 0, q_len, kv_len)
        chunk = ((end - first + splits - 1) // splits + 15) // 16 * 16
        lo, hi = first + split * chunk, min(first + (split + 1) * chunk, end)
        # Key j is cache row k_start + j; pages hold page_size rows; tiles never cross one.
        page_start = (k_start + lo) // page_size * page_size
        while page_start < k_start + hi:
            page = block_table[slot, page_start // page_size]
            k_first = max(lo, page_start - k_start)
            k_end = min(hi, page_start + page_size - k_start)
            for j0 in range(k_first, k_end, block_n):
                cols = min(block_n, k_end - j0)
                first_row = k_start + j0 - page_start
                cached_scores(q_rows, k_pages[page], first_row, cols, s, scale2)
                structure = tile_structure(variant, b, 0, 0, q_len, j0, cols)
                for hk in range(kv_heads):
                    for g in range(group):
                        head_rows = s[hk, g * q_len : (g + 1) * q_len]
                        modify_scores(head_rows, variant, b, hk * group + g, 0, j0, q_len, cols,
                                      structure, no_dtanh)  # fmt: skip
                    online_softmax_rescale(s[hk], rows, cols, acc[hk], row_max[hk],
                                           row_sum[hk], shift[hk])  # fmt: skip
                cached_values(s, v_pages[page], first_row, cols, acc)
            page_start += page_size
        for hk in range(kv_heads):
            for g in range(group):
                for t in range(q_len):
                    r, h = g * q_len + t, hk * group + g
                    partial_out[split, slot, h, t] = acc[hk, r]
                    partial_stats[split, slot, h, t, 0] = shift[hk, r]
                    partial_stats[split, slot, h, t, 1] = row_sum[hk, r]


@_njit(parallel=True, fastmath=FASTMATH)
def merge_splits(partial_out, partial_stats, out, stats):
    """out (B, Hq, L, Ev) and stats (B, Hq, L, 2) of the splits' partial softmaxes
    combined exactly: merge_attention's rule in base 2, on unnormalised accumulators."""
    splits, batch, heads, q_len, value_dim = partial_out.shape
    for item in prange(batch * heads):
        b, h, _ = split_index(item, heads, 1)
        for t in range(q_len):
            largest = -np.inf
            for split in range(splits):
                if partial_stats[split, b, h, t, 1] > 0:
                    largest = max(largest, partial_stats[split, b, h, t, 0])
            total = np.float32(0.0)
            row = out[b, h, t]
            row[:] = 0.0
            for split in range(splits):
                part_sum = partial_stats[split, b, h, t, 1]
                if part_sum > 0:
                    weight = np.float32(2.0 ** (partial_stats[split, b, h, t, 0] - largest))
                    total += part_sum * weight
                    for e in range(value_dim):
                        row[e] += weight * partial_out[split, b, h, t, e]
            inverse = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            for e in range(value_dim):
                row[e] *= inverse
            stats[b, h, t, 0] = largest if total > 0 else 0.0
            stats[b, h, t, 1] = total


@_njit(fastmath=FASTMATH)
def probabilities(q_tile, k_tile, p, dtanh, variant, b, h, i0, j0, structure, scale2, stats):
    """p[:rows, :cols] <- P of one (query tile, key tile), from the rows' saved max and sum
    (stats[i0:i0 + rows]): kept apart, they hold the sum where max + log2(sum) would round
    it away (scores near finfo.min). With a softcap, dtanh <- its gradient factor.

    `p` is a C-contiguous buffer: its rows are C-contiguous too, which the exp2 loop needs
    to vectorise (a [:rows, :cols] view's rows are not typed so).
    """
    rows, cols = q_tile.shape[0], k_tile.shape[0]
    gemm(q_tile, k_tile, p[:rows, :cols], scale2, 0.0, False, True)
    modify_scores(p, variant, b, h, i0, j0, rows, cols, structure, dtanh)
    for r in range(rows):
        total = stats[i0 + r, 1]
        exp2_shifted(p[r], cols, stats[i0 + r, 0], 1.0 / total if total != 0 else 0.0)


@_njit(fastmath=FASTMATH)
def score_gradients(p, dp, delta, rows, cols):
    """dp <- dS = P * (dP - delta) on [:rows, :cols] of C-contiguous buffers: the gradient
    of the final scores (a float mask's gradient)."""
    for r in range(rows):
        d = delta[r]
        p_row, dp_row = p[r], dp[r]
        for c in range(cols):
            dp_row[c] = p_row[c] * (dp_row[c] - d)


@_njit(fastmath=FASTMATH)
def through_softcap(ds, dtanh, rows, cols):
    """ds <- ds * (1 - tanh^2): the gradient of the scores before the softcap."""
    for r in range(rows):
        ds_row, factor = ds[r], dtanh[r]
        for c in range(cols):
            ds_row[c] *= factor[c]


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dq(
    q, k, v, variant, scale, stats, grad_out, delta, dq, dmask, block_m, block_n
):
    """dq += (and the float mask's gradient dS into dmask, unless it is empty) per query
    tile."""
    q_heads, kv_heads = q.shape[1], k.shape[1]
    group = q_heads // kv_heads
    q_tiles = (longest(variant, 2) + block_m - 1) // block_m
    scale2 = scale * LOG2E
    want_dmask = dmask.shape[0] > 0
    softcapped = variant[5] != 0
    for item in prange(variant[4].shape[0] * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        slot, q0, q_len, k0, kv_len = sequence(variant, b)
        hk = h // group
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        if rows <= 0:  # past this sequence's end
            continue
        q_tile = q[slot, h, q0 + i0 : q0 + i0 + rows]
        do_tile = grad_out[slot, h, q0 + i0 : q0 + i0 + rows]
        p_buffer = np.empty((rows, block_n), np.float32)
        ds_buffer = np.empty((rows, block_n), np.float32)
        dtanh = np.empty((rows if softcapped else 0, block_n), np.float32)
        for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
            k_tile = k[slot, hk, k0 + j0 : k0 + j0 + cols]
            v_tile = v[slot, hk, k0 + j0 : k0 + j0 + cols]
            ds = ds_buffer[:, :cols]
            probabilities(
                q_tile, k_tile, p_buffer, dtanh, variant, b, h, i0, j0, structure, scale2,
                stats[slot, h, q0 : q0 + q_len],
            )  # fmt: skip
            gemm(do_tile, v_tile, ds, 1.0, 0.0, False, True)
            score_gradients(
                p_buffer, ds_buffer, delta[slot, h, q0 + i0 : q0 + i0 + rows], rows, cols
            )
            if want_dmask:  # plain calls only: slot b, no row offsets
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            if softcapped:
                through_softcap(ds_buffer, dtanh, rows, cols)
            gemm(ds, k_tile, dq[slot, h, q0 + i0 : q0 + i0 + rows], scale, 1.0, False, False)


@_njit(fastmath=FASTMATH)
def key_tile_gradients(
    q, k, v, variant, scale, stats, grad_out, delta, dq, dk, dv, dmask,
    b, hk, j0, cols, block_m, p_buffer, ds_buffer, dtanh, with_dq,
):  # fmt: skip
    """dk, dv += those of keys j0..j0+cols of head hk, over the query heads of its group.

    With `with_dq`, also dq += dS K and, unless dmask is empty, dS into dmask: the caller
    owns every query row of the group then, so no other thread writes them.
    """
    group = q.shape[1] // k.shape[1]
    scale2 = scale * LOG2E
    softcapped = variant[5] != 0
    want_dmask = with_dq and dmask.shape[0] > 0
    slot, q0, q_len, k0, _ = sequence(variant, b)
    keys = slice(k0 + j0, k0 + j0 + cols)
    k_tile, v_tile = k[slot, hk, keys], v[slot, hk, keys]
    dk_tile, dv_tile = dk[slot, hk, keys], dv[slot, hk, keys]
    first, end = query_range(variant, b, j0, cols, q_len)
    for h in range(hk * group, (hk + 1) * group):
        for i0 in range(first, end, block_m):
            rows = min(block_m, end - i0)
            structure = tile_structure(variant, b, h, i0, rows, j0, cols)
            if structure == SKIP:
                continue
            queries = slice(q0 + i0, q0 + i0 + rows)
            q_tile, do_tile = q[slot, h, queries], grad_out[slot, h, queries]
            p, ds = p_buffer[:rows, :cols], ds_buffer[:rows, :cols]
            probabilities(
                q_tile, k_tile, p_buffer, dtanh, variant, b, h, i0, j0, structure, scale2,
                stats[slot, h, q0 : q0 + q_len],
            )  # fmt: skip
            gemm(p, do_tile, dv_tile, 1.0, 1.0, True, False)
            gemm(do_tile, v_tile, ds, 1.0, 0.0, False, True)
            score_gradients(p_buffer, ds_buffer, delta[slot, h, queries], rows, cols)
            if want_dmask:  # plain calls only: slot b, no row offsets
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            if softcapped:
                through_softcap(ds_buffer, dtanh, rows, cols)
            gemm(ds, q_tile, dk_tile, scale, 1.0, True, False)
            if with_dq:
                gemm(ds, k_tile, dq[slot, h, queries], scale, 1.0, False, False)


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dkdv(
    q, k, v, variant, scale, stats, grad_out, delta, dk, dv, block_m, block_n
):
    """dk, dv += per key tile, summed over every query head of the key/value head's group."""
    kv_heads = k.shape[1]
    kv_tiles = (longest(variant, 4) + block_n - 1) // block_n
    unused = np.zeros((0, 0, 0, 0), np.float32)
    softcapped = variant[5] != 0
    for item in prange(variant[4].shape[0] * kv_heads * kv_tiles):
        b, hk, tile = split_index(item, kv_heads, kv_tiles)
        j0 = tile * block_n
        cols = min(block_n, variant[4][b, 4] - j0)
        if cols <= 0:  # past this sequence's end
            continue
        p_buffer = np.empty((block_m, cols), np.float32)
        ds_buffer = np.empty((block_m, cols), np.float32)
        dtanh = np.empty((block_m if softcapped else 0, cols), np.float32)
        key_tile_gradients(
            q, k, v, variant, scale, stats, grad_out, delta, unused, dk, dv, unused,
            b, hk, j0, cols, block_m, p_buffer, ds_buffer, dtanh, False,
        )  # fmt: skip


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_fused(
    q, k, v, variant, scale, stats, grad_out, delta, dq, dk, dv, dmask, block_m, block_n
):
    """dq, dk, dv += (and dS into an L x S dmask) in one pass: P and dP are computed once.

    One prange item per (batch, key/value head) owns every query head of its group, so its
    dq updates need no atomics; worth it when there are enough items for the threads.
    """
    kv_heads = k.shape[1]
    softcapped = variant[5] != 0
    for item in prange(variant[4].shape[0] * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        kv_len = variant[4][b, 4]
        p_buffer = np.empty((block_m, block_n), np.float32)
        ds_buffer = np.empty((block_m, block_n), np.float32)
        dtanh = np.empty((block_m if softcapped else 0, block_n), np.float32)
        for j0 in range(0, kv_len, block_n):
            key_tile_gradients(
                q, k, v, variant, scale, stats, grad_out, delta, dq, dk, dv, dmask,
                b, hk, j0, min(block_n, kv_len - j0), block_m, p_buffer, ds_buffer, dtanh,
                True,
            )  # fmt: skip


@_njit(parallel=True, fastmath=FASTMATH)
def softmax_delta(out, grad_out, stats, grad_lse, delta):
    """delta (B, Hq, L) <- FlashAttention-2's rowsum(dO * O) - dLSE (`grad_lse` empty: no
    dLSE). A gradient on the LSE adds p * dLSE to every dS: the same as lowering delta by
    it. Rows that see no key (sum 0) take none of it: their p is 0, and a NaN must not
    creep in."""
    batch, heads, q_len, value_dim = out.shape
    for item in prange(batch * heads):
        b, h, _ = split_index(item, heads, 1)
        for i in range(q_len):
            total = np.float32(0.0)
            for e in range(value_dim):
                total += out[b, h, i, e] * grad_out[b, h, i, e]
            if grad_lse.shape[0] > 0 and stats[b, h, i, 1] > 0:
                total -= grad_lse[b, h, i]
            delta[b, h, i] = total


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


def balanced_order(table: Tensor, threads: int) -> Tensor:
    """An order of the sequences in which numba's prange, which gives each thread one
    contiguous share of the items (sequence-major, as many per sequence), shares their work
    (q_len x k_len) evenly: heaviest first, each to the lightest share with room. A packed
    batch of 8 causal sequences of 516 to 3890 tokens in cu_seqlens order left one of 2
    threads idle most of the time; a plain call's equal sequences keep their order."""
    count = table.shape[0]
    lengths = table[:, 2] * table[:, 4]
    if count <= 1 or threads <= 1 or bool((lengths == lengths[0]).all()):
        return torch.arange(count)
    room = [count // threads + (share < count % threads) for share in range(threads)]
    shares = [[] for _ in range(threads)]
    work = [0] * threads
    for b in torch.argsort(lengths, descending=True, stable=True).tolist():
        share = min((s for s in range(threads) if len(shares[s]) < room[s]), key=work.__getitem__)
        shares[share].append(b)
        work[share] += int(lengths[b])
    return torch.tensor([b for share in shares for b in share])


def lower_variant(inputs: AttentionInputs | KVCacheInputs) -> tuple:
    """The call's masks and variant as the kernels' one `variant` tuple (see UNBOUNDED)."""
    mask, mask_kind = _mask_for_kernel(inputs)
    variant = inputs.variant
    left, right = inputs.band or (None, None)
    softcap2 = np.float32(variant.softcap * LOG2E if variant.softcap is not None else 0.0)
    table = inputs.sequences.table
    order = balanced_order(table, torch.get_num_threads())
    alibi2 = np.zeros((0, 0), np.float32)
    if variant.alibi_slopes is not None:
        alibi2 = _as_numpy((variant.alibi_slopes[order] * LOG2E).float().contiguous())
    layout = variant.block_mask
    if layout is None:
        kinds = np.zeros((1, 1, 1, 1), np.int8)
        partial_index = np.zeros((1, 1, 1, 1), np.int32)
        partial = np.zeros((1, 1, 1), np.bool_)
        block_q = block_k = 0
    else:
        # Per (batch, head) copies, O(L S / block^2): C-contiguous, as without a layout, so
        # that both share one compiled kernel.
        full = (inputs.batch, inputs.q_heads, *layout.num_blocks)
        kinds = _as_numpy(layout.kinds.expand(full).contiguous())
        partial_index = _as_numpy(layout.partial_index.expand(full).contiguous())
        partial = _as_numpy(layout.partial)
        if partial.shape[0] == 0:
            partial = np.zeros((1, *layout.block_size), np.bool_)
        block_q, block_k = layout.block_size
    return (
        mask, mask_kind,
        UNBOUNDED if left is None else left, UNBOUNDED if right is None else right,
        table[order].numpy(), softcap2, alibi2, kinds, partial_index, partial, block_q,
        block_k,
    )  # fmt: skip


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
    Zeroed by memset, not torch.zeros: a torch op on OpenMP threads just before a kernel
    leaves them spinning on the cores the kernel's threads need (a 32K-element op cost the
    next forward 8 ms of 20, L = 4096, 2 threads).
    """
    tensor = torch.empty(shape, dtype=torch.float32)
    if tensor.numel() == 0:
        return tensor, np.zeros(shape, np.float32)
    if zero:
        ctypes.memset(tensor.data_ptr(), 0, tensor.numel() * 4)
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
    no_work = not inputs.has_pairs  # then zeros: no key is seen
    zero = no_work or inputs.has_padding  # nor by a padded batch's padding rows
    out, out_array = _float32_array((*q.shape[:3], v.shape[3]), zero=zero)
    stats, stats_array = _float32_array((*q.shape[:3], 2), zero=zero)
    if not no_work:
        _run_parallel(
            online_softmax_forward, q, k, v, lower_variant(inputs), inputs.scale, out_array,
            stats_array, *tile_sizes(inputs),
        )  # fmt: skip
    return out.to(inputs.dtype), stats


def tile_sizes(inputs: AttentionInputs, backward: bool = False) -> tuple[int, int]:
    """(query rows, keys) of the kernels' tiles for this call."""
    if inputs.band is None or None in inputs.band:
        return BLOCK_M, BLOCK_N
    return BANDED_BLOCK_M, min(BANDED_BACKWARD_BLOCK_N, BLOCK_N) if backward else BLOCK_N


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
    grad_lse: Tensor | None = None,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) in the inputs' dtypes, by FlashAttention-2 recomputation;
    `grad_lse` (B, Hq, L), the LSE's gradient, only shifts delta = rowsum(dO * O).

    `fused`: one pass over (batch, kv head) items, or a dq pass and a dk/dv pass over tiles;
    None picks the fused pass where it pays (`fused_backward_pays`).
    """
    q, k, v = _fp32(inputs.query), _fp32(inputs.key), _fp32(inputs.value)
    variant = lower_variant(inputs)
    do = _fp32(grad_out)
    stats = _as_numpy(stats.contiguous())
    no_lse = np.zeros((0, 0, 0), np.float32)
    lse_grad = no_lse if grad_lse is None else _as_numpy(grad_lse.detach().float().contiguous())
    # (tensor, array): kept bound while the kernels run, as the tensor owns the array's memory.
    delta_buffer = _float32_array(stats.shape[:3])
    delta = delta_buffer[1]
    (dq, dq_array), (dk, dk_array), (dv, dv_array) = (
        _float32_array(t.shape, zero=True) for t in (q, k, v)
    )
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask_shape = inputs.attn_mask.shape if want_dmask else (0, 0, 0, 0)
    dmask, dmask_array = _float32_array(dmask_shape, zero=True)
    if fused is None:
        fused = fused_backward_pays(
            inputs.sequence_count * inputs.kv_heads, torch.get_num_threads()
        )
    if inputs.has_pairs:
        _run_parallel(softmax_delta, _fp32(out), do, stats, lse_grad, delta)
        common = (q, k, v, variant, inputs.scale, stats, do, delta)
        blocks = tile_sizes(inputs, backward=True)
        if fused:
            grads = dq_array, dk_array, dv_array, dmask_array
            _run_parallel(attention_backward_fused, *common, *grads, *blocks)
        else:
            _run_parallel(attention_backward_dq, *common, dq_array, dmask_array, *blocks)
            _run_parallel(attention_backward_dkdv, *common, dk_array, dv_array, *blocks)
    dmask = dmask.to(inputs.attn_mask.dtype) if want_dmask else None
    return dq.to(inputs.dtype), dk.to(inputs.dtype), dv.to(inputs.dtype), dmask


def kvcache_splits(inputs: KVCacheInputs, threads: int) -> int:
    """How many chunks each sequence's keys are split into: as asked, else enough that the
    (batch, split) items fill the threads evenly, with at least MIN_SPLIT_KEYS keys each."""
    if inputs.num_splits:
        return inputs.num_splits
    items = inputs.batch  # an item walks every head (see kvcache_forward_splits)
    if items == 0 or items >= threads:
        return 1
    longest = inputs.sequences.max_kv_len
    return max(1, min(threads // math.gcd(items, threads), longest // MIN_SPLIT_KEYS))


# Keys per tile of a KV-cache step: of 32 to 512, 96 was as fast as any (B = 1 and 4, S =
# 16k and 64k, 32/8 heads, E = 128, 2 threads); every head's scores of the tile (8 x 4 x 96
# floats) stay in L1.
DECODE_BLOCK_N = 96
# A split's fixed cost (its partial rows, the merge) is a few microseconds: below ~256 keys
# (64K multiply-adds per row at head dim 128) it outweighs what a second thread saves.
MIN_SPLIT_KEYS = 256


def numba_kvcache_forward(inputs: KVCacheInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Lq, Ev) in the inputs' dtype, stats (B, Hq, Lq, 2)) of a KV-cache call:
    split-K over (batch, kv head, split) items, merged exactly."""
    k_pages, v_pages = inputs.k_pages, inputs.v_pages
    contiguous = inputs.block_table.shape[1] == 1 and inputs.batch == k_pages.shape[0]
    if contiguous and inputs.dtype != torch.float32:  # converted: only the filled rows
        filled = int((inputs.sequences.table[:, 3] + inputs.sequences.table[:, 4]).max())
        k_pages, v_pages = k_pages[:, :filled], v_pages[:, :filled]
    # The kernel reads cache rows whole (cached_scores): a strided cache is copied first.
    q = _fp32(inputs.query)
    k_pages, v_pages = (np.ascontiguousarray(_fp32(t)) for t in (k_pages, v_pages))
    splits = kvcache_splits(inputs, torch.get_num_threads())
    shape = (*q.shape[:3], v_pages.shape[3])
    # (tensor, array) pairs: kept bound while the kernels run, as the tensors own the memory.
    partials = _float32_array((splits, *shape)), _float32_array((splits, *q.shape[:3], 2))
    partial_out, partial_stats = partials[0][1], partials[1][1]
    out, out_array = _float32_array(shape, zero=True)
    stats, stats_array = _float32_array((*q.shape[:3], 2), zero=True)
    if q.size:
        variant = lower_variant(inputs)
        table = _as_numpy(inputs.block_table.cpu())
        _run_parallel(
            kvcache_forward_splits, q, k_pages, v_pages, table, variant, inputs.scale,
            DECODE_BLOCK_N, partial_out, partial_stats,
        )  # fmt: skip
        _run_parallel(merge_splits, partial_out, partial_stats, out_array, stats_array)
    return out.to(inputs.dtype), stats


class NumbaBackend(FusedBackend):
    name = "numba"
    description = "fused tiled online-softmax CPU kernel (Numba, BLAS tiles), O(tile) memory"
    capabilities = Capabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        max_head_dim=None,
        features=frozenset(FEATURES) - {"dropout", "kvcache_backward"},
    )

    forward = staticmethod(numba_attention_forward)
    backward = staticmethod(numba_attention_backward)
    kvcache_forward = staticmethod(numba_kvcache_forward)

    def unavailable_reason(self) -> str | None:
        return _MISSING


BACKEND = NumbaBackend()
