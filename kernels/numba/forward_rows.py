"""The forwards with their scores by rows: on BLAS tiles (`online_softmax_forward`), and on our
micro-kernels (`packed_forward`: fp32 on AVX2, bf16 off AMX)."""

from __future__ import annotations

import numpy as np

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
from attnperf.kernels.numba.packing import pack_key_panels, pack_vnni
from attnperf.kernels.numba.softmax import (
    F32,
    U16,
    finish_rows,
    forward_arrays,
    forward_items,
    head_pairs_view,
    head_panels_view,
    key_tile_width,
    online_softmax_rescale,
    online_softmax_tiles,
    query_tile,
    round_probabilities,
    rows_view,
    softmax_state,
    start_softmax,
    tile_and_head,
)
from attnperf.kernels.numba.variant import LoweredVariant, key_tiles, longest, modify_scores


@njit(parallel=True, fastmath=FASTMATH)
def online_softmax_forward(memory, variant, scale, block_m, block_n):
    """out (B, Hq, L, Ev) and stats (B, Hq, L, 2): each row's base-2 max and its sum of
    2 ** (score - max), the sink's term included; fp32 q, k, v with unit stride along E."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, k, v, outs, stats = forward_arrays(memory)
    q_heads, kv_heads, value_dim = q.shape[1], k.shape[1], v.shape[3]
    group = q_heads // kv_heads
    scale2 = scale * LOG2E
    for item in prange(forward_items(variant, q_heads, block_m)):
        b, h, slot, q0, i0, rows, k0, kv_len = query_tile(variant, q_heads, block_m, item)
        if rows <= 0:  # past this sequence's end
            continue
        s, acc, row_max, row_sum, shift = softmax_state(rows, block_n, value_dim)
        hk = h // group
        online_softmax_tiles(
            q[slot, h, q0 + i0 : q0 + i0 + rows], k[slot, hk, k0 : k0 + kv_len],
            v[slot, hk, k0 : k0 + kv_len], variant, b, h, i0, rows, kv_len, scale2, block_n, s,
            acc, row_max, row_sum, shift,
        )  # fmt: skip
        finish_rows(variant, slot, h, q0 + i0, acc, row_sum, shift, outs, stats)


@njit(fastmath=FASTMATH)
def packed_kv_buffers(address, keys, dim, value_dim, like):
    """A kv head's keys in panels of 16 (`pack_key_panels`: fp32, or bf16 pairs where like
    is uint16) and, for bf16, its values in pairs (`pack_vnni`; none for fp32, whose V is
    read in place), for up to `keys` keys, carved at `address`; and their extent."""
    pair = 2 if like.itemsize == 2 else 1
    panel_shape = ((keys + LANES - 1) // LANES, (dim + pair - 1) // pair, LANES * pair)
    key_panels, at = carve(address, 0, panel_shape, like)
    pairs_shape = ((keys + 1) // 2, 2 * value_dim) if pair == 2 else (0, 0)
    value_pairs, at = carve(address, at, pairs_shape, U16)
    return key_panels, value_pairs, at


@njit(fastmath=FASTMATH)
def packed_tile_buffers(address, rows, width, value_dim, bf16):
    """A query tile's buffers for `packed_query_tile`, carved at `address`: the scores, the
    unnormalised accumulator, the rows' (max, sum, shift), P in bf16 (bf16 calls: a column
    more, a pair's zero); and their extent."""
    s, at = carve(address, 0, (rows, width), F32)
    acc, at = carve(address, at, (rows, value_dim), F32)
    state, at = carve(address, at, (3, rows), F32)
    p16, at = carve(address, at, (rows, width + 1 if bf16 else 0), U16)
    return s, acc, state, p16, at


@njit(fastmath=FASTMATH)
def packed_query_tile(q, v, key_panels, value_pairs, variant, scale, outs, stats, block_n, tile,
                      address):  # fmt: skip
    """Query tile `tile` (`query_tile`'s, rows > 0) of `packed_forward` against its kv
    head's packed keys (and bf16 values), in buffers carved at `address`."""
    wide_vectors()
    bf16 = value_pairs.shape[0] > 0
    q_heads, kv_heads, value_dim = q.shape[1], v.shape[1], v.shape[3]
    scale2 = np.float32(scale * LOG2E)
    depth = key_panels.shape[1]
    b, h, slot, q0, i0, rows, k0, kv_len = tile
    width = key_tile_width(kv_len, block_n)
    s, acc, state, p16, _ = packed_tile_buffers(address, rows, width, value_dim, bf16)
    row_max, row_sum, shift = start_softmax(acc, state)
    hk = h // (q_heads // kv_heads)
    q_view = rows_view(q, slot, h, q0 + i0)
    acc_view = (acc, 0, value_dim)
    no_dtanh = s[:0, :0]
    for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
        keys_view = head_panels_view(key_panels, j0)
        tile_product(depth, scale2, ZERO, q_view, keys_view, (s, 0, width), rows, cols)
        modify_scores(s, variant, b, h, i0, j0, rows, cols, structure, no_dtanh)
        online_softmax_rescale(s, rows, cols, acc, row_max, row_sum, shift)
        if bf16:
            round_probabilities(s, p16, rows, cols)
            values_view = head_pairs_view(value_pairs, j0)
            p_view = (p16, 0, width + 1, 1)
            tile_product((cols + 1) // 2, ONE, ONE, p_view, values_view, acc_view, rows, value_dim)
        else:
            _, v_at, v_row, _ = rows_view(v, slot, hk, k0 + j0)  # V in place: B's rows
            values_view = (v, v_at, v_row, LANES)
            tile_product(cols, ONE, ONE, (s, 0, width, 1), values_view, acc_view, rows, value_dim)
    finish_rows(variant, slot, h, q0 + i0, acc, row_sum, shift, outs, stats)


@njit(fastmath=FASTMATH)
def packed_workspace_bytes(keys, dim, value_dim, block_m, block_n, like):
    """The bytes of one thread's workspace for `packed_forward_items` (a line more, to
    start on one)."""
    _, _, kv_end = packed_kv_buffers(0, keys, dim, value_dim, like)
    width = key_tile_width(keys, block_n)
    tile_end = packed_tile_buffers(0, block_m, width, value_dim, like.itemsize == 2)[-1]
    return (kv_end + 63) // 64 * 64 + tile_end + 64


@njit(fastmath=FASTMATH)
def packed_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n, workspace,
                         first, last):  # fmt: skip
    """Items (sequence, query head, query tile) first .. last - 1 of `packed_forward`, on
    one thread, in its workspace (`packed_workspace_bytes`): each (sequence, kv head)'s
    keys (and bf16 values) packed as its items come (consecutive items share them), then
    each query tile's buffers."""
    q_heads, kv_heads = q.shape[1], k.shape[1]
    address = (data_address(workspace) + 63) // 64 * 64
    like = q[0, 0, 0, :0]  # q's element type: fp32, or bf16 bits
    key_panels, value_pairs, at = packed_kv_buffers(address, longest(variant, 4), k.shape[3],
                                                    v.shape[3], like)  # fmt: skip
    tile_address = address + (at + 63) // 64 * 64
    packed = -1
    for item in range(first, last):
        tile, head = tile_and_head(variant, q_heads, kv_heads, block_m, item)
        if head < 0:
            continue
        if head != packed:
            slot, hk, k0, kv_len = tile[2], head % kv_heads, tile[6], tile[7]
            pack_key_panels(k[slot, hk, k0 : k0 + kv_len], key_panels)
            if value_pairs.shape[0] > 0:
                pack_vnni(v[slot, hk, k0 : k0 + kv_len], value_pairs)
            packed = head
        packed_query_tile(q, v, key_panels, value_pairs, variant, scale, outs, stats, block_n,
                          tile, tile_address)  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def packed_forward(memory, workspace, variant, scale, block_m, block_n):
    """online_softmax_forward on our micro-kernels, the scores by rows: fp32 (q, k, v
    float32; on AVX2, where `fp32_forward` does not serve) or bf16 off AMX (q, k, v bf16
    bits, values packed in pairs, P rounded to bf16 before P V; E even); scores, softmax
    and accumulation in fp32. The items shared out in workspace.shape[0] runs of
    consecutive ones, one per thread (as prange would share them), each in its own
    workspace row, with no allocation nor a packing pass of its own
    (`packed_forward_items`)."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, k, v, outs, stats = forward_arrays(memory)
    items = forward_items(variant, q.shape[1], block_m)
    runs = workspace.shape[0]
    for run in prange(runs):
        first, last = run_bounds(run, runs, items)
        packed_forward_items(q, k, v, variant, scale, outs, stats, block_m, block_n,
                             workspace[run], first, last)  # fmt: skip
