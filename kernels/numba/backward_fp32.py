"""FlashAttention-2's recomputing backward on fp32 tiles: a dq pass and a dk/dv pass, or one
fused pass; and the softmax's delta, which every backward reads."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.fastmath import LOG2E, exp2_shifted, to_whole_steps
from attnperf.kernels.numba.jit import (
    FASTMATH,
    njit,
    prange,
    row_view,
    split_index,
    unowned_members,
)
from attnperf.kernels.numba.microkernels import ZERO, tile_product
from attnperf.kernels.numba.packing import pack_key_panels
from attnperf.kernels.numba.softmax import panels_view
from attnperf.kernels.numba.tiles import product
from attnperf.kernels.numba.variant import (
    SKIP,
    LoweredVariant,
    key_tiles,
    longest,
    modify_scores,
    query_range,
    sequence,
    tile_structure,
)


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
