"""Attention forward and backward: the online-softmax forward over tiles, FlashAttention-2's
recomputing backward (a dq pass and a dk/dv pass, or one fused pass), and their launchers."""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch
from torch import Tensor

from attnperf.backend import ROUNDED_DTYPES, rounded_output
from attnperf.inputs import AttentionInputs
from attnperf.kernels.numba.amx import (
    TILE_PAIRS,
    TILE_ROWS,
    amx_product,
    depth_steps,
    whole_tiles,
    zero_to_step,
)
from attnperf.kernels.numba.fastmath import (
    LOG2E,
    exp2,
    exp2_for_bf16,
    exp2_shifted,
    row_maximum,
    scaled_minus,
    to_whole_steps,
    widen,
)
from attnperf.kernels.numba.jit import (
    FASTMATH,
    aligned_empty,
    array_at,
    carve,
    data_address,
    njit,
    pointer_at,
    prange,
    row_view,
    run_bounds,
    serial,
    split_index,
    strided_array,
    strided_at,
    unowned,
    unowned_members,
    wide_vectors,
)
from attnperf.kernels.numba.launch import (
    any_layout,
    as_bf16_bits,
    as_fp32,
    as_numpy,
    empty_output,
    float32_array,
    fp32_operand,
    memory_of,
    run_parallel,
    scratch,
    stats_output,
    strided_memory,
    zero_memory,
)
from attnperf.kernels.numba.microkernels import (
    BF16,
    FP32,
    LANES,
    ONE,
    ZERO,
    column_maxima,
    exp2_columns,
    exp2_pairs_to_bf16,
    pack_key_panels,
    pack_vnni,
    tile_product,
    tile_route,
    to_bf16,
    transpose_bf16,
    transpose_tile,
)
from attnperf.kernels.numba.tiles import OWN_TILES, product, tiles_flag
from attnperf.kernels.numba.variant import (
    MASKED,
    SKIP,
    LoweredVariant,
    adds_mask_values,
    changes_values,
    key_tiles,
    longest,
    longest_in_table,
    lower_variant,
    modify_scores,
    modify_transposed_scores,
    query_range,
    sequence,
    tile_structure,
    with_sink,
)

# The element types of `carve`'s arrays.
F32, U16 = np.empty(0, np.float32), np.empty(0, np.uint16)

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
# Query rows of a call's tiles where whole ones (BLOCK_M) leave a thread fewer than two.
SHORT_CALL_BLOCK_M = 64


@njit(fastmath=FASTMATH)
def online_softmax_rescale(s, rows, cols, acc, row_max, row_sum, shift):
    """The online softmax's step before acc += P V: s[:rows, :cols] <- P = 2 ** (s - the
    rows' new max), their max and sum updated, acc rescaled to the new max; the rows run
    in whole steps of 64 columns where s has room (`to_whole_steps`: P = 0 past cols)."""
    for r in range(rows):
        s_row = row_view(s, r)
        wide = to_whole_steps(s_row, cols, s.shape[1])
        new_max = row_maximum(s_row, wide, row_max[r])
        # A row with nothing allowed so far shifts by 0: its exp2 stays 0, not NaN.
        shift[r] = new_max if new_max != -np.inf else 0.0
        # Our float32 exp2, not `2.0 **` (a float64 libm pow per row); 1 leaves acc alone.
        alpha = exp2(row_max[r] - shift[r]) if row_max[r] != -np.inf else np.float32(0.0)
        row_max[r] = new_max
        row_sum[r] = row_sum[r] * alpha + exp2_shifted(s_row, wide, shift[r], 1.0)
        if alpha != 1:
            for e in range(acc.shape[1]):
                acc[r, e] *= alpha


@njit(fastmath=FASTMATH)
def online_softmax_tiles(
    q_tile, k, v, variant, b, h, i0, rows, kv_len, scale2, block_n, s, acc, row_max, row_sum,
    shift,
):  # fmt: skip
    """The online softmax (unnormalised acc, row_max, row_sum, shift) of query rows i0 ..
    i0 + rows - 1 (q_tile) of head h, over the key tiles they see of k, v (S, E)."""
    no_dtanh = np.empty((0, 0), np.float32)
    for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
        product(q_tile, k[j0 : j0 + cols], s[:, :cols], scale2, 0.0, False, True, variant.tiles)
        modify_scores(s, variant, b, h, i0, j0, rows, cols, structure, no_dtanh)
        online_softmax_rescale(s, rows, cols, acc, row_max, row_sum, shift)
        product(s[:, :cols], v[j0 : j0 + cols], acc, 1.0, 1.0, False, False, variant.tiles)


@njit()
def query_tile(variant, q_heads, block_m, item):
    """(b, h, slot, q0, i0, rows, k0, kv_len) of work item (sequence, query head, query
    tile) of the forward: the sequence's table row (its first query and key rows q0, k0 of
    batch entry `slot`), the tile's first row i0 within it and its rows (<= 0 past the
    sequence's end)."""
    q_tiles = (longest(variant, 2) + block_m - 1) // block_m
    b, h, tile = split_index(item, q_heads, q_tiles)
    slot, q0, q_len, k0, kv_len = sequence(variant, b)
    i0 = tile * block_m
    return b, h, slot, q0, i0, min(block_m, q_len - i0), k0, kv_len


@njit(fastmath=FASTMATH)
def tile_and_head(variant, q_heads, kv_heads, block_m, item):
    """A forward item's tile (`query_tile`) and its (sequence, kv head) as one index, b Hk +
    hk (-1 past its sequence's end: no work). Consecutive items of one index share its
    packed keys and values."""
    tile = query_tile(variant, q_heads, block_m, item)
    if tile[5] <= 0:
        return tile, -1
    return tile, tile[0] * kv_heads + tile[1] // (q_heads // kv_heads)


@njit(fastmath=FASTMATH)
def forward_items(variant, q_heads, block_m):
    """The forward's work items: (sequence, query head, query tile) triples."""
    return variant.sequences.shape[0] * q_heads * ((longest(variant, 2) + block_m - 1) // block_m)


@njit(fastmath=FASTMATH)
def softmax_state(rows, block_n, value_dim):
    """A query tile's online-softmax state: the score tile, the unnormalised accumulator
    (both on 64-byte lines, as AMX's tiles take them), and each row's running max, sum and
    shift (nothing seen yet)."""
    f32 = np.empty(0, np.float32)
    s, acc = aligned_empty(rows, block_n, f32), aligned_empty(rows, value_dim, f32)
    acc[:] = 0
    row_max = np.full(rows, -np.inf, np.float32)
    return s, acc, row_max, np.zeros(rows, np.float32), np.zeros(rows, np.float32)


@njit(fastmath=FASTMATH)
def start_softmax(acc, state):
    """A query tile's online softmax before its first key tile, in carved buffers: acc
    zeroed, and state (3, rows) as each row's running max (-inf: nothing seen yet), sum
    and shift; returns those three rows."""
    acc[:] = 0
    row_max, row_sum, shift = state[0], state[1], state[2]
    row_max[:] = -np.inf
    row_sum[:] = 0
    shift[:] = 0
    return row_max, row_sum, shift


@njit(fastmath=FASTMATH)
def finish_rows(variant, slot, h, first, acc, row_sum, shift, outs, stats):
    """out[slot, h, first:first + rows] and their stats (base-2 max, sum; the sink's term
    included) from the online softmax's unnormalised acc, sums and shifts (outs: (out,
    residual)). A uint16 out takes the rows rounded to bf16 (their bits), and a residual
    with rows (bf16 bits, else empty) what the rounding took off each value, rounded to bf16
    in turn: the backward's rowsum(dO * O) then reads O as computed (`rounding_residual`)."""
    out, residual = outs
    bf16 = out.itemsize == 2  # bf16 bits
    keep_residual = residual.shape[0] > 0
    value_dim = out.shape[3]  # acc may have columns more (`fp32_query_tile`'s sixteens)
    for r in range(acc.shape[0]):
        # Rows that see no key (sum 0) give 0; so does their backward (p = 2**x * 0).
        row_max, total, inv = with_sink(variant, h, shift[r], row_sum[r])
        i = first + r
        if bf16:  # the product in float32: it is rounded to bf16 next
            inv32 = np.float32(inv)
            for e in range(value_dim):
                value = acc[r, e] * inv32
                bits = to_bf16(value)
                out[slot, h, i, e] = bits
                if keep_residual:
                    residual[slot, h, i, e] = to_bf16(value - widen(bits))
        else:
            for e in range(value_dim):
                out[slot, h, i, e] = acc[r, e] * inv
        stats[slot, h, i, 0] = row_max
        stats[slot, h, i, 1] = total


@njit()
def forward_arrays(memory):
    """(q, k, v, (out, residual), stats) of a forward in its tensors' memory (q, k, v, out,
    stats, residual): q, k, v at any strides (`launch.strided_memory`), the others
    C-contiguous (`launch.memory_of`)."""
    q, k, v = strided_at(memory[0]), strided_at(memory[1]), strided_at(memory[2])
    return q, k, v, (array_at(memory[3]), array_at(memory[5])), array_at(memory[4])


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
def round_probabilities(p, p16, rows, cols):
    """p16[:rows, :cols] <- P rounded to bf16 (FlashAttention's practice before P V), a zero
    after an odd last column so that the column pairs are whole."""
    for r in range(rows):
        p_row, p16_row = p[r], p16[r]
        for c in range(cols):
            p16_row[c] = to_bf16(p_row[c])
        if cols % 2:
            p16_row[cols] = 0


@njit(fastmath=FASTMATH)
def rows_view(x, slot, h, row):
    """x[slot, h, row:] as a micro-kernel's A view: (x, offset, row stride, 1) in elements;
    rows of unit stride."""
    unit = x.itemsize
    at = (slot * x.strides[0] + h * x.strides[1] + row * x.strides[2]) // unit
    return x, at, x.strides[2] // unit, 1


@njit(fastmath=FASTMATH)
def rows_apart(x):
    """Whether x's rows (its last dim) do not lie side by side: a packed (T, H, E) batch's,
    or (B, L, H, E) transposed, rows a head apart. Such rows fall into a few of L1's sets,
    and the forward's products re-read a tile's rows from L2 at each row block: the
    forwards copy them side by side per (sequence, kv head) where they have room."""
    return x.strides[2] != x.shape[3] * x.itemsize


@njit(fastmath=FASTMATH)
def rows_bytes(rows, width, itemsize):
    """The bytes of `rows` rows of `width` elements side by side, to a whole line."""
    return (rows * width * itemsize + 63) // 64 * 64


@njit(fastmath=FASTMATH)
def copy_rows(x, slot, h, row, count, address):
    """x[slot, h, row : row + count] copied side by side to `address`, as an array of x's
    type (1, 1, count, E), each row read as the contiguous array it is."""
    width, unit = x.shape[3], x.itemsize
    _, at, stride, _ = rows_view(x, slot, h, row)
    first = data_address(x) + at * unit
    for i in range(count):
        source = numba.carray(pointer_at(first + i * stride * unit, x), width)
        numba.carray(pointer_at(address + i * width * unit, x), width)[:] = source
    return strided_array(address, (1, 1, count, width), (0, 0, width, 1), x)


@njit(fastmath=FASTMATH)
def panels_view(panels, b, hk, j0):
    """Keys j0.. of head hk of sequence b in `pack_key_panels`' panels (NS, Hk, S16,
    depth, w) as a micro-kernel's B view: X^T of those keys."""
    return head_panels_view(panels[b, hk], j0)


@njit(fastmath=FASTMATH)
def head_panels_view(head, j0):
    """Keys j0.. of a kv head's panels (S16, depth, w) as a micro-kernel's B view."""
    size = head.shape[1] * head.shape[2]
    return head, j0 // LANES * size, head.shape[2], size


@njit(fastmath=FASTMATH)
def pairs_view(pairs, b, hk, j0):
    """Keys j0.. (even) of head hk of sequence b in `pack_vnni`'s key pairs (NS, Hk,
    ceil(S / 2), 2 E) as a micro-kernel's B view: those keys' rows, paired. Views here are
    of 2-D arrays, as the forward's P V takes them: one compiled product serves both."""
    return head_pairs_view(pairs[b, hk], j0)


@njit(fastmath=FASTMATH)
def head_pairs_view(head, j0):
    """Keys j0.. (even) of a kv head's pairs (ceil(S / 2), 2 E) as a micro-kernel's B
    view."""
    return head, j0 // 2 * head.shape[1], head.shape[1], 2 * LANES


@njit(fastmath=FASTMATH)
def transposed_view(x_t, b, h, i0):
    """Rows i0.. of head h of sequence b in a transposed pack (NS, H, E, L + 1) as a
    micro-kernel's A view: X^T, its depth (the rows) in pairs."""
    head = x_t[b, h]
    return head, i0, head.shape[1], 1


@njit(fastmath=FASTMATH)
def amx_query_rows(q, slot, h, row, rows):
    """Query rows q[slot, h, row : row + rows] copied into whole AMX tiles: rows in
    sixteens, zeros past `rows`."""
    padded = aligned_empty(whole_tiles(rows), q.shape[3], q[0, 0])
    padded[:rows] = q[slot, h, row : row + rows]
    padded[rows:] = 0
    return padded


@njit(fastmath=FASTMATH)
def amx_scores(q, slot, h, row, rows, key_panels, b, hk, j0, s, cols):
    """s[:whole_tiles(rows), :cols] = Q K^T (unscaled) of query rows q[slot, h, row : row +
    rows] against keys j0.. on AMX tiles; the extra rows and columns (to sixteens) get the
    padding's. The rows are read where they lie when they fill whole tiles, else copied
    into them first (`amx_query_rows`; a copy per call took ~2 us of a 128 x 128 bf16 head's
    19.5). The backward's dP = dO V^T too: dO's rows against the values' panels."""
    keys = panels_view(key_panels, b, hk, j0)
    col_tiles, steps = whole_tiles(cols) // TILE_ROWS, depth_steps(q.shape[3])
    if rows % TILE_ROWS == 0 and q.strides[3] == q.itemsize:
        x, at, row_stride, _ = rows_view(q, slot, h, row)
        amx_product((x, at, row_stride), keys, (s, 0, s.shape[1]), rows // TILE_ROWS, col_tiles,
                    steps, False)  # fmt: skip
        return
    padded = amx_query_rows(q, slot, h, row, rows)
    amx_product((padded, 0, padded.shape[1]), keys, (s, 0, s.shape[1]),
                padded.shape[0] // TILE_ROWS, col_tiles, steps, False)  # fmt: skip


@njit(fastmath=FASTMATH)
def scale_scores(s, rows, cols, factor):
    for r in range(rows):
        s_row = s[r]
        for c in range(cols):
            s_row[c] *= factor


@njit(fastmath=FASTMATH)
def online_softmax_to_bf16(s, factor, p16, rows, cols, acc, row_max, row_sum, shift):
    """`online_softmax_rescale` of the scores factor * s (factor > 0), P written rounded to
    bf16 into p16 (`round_probabilities`) in the same pass: s is read twice, never written."""
    wide_vectors()
    for r in range(rows):
        s_row, p16_row = s[r], p16[r]
        new_max = max(row_max[r], factor * row_maximum(s_row, cols, -np.inf))
        shift[r] = new_max if new_max != -np.inf else 0.0
        alpha = exp2(row_max[r] - shift[r]) if row_max[r] != -np.inf else np.float32(0.0)
        row_max[r] = new_max
        total = np.float32(0.0)
        for c in range(cols):
            p = exp2_for_bf16(scaled_minus(s_row[c], factor, shift[r]))
            total += p
            p16_row[c] = to_bf16(p)
        row_sum[r] = row_sum[r] * alpha + total
        if alpha != 1:
            for e in range(acc.shape[1]):
                acc[r, e] *= alpha


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


@njit(fastmath=FASTMATH)
def key_tile_width(kv_len, block_n):
    """A score tile's keys: as many as the sequence needs, in whole steps of 64 (the
    softmax's vector loops: `to_whole_steps`), up to block_n (a short call's 64 keys
    would otherwise allocate, and fault in, 512 columns per item)."""
    return min(block_n, (kv_len + 63) // 64 * 64)


# ------------------------------------------------------------- the forward on AMX tiles
# The scores transposed, S^T = K Q^T (keys by query rows): the softmax's maxima and sums
# then run down the keys, a vector of 16 query rows at a time, where by rows each row
# reduced its vectors across lanes and rescaled on its own (a 128 x 128 bf16 head's
# softmax 4.2 us against 10.1, Intel with AMX, one thread). K is A as its rows lie, Q^T
# (packed per query tile) B; then O^T += V^T P^T, with V^T packed once per kv head (0.8
# us for 128 keys of E = 64, where the values' pairs took 3.3) and P^T written in B's
# pairs by the softmax itself. O goes back to rows once, at the end of the query tile.


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
def transposed_shifts(s_t, factor, cols, row_max, shift, work):
    """The online softmax's step before the exponentials, on transposed scores (s_t[c, r]
    the score of key c and query row r, all of s_t's rows, a whole number of sixteens;
    times factor > 0): the rows' new max and shift, work[1] <- each row's rescale factor
    alpha and work[2] <- 0 (the rows' sums to come). work: (3, rows) float32."""
    rows = s_t.shape[1]
    largest, alpha, total = work[0], work[1], work[2]
    largest[:] = -np.inf
    for r in range(0, rows, LANES):
        column_maxima(s_t, cols, r, largest)
    for r in range(rows):
        new_max = max(row_max[r], factor * largest[r])
        # A row with nothing allowed so far shifts by 0: its exp2 stays 0, not NaN.
        shift[r] = new_max if new_max != -np.inf else np.float32(0.0)
        alpha[r] = exp2(row_max[r] - shift[r]) if row_max[r] != -np.inf else np.float32(0.0)
        row_max[r] = new_max
        total[r] = 0


@njit(fastmath=FASTMATH)
def rescale_transposed(acc_t, row_sum, work):
    """The online softmax's step after the exponentials: each row's sum rescaled by its
    alpha (work[1]) plus the tile's (work[2]), and O^T's columns (acc_t (Ev, rows)) by
    alpha."""
    alpha, total = work[1], work[2]
    for r in range(row_sum.shape[0]):
        row_sum[r] = row_sum[r] * alpha[r] + total[r]
    for e in range(acc_t.shape[0]):
        acc_row = row_view(acc_t, e)
        for r in range(acc_row.shape[0]):
            acc_row[r] *= alpha[r]


@njit(fastmath=FASTMATH)
def transposed_softmax_to_bf16(s_t, factor, p_t, cols, acc_t, row_max, row_sum, shift, work):
    """`online_softmax_to_bf16` of transposed scores (`transposed_shifts`). P^T goes to p_t
    rounded to bf16 in AMX's B pairs (p_t[d, 2 r + u] = P[r, 2 d + u]), zeros to the end
    of the last step of 32 keys; acc_t = O^T (Ev, rows) is rescaled."""
    wide_vectors()
    rows = s_t.shape[1]
    transposed_shifts(s_t, factor, cols, row_max, shift, work)
    total = work[2]
    pairs = p_t.view(np.uint32)
    for d in range(cols // 2):
        for r in range(0, rows, LANES):  # rows: whole sixteens
            exp2_pairs_to_bf16(s_t, 2 * d * rows + r, rows, shift, r, factor, p_t,
                               d * 2 * rows + 2 * r, total)  # fmt: skip
    if cols % 2:
        last, pair = s_t[cols - 1], pairs[cols // 2]
        for r in range(rows):
            p_last = exp2_for_bf16(scaled_minus(last[r], factor, shift[r]))
            total[r] += p_last
            pair[r] = np.uint32(to_bf16(p_last))
    pairs[(cols + 1) // 2 :] = 0
    rescale_transposed(acc_t, row_sum, work)


@njit(fastmath=FASTMATH)
def transposed_softmax(s_t, factor, cols, acc_t, row_max, row_sum, shift, work):
    """The online softmax's step of transposed fp32 scores (`transposed_shifts`): s_t[:cols]
    <- P^T = 2 ** (factor s - shift) in place, the rows' sums updated, acc_t = O^T (Ev,
    rows) rescaled."""
    wide_vectors()
    transposed_shifts(s_t, factor, cols, row_max, shift, work)
    for r in range(0, s_t.shape[1], LANES):  # rows: whole sixteens
        exp2_columns(s_t, cols, r, shift, factor, work[2])
    rescale_transposed(acc_t, row_sum, work)


@njit(fastmath=FASTMATH)
def modify_transposed(s_t, s_rows, variant, scale2, b, h, i0, rows, j0, cols, structure):
    """A transposed score tile's variant (`modify_transposed_scores`); returns the factor
    that the softmax's pass multiplies the scores by. The scale goes into that pass unless
    a variant changes scores' values (then it is applied first and the factor is 1): the
    band and the block layout only set -inf (a causal tile's pass over its scores cost as
    much as its maxima)."""
    factor = scale2
    biased = structure == MASKED and adds_mask_values(variant, b, h, i0, rows, j0, cols)
    if scale2 <= 0 or changes_values(variant) or biased:
        scale_scores(s_t, cols, s_t.shape[1], scale2)
        factor = ONE
    if factor == ONE or structure == MASKED:
        modify_transposed_scores(s_t, s_rows, variant, b, h, i0, j0, rows, cols, structure)
    return factor


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
def scores_by_rows(variant):
    """Whether `modify_transposed_scores` takes a tile's scores by rows (a block layout),
    into a buffer of its own."""
    return variant.block_q != 0


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


# ------------------------------------------------------- the fp32 forward, transposed
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
    consecutive items, where the workspace has room (a packed varlen batch, 8 heads of 64,
    had taken 1.26x the time of the same rows side by side)."""
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


@njit(fastmath=FASTMATH)
def product_with_transposed(a, x_tile, panels, b, hk, j0, out, alpha, tiles):
    """out = alpha * a @ x_tile^T (x_tile: keys j0.. of head hk of sequence b): from x's
    panels, packed once per call (`pack_panels`), where they are given, else by `product`
    (which packs x_tile^T per call on our tiles)."""
    if panels.shape[0] == 0:
        product(a, x_tile, out, alpha, 0.0, False, True, tiles)
        return
    a_view = (a, 0, a.strides[0] // 4, 1)
    x_view = panels_view(panels, b, hk, j0)
    out_view = (out, 0, out.strides[0] // 4)
    tile_product(panels.shape[3], np.float32(alpha), ZERO, a_view, x_view, out_view, a.shape[0],
                 x_tile.shape[0])  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def pack_panels(x_any, variant, panels):
    """panels (NS, Hk, S16, E, 16) <- each sequence's keys (or values) of x, per kv head, as
    `pack_key_panels`: x^T for the micro-kernels, a sequence starting at a panel."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    x = x_any[0]  # launch.any_layout's view
    kv_heads = x.shape[1]
    for item in prange(variant.sequences.shape[0] * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        slot, _, _, k0, kv_len = sequence(variant, b)
        pack_key_panels(x[slot, hk, k0 : k0 + kv_len], panels[b, hk])


@njit(fastmath=FASTMATH)
def probabilities(q_tile, k_tile, p, dtanh, variant, b, h, i0, j0, structure, scale2, stats,
                  key_panels, hk):  # fmt: skip
    """p[:rows, :cols] <- P of one (query tile, key tile), from the rows' saved max and sum
    (stats[i0:i0 + rows]): kept apart, they hold the sum where max + log2(sum) would round
    it away (scores near finfo.min). With a softcap, dtanh <- its gradient factor.

    `p` is a C-contiguous buffer: its rows are C-contiguous too, which the exp2 loop needs
    to vectorise (a [:rows, :cols] view's rows are not typed so).
    """
    rows, cols = q_tile.shape[0], k_tile.shape[0]
    product_with_transposed(q_tile, k_tile, key_panels, b, hk, j0, p[:rows, :cols], scale2,
                            variant.tiles)  # fmt: skip
    scores_to_probabilities(p, dtanh, variant, b, h, i0, j0, rows, cols, structure, stats)


@njit(fastmath=FASTMATH)
def scores_to_probabilities(p, dtanh, variant, b, h, i0, j0, rows, cols, structure, stats):
    """p[:rows, :cols] <- P from the scores there (times log2 e): the variant's
    modifications, then 2 ** (s - max) / sum by the rows' saved stats (`probabilities`);
    0 past cols to a whole step of 64 where p has room (`to_whole_steps`)."""
    modify_scores(p, variant, b, h, i0, j0, rows, cols, structure, dtanh)
    for r in range(rows):
        total = stats[i0 + r, 1]
        p_row = row_view(p, r)
        wide = to_whole_steps(p_row, cols, p.shape[1])
        exp2_shifted(p_row, wide, stats[i0 + r, 0], 1.0 / total if total != 0 else 0.0)


@njit(fastmath=FASTMATH)
def score_gradients(p, dp, delta, whole_rows, rows, cols):
    """dp <- dS = P * (dP - delta) on [:rows, :cols] of C-contiguous buffers: the gradient
    of the final scores (a float mask's gradient).

    With `whole_rows` (the tile holds every key its rows see; delta is FlashAttention's
    rowsum(dO * O), no dLSE), each row's delta first takes the tile's sum of
    P / sum(P) * (dP - delta), which makes it autograd's sum of P * dP over the very dP
    values that dS reads. Where one key takes nearly all of a row's softmax, rowsum(dO * O)
    and that key's dP differ by their own roundings, and dS, dq and dk carried it (1.1-4.3x
    the agreement rule's tolerance at E = 100, scale 1-3, L = 4-8). The correction is
    summed as differences from delta, and normalised by the tile's own sum of P, which the
    recomputed scores' last bits move off 1 (by ~1e-6 at scores ~40): a row of one key
    then gets delta = its dP and dS = 0 exactly, as in autograd.
    """
    for r in range(rows):
        d = delta[r]
        p_row, dp_row = p[r], dp[r]
        if whole_rows:
            mass = np.float32(0.0)
            correction = np.float32(0.0)
            for c in range(cols):
                mass += p_row[c]
                correction += p_row[c] * (dp_row[c] - d)
            if mass > 0:
                d += correction / mass
        for c in range(cols):
            dp_row[c] = p_row[c] * (dp_row[c] - d)


@njit(fastmath=FASTMATH)
def through_softcap(ds, dtanh, rows, cols):
    """ds <- ds * (1 - tanh^2): the gradient of the scores before the softcap."""
    for r in range(rows):
        ds_row, factor = ds[r], dtanh[r]
        for c in range(cols):
            ds_row[c] *= factor[c]


@njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dq(
    q_any, k_any, v_any, panels, variant, scale, stats, grad_out_any, delta, whole_rows, dq,
    dmask, block_m, block_n,
):  # fmt: skip
    """dq += (and the float mask's gradient dS into dmask, unless it is empty) per query
    tile (`whole_rows` as `score_gradients`')."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    # launch.any_layout's views:
    q, k, v, grad_out = q_any[0], k_any[0], v_any[0], grad_out_any[0]
    q_heads, kv_heads = q.shape[1], k.shape[1]
    group = q_heads // kv_heads
    q_tiles = (longest(variant, 2) + block_m - 1) // block_m
    scale2 = scale * LOG2E
    want_dmask = dmask.shape[0] > 0
    softcapped = variant.softcap2 != 0
    for item in prange(variant.sequences.shape[0] * q_heads * q_tiles):
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
                stats[slot, h, q0 : q0 + q_len], panels[0], hk,
            )  # fmt: skip
            product_with_transposed(do_tile, v_tile, panels[1], b, hk, j0, ds, 1.0, variant.tiles)
            score_gradients(
                p_buffer, ds_buffer, delta[slot, h, q0 + i0 : q0 + i0 + rows], whole_rows, rows,
                cols,
            )  # fmt: skip
            if want_dmask:  # plain calls only: slot b, no row offsets
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            if softcapped:
                through_softcap(ds_buffer, dtanh, rows, cols)
            product(
                ds,
                k_tile,
                dq[slot, h, q0 + i0 : q0 + i0 + rows],
                scale,
                1.0,
                False,
                False,
                variant.tiles,
            )


@njit(fastmath=FASTMATH)
def key_tile_gradients(
    q, k, v, panels, variant, scale, stats, grad_out, delta, whole_rows, dq, dk, dv, dmask,
    b, hk, j0, cols, block_m, p_buffer, ds_buffer, dtanh, with_dq,
):  # fmt: skip
    """dk, dv += those of keys j0..j0+cols of head hk, over the query heads of its group.

    With `with_dq`, also dq += dS K and, unless dmask is empty, dS into dmask: the caller
    owns every query row of the group then, so no other thread writes them.
    """
    group = q.shape[1] // k.shape[1]
    scale2 = scale * LOG2E
    softcapped = variant.softcap2 != 0
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
                stats[slot, h, q0 : q0 + q_len], panels[0], hk,
            )  # fmt: skip
            product(p, do_tile, dv_tile, 1.0, 1.0, True, False, variant.tiles)
            product_with_transposed(do_tile, v_tile, panels[1], b, hk, j0, ds, 1.0, variant.tiles)
            score_gradients(p_buffer, ds_buffer, delta[slot, h, queries], whole_rows, rows, cols)
            if want_dmask:  # plain calls only: slot b, no row offsets
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            if softcapped:
                through_softcap(ds_buffer, dtanh, rows, cols)
            product(ds, q_tile, dk_tile, scale, 1.0, True, False, variant.tiles)
            if with_dq:
                product(ds, k_tile, dq[slot, h, queries], scale, 1.0, False, False, variant.tiles)


@njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dkdv(
    q_any, k_any, v_any, panels, variant, scale, stats, grad_out_any, delta, whole_rows, dk, dv,
    block_m, block_n,
):  # fmt: skip
    """dk, dv += per key tile, summed over every query head of the key/value head's group."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    # launch.any_layout's views:
    q, k, v, grad_out = q_any[0], k_any[0], v_any[0], grad_out_any[0]
    kv_heads = k.shape[1]
    kv_tiles = (longest(variant, 4) + block_n - 1) // block_n
    unused = np.zeros((0, 0, 0, 0), np.float32)
    softcapped = variant.softcap2 != 0
    for item in prange(variant.sequences.shape[0] * kv_heads * kv_tiles):
        b, hk, tile = split_index(item, kv_heads, kv_tiles)
        j0 = tile * block_n
        cols = min(block_n, variant.sequences[b, 4] - j0)
        if cols <= 0:  # past this sequence's end
            continue
        p_buffer = np.empty((block_m, cols), np.float32)
        ds_buffer = np.empty((block_m, cols), np.float32)
        dtanh = np.empty((block_m if softcapped else 0, cols), np.float32)
        key_tile_gradients(
            q, k, v, panels, variant, scale, stats, grad_out, delta, whole_rows, unused, dk, dv,
            unused, b, hk, j0, cols, block_m, p_buffer, ds_buffer, dtanh, False,
        )  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def attention_backward_fused(
    q_any, k_any, v_any, panels, variant, scale, stats, grad_out_any, delta, whole_rows, dq, dk,
    dv, dmask, block_m, block_n,
):  # fmt: skip
    """dq, dk, dv += (and dS into an L x S dmask) in one pass: P and dP are computed once.

    One prange item per (batch, key/value head) owns every query head of its group, so its
    dq updates need no atomics; worth it when there are enough items for the threads.
    """
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    # launch.any_layout's views:
    q, k, v, grad_out = q_any[0], k_any[0], v_any[0], grad_out_any[0]
    kv_heads = k.shape[1]
    softcapped = variant.softcap2 != 0
    for item in prange(variant.sequences.shape[0] * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        kv_len = variant.sequences[b, 4]
        p_buffer = np.empty((block_m, block_n), np.float32)
        ds_buffer = np.empty((block_m, block_n), np.float32)
        dtanh = np.empty((block_m if softcapped else 0, block_n), np.float32)
        for j0 in range(0, kv_len, block_n):
            key_tile_gradients(
                q, k, v, panels, variant, scale, stats, grad_out, delta, whole_rows, dq, dk, dv,
                dmask, b, hk, j0, min(block_n, kv_len - j0), block_m, p_buffer, ds_buffer,
                dtanh, True,
            )  # fmt: skip


# The backward on bf16 tiles: every product's operands bf16, accumulation fp32, P and dS
# rounded to bf16 before the products that take them (FlashAttention's practice; PyTorch's
# CPU kernel rounds them too). The products over query rows run transposed, dV^T += dO^T P
# and dK^T += Q^T dS: their A operands, dO^T and Q^T, are packed once per call, and P and
# dS go to bf16 in pairs of rows (`pair_rows`) at the cost of rounding them. The transposes
# dV^T and dK^T of a key tile are added to dv and dk once, when its walk ends.


@njit(fastmath=FASTMATH)
def pair_rows(x, rows, cols, pairs):
    """pairs[:ceil(rows / 2), :2 cols] <- x[:rows, :cols] rounded to bf16, its rows in
    pairs (the VNNI layout over rows): pairs[d, 2 c + u] = x[2 d + u, c], a zero row after
    an odd last one."""
    x, pairs = unowned(x), unowned(pairs)  # no reference counted per row's view
    for d in range((rows + 1) // 2):
        top, out = x[2 * d], pairs[d]
        if 2 * d + 1 < rows:
            bottom = x[2 * d + 1]
            for c in range(cols):
                out[2 * c] = to_bf16(top[c])
                out[2 * c + 1] = to_bf16(bottom[c])
        else:
            for c in range(cols):
                out[2 * c] = to_bf16(top[c])
                out[2 * c + 1] = 0


@njit(fastmath=FASTMATH)
def transpose_rows(src, dst):
    """dst[:cols] <- src (rows, cols) transposed, zeros past its rows."""
    rows, cols = src.shape
    for r0 in range(0, rows, LANES):  # 16 rows at a time: dst's lines stay in cache
        for c in range(cols):
            for r in range(r0, min(r0 + LANES, rows)):
                dst[c, r] = src[r, c]
    dst[:, rows:] = 0


@njit(fastmath=FASTMATH)
def add_transposed(src, dst):
    """dst (cols, E) += src (E, cols) transposed."""
    for c in range(dst.shape[0]):
        for e in range(dst.shape[1]):
            dst[c, e] += src[e, c]


@njit(parallel=True, fastmath=FASTMATH)
def pack_bf16_backward(q_any, k_any, v_any, do_any, variant, operands):
    """operands (key panels, value panels, key pairs, Q^T, dO^T) <- per sequence: K and V
    in panels (S = Q K^T, dP = dO V^T; `pack_key_panels`), K in pairs of keys (dQ = dS K;
    `pack_vnni`), Q and dO transposed (NS, Hq, E, L + 1: the A operands of dK^T and dV^T,
    zeros past the rows for an odd last pair)."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, k, v, do = q_any[0], k_any[0], v_any[0], do_any[0]  # launch.any_layout's views
    key_panels, value_panels, key_pairs, q_t, do_t = operands
    kv_heads, q_heads = k.shape[1], q.shape[1]
    for item in prange(variant.sequences.shape[0] * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        slot, _, _, k0, kv_len = sequence(variant, b)
        keys = slice(k0, k0 + kv_len)
        pack_key_panels(k[slot, hk, keys], key_panels[b, hk])
        pack_key_panels(v[slot, hk, keys], value_panels[b, hk])
        pack_vnni(k[slot, hk, keys], key_pairs[b, hk])
    for item in prange(variant.sequences.shape[0] * q_heads):
        b, h, _ = split_index(item, q_heads, 1)
        slot, q0, q_len, _, _ = sequence(variant, b)
        transpose_rows(q[slot, h, q0 : q0 + q_len], q_t[b, h])
        transpose_rows(do[slot, h, q0 : q0 + q_len], do_t[b, h])


@njit(fastmath=FASTMATH)
def bf16_score_gradients(q, grad_out, operands, variant, scale2, stats, delta, dmask, b, h,
                         i0, rows, j0, cols, structure, p, ds, dtanh, want_dmask, amx):  # fmt: skip
    """p <- P and ds <- dS (through the softcap; into dmask too with `want_dmask`) of query
    rows i0.. and keys j0.. of head h of sequence b: S = Q K^T and dP = dO V^T on bf16
    tiles against the packed panels (`amx`: on AMX tiles)."""
    key_panels, value_panels = operands[0], operands[1]
    hk = h // (q.shape[1] // key_panels.shape[1])
    slot, q0, q_len, _, _ = sequence(variant, b)
    if amx:  # p and ds hold whole tiles (`bf16_tile_buffers`)
        amx_scores(q, slot, h, q0 + i0, rows, key_panels, b, hk, j0, p, cols)
        scale_scores(p, rows, cols, scale2)
    else:
        keys = panels_view(key_panels, b, hk, j0)
        q_rows = rows_view(q, slot, h, q0 + i0)
        tile_product(key_panels.shape[3], scale2, ZERO, q_rows, keys, (p, 0, p.shape[1]), rows,
                     cols)  # fmt: skip
    scores_to_probabilities(p, dtanh, variant, b, h, i0, j0, rows, cols, structure,
                            stats[slot, h, q0 : q0 + q_len])  # fmt: skip
    if amx:
        amx_scores(grad_out, slot, h, q0 + i0, rows, value_panels, b, hk, j0, ds, cols)
    else:
        values = panels_view(value_panels, b, hk, j0)
        do_rows = rows_view(grad_out, slot, h, q0 + i0)
        tile_product(value_panels.shape[3], ONE, ZERO, do_rows, values, (ds, 0, ds.shape[1]),
                     rows, cols)  # fmt: skip
    score_gradients(p, ds, delta[slot, h, q0 + i0 : q0 + i0 + rows], False, rows, cols)
    if want_dmask:  # plain calls only: slot b, no row offsets
        dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds[:rows, :cols]
    if variant.softcap2 != 0:
        through_softcap(ds, dtanh, rows, cols)


@njit(fastmath=FASTMATH)
def bf16_add_dq(ds, ds16, rows, cols, key_pairs, b, hk, j0, dq, slot, h, row, scale):
    """dq[slot, h, row:row + rows] += scale dS K (keys j0..), dS rounded to bf16."""
    round_probabilities(ds, ds16, rows, cols)
    rows_of_dq = dq[slot, h]
    ds_view, dq_view = (ds16, 0, ds16.shape[1], 1), (rows_of_dq, row * rows_of_dq.shape[1],
                                                      rows_of_dq.shape[1])  # fmt: skip
    keys = pairs_view(key_pairs, b, hk, j0)
    dim = key_pairs.shape[3] // 2
    tile_product((cols + 1) // 2, scale, ONE, ds_view, keys, dq_view, rows, dim)


@njit(parallel=True, fastmath=FASTMATH)
def bf16_backward_dq(q_any, do_any, operands, variant, scale, stats, delta, dq, dmask, block_m,
                     block_n, amx):  # fmt: skip
    """`attention_backward_dq` on bf16 tiles (`pack_bf16_backward`'s operands; `amx`: on
    AMX tiles)."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, grad_out = q_any[0], do_any[0]  # launch.any_layout's views
    key_pairs = operands[2]
    q_heads = q.shape[1]
    group = q_heads // key_pairs.shape[1]
    q_tiles = (longest(variant, 2) + block_m - 1) // block_m
    scale2, scale32 = np.float32(scale * LOG2E), np.float32(scale)
    want_dmask = dmask.shape[0] > 0
    for item in prange(variant.sequences.shape[0] * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        slot, q0, q_len, _, kv_len = sequence(variant, b)
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        if rows <= 0:  # past this sequence's end
            continue
        p, ds = score_tiles(rows, block_n), score_tiles(rows, block_n)
        dtanh = np.empty((rows if variant.softcap2 != 0 else 0, block_n), np.float32)
        ds16, dq_tile = rounded_tiles(rows, block_n), score_tiles(rows, key_pairs.shape[3] // 2)
        for j0, cols, structure in key_tiles(variant, b, h, i0, rows, kv_len, block_n):
            bf16_score_gradients(
                q, grad_out, operands, variant, scale2, stats, delta, dmask, b, h, i0, rows, j0,
                cols, structure, p, ds, dtanh, want_dmask, amx,
            )  # fmt: skip
            if amx:
                amx_add_dq(ds, ds16, rows, cols, key_pairs, b, h // group, j0, dq_tile, dq, slot,
                           h, q0 + i0, scale32)  # fmt: skip
            else:
                bf16_add_dq(ds, ds16, rows, cols, key_pairs, b, h // group, j0, dq, slot, h,
                            q0 + i0, scale32)  # fmt: skip


@njit(fastmath=FASTMATH)
def score_tiles(rows, cols):
    """A (rows, cols) fp32 score tile that AMX's tiles may fill whole: rows and columns up
    to sixteens, its rows in whole lines (`aligned_empty`)."""
    return aligned_empty(whole_tiles(rows), whole_tiles(cols), np.empty(0, np.float32))


@njit(fastmath=FASTMATH)
def pair_tiles(rows, cols):
    """P or dS of (rows, cols) in pairs of rows (`pair_rows`), as AMX's B tiles may read
    them whole: pairs of rows to steps of 16 pairs, columns to sixteens."""
    like = np.empty(0, np.uint16)
    return aligned_empty(depth_steps(rows) * TILE_PAIRS, 2 * whole_tiles(cols), like)


@njit(fastmath=FASTMATH)
def rounded_tiles(rows, cols):
    """dS of (rows, cols) rounded to bf16 (`round_probabilities`), as AMX's A tiles may read
    it whole: rows to sixteens, columns to steps of 32, zeros."""
    like = np.empty(0, np.uint16)
    tile = aligned_empty(whole_tiles(rows), depth_steps(cols + 1) * 2 * TILE_PAIRS, like)
    tile[:] = 0
    return tile


@njit(fastmath=FASTMATH)
def amx_add_dq(ds, ds16, rows, cols, key_pairs, b, hk, j0, dq_tile, dq, slot, h, row, scale):
    """`bf16_add_dq` on AMX tiles: dS rounded into ds16 (`rounded_tiles`), its columns
    zeroed to the step of 32 keys; dS K into dq_tile, then scaled into dq."""
    round_probabilities(ds, ds16, rows, cols)
    steps = zero_to_step(ds16, rows, cols)
    dim = key_pairs.shape[3] // 2
    row_tiles = whole_tiles(rows) // TILE_ROWS
    keys, tile = pairs_view(key_pairs, b, hk, j0), (dq_tile, 0, dq_tile.shape[1])
    amx_product((ds16, 0, ds16.shape[1]), keys, tile, row_tiles, dim // TILE_ROWS, steps, False)
    rows_of_dq = dq[slot, h]
    for r in range(rows):
        out, tile_row = rows_of_dq[row + r], dq_tile[r]
        for e in range(dim):
            out[e] += scale * tile_row[e]


@njit(fastmath=FASTMATH)
def amx_add_transposed_product(x_t, b, h, i0, rows, pairs, cols, out):
    """out[:, :cols] += X^T (rows i0 .. i0 + rows - 1 of head h of sequence b in a
    transposed pack) @ pairs (`pair_rows` of those rows; its pairs past them zeroed here)
    on AMX tiles. The depth runs to the step of 32 rows: X^T's columns past `rows` meet
    zero pairs (the pack holds 32 zero columns past the longest sequence)."""
    steps = depth_steps(rows)
    pairs[(rows + 1) // 2 : steps * TILE_PAIRS] = 0
    head = x_t[b, h]
    col_tiles = whole_tiles(cols) // TILE_ROWS
    rows_of_x, b_view = (head, i0, head.shape[1]), (pairs, 0, pairs.shape[1], 2 * LANES)
    amx_product(rows_of_x, b_view, (out, 0, out.shape[1]), out.shape[0] // TILE_ROWS, col_tiles,
                steps, True)  # fmt: skip


@njit(fastmath=FASTMATH)
def bf16_tile_buffers(operands, variant, block_m, block_n):
    """`bf16_key_tile_gradients`' scratch for key tiles of up to block_n keys, one set per
    work item: P, dS and the softcap's factor (fp32), P and dS in pairs of rows and dS
    rounded (bf16), a key tile's dK^T and dV^T, a query tile's dS K (fp32); in whole AMX
    tiles where they take part in AMX's products."""
    f32 = np.float32
    return (
        score_tiles(block_m, block_n), score_tiles(block_m, block_n),
        np.empty((block_m if variant.softcap2 != 0 else 0, block_n), f32),
        pair_tiles(block_m, block_n), pair_tiles(block_m, block_n), rounded_tiles(block_m, block_n),
        score_tiles(operands[3].shape[2], block_n), score_tiles(operands[4].shape[2], block_n),
        score_tiles(block_m, operands[2].shape[3] // 2),
    )  # fmt: skip


@njit(fastmath=FASTMATH)
def bf16_key_tile_gradients(q, grad_out, operands, variant, scale, stats, delta, dq, dk, dv,
                            dmask, b, hk, j0, cols, block_m, buffers, with_dq, amx):  # fmt: skip
    """`key_tile_gradients` on bf16 tiles (`pack_bf16_backward`'s operands, in
    `bf16_tile_buffers`; `amx`: all five products on AMX tiles)."""
    key_pairs, q_t, do_t = operands[2], operands[3], operands[4]
    p, ds, dtanh, p_pairs, ds_pairs, ds16, dk_t, dv_t, dq_tile = buffers
    group = q.shape[1] // key_pairs.shape[1]
    scale2, scale32 = np.float32(scale * LOG2E), np.float32(scale)
    want_dmask = with_dq and dmask.shape[0] > 0
    slot, q0, q_len, k0, _ = sequence(variant, b)
    dk_t[:, :cols] = 0.0
    dv_t[:, :cols] = 0.0
    first, end = query_range(variant, b, j0, cols, q_len)
    for h in range(hk * group, (hk + 1) * group):
        for i0 in range(first, end, block_m):
            rows = min(block_m, end - i0)
            structure = tile_structure(variant, b, h, i0, rows, j0, cols)
            if structure == SKIP:
                continue
            bf16_score_gradients(
                q, grad_out, operands, variant, scale2, stats, delta, dmask, b, h, i0, rows, j0,
                cols, structure, p, ds, dtanh, want_dmask, amx,
            )  # fmt: skip
            pair_rows(p, rows, cols, p_pairs)
            pair_rows(ds, rows, cols, ds_pairs)
            if amx:  # dK^T unscaled here, scaled once when the key tile is done
                amx_add_transposed_product(do_t, b, h, i0, rows, p_pairs, cols, dv_t)
                amx_add_transposed_product(q_t, b, h, i0, rows, ds_pairs, cols, dk_t)
                if with_dq:
                    amx_add_dq(ds, ds16, rows, cols, key_pairs, b, hk, j0, dq_tile, dq, slot, h,
                               q0 + i0, scale32)  # fmt: skip
                continue
            row_pairs = (rows + 1) // 2
            p_view, dv_view = (p_pairs, 0, p_pairs.shape[1], 2 * LANES), (dv_t, 0, dv_t.shape[1])
            do_t_view = transposed_view(do_t, b, h, i0)
            tile_product(row_pairs, ONE, ONE, do_t_view, p_view, dv_view, dv_t.shape[0], cols)
            ds_view, dk_view = (ds_pairs, 0, ds_pairs.shape[1], 2 * LANES), (dk_t, 0, dk_t.shape[1])
            q_t_view = transposed_view(q_t, b, h, i0)
            tile_product(row_pairs, scale32, ONE, q_t_view, ds_view, dk_view, dk_t.shape[0], cols)
            if with_dq:
                bf16_add_dq(ds, ds16, rows, cols, key_pairs, b, hk, j0, dq, slot, h, q0 + i0,
                            scale32)  # fmt: skip
    if amx:
        dk_t[:, :cols] *= scale32
    keys = slice(k0 + j0, k0 + j0 + cols)
    add_transposed(dk_t, dk[slot, hk, keys])
    add_transposed(dv_t, dv[slot, hk, keys])


@njit(parallel=True, fastmath=FASTMATH)
def bf16_backward_dkdv(q_any, do_any, operands, variant, scale, stats, delta, dk, dv, block_m,
                       block_n, amx):  # fmt: skip
    """`attention_backward_dkdv` on bf16 tiles."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, grad_out = q_any[0], do_any[0]  # launch.any_layout's views
    kv_heads = operands[2].shape[1]
    kv_tiles = (longest(variant, 4) + block_n - 1) // block_n
    unused = np.zeros((0, 0, 0, 0), np.float32)
    for item in prange(variant.sequences.shape[0] * kv_heads * kv_tiles):
        b, hk, tile = split_index(item, kv_heads, kv_tiles)
        j0 = tile * block_n
        cols = min(block_n, variant.sequences[b, 4] - j0)
        if cols <= 0:  # past this sequence's end
            continue
        buffers = bf16_tile_buffers(operands, variant, block_m, cols)
        bf16_key_tile_gradients(q, grad_out, operands, variant, scale, stats, delta, unused, dk,
                                dv, unused, b, hk, j0, cols, block_m, buffers, False,
                                amx)  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def bf16_backward_fused(q_any, do_any, operands, variant, scale, stats, delta, dq, dk, dv,
                        dmask, block_m, block_n, amx):  # fmt: skip
    """`attention_backward_fused` on bf16 tiles."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q, grad_out = q_any[0], do_any[0]  # launch.any_layout's views
    kv_heads = operands[2].shape[1]
    for item in prange(variant.sequences.shape[0] * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        kv_len = variant.sequences[b, 4]
        buffers = bf16_tile_buffers(operands, variant, block_m, block_n)
        for j0 in range(0, kv_len, block_n):
            bf16_key_tile_gradients(q, grad_out, operands, variant, scale, stats, delta, dq, dk,
                                    dv, dmask, b, hk, j0, min(block_n, kv_len - j0), block_m,
                                    buffers, True, amx)  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
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


def tensor_rows_apart(tensor: Tensor) -> bool:
    """`rows_apart` of a tensor: whether its rows (its last dim) do not lie side by side."""
    return tensor.stride(-2) != tensor.shape[-1]


def rows_side_by_side(tensor: Tensor) -> Tensor:
    """`tensor` itself where its rows lie side by side, else a contiguous copy: the
    backward's products read Q, K, V and dO rows in place, and rows a head apart ((B, L, H,
    E) transposed) fall into a few of L1's sets (fp32, L = 2048, 8 heads of 128: the
    backward took 1.24x the time; one copy of each is O(L E), the backward O(L^2 E))."""
    return tensor.contiguous() if tensor_rows_apart(tensor) else tensor


class DenseForward:
    """numba's forward for calls of one metadata: what a call's metadata decides (the
    micro-kernel kind, the kernel, its tiles and threads' workspace, the variant of a call
    without tensor variants) worked out once; a call binds its own q, k, v, which the kernel
    reads in place at their strides (`strided_memory`). attnperf.plans keeps one per call
    metadata (`Backend.forward_for`): at B = 1, H = 8, L = 64 (bf16, Intel Xeon) working it
    out and the numpy views it made cost a call ~50 us against its kernel's ~30.

    forward(inputs) -> (out (B, Hq, L, Ev) in the inputs' dtype, softmax stats (B, Hq, L,
    2) fp32: each row's base-2 max and sum, 0 and 0 for a row that sees no key, residual:
    a bf16 or fp16 out's rounding residual where an input requires grad, else None
    (`FusedBackend`)); stats None where made with keep_stats=False (`numba_forward_for`:
    for calls that read none), unless too large to keep (`stats_output`)."""

    def __init__(self, inputs: AttentionInputs, keep_stats: bool = True):
        self.kind = kind = forward_kind(inputs)
        self.keep_stats = keep_stats
        # bf16 and fp16 outputs with a gradient to come: their rounding residual for the
        # backward (`rounding_residual`).
        self.keep_residual = inputs.differentiable and inputs.dtype in ROUNDED_DTYPES
        self.dtype, self.value_dim, self.scale = inputs.dtype, inputs.value_dim, inputs.scale
        # The bf16 tiles take E in pairs: an odd E runs on a zero column more (`bf16_operand`).
        head_dim = inputs.head_dim + (kind == BF16 and inputs.head_dim % 2)
        value_dim = inputs.value_dim + (kind == BF16 and inputs.value_dim % 2)
        self.out_shape = (*inputs.query.shape[:3], value_dim)
        # Without pairs no key is seen: zeros (with sinks the kernel still writes each row's
        # sink term), nor by a padded batch's padding rows.
        no_work = not inputs.has_pairs and inputs.variant.sinks is None
        self.zero = no_work or inputs.has_padding
        self.kernel, self.variant, self.workspace, self.blocks = None, None, None, ()
        self.parallel = True
        if no_work:
            return
        self.variant = variant = lower_variant(inputs)
        if kind is None:
            self.kernel, self.blocks = online_softmax_forward, tile_sizes(inputs)
            return
        self.blocks = block_m, _ = short_call_tiles(inputs, variant)
        # On the threads wherever there are two query tiles to share: H = 2, L = 64
        # (2 MFLOP) took 23 us there against 35 us serially.
        self.parallel = query_tiles(inputs, variant, block_m) >= 2
        # Room to copy a kv head's rows side by side where the first call's lie apart
        # (`rows_apart`; a later call of other strides runs without it if it must).
        apart = tensor_rows_apart(inputs.key) or tensor_rows_apart(inputs.value)
        if kind == BF16 and amx_tiles(inputs):
            size = amx_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                       *self.blocks, scores_by_rows(variant), apart)  # fmt: skip
            parallel = amx_forward
        elif kind == FP32 and transposed_fp32():
            size = fp32_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                        *self.blocks, scores_by_rows(variant), apart)  # fmt: skip
            parallel = fp32_forward
        else:
            like = U16 if kind == BF16 else F32
            size = packed_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                          *self.blocks, like)  # fmt: skip
            parallel = packed_forward
        # A workspace row per thread (`amx_forward`, `packed_forward`).
        runs = torch.get_num_threads() if self.parallel else 1
        self.workspace = ("forward workspace", (runs, size), np.uint8)
        self.kernel = parallel if self.parallel else serial(parallel)

    def __call__(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor, Tensor | None]:
        operand = bf16_operand if self.kind == BF16 else fp32_operand
        q, k, v = operand(inputs.query), operand(inputs.key), operand(inputs.value)
        # bf16 calls on our tiles write their output rounded (the kernel's last pass), and
        # its rounding residual where a backward will read it.
        out_dtype = torch.bfloat16 if self.kind == BF16 else torch.float32
        out = empty_output(self.out_shape, out_dtype)
        stats, stats_memory = stats_output((*self.out_shape[:3], 2), self.keep_stats)
        residual, residual_memory = None, _no_residual()[1]
        if self.keep_residual and self.kind == BF16:
            residual = empty_output(self.out_shape, torch.bfloat16)
            residual_memory = memory_of(residual)
        if self.zero:
            for tensor in (out, stats, residual):
                if tensor is not None:
                    zero_memory(tensor)
        if self.kernel is not None:
            memory = (strided_memory(q), strided_memory(k), strided_memory(v), memory_of(out),
                      stats_memory, residual_memory)  # fmt: skip
            workspace = () if self.workspace is None else (scratch(*self.workspace),)
            args = (memory, *workspace, self.variant, self.scale, *self.blocks)
            if self.parallel:
                run_parallel(self.kernel, *args)
            else:
                self.kernel(*args)
        if out.shape[3] != self.value_dim:  # a bf16 call of odd E ran on a zero column more
            out = out[..., : self.value_dim].contiguous()
            residual = None if residual is None else residual[..., : self.value_dim].contiguous()
        if out.dtype != self.dtype:  # fp32 tiles' output: rounded here, its residual kept
            out, residual = rounded_output(out, self.dtype, self.keep_residual)
        return out, stats, residual


@functools.cache
def _no_residual() -> tuple[Tensor, tuple]:
    """An empty bf16 residual and its memory: the forward kernels' where none is kept."""
    empty = torch.empty((0, 0, 0, 0), dtype=torch.bfloat16)
    return empty, memory_of(empty)


def numba_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    """(out (B, Hq, L, Ev) in the inputs' dtype, softmax stats (B, Hq, L, 2) fp32: each
    row's base-2 max and sum, 0 and 0 for a row that sees no key, a bf16 or fp16 out's
    rounding residual or None: `DenseForward`)."""
    return DenseForward(inputs)(inputs)


def numba_forward_for(inputs: AttentionInputs) -> DenseForward | None:
    """numba's `Backend.forward_for`: the forward for calls with `inputs`' metadata, where
    no variant is a tensor (a mask, ALiBi slopes, a block layout or sinks: the kernel's
    variant holds their values), else None. Its calls' metadata fixes whether they read the
    stats (a gradient to come, the LSE asked): where not, it returns None for them."""
    variant = inputs.variant
    tensors = (inputs.attn_mask, variant.sequences, variant.alibi_slopes, variant.block_mask,
               variant.sinks)  # fmt: skip
    if any(t is not None for t in tensors):
        return None
    return DenseForward(inputs, keep_stats=inputs.needs_grad or variant.return_lse)


def query_tiles(inputs: AttentionInputs, variant: LoweredVariant, block_m: int) -> int:
    """The forward's work items: (sequence, query head, query tile) triples."""
    return forward_items(variant, inputs.q_heads, block_m)


def short_call_tiles(inputs: AttentionInputs, variant: LoweredVariant) -> tuple[int, int]:
    """`tile_sizes`, with SHORT_CALL_BLOCK_M query rows where whole tiles leave a thread
    fewer than two: B = 1, H = 1, L = 128 took 41 us against 61, L = 256 139 us against 204
    (2 threads)."""
    block_m, block_n = tile_sizes(inputs)
    if query_tiles(inputs, variant, block_m) < 2 * torch.get_num_threads():
        block_m = min(block_m, SHORT_CALL_BLOCK_M)
    return block_m, block_n


def forward_kind(inputs: AttentionInputs) -> int | None:
    """The forward's micro-kernel kind: BF16 for bf16 inputs where the CPU has the bf16 dot
    product (AMX's or AVX-512's), FP32 where our fp32 tiles serve, None for BLAS tiles."""
    if inputs.dtype == torch.bfloat16 and tile_route("bf16")[0] in ("amx", "avx512-bf16"):
        return BF16
    return FP32 if tiles_flag() == OWN_TILES else None


def transposed_fp32() -> bool:
    """Whether the fp32 forward holds its scores transposed (`fp32_forward`): where our
    micro-kernels run AVX-512 (its softmax's `column_maxima` and `exp2_columns`); by rows
    (`packed_forward`) on AVX2."""
    return tile_route("fp32")[0] == "avx512"


def amx_tiles(inputs: AttentionInputs) -> bool:
    """Whether a bf16 call's dense products run on AMX tiles (the forward's two, the
    backward's five): where the route is AMX and both head dims fill whole steps of depth
    (multiples of 32); vdpbf16ps micro-kernels otherwise."""
    step = 2 * TILE_PAIRS
    return (
        tile_route("bf16")[0] == "amx"
        and inputs.head_dim % step == 0
        and inputs.value_dim % step == 0
    )


def bf16_bits(tensor: Tensor) -> np.ndarray:
    """`as_bf16_bits` of `bf16_operand`: zero-padded to an even E (the micro-kernel takes
    depth in pairs)."""
    return as_bf16_bits(bf16_operand(tensor))


def bf16_operand(tensor: Tensor) -> Tensor:
    """A bf16 tensor as the bf16 tiles read it: itself where E is even and of unit stride,
    else zero-padded to an even E, contiguous (detached; as `fp32_operand`)."""
    if tensor.shape[-1] % 2:
        return torch.nn.functional.pad(tensor.detach(), (0, 1))
    return tensor if tensor.stride(-1) == 1 else tensor.detach().contiguous()


def tile_sizes(inputs: AttentionInputs, backward: bool = False) -> tuple[int, int]:
    """(query rows, keys) of the kernels' tiles for this call."""
    if inputs.band is None or None in inputs.band:
        return BLOCK_M, BLOCK_N
    return BANDED_BLOCK_M, min(BANDED_BACKWARD_BLOCK_N, BLOCK_N) if backward else BLOCK_N


def transposed_panels(k, v, variant) -> tuple[np.ndarray, np.ndarray]:
    """K and V packed once as panels for the backward's two products against their
    transposes (S = Q K^T, dP = dO V^T) on our tiles; empty on BLAS tiles."""
    if variant.tiles != OWN_TILES:
        empty = np.zeros((0, 0, 0, 0, 0), np.float32)
        return empty, empty
    count, kv_heads = variant.sequences.shape[0], k.shape[1]
    panels = (longest_in_table(variant, 4) + LANES - 1) // LANES
    packed = []
    for slot, x in (("key panels", k), ("value panels", v)):
        x_panels = scratch(slot, (count, kv_heads, panels, x.shape[3], LANES), np.float32)
        run_parallel(pack_panels, any_layout(x), variant, x_panels)
        packed.append(x_panels)
    return packed[0], packed[1]


def bf16_backward_operands(q, k, v, do, variant) -> tuple[np.ndarray, ...]:
    """`pack_bf16_backward`'s operands, packed: (key panels, value panels, key pairs, Q^T,
    dO^T) from bf16 bits of even E."""
    count, q_heads, kv_heads = variant.sequences.shape[0], q.shape[1], k.shape[1]
    longest_keys, longest_queries = longest_in_table(variant, 4), longest_in_table(variant, 2)
    panels = (longest_keys + LANES - 1) // LANES
    # AMX's products read a step of 32 keys or query rows past a tile's last: zeros there.
    pairs, columns = (longest_keys + 1) // 2 + TILE_PAIRS, longest_queries + 1 + 2 * TILE_PAIRS
    operands = (
        scratch("key panels", (count, kv_heads, panels, k.shape[3] // 2, 2 * LANES), np.uint16),
        scratch("value panels", (count, kv_heads, panels, v.shape[3] // 2, 2 * LANES), np.uint16),
        scratch("key pairs", (count, kv_heads, pairs, 2 * k.shape[3]), np.uint16),
        scratch("Q^T", (count, q_heads, q.shape[3], columns), np.uint16),
        scratch("dO^T", (count, q_heads, do.shape[3], columns), np.uint16),
    )
    run_parallel(pack_bf16_backward, *map(any_layout, (q, k, v, do)), variant, operands)
    return operands


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
    partial_keys: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) in the inputs' dtypes, by FlashAttention-2 recomputation:
    on bf16 tiles for bf16 inputs where the forward runs on them (`forward_kind`), P and dS
    rounded to bf16 there, else on fp32 tiles. `grad_lse` (B, Hq, L), the LSE's gradient,
    only shifts delta = rowsum(dO * O).

    `fused`: one pass over (batch, kv head) items, or a dq pass and a dk/dv pass over tiles;
    None picks the fused pass where it pays (`fused_backward_pays`). `partial_keys`: out and
    stats are a larger attention's, of which the call's keys are a part (ring attention's
    blocks), so a row's P over them sums short of 1.
    """
    bf16 = forward_kind(inputs) == BF16
    query, key = inputs.query, inputs.key
    if inputs.head_dim == 0:  # the same zero scores on one zero column: numba types a
        # zero-size array as contiguous, and compiled every backward kernel anew for it
        query, key = (torch.nn.functional.pad(t.detach(), (0, 1)) for t in (query, key))
    if bf16:  # on bf16 tiles: the bits (E even), dO in bf16 as FlashAttention takes it
        grad_out = grad_out.to(torch.bfloat16)
        q, k, v, do = map(bf16_bits, (query, key, inputs.value, grad_out))
    else:
        q, k, v, do = (as_numpy(rows_side_by_side(fp32_operand(t)))
                       for t in (query, key, inputs.value, grad_out))  # fmt: skip
    variant = lower_variant(inputs)
    stats = as_numpy(stats.contiguous())
    no_lse = np.zeros((0, 0, 0), np.float32)
    lse_grad = no_lse if grad_lse is None else as_numpy(grad_lse.detach().float().contiguous())
    # (tensor, array): kept bound while the kernels run, as the tensor owns the array's memory.
    delta_buffer = float32_array(stats.shape[:3])
    delta = delta_buffer[1]
    (dq, dq_array), (dk, dk_array), (dv, dv_array) = (
        float32_array(t.shape, zero=True) for t in (q, k, v)
    )
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask_shape = inputs.attn_mask.shape if want_dmask else (0, 0, 0, 0)
    dmask, dmask_array = float32_array(dmask_shape, zero=True)
    if fused is None:
        fused = fused_backward_pays(
            inputs.sequence_count * inputs.kv_heads, torch.get_num_threads()
        )
    if inputs.has_pairs:
        blocks = tile_sizes(inputs, backward=True)
        # On fp32 tiles, where one key tile holds every key a row sees, the tiles correct
        # delta (`score_gradients`' whole rows); not where a dLSE, a sink's share of the
        # softmax (whose dP is 0) or other keys' would enter it.
        whole_rows = (
            not bf16 and grad_lse is None and inputs.variant.sinks is None and not partial_keys
            and longest_in_table(variant, 4) <= blocks[1]
        )  # fmt: skip
        do_fp32 = as_fp32(grad_out) if bf16 else do
        run_parallel(softmax_delta, as_fp32(out), do_fp32, stats, lse_grad, delta)
        if bf16:
            common = (any_layout(q), any_layout(do), bf16_backward_operands(q, k, v, do, variant),
                      variant, inputs.scale, stats, delta)  # fmt: skip
            amx = amx_tiles(inputs)
            if fused:
                run_parallel(bf16_backward_fused, *common, dq_array, dk_array, dv_array,
                             dmask_array, *blocks, amx)  # fmt: skip
            else:
                run_parallel(bf16_backward_dq, *common, dq_array, dmask_array, *blocks, amx)
                run_parallel(bf16_backward_dkdv, *common, dk_array, dv_array, *blocks, amx)
        else:
            common = (*map(any_layout, (q, k, v)), transposed_panels(k, v, variant), variant,
                      inputs.scale, stats, any_layout(do), delta, whole_rows)  # fmt: skip
            if fused:
                grads = dq_array, dk_array, dv_array, dmask_array
                run_parallel(attention_backward_fused, *common, *grads, *blocks)
            else:
                run_parallel(attention_backward_dq, *common, dq_array, dmask_array, *blocks)
                run_parallel(attention_backward_dkdv, *common, dk_array, dv_array, *blocks)
    if bf16 or inputs.head_dim == 0:  # E = 0 or an odd E (bf16) ran on a zero column more
        dq, dk = dq[..., : inputs.head_dim], dk[..., : inputs.head_dim]
        dv = dv[..., : inputs.value_dim]
    dmask = dmask.to(inputs.attn_mask.dtype) if want_dmask else None
    return dq.to(inputs.dtype), dk.to(inputs.dtype), dv.to(inputs.dtype), dmask
