"""The backward on bf16 tiles (AVX512-BF16 or AMX): products on bf16 operands packed once per
call, P and dS rounded to bf16 before the products that take them."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.amx import (
    TILE_PAIRS,
    TILE_ROWS,
    amx_product,
    depth_steps,
    whole_tiles,
    zero_to_step,
)
from attnperf.kernels.numba.backward_fp32 import (
    score_gradients,
    scores_to_probabilities,
    through_softcap,
)
from attnperf.kernels.numba.fastmath import LOG2E
from attnperf.kernels.numba.jit import (
    FASTMATH,
    aligned_empty,
    njit,
    prange,
    split_index,
    unowned,
    unowned_members,
)
from attnperf.kernels.numba.microkernels import LANES, ONE, ZERO, tile_product
from attnperf.kernels.numba.packing import pack_key_panels, pack_vnni
from attnperf.kernels.numba.softmax import (
    amx_scores,
    pairs_view,
    panels_view,
    round_probabilities,
    rows_view,
    scale_scores,
    transposed_view,
)
from attnperf.kernels.numba.variant import (
    SKIP,
    LoweredVariant,
    key_tiles,
    longest,
    query_range,
    sequence,
    tile_structure,
)
from attnperf.kernels.numba.vector_ops import to_bf16

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
