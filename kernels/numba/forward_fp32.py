"""The fp32 forward on AVX-512, its scores transposed (`fp32_forward`)."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.amx import whole_tiles
from attnperf.kernels.numba.fastmath import LOG2E
from attnperf.kernels.numba.jit import (
    FASTMATH,
    carve,
    data_address,
    njit,
    prange,
    run_bounds,
    unowned_members,
    wide_vectors,
)
from attnperf.kernels.numba.microkernels import LANES, ONE, ZERO, tile_product
from attnperf.kernels.numba.packing import pack_key_panels, transpose_tile
from attnperf.kernels.numba.softmax import (
    F32,
    copy_rows,
    finish_rows,
    forward_arrays,
    forward_items,
    key_tile_width,
    modify_transposed,
    rows_apart,
    rows_bytes,
    rows_view,
    scores_by_rows,
    start_softmax,
    tile_and_head,
    transposed_softmax,
)
from attnperf.kernels.numba.variant import LoweredVariant, key_tiles, longest

# As on AMX tiles: S^T = K Q^T on our fp32 micro-kernels, K read where it lies as A, Q^T
# packed per query tile as B's panels; the softmax down the keys, 16 query rows a vector;
# O^T += V^T P^T with V read where it lies as A (its rows are V^T's depth) and P^T, the
# score tile itself, as B. Nothing is packed per kv head.


@njit(fastmath=FASTMATH)
def fp32_tile_buffers(address, tile_rows, width, dim, value_dim, by_rows):
    """A query tile's buffers for `fp32_query_tile`, carved at `address` (`carve`): Q^T in
    panels of 16 rows, S^T (then P^T), O^T (whole sixteens of Ev), O, the rows' (max, sum,
    shift), the softmax's work, the scores by rows (a layout's); and their extent."""
    q_t, at = carve(address, 0, (tile_rows // LANES, dim, LANES), F32)
    s_t, at = carve(address, at, (width, tile_rows), F32)
    acc_t, at = carve(address, at, (whole_tiles(value_dim), tile_rows), F32)
    acc, at = carve(address, at, (tile_rows, whole_tiles(value_dim)), F32)
    state, at = carve(address, at, (3, tile_rows), F32)
    work, at = carve(address, at, (3, tile_rows), F32)
    s_rows, at = carve(address, at, (tile_rows if by_rows else 0, width), F32)
    return (q_t, s_t, acc_t, acc, state, work, s_rows), at


@njit(fastmath=FASTMATH)
def fp32_query_tile(q, k, v, kv_at, variant, scale, outs, stats, block_m, block_n, tile,
                    address):  # fmt: skip
    """Query tile `tile` (`query_tile`'s, rows > 0) of `fp32_forward`, its scores
    transposed, in buffers carved at `address` (`fp32_tile_buffers`), against its kv head's
    keys and values at kv_at = (slot, head, first row) of k and v: where they lie, or as
    copied (`fp32_forward_items`)."""
    wide_vectors()
    k_slot, hk, k0 = kv_at
    dim, value_dim = q.shape[3], v.shape[3]
    scale2 = np.float32(scale * LOG2E)
    b, h, slot, q0, i0, rows, _, kv_len = tile
    tile_rows, width = whole_tiles(rows), key_tile_width(kv_len, block_n)
    buffers, _ = fp32_tile_buffers(address, tile_rows, width, dim, value_dim,
                                   scores_by_rows(variant))  # fmt: skip
    q_t, s_t, acc_t, acc, state, work, s_rows = buffers
    pack_key_panels(q[slot, h, q0 + i0 : q0 + i0 + rows], q_t)  # zero rows to a sixteen
    q_view = (q_t, 0, LANES, dim * LANES)
    s_view = (s_t, 0, tile_rows)
    p_view = (s_t, 0, tile_rows, LANES)
    acc_view = (acc_t, 0, tile_rows)
    row_max, row_sum, shift = start_softmax(acc_t, state)
    for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
        tile_product(dim, ONE, ZERO, rows_view(k, k_slot, hk, k0 + j0), q_view, s_view, cols,
                     tile_rows)  # fmt: skip
        factor = modify_transposed(s_t, s_rows, variant, scale2, b, h, i0, rows, j0, cols,
                                   structure)  # fmt: skip
        transposed_softmax(s_t, factor, cols, acc_t, row_max, row_sum, shift, work)
        x, at, row_stride, _ = rows_view(v, k_slot, hk, k0 + j0)
        tile_product(cols, ONE, ONE, (x, at, 1, row_stride), p_view, acc_view, value_dim,
                     tile_rows)  # fmt: skip
    transpose_tile(acc_t, acc, acc_t.shape[0], tile_rows)
    finish_rows(variant, slot, h, q0 + i0, acc[:rows], row_sum, shift, outs, stats)


@njit(fastmath=FASTMATH)
def fp32_workspace_bytes(keys, dim, value_dim, block_m, block_n, by_rows, copies):
    """The bytes of one thread's workspace for `fp32_forward_items` (a line more, to start
    on one), with room for a kv head's keys and values copied side by side (`copies`)."""
    width = key_tile_width(keys, block_n)
    _, tile_end = fp32_tile_buffers(0, whole_tiles(block_m), width, dim, value_dim, by_rows)
    head_end = fp32_head_bytes(keys, dim, value_dim) if copies else 0
    return head_end + tile_end + 64


@njit(fastmath=FASTMATH)
def fp32_head_bytes(keys, dim, value_dim):
    """The bytes of a kv head's `keys` keys, then its values, copied side by side
    (`copy_rows`), each from a line."""
    return rows_bytes(keys, dim, 4) + rows_bytes(keys, value_dim, 4)


@njit(fastmath=FASTMATH)
def fp32_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n, workspace, first,
                       last):  # fmt: skip
    """Items (sequence, query head, query tile) first .. last - 1 of `fp32_forward`, on one
    thread, in its workspace (`fp32_workspace_bytes`). Keys and values whose rows lie a
    head apart (`rows_apart`) are copied side by side once per (sequence, kv head) of
    consecutive items, where the workspace has room (rows a head apart had slowed a
    packed varlen batch by a quarter)."""
    q_heads, kv_heads, dim, value_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    address = (data_address(workspace) + 63) // 64 * 64
    longest_keys = longest(variant, 4)
    head_bytes = fp32_head_bytes(longest_keys, dim, value_dim)
    room = workspace.shape[0] - fp32_workspace_bytes(
        longest_keys, dim, value_dim, block_m, block_n, scores_by_rows(variant), False
    )
    copies = (rows_apart(k) or rows_apart(v)) and room >= head_bytes
    tile_address = address + (head_bytes if copies else 0)
    copied = -1
    keys, values = k, v
    for item in range(first, last):
        tile, head = tile_and_head(variant, q_heads, kv_heads, block_m, item)
        if head < 0:
            continue
        slot, hk, k0, kv_len = tile[2], head % kv_heads, tile[6], tile[7]
        if copies and head != copied:
            keys = copy_rows(k, slot, hk, k0, kv_len, address)
            values = copy_rows(v, slot, hk, k0, kv_len, address + rows_bytes(kv_len, dim, 4))
            copied = head
        kv_at = (0, 0, 0) if copies else (slot, hk, k0)
        fp32_query_tile(q, keys, values, kv_at, variant, scale, outs, stats, block_m, block_n,
                        tile, tile_address)  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def fp32_forward(memory, workspace, variant, scale, block_m, block_n):
    """`packed_forward` for fp32 with the scores transposed (AVX-512: `column_maxima`): the
    items shared out in workspace.shape[0] runs of consecutive ones, one per thread, each
    in its own workspace row (`fp32_forward_items`)."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, k, v, outs, stats = forward_arrays(memory)
    items = forward_items(variant, q.shape[1], block_m)
    runs = workspace.shape[0]
    for run in prange(runs):
        first, last = run_bounds(run, runs, items)
        fp32_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n,
                           workspace[run], first, last)  # fmt: skip
