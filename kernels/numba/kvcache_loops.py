"""A decoding step's per-key loops: scores and value updates one key at a time, over float
pages or int8 codes with their scales (the route where no micro-kernel serves the cache)."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.fastmath import widen
from attnperf.kernels.numba.jit import FASTMATH, njit


# The per-key helpers are inlined into their loops (numba's IR inlining): as calls, with an
# array view made per key, the steps ran a fifth slower.
@njit(fastmath=FASTMATH, inline="always")
def key_scores(queries, key, s_head, j, scale2):
    """s_head[r, j] <- scale2 * queries[r] . key for every query row r of one head."""
    for r in range(queries.shape[0]):
        query = queries[r]
        total = np.float32(0.0)
        for e in range(key.shape[0]):
            total += query[e] * widen(key[e])
        s_head[r, j] = total * scale2


@njit(fastmath=FASTMATH, inline="always")
def value_update(p_head, j, value, acc_head):
    """acc_head[r] += p_head[r, j] * value for every query row r of one head."""
    for r in range(acc_head.shape[0]):
        weight = p_head[r, j]
        out = acc_head[r]
        for e in range(value.shape[0]):
            out[e] += weight * widen(value[e])


@njit(fastmath=FASTMATH, inline="always")
def values_update(p_head, j, v0, v1, v2, v3, acc_head):
    """acc_head[r] += sum_i p_head[r, j + i] * v_i, i < 4: four keys' values at once, so
    that each row of acc is loaded and stored once for four (faster than one at a
    time)."""
    for r in range(acc_head.shape[0]):
        w0, w1, w2, w3 = p_head[r, j], p_head[r, j + 1], p_head[r, j + 2], p_head[r, j + 3]
        out = acc_head[r]
        for e in range(out.shape[0]):
            out[e] += (w0 * widen(v0[e]) + w1 * widen(v1[e]) + w2 * widen(v2[e])
                       + w3 * widen(v3[e]))  # fmt: skip


@njit(fastmath=FASTMATH)
def cached_scores(q_rows, page, head_major, first_row, cols, s, scale2):
    """s[h, r, j] <- scale2 * q_rows[h, r] . key j of head h, for keys first_row ..
    first_row + cols - 1 of `page`: (rows, H, E), a cache row with all its heads side by
    side, walked a row at a time; or `head_major` (H, rows, E), walked a head at a time.
    Either way memory is read in order.

    A decode step has a few query rows per head: BLAS's small-M products ran it slower
    than these loops (which need a C-contiguous cache to vectorise along E).
    """
    heads = q_rows.shape[0]
    if head_major:
        for h in range(heads):
            for j in range(cols):
                key_scores(q_rows[h], page[h, first_row + j], s[h], j, scale2)
    else:
        for j in range(cols):
            keys = page[first_row + j]
            for h in range(heads):
                key_scores(q_rows[h], keys[h], s[h], j, scale2)


@njit(fastmath=FASTMATH)
def cached_values(p, page, head_major, first_row, cols, acc):
    """acc[h, r] += sum_j p[h, r, j] * value j of head h (`page` as in cached_scores)."""
    heads = acc.shape[0]
    quads = cols // 4 * 4
    if head_major:
        for h in range(heads):
            values = page[h]
            for j in range(0, quads, 4):
                row = first_row + j
                values_update(p[h], j, values[row], values[row + 1], values[row + 2],
                              values[row + 3], acc[h])  # fmt: skip
            for j in range(quads, cols):
                value_update(p[h], j, values[first_row + j], acc[h])
    else:
        for j in range(0, quads, 4):
            rows = page[first_row + j : first_row + j + 4]
            for h in range(heads):
                values_update(p[h], j, rows[0, h], rows[1, h], rows[2, h], rows[3, h], acc[h])
        for j in range(quads, cols):
            values = page[first_row + j]
            for h in range(heads):
                value_update(p[h], j, values[h], acc[h])


@njit(fastmath=FASTMATH, inline="always")
def code_dot(query, codes, start, count):
    """query[start:start + count] . codes[start:start + count], the int8 codes widened in
    registers (a loop of its own, which LLVM vectorises)."""
    total = np.float32(0.0)
    for e in range(count):
        total += query[start + e] * np.float32(codes[start + e])
    return total


@njit(fastmath=FASTMATH, inline="always")
def quantized_key_scores(queries, codes, scales, s_head, j, scale2):
    """s_head[r, j] <- scale2 * queries[r] . key for every query row r of one head, the key
    int8 codes times one scale per group of E // scales.shape[0] of them: each group's dot
    product scaled once."""
    groups = scales.shape[0]
    group = codes.shape[0] // groups
    for r in range(queries.shape[0]):
        total = np.float32(0.0)
        for g in range(groups):
            total += code_dot(queries[r], codes, g * group, group) * scales[g]
        s_head[r, j] = total * scale2


@njit(fastmath=FASTMATH, inline="always")
def add_codes(out, weight, codes, start, count):
    """out[start:start + count] += weight * codes[start:start + count], widened in registers."""
    for e in range(count):
        out[start + e] += weight * np.float32(codes[start + e])


@njit(fastmath=FASTMATH, inline="always")
def quantized_value_update(p_head, j, codes, scales, acc_head):
    """acc_head[r] += p_head[r, j] * value for every query row r of one head, the value int8
    codes times their groups' scales (each folded into the row's weight)."""
    groups = scales.shape[0]
    group = codes.shape[0] // groups
    for r in range(acc_head.shape[0]):
        for g in range(groups):
            add_codes(acc_head[r], p_head[r, j] * scales[g], codes, g * group, group)


@njit(fastmath=FASTMATH)
def quantized_scores(q_rows, codes, scales, first_row, cols, s, scale2):
    """cached_scores over an int8 page: codes (rows, H, E), scales (rows, H, groups)."""
    for j in range(cols):
        keys, key_scales = codes[first_row + j], scales[first_row + j]
        for h in range(q_rows.shape[0]):
            quantized_key_scores(q_rows[h], keys[h], key_scales[h], s[h], j, scale2)


@njit(fastmath=FASTMATH)
def quantized_values(p, codes, scales, first_row, cols, acc):
    """cached_values over an int8 page: codes (rows, H, Ev), scales (rows, H, groups)."""
    for j in range(cols):
        values, value_scales = codes[first_row + j], scales[first_row + j]
        for h in range(acc.shape[0]):
            quantized_value_update(p[h], j, values[h], value_scales[h], acc[h])


LOOPS = -1  # a step's kind where no micro-kernel serves it: the per-key loops above
