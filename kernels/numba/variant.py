"""A call's variant lowered once for the kernels, and the helpers that every kernel, forward
and backward, shares: the tile ranges of the band and the layout, and the score
modification (softcap, mask, ALiBi, band, block layout)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from attnperf.inputs import AttentionInputs
from attnperf.kernels.numba.amx import whole_tiles
from attnperf.kernels.numba.fastmath import LOG2E, base2_bias, tanh, widen
from attnperf.kernels.numba.jit import FASTMATH, njit, prange, split_index
from attnperf.kernels.numba.launch import any_layout, as_numpy, run_parallel
from attnperf.kernels.numba.packing import transpose_tile
from attnperf.kernels.numba.tiles import tiles_flag
from attnperf.kernels.numba.vector_ops import add_block, vector_blocks
from attnperf.layouts import EMPTY as LAYOUT_EMPTY
from attnperf.layouts import FULL as LAYOUT_FULL
from attnperf.serving import KVCacheInputs

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
# An attn_mask is summarised once per call by blocks of MASK_BLOCK query rows by MASK_BLOCK
# keys (`summarise_mask`): OPEN where it lets every key through (True, 0.0), SHUT where it
# lets none (False, -inf), SIEVE where it does one or the other to each (a bool mask's
# other blocks), VALUES where a float mask adds other values. Tiles skip what it shuts,
# leave alone what it opens, and take a tile with no VALUES block unscaled (-inf stays
# -inf), so that a causal or padding mask costs about what is_causal does: SDPA adds the
# whole mask to every score. A tile is summarised by the same kinds (`mask_tile`).
MASK_BLOCK = 16
MASK_AREA = MASK_BLOCK * MASK_BLOCK
MASK_OPEN, MASK_SHUT, MASK_SIEVE, MASK_VALUES = 0, 1, 2, 3


# ---------------------------------------------------------------------------- the variant
class LoweredVariant(NamedTuple):
    """A call's variant lowered once (`lower_variant`), passed on by every kernel (numba
    reads a named tuple's fields by name, as a tuple's members). A kernel that shares its
    work out by prange rebuilds it by its class, `LoweredVariant(*unowned_members(variant))`:
    numba's parfor lowering re-creates a named tuple in its gufunc by the class of the call
    that defined it, and one defined by another call (`unowned_members`) failed to compile."""

    # The attn_mask by blocks (`_mask_for_kernel`): the elements of the blocks it reads (P,
    # MASK_BLOCK, MASK_BLOCK), its kind (MASK_NONE ...), then below each block's kind and
    # index, (B, Hq, ceil(L / MASK_BLOCK), ceil(S / MASK_BLOCK)) behind `any_layout`'s
    # leading dim.
    mask: np.ndarray
    mask_kind: int
    # The band, inclusive around each row's diagonal i + offset; UNBOUNDED where open.
    window_left: int
    window_right: int
    # attnperf.inputs.Sequences' table (B, 6): (slot, q_start, q_len, k_start, k_len,
    # offset), one row per batch entry for a plain call: row indices i, j are within a
    # sequence, its arrays' rows start at q_start, k_start of batch entry `slot`.
    sequences: np.ndarray
    softcap2: np.float32  # softcap * log2(e), 0 without
    alibi2: np.ndarray  # (B, Hq) slopes * log2(e), empty without
    # The block layout broadcast to (B, Hq, QB, KB) (`attnperf.layouts`); block_q = 0
    # without.
    layout_kinds: np.ndarray
    layout_partial_index: np.ndarray
    layout_partial: np.ndarray
    block_q: int
    block_k: int
    sinks2: np.ndarray  # (Hq,) sinks * log2(e), empty without
    tiles: int  # the fp32 tile products' route (tiles.product)
    mask_blocks: np.ndarray
    mask_index: np.ndarray


UNBOUNDED = 1 << 40
SKIP, MASKED, UNMASKED = 0, 1, 2  # what a (query tile, key tile) needs from the structure


@njit()
def sequence(variant, b):
    """(slot, q_start, q_len, k_start, k_len) of sequence b."""
    row = variant.sequences[b]
    return row[0], row[1], row[2], row[3], row[4]


@njit()
def longest(variant, column):
    """The largest q_len (column 2) or k_len (4) of the sequences."""
    sequences = variant.sequences
    result = 0
    for b in range(sequences.shape[0]):
        result = max(result, sequences[b, column])
    return result


def longest_in_table(variant: LoweredVariant, column: int) -> int:
    """`longest` for the launchers, in numpy: a call into numba types the whole variant
    tuple first (and a short call made three). By a list: numpy's reduction of a table
    this small cost more than the list."""
    return max(variant.sequences[:, column].tolist(), default=0)


@njit()
def key_range(variant, b, i0, rows, kv_len):
    """[first, end) of the keys that query rows i0 .. i0 + rows - 1 may see in the band."""
    left, right, offset = variant.window_left, variant.window_right, variant.sequences[b, 5]
    # Whole multiples of 16 keys (the band masks the extra ones): BLAS runs faster on them.
    first = max(i0 + offset - left, 0) // 16 * 16
    end = min((i0 + rows - 1 + offset + right + 1 + 15) // 16 * 16, kv_len)
    return first, max(end, first)


@njit()
def query_range(variant, b, j0, cols, q_len):
    """[first, end) of the query rows that may see keys j0 .. j0 + cols - 1 in the band."""
    left, right, offset = variant.window_left, variant.window_right, variant.sequences[b, 5]
    first = max(j0 - offset - right, 0)
    end = min(j0 + cols - 1 - offset + left + 1, q_len)
    return first, max(end, first)


@njit()
def tile_structure(variant, b, h, i0, rows, j0, cols):
    """SKIP, MASKED or UNMASKED: what the band and the block layout leave of one tile."""
    left, right, offset = variant.window_left, variant.window_right, variant.sequences[b, 5]
    # Key j's distance right of row i's diagonal, j - (i + offset), over the tile:
    nearest = j0 - (i0 + rows - 1) - offset
    farthest = j0 + cols - 1 - i0 - offset
    result = UNMASKED if nearest >= -left and farthest <= right else MASKED
    masked = mask_tile(variant, b, h, i0, rows, j0, cols)
    if masked == MASK_SHUT:
        return SKIP
    if masked != MASK_OPEN:
        result = MASKED
    kinds, block_q, block_k = variant.layout_kinds, variant.block_q, variant.block_k
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


@njit()
def mask_tile(variant, b, h, i0, rows, j0, cols):
    """What the attn_mask does to one tile: MASK_VALUES if one of its blocks adds values,
    MASK_OPEN if all are open (or no mask), MASK_SHUT if all are shut, else MASK_SIEVE."""
    if variant.mask_kind == MASK_NONE:
        return MASK_OPEN
    blocks = variant.mask_blocks
    opened = shut = True
    for qb in range(i0 // MASK_BLOCK, (i0 + rows - 1) // MASK_BLOCK + 1):
        for kb in range(j0 // MASK_BLOCK, (j0 + cols - 1) // MASK_BLOCK + 1):
            kind = blocks[0, b, h, qb, kb]
            if kind == MASK_VALUES:
                return MASK_VALUES
            opened = opened and kind == MASK_OPEN
            shut = shut and kind == MASK_SHUT
    return MASK_OPEN if opened else MASK_SHUT if shut else MASK_SIEVE


@njit()
def mask_key_range(variant, b, h, i0, rows, first, end):
    """[first, end) narrowed to the attn_mask's blocks that are not shut for query rows
    i0 .. i0 + rows - 1 (still whole multiples of 16 keys): a causal mask's last tile ends
    at its diagonal, as is_causal's does."""
    if variant.mask_kind == MASK_NONE or first >= end:
        return first, end
    blocks = variant.mask_blocks
    low, high = end, first
    for qb in range(i0 // MASK_BLOCK, (i0 + rows - 1) // MASK_BLOCK + 1):
        for kb in range(first // MASK_BLOCK, (end - 1) // MASK_BLOCK + 1):
            if blocks[0, b, h, qb, kb] != MASK_SHUT:
                low = min(low, kb * MASK_BLOCK)
                high = max(high, (kb + 1) * MASK_BLOCK)
    return max(first, low), min(end, max(high, low))


@njit()
def key_tiles(variant, b, h, i0, rows, kv_len, block_n):
    """The key tiles that query rows i0 .. i0 + rows - 1 must visit, as (j0, cols,
    structure) with structure MASKED or UNMASKED: the tile range of the band, without the
    tiles that the block layout leaves empty."""
    tiles = []
    first, end = key_range(variant, b, i0, rows, kv_len)
    first, end = mask_key_range(variant, b, h, i0, rows, first, end)
    for j0 in range(first, end, block_n):
        cols = min(block_n, end - j0)
        structure = tile_structure(variant, b, h, i0, rows, j0, cols)
        if structure != SKIP:
            tiles.append((j0, cols, structure))
    return tiles


@njit()
def modifies_scores(variant, structure):
    """Whether modify_scores changes a tile of this structure: a softcap, a mask, ALiBi,
    or a MASKED tile (a decode step's plain tiles skip its calls)."""
    return structure == MASKED or changes_values(variant)


@njit()
def changes_values(variant):
    """Whether modify_scores changes every tile's scores' values (a softcap, ALiBi: each on
    the scaled scores), not only sets some to -inf (the band, the block layout), which the
    scale leaves as they are. A float mask's values change a MASKED tile's where
    `adds_mask_values`."""
    return variant.softcap2 != 0 or variant.alibi2.shape[0] > 0


@njit()
def adds_mask_values(variant, b, h, i0, rows, j0, cols):
    """Whether a float attn_mask adds values other than 0 and -inf to a tile's scores."""
    return mask_tile(variant, b, h, i0, rows, j0, cols) == MASK_VALUES


@njit(fastmath=FASTMATH)
def modify_scores(s, variant, b, h, i0, j0, rows, cols, structure, dtanh):
    """Scores of one tile (base 2, scaled) in place: softcap, attn_mask, ALiBi, and, for a
    MASKED tile, the band and the block layout (-inf outside them).

    With a softcap and `dtanh` of the tile's size, also dtanh <- 1 - tanh^2, the softcap's
    gradient factor for the backward.
    """
    softcap_scores(s, rows, cols, variant.softcap2, dtanh)
    if structure == MASKED:
        mask_scores(s, False, variant, b, h, i0, j0, rows, cols)
    alibi2, offset = variant.alibi2, variant.sequences[b, 5]
    if alibi2.shape[0] > 0:
        slope = alibi2[b, h]
        for r in range(rows):
            distance = j0 - (i0 + r) - offset
            s_row = s[r]
            for c in range(cols):
                s_row[c] -= slope * abs(distance + c)
    if structure != MASKED:
        return
    left, right = variant.window_left, variant.window_right
    for r in range(rows):  # the band: key j for row i iff -left <= j - (i + offset) <= right
        distance = j0 - (i0 + r) - offset
        for c in range(0, min(max(-left - distance, 0), cols)):
            s[r, c] = -np.inf
        for c in range(max(right - distance + 1, 0), cols):
            s[r, c] = -np.inf
    layout_scores(s, variant, b, h, i0, j0, rows, cols)


@njit(fastmath=FASTMATH)
def modify_transposed_scores(s_t, s_rows, variant, b, h, i0, j0, rows, cols, structure):
    """`modify_scores` (forward: no dtanh) of a tile held transposed, s_t[c, r] the score
    of query row i0 + r and key j0 + c (s_t's columns whole sixteens). The
    softcap, ALiBi and the band run down each key's row of query rows, vectorised as
    `modify_scores`' rows are, and the attn_mask by its blocks; with a block layout to apply
    (read by rows) the tile goes through s_rows (rows by cols) by rows and back."""
    if structure == MASKED and variant.block_q != 0:
        keys = whole_tiles(cols)
        transpose_tile(s_t, s_rows, keys, s_t.shape[1])
        modify_scores(s_rows, variant, b, h, i0, j0, rows, cols, structure,
                      np.empty((0, 0), np.float32))  # fmt: skip
        transpose_tile(s_rows, s_t, s_t.shape[1], keys)
        return
    softcap_scores(s_t, cols, rows, variant.softcap2, np.empty((0, 0), np.float32))
    if structure == MASKED:
        mask_scores(s_t, True, variant, b, h, i0, j0, rows, cols)
    alibi2, offset = variant.alibi2, variant.sequences[b, 5]
    if alibi2.shape[0] > 0:
        slope = alibi2[b, h]
        for c in range(cols):
            distance = j0 + c - i0 - offset
            s_row = s_t[c]
            for r in range(rows):
                s_row[r] -= slope * abs(distance - r)
    if structure != MASKED:
        return
    left, right = variant.window_left, variant.window_right
    for c in range(cols):  # key j sees rows i with j - offset - right <= i <= j - offset + left
        first = j0 + c - offset - right - i0
        last = j0 + c - offset + left - i0
        s_row = s_t[c]
        for r in range(0, min(max(first, 0), rows)):
            s_row[r] = -np.inf
        for r in range(max(last + 1, 0), rows):
            s_row[r] = -np.inf


@njit(fastmath=FASTMATH)
def softcap_scores(s, rows, cols, softcap2, dtanh):
    """s[:rows, :cols] <- softcap2 tanh(s / softcap2) (nothing without a softcap), and
    dtanh <- 1 - tanh^2 where dtanh has the rows."""
    if softcap2 == 0:
        return
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


@njit(fastmath=FASTMATH)
def mask_scores(s, transposed, variant, b, h, i0, j0, rows, cols):
    """The attn_mask added to a tile's scores (s[r, c], or s[c, r] if transposed) by its
    blocks: nothing to an open block, -inf to a shut one, its values to the others (a bool
    mask's False as -inf; added, not set, so that a NaN score stays NaN, as in SDPA)."""
    values, blocks, index = variant.mask, variant.mask_blocks, variant.mask_index
    if variant.mask_kind == MASK_NONE:
        return
    # Whole blocks (the tile's corner on the blocks' grid) on explicit vectors where they
    # fit in s (its rows and columns, or its columns and rows transposed): cells past rows
    # and cols are the tile's padding, never read.
    whole_blocks = i0 % MASK_BLOCK == 0 and j0 % MASK_BLOCK == 0 and vector_blocks()
    whole_blocks = whole_blocks and s.strides[1] == s.itemsize
    reach = (s.shape[1], s.shape[0]) if transposed else (s.shape[0], s.shape[1])
    row = s.strides[0] // s.itemsize
    for qb in range(i0 // MASK_BLOCK, (i0 + rows - 1) // MASK_BLOCK + 1):
        r0, r1 = max(qb * MASK_BLOCK - i0, 0), min((qb + 1) * MASK_BLOCK - i0, rows)
        for kb in range(j0 // MASK_BLOCK, (j0 + cols - 1) // MASK_BLOCK + 1):
            c0, c1 = max(kb * MASK_BLOCK - j0, 0), min((kb + 1) * MASK_BLOCK - j0, cols)
            kind = blocks[0, b, h, qb, kb]
            if kind == MASK_OPEN:
                continue
            shut = kind == MASK_SHUT
            at = index[0, b, h, qb, kb]
            di, dj = i0 - qb * MASK_BLOCK, j0 - kb * MASK_BLOCK  # the tile's corner in the block
            if whole_blocks and r0 + MASK_BLOCK <= reach[0] and c0 + MASK_BLOCK <= reach[1]:
                if transposed:
                    add_block(s, c0 * row + r0, values, max(at, 0) * MASK_AREA, shut, True)
                else:
                    add_block(s, r0 * row + c0, values, max(at, 0) * MASK_AREA, shut, False)
            elif transposed:  # down s's rows, each loop
                for c in range(c0, c1):
                    for r in range(r0, r1):
                        s[c, r] += np.float32(-np.inf) if shut else values[at, di + r, dj + c]
            else:
                for r in range(r0, r1):
                    for c in range(c0, c1):
                        s[r, c] += np.float32(-np.inf) if shut else values[at, di + r, dj + c]


@njit(fastmath=FASTMATH)
def layout_scores(s, variant, b, h, i0, j0, rows, cols):
    """-inf where the block layout leaves a MASKED tile's scores out."""
    kinds, partial_index, partial = (
        variant.layout_kinds,
        variant.layout_partial_index,
        variant.layout_partial,
    )
    block_q, block_k = variant.block_q, variant.block_k
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


@njit(fastmath=FASTMATH)
def with_sink(variant, h, row_max, row_sum):
    """(max, sum, normaliser) of a row's base-2 statistics (its max and sum of 2 ** (score
    - max)) with head h's sink term 2 ** sink2 added to the sum, and the factor that turns
    its unnormalised accumulator into the output (0 for a row of sum 0 without sinks; a row
    that saw no key gets (sink2, 1, 0) with them)."""
    sinks2 = variant.sinks2
    if sinks2.shape[0] == 0:
        return row_max, row_sum, 1.0 / row_sum if row_sum != 0 else 0.0
    sink2 = sinks2[h]
    if row_sum == 0:
        return sink2, np.float32(1.0), 0.0
    largest = max(row_max, sink2)
    rescale = 2.0 ** np.float64(row_max - largest)
    total = row_sum * rescale + 2.0 ** np.float64(sink2 - largest)
    return largest, np.float32(total), rescale / total


NO_MASK_BLOCKS = any_layout(np.zeros((1, 1, 1, 1), np.int8))  # read-only: one for every call
NO_MASK_INDEX = any_layout(np.zeros((1, 1, 1, 1), np.int32))
# The variant's arrays where a call has none of it, one for every call (a decoding step
# made these afresh each time). Writeable, as a call's own would be: numba types read-only
# arrays apart, a compilation of their own; the kernels never write them.
NO_MASK = np.zeros((1, MASK_BLOCK, MASK_BLOCK), np.float32)
NO_ALIBI = np.zeros((0, 0), np.float32)
NO_LAYOUT = (np.zeros((1, 1, 1, 1), np.int8), np.zeros((1, 1, 1, 1), np.int32),
             np.zeros((1, 1, 1), np.bool_))  # fmt: skip
NO_SINKS = np.zeros(0, np.float32)


# A mask's elements as the bits `summarise_mask` folds: (numpy view, open, shut, also; for a
# float mask its sign bit and the magnitudes of -1e30 (the floor), -1e20 (ordinary) and inf,
# truncated to the format), and the array `gather_mask_blocks` reads (fp16 masks are made
# float32 first). A bool mask's sign 0 makes no element a floor.
_MASK_BITS = {
    torch.bool: (np.uint8, 1, 0, 1, 0, 0, 0, 0),
    torch.bfloat16: (np.uint16, 0, 0xFF80, 0x8000, 0x8000, 0x7149, 0x60AD, 0x7F80),
    torch.float32: (np.uint32, 0, 0xFF800000, 0x80000000, 0x80000000, 0x7149F2CA,
                    0x60AD78EC, 0x7F800000),
}  # fmt: skip
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _mask_for_kernel(inputs: AttentionInputs) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(values, kind, blocks, index): the mask summarised by blocks (`summarise_mask`),
    read as `blocks[0, b, h, qb, kb]`; the sieve and values blocks' elements in base 2
    (a bool's False -inf, True 0), block `index[0, b, h, qb, kb]` of values (P, MASK_BLOCK,
    MASK_BLOCK); and the mask's kind. Of a causal mask, the kernels read its diagonal's
    blocks alone."""
    mask = inputs.attn_mask
    kind = MASK_NONE if mask is None else MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT
    if kind == MASK_NONE:
        return NO_MASK, kind, NO_MASK_BLOCKS, NO_MASK_INDEX
    # Summarise only the mask's own elements, then broadcast again: never a full-size copy.
    compact = mask.detach()
    for dim in range(4):
        if compact.stride(dim) == 0:
            compact = compact.narrow(dim, 0, 1)
    compact = compact.contiguous() if compact.dtype != torch.float16 else compact.float()
    unsigned, *marks = _MASK_BITS[compact.dtype]
    bits = as_numpy(compact.view(_SAME_SIZE_INT[compact.element_size()])).view(unsigned)
    shape = (*bits.shape[:2], *(-(-n // MASK_BLOCK) for n in bits.shape[2:]))
    blocks = np.empty(shape, np.int8)
    # Floors add exactly nothing to a row that sees a key of ordinary value, unless a band
    # or a layout may hide that key (`summarise_mask`).
    floors_shut = kind == MASK_FLOAT and inputs.band is None and inputs.variant.block_mask is None
    run_parallel(summarise_mask, bits, tuple(unsigned(mark) for mark in marks), floors_shut,
                 blocks)  # fmt: skip
    read = blocks >= MASK_SIEVE
    index = np.where(read, np.cumsum(read).reshape(shape) - 1, -1).astype(np.int32)
    values = np.empty((max(int(read.sum()), 1), MASK_BLOCK, MASK_BLOCK), np.float32)
    elements = bits if compact.dtype != torch.float32 else as_numpy(compact)
    run_parallel(gather_mask_blocks, elements, kind == MASK_BOOL, index, values)
    full = (*mask.shape[:2], *(-(-n // MASK_BLOCK) for n in mask.shape[2:]))
    blocks, index = np.broadcast_to(blocks, full), np.broadcast_to(index, full)
    return values, kind, any_layout(blocks), any_layout(index)


@njit(parallel=True)
def gather_mask_blocks(mask, boolean, index, values):
    """values[index[b, h, qb, kb]] <- block (qb, kb) of mask[b, h] (bool as uint8, bf16 as
    its bits, or float32) in base 2 (a bool's False -inf, True 0), for each block indexed
    (>= 0). Cells past its last row or column repeat it: a dim of 1 is broadcast, else
    they are never read."""
    heads, query_blocks, key_blocks = index.shape[1], index.shape[2], index.shape[3]
    q_len, kv_len = mask.shape[2], mask.shape[3]
    for item in prange(index.shape[0] * heads * query_blocks):
        b, h, qb = split_index(item, heads, query_blocks)
        for kb in range(key_blocks):
            at = index[b, h, qb, kb]
            if at < 0:
                continue
            for r in range(MASK_BLOCK):
                row = mask[b, h, min(qb * MASK_BLOCK + r, q_len - 1)]
                for c in range(MASK_BLOCK):
                    x = row[min(kb * MASK_BLOCK + c, kv_len - 1)]
                    if boolean:
                        values[at, r, c] = np.float32(0.0) if x else np.float32(-np.inf)
                    else:
                        values[at, r, c] = base2_bias(widen(x))


@njit(parallel=True)
def summarise_mask(mask, marks, floors_shut, blocks):
    """blocks[b, h, qb, kb] <- what mask[b, h] does over its block (qb, kb) of MASK_BLOCK x
    MASK_BLOCK: MASK_OPEN if every element is `opened` (or -0.0), MASK_SHUT if every one is
    `shut`, MASK_SIEVE if each is one of them (or `also`, which adds nothing either: -0.0),
    else MASK_VALUES. marks: (opened, shut, also, sign, floor, ordinary, inf) (`_MASK_BITS`).

    With floors_shut, a block of floors (-1e30 or below: finfo.min, -inf) is shut too where
    each row of its strip sees an ordinary key (-1e20 or above, not NaN): 2 ** (floor -
    ordinary) is exactly 0 in float32 for every score under 1e29, so such keys add nothing
    (a row of floors alone averages them, as in SDPA: kept).

    mask: C-contiguous bits (a bool mask as uint8, bf16 as uint16, float32 as uint32), so
    that a strip of rows folds into its columns' AND, OR and odd ones as whole vectors (a
    block at a time ran several times slower)."""
    opened, shut, also, sign, floor, ordinary, inf = marks
    heads, query_blocks, key_blocks = blocks.shape[1], blocks.shape[2], blocks.shape[3]
    q_len, kv_len = mask.shape[2], mask.shape[3]
    for item in prange(blocks.shape[0] * heads * query_blocks):
        b, h, qb = split_index(item, heads, query_blocks)
        r0, r1 = qb * MASK_BLOCK, min((qb + 1) * MASK_BLOCK, q_len)
        every, some = mask[b, h, r0].copy(), mask[b, h, r0].copy()  # AND, OR of each column
        odd = np.zeros(kv_len, np.bool_)  # a value other than opened, shut and also
        floors = np.ones(kv_len, np.bool_)  # floors only
        rows_see = True  # each row sees an ordinary key
        for r in range(r0, r1):
            row = mask[b, h, r]
            for c in range(kv_len):
                x = row[c]
                every[c] &= x
                some[c] |= x
                odd[c] |= (x != opened) & (x != shut) & (x != also)
            if not floors_shut:
                continue
            sees = False
            for c in range(kv_len):
                magnitude, positive = row[c] & ~sign, (row[c] & sign) == 0
                floors[c] &= (not positive) & (magnitude >= floor) & (magnitude <= inf)
                sees |= (magnitude <= ordinary) | (positive & (magnitude <= inf))
            rows_see = rows_see and sees
        for kb in range(key_blocks):
            c0, c1 = kb * MASK_BLOCK, min((kb + 1) * MASK_BLOCK, kv_len)
            all_of, any_of, values, floored = every[c0], some[c0], False, floors_shut and rows_see
            for c in range(c0, c1):
                all_of &= every[c]
                any_of |= some[c]
                values |= odd[c]
                floored &= floors[c]
            kind = MASK_VALUES if values else MASK_SIEVE
            if (all_of == shut and any_of == shut) or (values and floored):
                kind = MASK_SHUT
            if all_of & ~sign == opened and any_of & ~sign == opened:  # 0.0 and -0.0 alike:
                kind = MASK_OPEN  # (1 - keep) * finfo.min makes -0.0
            blocks[b, h, qb, kb] = kind


def balanced_order(table: Tensor, threads: int) -> Tensor | None:
    """An order of the sequences in which numba's prange, which gives each thread one
    contiguous share of the items (sequence-major, as many per sequence), shares their work
    (q_len x k_len) evenly: heaviest first, each to the lightest share with room. A packed
    batch of 8 causal sequences of 516 to 3890 tokens in cu_seqlens order left one of 2
    threads idle most of the time; equal sequences keep their order (None: as they are)."""
    count = table.shape[0]
    if count <= 1 or threads <= 1:
        return None
    rows = table.numpy()  # in lists: torch's ops on a table this small cost a decoding step
    lengths = (rows[:, 2] * rows[:, 4]).tolist()
    if all(length == lengths[0] for length in lengths):
        return None
    room = [count // threads + (share < count % threads) for share in range(threads)]
    shares = [[] for _ in range(threads)]
    work = [0] * threads
    for b in sorted(range(count), key=lambda b: -lengths[b]):  # heaviest first, ties in order
        share = min((s for s in range(threads) if len(shares[s]) < room[s]), key=work.__getitem__)
        shares[share].append(b)
        work[share] += lengths[b]
    return torch.tensor([b for share in shares for b in share])


# Dense calls' lowered variants by what they are made of: each is made of the call's shape
# and scalars alone, and making its own was a visible part of a short call. The kernels
# only read them (their arrays stay writeable all the same: numba
# types a read-only array apart, a compilation of its own).
_DENSE_VARIANTS: dict[tuple, tuple] = {}
MAX_DENSE_VARIANTS = 256


def lower_variant(inputs: AttentionInputs | KVCacheInputs) -> LoweredVariant:
    """The call's masks and variant as the kernels' one `LoweredVariant`."""
    variant = inputs.variant
    tensorless = (
        isinstance(inputs, AttentionInputs) and inputs.attn_mask is None
        and variant.sequences is None and variant.alibi_slopes is None
        and variant.block_mask is None and variant.sinks is None
    )  # fmt: skip
    if not tensorless:
        return _lower_variant(inputs)
    key = (inputs.batch, inputs.q_len, inputs.kv_len, variant.align, inputs.band,
           variant.softcap, torch.get_num_threads(), tiles_flag())  # fmt: skip
    lowered = _DENSE_VARIANTS.get(key)
    if lowered is None:
        if len(_DENSE_VARIANTS) >= MAX_DENSE_VARIANTS:
            _DENSE_VARIANTS.clear()
        lowered = _DENSE_VARIANTS[key] = _lower_variant(inputs)
    return lowered


def with_sequences(lowered: LoweredVariant, table: np.ndarray) -> LoweredVariant:
    """A lowered variant (`lower_variant`) with another call's sequences (their table,
    attnperf.inputs.Sequences') in place of its own: for calls alike but for their lengths,
    every sequence as long (so that balanced_order keeps their order) and none packed."""
    return lowered._replace(sequences=table)


def _lower_variant(inputs: AttentionInputs | KVCacheInputs) -> LoweredVariant:
    mask, mask_kind, mask_blocks, mask_index = _mask_for_kernel(inputs)
    variant = inputs.variant
    left, right = inputs.band or (None, None)
    softcap2 = np.float32(variant.softcap * LOG2E if variant.softcap is not None else 0.0)
    table = inputs.sequences.table
    order = balanced_order(table, torch.get_num_threads())
    if order is not None:
        table = table[order]
    alibi2 = NO_ALIBI
    if variant.alibi_slopes is not None:
        slopes = variant.alibi_slopes if order is None else variant.alibi_slopes[order]
        alibi2 = as_numpy((slopes * LOG2E).float().contiguous())
    layout = variant.block_mask
    if layout is None:
        kinds, partial_index, partial = NO_LAYOUT
        block_q = block_k = 0
    else:
        # Per (batch, head) copies, O(L S / block^2): C-contiguous, as without a layout, so
        # that both share one compiled kernel.
        full = (inputs.batch, inputs.q_heads, *layout.num_blocks)
        kinds = as_numpy(layout.kinds.expand(full).contiguous())
        partial_index = as_numpy(layout.partial_index.expand(full).contiguous())
        partial = as_numpy(layout.partial)
        if partial.shape[0] == 0:
            partial = np.zeros((1, *layout.block_size), np.bool_)
        block_q, block_k = layout.block_size
    sinks2 = NO_SINKS
    if variant.sinks is not None:
        sinks2 = as_numpy((variant.sinks.detach().float() * LOG2E).contiguous())
    return LoweredVariant(
        mask=mask, mask_kind=mask_kind,
        window_left=UNBOUNDED if left is None else left,
        window_right=UNBOUNDED if right is None else right,
        sequences=table.numpy(), softcap2=softcap2, alibi2=alibi2, layout_kinds=kinds,
        layout_partial_index=partial_index, layout_partial=partial, block_q=block_q,
        block_k=block_k, sinks2=sinks2, tiles=tiles_flag(), mask_blocks=mask_blocks,
        mask_index=mask_index,
    )  # fmt: skip
