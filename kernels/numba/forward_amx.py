"""The bf16 forward on AMX tiles, its scores transposed (`amx_forward`)."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.amx import TILE_PAIRS, TILE_ROWS, amx_product, depth_steps, whole_tiles
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
from attnperf.kernels.numba.packing import pack_key_panels, transpose_bf16, transpose_tile
from attnperf.kernels.numba.softmax import (
    F32,
    U16,
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
    transposed_softmax_to_bf16,
)
from attnperf.kernels.numba.variant import LoweredVariant, key_tiles, longest

# The scores transposed, S^T = K Q^T (keys by query rows): the softmax's maxima and sums
# then run down the keys, a vector of 16 query rows at a time, where by rows each row
# reduced its vectors across lanes and rescaled on its own (twice as slow). K is A as its
# rows lie, Q^T (packed per query tile) B; then O^T += V^T P^T, with V^T packed once per
# kv head (a quarter of the values' pairs' time) and P^T written in B's pairs by the
# softmax itself. O goes back to rows once, at the end of the query tile.


@njit(fastmath=FASTMATH)
def transposed_scores(k, slot, hk, j0, cols, q_view, s_t, tail):
    """s_t[:whole_tiles(cols)] = K Q^T (unscaled) of keys k[slot, hk, j0 : j0 + cols]
    against the query tile's Q^T (q_view, B's pairs), on AMX tiles: whole tiles of 16 keys
    read where they lie (E of unit stride), the rest copied 16 at a time into `tail`
    (16, E), zeros past the last key, so that no tile reads past the tensor."""
    col_tiles, steps = s_t.shape[1] // TILE_ROWS, depth_steps(k.shape[3])
    whole = cols // TILE_ROWS * TILE_ROWS if k.strides[3] == k.itemsize else 0
    if whole > 0:
        x, at, row_stride, _ = rows_view(k, slot, hk, j0)
        amx_product((x, at, row_stride), q_view, (s_t, 0, s_t.shape[1]), whole // TILE_ROWS,
                    col_tiles, steps, False)  # fmt: skip
    for t in range(whole, cols, TILE_ROWS):
        count = min(TILE_ROWS, cols - t)
        for j in range(count):
            key, row = k[slot, hk, j0 + t + j], tail[j]
            for e in range(k.shape[3]):
                row[e] = key[e]
        tail[count:] = 0
        amx_product((tail, 0, tail.shape[1]), q_view, (s_t, t * s_t.shape[1], s_t.shape[1]), 1,
                    col_tiles, steps, False)  # fmt: skip


@njit(fastmath=FASTMATH)
def amx_tile_buffers(address, tile_rows, width, dim, value_dim, by_rows):
    """A query tile's buffers for `amx_query_tile`, carved at `address` (`carve`): Q^T in
    B's pairs, S^T, P^T in B's pairs, O^T, O, the rows' (max, sum, shift), the softmax's
    work, the scores by rows (a mask's or a layout's), a tail of 16 keys; and their extent
    in bytes."""
    q_t, at = carve(address, 0, (tile_rows // TILE_ROWS, dim // 2, 2 * TILE_PAIRS), U16)
    s_t, at = carve(address, at, (whole_tiles(width), tile_rows), F32)
    p_t, at = carve(address, at, (depth_steps(width) * TILE_PAIRS, 2 * tile_rows), U16)
    acc_t, at = carve(address, at, (value_dim, tile_rows), F32)
    acc, at = carve(address, at, (tile_rows, value_dim), F32)
    state, at = carve(address, at, (3, tile_rows), F32)
    work, at = carve(address, at, (3, tile_rows), F32)
    s_rows, at = carve(address, at, (tile_rows if by_rows else 0, whole_tiles(width)), F32)
    tail, at = carve(address, at, (TILE_ROWS, dim), U16)
    return (q_t, s_t, p_t, acc_t, acc, state, work, s_rows, tail), at


@njit(fastmath=FASTMATH)
def amx_query_tile(q, k, k_at, values, variant, scale, outs, stats, block_m, block_n, tile,
                   address):  # fmt: skip
    """Query tile `tile` (`query_tile`'s, rows > 0) of `amx_forward` against its kv head's
    keys at k_at = (slot, head, first row) of k (where they lie, or as copied) and its V^T
    (values: Ev x >= S + 32), in buffers carved at `address` (`amx_tile_buffers`)."""
    wide_vectors()
    k_slot, hk, k0 = k_at
    value_dim = values.shape[0]
    scale2 = np.float32(scale * LOG2E)
    b, h, slot, q0, i0, rows, _, kv_len = tile
    tile_rows, width = whole_tiles(rows), key_tile_width(kv_len, block_n)
    buffers, _ = amx_tile_buffers(address, tile_rows, width, q.shape[3], value_dim,
                                  scores_by_rows(variant))  # fmt: skip
    q_t, s_t, p_t, acc_t, acc, state, work, s_rows, tail = buffers
    depth = q.shape[3] // 2
    pack_key_panels(q[slot, h, q0 + i0 : q0 + i0 + rows], q_t)  # zero rows to a whole tile
    q_view = (q_t, 0, 2 * TILE_PAIRS, depth * 2 * TILE_PAIRS)
    p_view = (p_t, 0, 2 * tile_rows, 2 * TILE_PAIRS)
    row_max, row_sum, shift = start_softmax(acc_t, state)
    for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
        transposed_scores(k, k_slot, hk, k0 + j0, cols, q_view, s_t, tail)
        factor = modify_transposed(s_t, s_rows, variant, scale2, b, h, i0, rows, j0, cols,
                                   structure)  # fmt: skip
        transposed_softmax_to_bf16(s_t, factor, p_t, cols, acc_t, row_max, row_sum, shift, work)
        value_tile = (values, j0, values.shape[1])
        amx_product(value_tile, p_view, (acc_t, 0, tile_rows), value_dim // TILE_ROWS,
                    tile_rows // TILE_ROWS, depth_steps(cols), True)  # fmt: skip
    transpose_tile(acc_t, acc, value_dim, tile_rows)
    finish_rows(variant, slot, h, q0 + i0, acc[:rows], row_sum, shift, outs, stats)


@njit(fastmath=FASTMATH)
def values_columns(keys):
    """V^T's columns for `keys` keys: whole steps of 32 and one more, of zeros (a last step
    of 32 keys reads past the keys)."""
    return -(-keys // (2 * TILE_PAIRS)) * 2 * TILE_PAIRS + 2 * TILE_PAIRS


@njit(fastmath=FASTMATH)
def amx_values_buffers(address, keys, value_dim):
    """V^T of a kv head of up to `keys` keys and `transpose_bf16`'s pairs, carved at
    `address`; and their extent in bytes."""
    values, at = carve(address, 0, (value_dim, values_columns(keys)), U16)
    pairs_t, at = carve(address, at, (value_dim // 2, 2 * whole_tiles(keys)), U16)
    return values, pairs_t, at


@njit(fastmath=FASTMATH)
def amx_workspace_bytes(keys, dim, value_dim, block_m, block_n, by_rows, copies):
    """The bytes of one thread's workspace for `amx_forward_items` (a line more, to start
    on one), with room for a kv head's keys copied side by side (`copies`)."""
    _, _, values_end = amx_values_buffers(0, keys, value_dim)
    width = key_tile_width(keys, block_n)
    _, tile_end = amx_tile_buffers(0, whole_tiles(block_m), width, dim, value_dim, by_rows)
    keys_end = rows_bytes(keys, dim, 2) if copies else 0
    return (values_end + 63) // 64 * 64 + keys_end + tile_end + 64


@njit(fastmath=FASTMATH)
def amx_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n, workspace, first,
                      last):  # fmt: skip
    """Items (sequence, query head, query tile) first .. last - 1 of `amx_forward`, on one
    thread, in its workspace (`amx_workspace_bytes`): V^T of each (sequence, kv head)
    packed as its items come (consecutive items share it), its keys copied side by side
    where their rows lie a head apart (`rows_apart`) and the workspace has room, then each
    query tile's buffers."""
    q_heads, kv_heads, dim = q.shape[1], k.shape[1], k.shape[3]
    address = (data_address(workspace) + 63) // 64 * 64
    longest_keys = longest(variant, 4)
    values, pairs_t, at = amx_values_buffers(address, longest_keys, v.shape[3])
    keys_at = address + (at + 63) // 64 * 64
    key_bytes = rows_bytes(longest_keys, dim, 2)
    room = workspace.shape[0] - amx_workspace_bytes(
        longest_keys, dim, v.shape[3], block_m, block_n, scores_by_rows(variant), False
    )
    copies = rows_apart(k) and room >= key_bytes
    tile_address = keys_at + (key_bytes if copies else 0)
    packed = -1
    keys = k
    for item in range(first, last):
        tile, head = tile_and_head(variant, q_heads, kv_heads, block_m, item)
        if head < 0:
            continue
        slot, hk, k0, kv_len = tile[2], head % kv_heads, tile[6], tile[7]
        if head != packed:
            transpose_bf16(v[slot, hk, k0 : k0 + kv_len], values, pairs_t)
            if copies:
                keys = copy_rows(k, slot, hk, k0, kv_len, keys_at)
            packed = head
        k_at = (0, 0, 0) if copies else (slot, hk, k0)
        amx_query_tile(q, keys, k_at, values, variant, scale, outs, stats, block_m, block_n,
                       tile, tile_address)  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def amx_forward(memory, workspace, variant, scale, block_m, block_n):
    """`packed_forward` for bf16 on AMX tiles (E and Ev multiples of 32), the scores
    transposed: the items shared out in workspace.shape[0] runs of consecutive ones, one
    per thread (as prange would share them), each run in its own workspace row, with no
    allocation nor a packing pass of its own (`amx_forward_items`)."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, k, v, outs, stats = forward_arrays(memory)
    items = forward_items(variant, q.shape[1], block_m)
    runs = workspace.shape[0]
    for run in prange(runs):
        first, last = run_bounds(run, runs, items)
        amx_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n,
                          workspace[run], first, last)  # fmt: skip
