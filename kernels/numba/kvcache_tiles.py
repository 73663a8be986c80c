"""A decoding step's key tile on tiles: every kv head's scores, online softmax and P V on our
micro-kernels (`micro_kernel_tile`) or, for a bf16 cache, on AMX (`amx_tile`)."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.amx import (
    TILE_CONFIG,
    TILE_PAIRS,
    TILE_ROWS,
    amx_product,
    configure_tiles,
    depth_steps,
    release_tiles,
    tile_dot,
    tile_load,
    tile_store,
    tile_zero,
    whole_tiles,
)
from attnperf.kernels.numba.fastmath import widen
from attnperf.kernels.numba.jit import (
    FASTMATH,
    aligned_empty,
    njit,
    prefetch_line,
    unowned,
    wide_vectors,
)
from attnperf.kernels.numba.key_dots import scores_by_dots
from attnperf.kernels.numba.microkernels import BLOCK_ROWS, LANES, ONE, inlined_tile_product
from attnperf.kernels.numba.packing import transpose_block
from attnperf.kernels.numba.softmax import (
    online_softmax_rescale,
    online_softmax_to_bf16,
    scale_scores,
)
from attnperf.kernels.numba.variant import modifies_scores, modify_scores
from attnperf.kernels.numba.vector_ops import to_bf16

AMX = -2  # a bf16 step on AMX tiles (`amx_tile`)
# From this many query rows a kv head (group x Lq), an AMX step's P V runs on AMX tiles, its
# values packed in pairs per tile; below, on our FMA micro-kernels with the values widened
# where they lie: at a few rows the packing costs AMX more than it saves; the
# micro-kernels' time grows with the rows, AMX's does not.
AMX_VALUES_MIN_ROWS = 8
# Keys a P V product takes at a time over row-major pages (a head's chunk; the chunks walked
# across the heads, `memory_order`): against 16, each head's accumulators are loaded and
# stored half as often, which made the step faster; 64 and 192 keys ran slower from
# memory.
VALUE_CHUNK = 32


@njit(fastmath=FASTMATH)
def modify_tile(s, hk, q_len, cols, variant, b, j0, structure):
    """Masks and variant on kv head hk's scaled scores s[hk] (its group's query heads, q_len
    rows each)."""
    rows = s.shape[1]
    no_dtanh = np.empty((0, 0), np.float32)
    for g in range(rows // q_len):
        modify_scores(s[hk, g * q_len : (g + 1) * q_len], variant, b, hk * (rows // q_len) + g,
                      0, j0, q_len, cols, structure, no_dtanh)  # fmt: skip


@njit(fastmath=FASTMATH)
def tile_softmax(s, hk, q_len, cols, variant, b, j0, structure, acc, row_max, row_sum, shift):
    """The online softmax's step over one key tile for kv head hk's rows, s[hk] (its
    group's query heads, q_len rows each): masks and variant, then P in place."""
    if modifies_scores(variant, structure):
        modify_tile(s, hk, q_len, cols, variant, b, j0, structure)
    online_softmax_rescale(s[hk], s.shape[1], cols, acc[hk], row_max[hk], row_sum[hk], shift[hk])


@njit(fastmath=FASTMATH)
def round_to_bf16(s, rows, cols, bits):
    """s[:rows, :cols] <- P rounded to bf16 and widened back (FlashAttention's practice
    before P V: the products of the widened values are then those of bf16 tiles), and
    bits[:rows, :cols] <- its bf16 bits where bits has rows (uint16; empty: none)."""
    for r in range(rows):
        row = s[r]
        for c in range(cols):
            row[c] = widen(to_bf16(row[c]))
        if bits.shape[0]:
            bits_row = bits[r]
            for c in range(cols):
                bits_row[c] = to_bf16(row[c])  # exact: rounded above


@njit()
def memory_order(item, chunks, heads, head_major, span):
    """(first key, head) of the item-th (chunk of `span` keys, head) of a tile, in the order
    its cache lies in memory: chunk by chunk across the heads of row-major pages, head by
    head along the rows of head-major ones."""
    if head_major:
        return item % chunks * span, item // chunks
    return item // heads * span, item % heads


@njit()
def page_offsets(pages, head_major, page, first_row):
    """(offset of head 0's row first_row of pages[page], offset between heads, between
    rows), counting elements of `pages` (see kvcache_split for the two layouts)."""
    strides = (pages.strides[0] // pages.itemsize, pages.strides[1] // pages.itemsize,
               pages.strides[2] // pages.itemsize)  # fmt: skip
    head, row = (strides[1], strides[2]) if head_major else (strides[2], strides[1])
    return page * strides[0] + first_row * row, head, row


@njit(fastmath=FASTMATH)
def micro_kernel_tile(q_rows, k_pages, v_pages, head_major, page, first_row, cols, variant, b,
                      q_len, j0, structure, scale2, s, p_pairs, acc, row_max, row_sum, shift,
                      prefetch):  # fmt: skip
    """One key tile of every kv head on the micro-kernels, the group's query rows (q_rows
    (Hk, rows, E), fp32, or bf16 bits for a bf16 cache) as the rows of each product:
    S = Q K^T by `scores_by_dots` on the keys as they lie, the online softmax, then acc += P V
    with the values read in place (bf16 ones paired in registers, P rounded to bf16 first
    and its bits kept in pairs in p_pairs (Hk, rows, W / 2) uint32; see chunked_values).
    Both products walk (chunk, head) pairs (chunks of 16 keys for the scores, VALUE_CHUNK
    for P V) in the order the page lies in memory (`memory_order`); with `prefetch`, each
    load of a key (value) row asks for the same head's row 16 (32) keys on into L2 (see
    `ahead_of`)."""
    # Held by the caller: the per-head views and calls below then count no references (the
    # step from L2/L3 measurably faster).
    s, p_pairs, acc = unowned(s), unowned(p_pairs), unowned(acc)
    row_max, row_sum, shift = unowned(row_max), unowned(row_sum), unowned(shift)
    kv_heads, rows, width = s.shape
    bf16 = k_pages.itemsize == 2  # bf16 bits (fp16 caches come converted to fp32)
    depth = q_rows.shape[2] // 2 if bf16 else q_rows.shape[2]
    k_at, k_head, k_row = page_offsets(k_pages, head_major, page, first_row)
    ahead = ahead_of(prefetch, k_row, 1)
    chunks = (cols + LANES - 1) // LANES
    for item in range(chunks * kv_heads):
        c, hk = memory_order(item, chunks, kv_heads, head_major, LANES)
        q_view = (q_rows, hk * rows * q_rows.shape[2], q_rows.shape[2])
        k_view = (k_pages, k_at + hk * k_head + c * k_row, k_row)
        s_view = (s, hk * rows * width + c, width)
        scores_by_dots(depth, scale2, q_view, k_view, s_view, rows, min(LANES, cols - c), ahead)
    for hk in range(kv_heads):
        tile_softmax(s, hk, q_len, cols, variant, b, j0, structure, acc, row_max, row_sum,
                     shift)  # fmt: skip
        if bf16:
            round_to_bf16(s[hk], rows, cols, p_pairs[hk].view(np.uint16))
    values = (v_pages, *page_offsets(v_pages, head_major, page, first_row))
    chunked_values(s, p_pairs, values, head_major, cols, acc, prefetch)


@njit()
def ahead_of(prefetch, row, chunks):
    """Elements from a key's row to the same head's row `chunks` 16-key chunks on where the
    walk prefetches (`prefetch`; `row`: elements between keys), else 0. The hardware
    prefetchers do not follow the walk: row-major pages are read a chunk at a time head by
    head, rows 2-4 KiB apart, and head-major ones stop them at each 4 KiB page, 8-16 of a
    head's keys. Asked for with each load, the lines are in L2 a chunk's work later, and no
    burst of prefetches waits on memory (blocks of 8 keys, each first asking for its share
    of the next chunk, ran slower)."""
    return chunks * LANES * row if prefetch else 0


@njit(fastmath=FASTMATH)
def chunked_values(p, p_pairs, values, head_major, cols, acc, prefetch):
    """acc[hk, :rows] += P V for every kv head hk, P (Hk, rows, W) in fp32 (a bf16 call's
    rounded to bf16), the values where they lie (values: (pages, offset of head 0's first
    key, between heads, between keys)), in (chunk, head) pairs in memory order
    (`memory_order`). bf16 values: with P's bits in pairs (p_pairs (Hk, rows, W / 2)
    uint32), two keys' rows paired in registers for vdpbf16ps (PAIRED; an odd chunk's last
    key as below); with p_pairs empty, widened in registers for fp32 FMAs on P (WIDENED:
    twice the multiply-adds). Head-major pages give rows that fit one micro-kernel a head's
    whole tile at once: its accumulators stay in registers across the tile's keys.
    Otherwise chunks of VALUE_CHUNK keys: more rows' values stay in L1 across the row
    blocks, and row-major pages are read across their heads (a head at a time ran
    slower); `prefetch` as `micro_kernel_tile`'s."""
    kv_heads, rows, width = p.shape
    pages, v_at, v_head, v_row = values
    acc_rows, value_dim = acc.shape[1], acc.shape[2]
    span = cols if head_major and rows <= BLOCK_ROWS else VALUE_CHUNK
    # 32 keys on: with bf16 values paired, 16 keys on read 5% slower from memory (2 threads,
    # 16k keys, B = 1 and 4; fp32 alike either way).
    ahead = ahead_of(prefetch, v_row, 2)
    chunks = (cols + span - 1) // span
    for item in range(chunks * kv_heads):
        c, hk = memory_order(item, chunks, kv_heads, head_major, span)
        acc_view = (acc, hk * acc_rows * value_dim, value_dim)
        keys = min(span, cols - c)
        v_view = (pages, v_at + hk * v_head + c * v_row, v_row, LANES)
        paired = keys // 2 * 2 if p_pairs.shape[0] else 0
        if paired:
            pair_row = p_pairs.shape[2]
            pairs_view = (p_pairs, (hk * rows * pair_row) + c // 2, pair_row, 1)
            inlined_tile_product(paired // 2, ONE, ONE, pairs_view, v_view, acc_view, rows,
                                 value_dim, ahead)  # fmt: skip
        if paired < keys:
            p_view = (p, hk * rows * width + c + paired, width, 1)
            v_view = (pages, v_at + hk * v_head + (c + paired) * v_row, v_row, LANES)
            inlined_tile_product(keys - paired, ONE, ONE, p_view, v_view, acc_view, rows,
                                 value_dim, ahead)  # fmt: skip


@njit()
def _chunk_scores(a_view, q_pairs, q_at, steps, st, st_at, ahead):
    """st[st_at + t * st_row + r] = key t . query row r (t < 16, every padded row r): one
    chunk's 16 key rows (a_view: (array, offset, row stride), 32 values a tile) against the
    queries in pairs (`amx_query_pairs`), over `steps` tiles of depth; each key row's lines
    `ahead` elements on asked for first where ahead is not 0 (`ahead_of`)."""
    a, a_at, a_stride = a_view
    for t in range(TILE_ROWS if ahead else 0):
        for step in range(steps):
            prefetch_line(a, (a_at + t * a_stride + step * 2 * TILE_PAIRS + ahead,))
    st_row = st.shape[1]
    q_row = q_pairs.shape[2]
    for j in range(q_row // (2 * TILE_ROWS)):
        tile_zero(0)
        for step in range(steps):
            tile_load(4, a, a_at + step * 2 * TILE_PAIRS, a_stride)
            tile_load(6, q_pairs, q_at + step * TILE_PAIRS * q_row + j * 2 * TILE_ROWS, q_row)
            tile_dot(0, 4, 6)
        tile_store(0, st, st_at + j * TILE_ROWS, st_row)


@njit()
def amx_key_scores(q_pairs, keys, head_major, cols, k_tail, st, prefetch):
    """st[hk * W + t, r] <- key t of kv head hk . query row r (unscaled; W = st's rows per
    head) for the tile's `cols` keys: each 16-key chunk's rows, where they lie in the page
    (keys: (pages, offset of head 0's first key, between heads, between keys)), are A, the
    queries in pairs (q_pairs (Hk, E / 2, 2 rows16)) B. Chunks in memory order
    (`memory_order`); a last chunk of fewer than 16 keys is copied into k_tail (Hk 16, E)
    first: a tile loads 16 rows, and the page may end before them."""
    pages, k_at, k_head, k_row = keys
    heads, pairs = q_pairs.shape[0], q_pairs.shape[1]
    head_dim = k_tail.shape[1]
    per_head = st.shape[0] // heads
    whole = cols // TILE_ROWS * TILE_ROWS
    flat = pages.reshape(pages.size)
    for hk in range(heads if whole < cols else 0):
        for t in range(cols - whole):
            at = k_at + hk * k_head + (whole + t) * k_row
            k_tail[hk * TILE_ROWS + t] = flat[at : at + head_dim]
    configure_tiles(TILE_CONFIG)
    chunks = whole_tiles(cols) // TILE_ROWS
    steps = pairs // TILE_PAIRS
    ahead = ahead_of(prefetch, k_row, 1)
    # Both A operands flat: `_chunk_scores`' one prefetch index serves the pages and k_tail.
    for item in range(chunks * heads):
        c, hk = memory_order(item, chunks, heads, head_major, TILE_ROWS)
        q_at, st_at = hk * q_pairs.shape[1] * q_pairs.shape[2], (hk * per_head + c) * st.shape[1]
        if c < whole:
            a_view = (flat, k_at + hk * k_head + c * k_row, k_row)
            _chunk_scores(a_view, q_pairs, q_at, steps, st, st_at, ahead)
        else:
            _chunk_scores((k_tail.reshape(k_tail.size), hk * TILE_ROWS * head_dim, head_dim),
                          q_pairs, q_at, steps, st, st_at, 0)  # fmt: skip
    release_tiles()


@njit(fastmath=FASTMATH)
def pack_value_pairs(values, head_major, cols, heads, pairs):
    """pairs[hk W + d, e] <- value e of keys 2 d and 2 d + 1 of kv head hk in one uint32
    (bf16 bits, the even key low: the VNNI layout of AMX's B; W = pairs' rows per head),
    zeros past `cols` to the end of the last step of 32 keys. values: (pages, offset of
    head 0's first key, between heads, between keys), read in memory order: a step at a
    time across the heads of row-major pages, a head at a time along head-major ones.
    `pack_vnni`'s layout, written a uint32 (a pair) at a time: faster here than on
    pack_vnni itself."""
    wide_vectors()
    pages, v_at, v_head, v_row = values
    flat = pages.reshape(pages.size)
    per_head, value_dim = pairs.shape[0] // heads, pairs.shape[1]
    steps = depth_steps(cols)
    for item in range(steps * heads):
        step, hk = (item % steps, item // steps) if head_major else (item // heads, item % heads)
        for d in range(step * TILE_PAIRS, (step + 1) * TILE_PAIRS):
            out, key = pairs[hk * per_head + d], 2 * d
            at = v_at + hk * v_head + key * v_row
            if key + 1 < cols:
                even, odd = flat[at : at + value_dim], flat[at + v_row : at + v_row + value_dim]
                for e in range(value_dim):
                    out[e] = np.uint32(even[e]) | (np.uint32(odd[e]) << 16)
            elif key < cols:
                even = flat[at : at + value_dim]
                for e in range(value_dim):
                    out[e] = np.uint32(even[e])
            else:
                out[:] = 0


@njit(fastmath=FASTMATH)
def amx_tile(q_pairs, k_pages, v_pages, head_major, page, first_row, cols, variant, b, q_len,
             j0, structure, scale2, s, buffers, acc, row_max, row_sum, shift,
             prefetch):  # fmt: skip
    """One key tile of every kv head on AMX tiles (a bf16 cache; E and Ev multiples of 32):
    S^T = K Q^T with the keys where they lie as A (`amx_key_scores`), transposed into s;
    the online softmax, P rounded to bf16 in its pass (scaled first where a variant changes
    the scores); the values packed in pairs (`pack_value_pairs`); acc += P V. Under
    AMX_VALUES_MIN_ROWS rows P V runs on the micro-kernels instead (`chunked_values`).
    buffers: (S^T (Hk W, rows16), k_tail (Hk 16, E), P (Hk rows16, whole steps of keys),
    value pairs (Hk W / 2, Ev); `amx_buffers`); acc (Hk, rows16, Ev), all on 64-byte
    lines."""
    st, k_tail, p16, v_pairs = buffers
    heads, rows, width = s.shape
    tile_rows, value_dim = acc.shape[1], acc.shape[2]
    keys = (k_pages, *page_offsets(k_pages, head_major, page, first_row))
    amx_key_scores(q_pairs, keys, head_major, cols, k_tail, st, prefetch)
    per_head = st.shape[0] // heads
    values_on_amx = rows >= AMX_VALUES_MIN_ROWS
    no_bits = np.empty((0, 0), np.uint16)  # P V on widened values below: no pairs kept
    for hk in range(heads):
        for c in range(0, cols, TILE_ROWS):
            for r in range(0, rows, TILE_ROWS):
                transpose_block((st, (hk * per_head + c) * tile_rows + r, tile_rows),
                                min(TILE_ROWS, cols - c), min(TILE_ROWS, rows - r),
                                (s, (hk * rows + r) * width + c, width))  # fmt: skip
        factor = scale2
        if scale2 <= 0 or modifies_scores(variant, structure) or not values_on_amx:
            scale_scores(s[hk], rows, cols, scale2)
            if modifies_scores(variant, structure):
                modify_tile(s, hk, q_len, cols, variant, b, j0, structure)
            factor = ONE
        if not values_on_amx:
            online_softmax_rescale(s[hk], rows, cols, acc[hk], row_max[hk], row_sum[hk],
                                   shift[hk])  # fmt: skip
            round_to_bf16(s[hk], rows, cols, no_bits)
            continue
        p_head = p16[hk * tile_rows : (hk + 1) * tile_rows]
        # P's columns past cols keep an earlier tile's probabilities: finite, against the
        # value pairs' zeros.
        online_softmax_to_bf16(s[hk], factor, p_head, rows, cols, acc[hk], row_max[hk],
                               row_sum[hk], shift[hk])  # fmt: skip
    values = (v_pages, *page_offsets(v_pages, head_major, page, first_row))
    if not values_on_amx:
        no_pairs = np.empty((0, 0, 0), np.uint32)  # widened values, as measured on AMX CPUs
        chunked_values(s, no_pairs, values, head_major, cols, acc, prefetch)
        return
    pack_value_pairs(values, head_major, cols, heads, v_pairs)
    pair_rows = v_pairs.shape[0] // heads
    for hk in range(heads):
        amx_product((p16, hk * tile_rows * p16.shape[1], p16.shape[1]),
                    (v_pairs, hk * pair_rows * value_dim, value_dim, TILE_ROWS),
                    (acc, hk * tile_rows * value_dim, value_dim), tile_rows // TILE_ROWS,
                    value_dim // TILE_ROWS, depth_steps(cols), True)  # fmt: skip


@njit()
def amx_query_pairs(q_rows, tile_rows):
    """(H, R, E) query rows (bf16 bits) as AMX's B for S^T = K Q^T: (H, E / 2, 2 R16) on
    64-byte lines, row d holding every row's values 2 d and 2 d + 1 side by side (zero rows
    to R16, `tile_rows`)."""
    heads, rows, width = q_rows.shape
    pairs = aligned_empty(heads * width // 2, 2 * tile_rows, q_rows[0])
    pairs[:] = 0
    for hk in range(heads):
        for r in range(rows):
            for d in range(width // 2):
                pairs[hk * width // 2 + d, 2 * r] = q_rows[hk, r, 2 * d]
                pairs[hk * width // 2 + d, 2 * r + 1] = q_rows[hk, r, 2 * d + 1]
    return pairs.reshape((heads, width // 2, 2 * tile_rows))


@njit()
def amx_buffers(kind, kv_heads, rows, block_n, head_dim, value_dim):
    """amx_tile's buffers (see there) for `rows` query rows a kv head, zeroed; empty ones for
    other kinds, and P's and the value pairs' where P V runs off AMX."""
    if kind != AMX:
        kv_heads = 0
    tile_rows = whole_tiles(rows)
    value_heads = kv_heads if rows >= AMX_VALUES_MIN_ROWS else 0
    f32, u16 = np.empty(0, np.float32), np.empty(0, np.uint16)
    st = aligned_empty(kv_heads * whole_tiles(block_n), tile_rows, f32)
    k_tail = aligned_empty(kv_heads * TILE_ROWS, head_dim, u16)
    key_steps = depth_steps(block_n)
    p16 = aligned_empty(value_heads * tile_rows, key_steps * 2 * TILE_PAIRS, u16)
    v_pairs = aligned_empty(value_heads * key_steps * TILE_PAIRS, value_dim,
                            np.empty(0, np.uint32))  # fmt: skip
    k_tail[:] = 0
    p16[:] = 0
    return st, k_tail, p16, v_pairs
