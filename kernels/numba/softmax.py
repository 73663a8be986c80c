"""The online softmax's walk that the forwards share: work items, the rows' state and finish, its
steps by rows and transposed; and the views through which the tile routes read their operands."""

from __future__ import annotations

import numba
import numpy as np

from attnperf.kernels.numba.amx import TILE_ROWS, amx_product, depth_steps, whole_tiles
from attnperf.kernels.numba.fastmath import (
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
    data_address,
    njit,
    pointer_at,
    row_view,
    split_index,
    strided_array,
    strided_at,
    wide_vectors,
)
from attnperf.kernels.numba.microkernels import LANES, ONE
from attnperf.kernels.numba.tiles import product
from attnperf.kernels.numba.variant import (
    MASKED,
    adds_mask_values,
    changes_values,
    key_tiles,
    longest,
    modify_scores,
    modify_transposed_scores,
    sequence,
    with_sink,
)
from attnperf.kernels.numba.vector_ops import (
    column_maxima,
    exp2_columns,
    exp2_pairs_to_bf16,
    to_bf16,
)

# The element types of `carve`'s arrays.
F32, U16 = np.empty(0, np.float32), np.empty(0, np.uint16)


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
    into them first (`amx_query_rows`; a copy per call is a tenth of a head's time). The
    backward's dP = dO V^T too: dO's rows against the values' panels."""
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
def key_tile_width(kv_len, block_n):
    """A score tile's keys: as many as the sequence needs, in whole steps of 64 (the
    softmax's vector loops: `to_whole_steps`), up to block_n (a short call's 64 keys
    would otherwise allocate, and fault in, 512 columns per item)."""
    return min(block_n, (kv_len + 63) // 64 * 64)


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
def scores_by_rows(variant):
    """Whether `modify_transposed_scores` takes a tile's scores by rows (a block layout),
    into a buffer of its own."""
    return variant.block_q != 0
