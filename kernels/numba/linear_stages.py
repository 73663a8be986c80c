"""The chunked linear-attention rules' shared stages, each a named function over one chunk of
one head: its gates, the products of its rows (the pair scores and their backward), the
state's advance, and their buffers; the rule (`LinearRule`) they read. The delta rule's own
stages (its WY form, the triangular solves, their backward) are linear_delta's."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from attnperf.kernels.numba.fastmath import LOG2E, exp2
from attnperf.kernels.numba.jit import FASTMATH, aligned_empty, njit, prefetch_line, wide_vectors
from attnperf.kernels.numba.tiles import product
from attnperf.linear_inputs import L2NORM_EPS

# Steps per chunk: the intra-chunk work (C^2 (K + V) per chunk) against the state's (C K V).
# A forward that keeps nothing for a backward takes chunks of FORWARD_CHUNK steps: fewer
# FLOPs in the triangles, and its per-chunk costs paid no more often than the state's
# products amortise them (faster than 64-step chunks for every rule; 16 steps no faster).
# A forward that keeps its chunks takes 64: the backward over 32-step chunks was slower
# (twice the start states kept and read).
CHUNK = 64
FORWARD_CHUNK = 32
# Rows of a block of the products with a triangular side: a block of rows i0 .. i0 + 15
# reads (or writes) columns up to i0 + 15 only, 10/16 of the whole square's work at C = 64
# (the micro-kernels hold 16 columns a vector).
TRIANGLE_ROWS = 16
# load_rows asks for the row this many ahead: rows of a (B, T, H, K) tensor lie H K floats
# apart, a stride no prefetcher follows (2 was the fastest distance measured).
PREFETCH_ROWS = 2
# Floats a running state's rows run past V (new_states).
STATE_PAD = 16


class LinearRule(NamedTuple):
    """A call's rule as every kernel and stage reads it (a named tuple numba reads by field):
    scale, q's factor (float32); l2norm, whether q and k are normalised first; gated, whether
    gates decay the state (g given); delta, whether the delta rule writes it (beta given;
    else the additive rule). The delta rule's own stages live in linear_delta."""

    scale: np.float32
    l2norm: bool
    gated: bool
    delta: bool


@njit(fastmath=FASTMATH)
def chunk_gates(g, slot, t0, rows, hv, gamma, e_in, e_out):
    """gamma[:rows] <- the cumulative gates of rows t0 .. t0 + rows - 1 (per key dim, or one
    column), e_in <- exp(Gamma_i), e_out <- exp(Gamma_last - Gamma_i). gamma is float64: a
    chunk's cumulative gate reaches -1e3 and more, where float32's rounding would cost
    exp(Gamma_i - Gamma_j) 1e-4 of relative error."""
    for d in range(gamma.shape[1]):
        total = 0.0
        for i in range(rows):
            total += g[slot, t0 + i, hv, d]
            gamma[i, d] = total
        for i in range(rows):
            e_in[i, d] = np.exp(gamma[i, d])
            e_out[i, d] = np.exp(total - gamma[i, d])


@njit(fastmath=FASTMATH)
def decay(gamma, i, j, d):
    """exp(Gamma_i - Gamma_j) in float32, gate column d: step j's decay until step i (the
    difference taken in float64, the exponential by the vectorisable exp2)."""
    return exp2(np.float32((gamma[i, d] - gamma[j, d]) * LOG2E))


@njit(fastmath=FASTMATH)
def lower_scores(x, y, out, tiles):
    """out[i, j] = sum_d x_id y_jd for j <= i (rows = x.shape[0]; the diagonal blocks'
    entries above it too, no other above it): x y^T's lower triangle, by row blocks."""
    rows = x.shape[0]
    for i0 in range(0, rows, TRIANGLE_ROWS):
        i1 = min(i0 + TRIANGLE_ROWS, rows)
        product(x[i0:i1], y[:i1], out[i0:i1, :i1], 1.0, 0.0, False, True, tiles)


@njit(fastmath=FASTMATH)
def lower_times(a, b, c, alpha, beta, tiles):
    """c = alpha a b + beta c for a lower triangular (rows x rows; the diagonal blocks'
    entries above it are read, and must be 0, no other above it), by row blocks."""
    rows = a.shape[0]
    for i0 in range(0, rows, TRIANGLE_ROWS):
        i1 = min(i0 + TRIANGLE_ROWS, rows)
        product(a[i0:i1, :i1], b[:i1], c[i0:i1], alpha, beta, False, False, tiles)


@njit(fastmath=FASTMATH)
def plain_pair_products(x, y, gamma, gated, out, tiles):
    """out <- x y^T's lower triangle (lower_scores) where pair_scores takes its gates out of
    the product (no gate, or one per step); nothing for gates per key dim."""
    if not (gated and gamma.shape[1] > 1):
        lower_scores(x, y, out, tiles)


@njit(fastmath=FASTMATH)
def pair_decays(gamma, rows, out):
    """out[i, j] <- exp(Gamma_i - Gamma_j) for j <= i < rows, 0 above, for a gate a step
    (gamma (C, 1)): what a value head's A and k k^T both take. Whole rows in the vector loop
    (the exponent held at 0 above the diagonal): a triangle's short rows ran mostly in its
    scalar remainder."""
    wide_vectors()
    column = gamma.ravel()  # contiguous where gamma[:, 0] is strided to numba
    for i in range(rows):
        for j in range(rows):
            d = exp2(np.float32(min((column[i] - column[j]) * LOG2E, 0.0)))
            out[i, j] = d if j <= i else np.float32(0.0)


@njit(fastmath=FASTMATH)
def pair_scores(x, y, plain, gamma, pair_decay, gated, strict, out):
    """out[i, j] = sum_d x_id y_jd exp(gamma_id - gamma_jd) for j <= i (j < i when strict),
    0 above, on rows x rows (rows = x.shape[0]); `plain` holds plain_pair_products(x, y)
    (value heads that share x and y share it), `pair_decay` pair_decays(gamma) for a gate
    a step."""
    wide_vectors()
    rows = x.shape[0]
    vector = gated and gamma.shape[1] > 1
    if vector:  # exp(gamma_i - gamma_j) differs per key dim: no product to factor out
        for i in range(rows):
            for j in range(i + 1 - strict):
                total = np.float32(0.0)
                for d in range(x.shape[1]):
                    total += x[i, d] * y[j, d] * decay(gamma, i, j, d)
                out[i, j] = total
            for j in range(i + 1 - strict, rows):
                out[i, j] = 0.0
    else:
        for i in range(rows):
            last = i - strict
            for j in range(rows):
                factor = pair_decay[i, j] if gated else np.float32(1.0)
                out[i, j] = plain[i, j] * factor if j <= last else np.float32(0.0)


@njit(fastmath=FASTMATH)
def add_crossing(r, rows, dg, d):
    """dg[s, d] += sum over pairs j < s <= i of r[i, j] (r strictly lower): a pair's gate
    term reaches the steps between its two ends. Summed as such, never as a difference of
    suffix sums, which would cancel large terms of pairs on one side of s."""
    column = np.zeros(rows, np.float64)  # column[j] = sum_{i >= s} r[i, j]
    for s in range(rows - 1, 0, -1):
        total = 0.0
        for j in range(s):
            column[j] += r[s, j]
            total += column[j]
        dg[s, d] += total


@njit(fastmath=FASTMATH)
def pair_scores_backward(d_out, scores, x, y, gamma, gated, strict, dx, dy, dg, tiles):
    """dx, dy += the gradients of pair_scores through d_out (its forward `scores`), and the
    gates' share to dg (C, gate dims): the gradient of each step's own gate g_s. dx and dy
    may be one array (x and y one too: k k^T's pairs)."""
    rows = x.shape[0]
    crossing = np.zeros((rows, rows), np.float32)  # gate terms of the pairs j < i
    if gated and gamma.shape[1] > 1:
        for d in range(x.shape[1]):
            for i in range(rows):
                for j in range(i + 1 - strict):
                    t = d_out[i, j] * decay(gamma, i, j, d)
                    dx[i, d] += t * y[j, d]
                    dy[j, d] += t * x[i, d]
                    crossing[i, j] = t * x[i, d] * y[j, d] if j < i else np.float32(0.0)
            add_crossing(crossing, rows, dg, d)
        return
    weighted = np.zeros((rows, rows), np.float32)  # d_out * exp(gamma_i - gamma_j), masked
    for i in range(rows):
        for j in range(i + 1 - strict):
            weighted[i, j] = d_out[i, j]
            if gated:
                weighted[i, j] *= decay(gamma, i, j, 0)
                if j < i:
                    crossing[i, j] = d_out[i, j] * scores[i, j]
    if gated:
        add_crossing(crossing, rows, dg, 0)
    if dx.ctypes.data == dy.ctypes.data:  # dk += (W + W^T) k: one product
        for i in range(rows):
            weighted[i, i] *= 2
            for j in range(i):
                weighted[i, j] += weighted[j, i]
                weighted[j, i] = weighted[i, j]
        product(weighted, y, dx, 1.0, 1.0, False, False, tiles)
        return
    product(weighted, y, dx, 1.0, 1.0, False, False, tiles)
    product(weighted, x, dy, 1.0, 1.0, True, False, tiles)


@njit(fastmath=FASTMATH)
def to_raw(grad, loaded, scale, inverse_norm, l2norm, out):
    """out <- the gradient of a raw row x from `grad`, that of loaded = scale * n(x) (n the
    l2norm when asked: dx = r (dn - n (n . dn)), r the inverse norm)."""
    total = np.float32(0.0)
    if l2norm:
        for d in range(grad.shape[0]):
            total += loaded[d] * grad[d]
        total /= scale  # n . (scale dloaded) with n = loaded / scale
    else:
        inverse_norm = np.float32(1.0)
    for d in range(grad.shape[0]):
        out[d] = inverse_norm * (grad[d] * scale - loaded[d] * total)


@njit(fastmath=FASTMATH)
def gate_row(e, i, out):
    """out[d] <- e[i, d], or e[i, 0] for every d when the gate has one column."""
    if e.shape[1] == 1:
        out[:] = e[i, 0]
    else:
        out[:] = e[i]


@njit(fastmath=FASTMATH)
def add_gate_terms(row, terms, i):
    """terms[i] += row per key dim, or terms[i, 0] += sum(row) for a one-column gate."""
    if terms.shape[1] == 1:
        total = np.float32(0.0)
        for d in range(row.shape[0]):
            total += row[d]
        terms[i, 0] += total
    else:
        for d in range(row.shape[0]):
            terms[i, d] += row[d]


@njit(fastmath=FASTMATH)
def scale_rows(x, factors, e, out):
    """out[i, d] = x[i, d] * factors[i] * e[i, d] (e's one column for every d when it has
    one); factors may be empty (1)."""
    rows, dims = x.shape
    for i in range(rows):
        f = factors[i] if factors.shape[0] > 0 else np.float32(1.0)
        if e.shape[1] == 1:
            fe = f * e[i, 0]
            for d in range(dims):
                out[i, d] = x[i, d] * fe
        else:
            for d in range(dims):
                out[i, d] = x[i, d] * f * e[i, d]


@njit(fastmath=FASTMATH)
def load_rows(x, slot, t0, rows, h, factors, scale, l2norm, out, inverse_norms):
    """out[:rows] <- rows t0 .. t0 + rows - 1 of head h of x (B, T, heads, dim) times scale
    and factors[i] (when not empty), l2-normalised first when asked (inverse_norms <- 1 /
    sqrt(sum(x^2) + 1e-6)): a contiguous copy for the products. Indexing the 4-D array
    itself, whose last dim numba knows to be contiguous, lets the loops vectorise."""
    for i in range(rows):
        if i + PREFETCH_ROWS < rows:
            for d in range(0, x.shape[3], 16):
                prefetch_line(x, (slot, t0 + i + PREFETCH_ROWS, h, d))
        factor = scale * (factors[i] if factors.shape[0] > 0 else np.float32(1.0))
        if l2norm:
            total = np.float32(0.0)
            for d in range(x.shape[3]):
                total += x[slot, t0 + i, h, d] * x[slot, t0 + i, h, d]
            inverse_norms[i] = np.float32(1.0) / np.sqrt(total + np.float32(L2NORM_EPS))
            factor *= inverse_norms[i]
        for d in range(x.shape[3]):
            out[i, d] = x[slot, t0 + i, h, d] * factor


@njit(fastmath=FASTMATH)
def chunk_rows(q, k, rule, slot, hk, t0, rows, scores, pairs, scratch, tiles):
    """What the value heads of key head hk share of chunk t0 .. t0 + rows - 1, into `scratch`
    (new_scratch's arrays, (C, ...); only [:rows] is meaningful): kc = k
    (normalised when the rule asks), k_inv its rows' inverse norms; with `scores` also qs =
    q^ (scaled; normalised when asked), q_inv, and qk = plain_pair_products(qs, kc); with
    `pairs` (the delta rule's) kk_plain = plain_pair_products(kc, kc)."""
    gamma, e_in, _, qs, kc, q_inv, k_inv, _, _, _, qk, kk_plain, _ = scratch
    no_factor = e_in[:0, 0]
    load_rows(k, slot, t0, rows, hk, no_factor, np.float32(1.0), rule.l2norm, kc, k_inv)
    if scores:
        load_rows(q, slot, t0, rows, hk, no_factor, rule.scale, rule.l2norm, qs, q_inv)
        plain_pair_products(qs[:rows], kc[:rows], gamma, rule.gated, qk, tiles)
    if pairs:
        plain_pair_products(kc[:rows], kc[:rows], gamma, rule.gated, kk_plain, tiles)


@njit(fastmath=FASTMATH)
def chunk_gating(g, slot, hv, t0, rows, rule, scores, scratch):
    """Value head hv's share of a chunk, after chunk_rows, into `scratch`: gamma, e_in,
    e_out (chunk_gates; 0, 1, 1 when ungated), pair_decay (pair_decays, for a gate a step), kd
    = k exp(Gamma_last - Gamma); with `scores` also a = A and qg = q^ exp(Gamma)."""
    gamma, e_in, e_out, qs, kc, _, _, a, qg, kd, qk, _, pair_decay = scratch
    if rule.gated:
        chunk_gates(g, slot, t0, rows, hv, gamma, e_in, e_out)
        if gamma.shape[1] == 1:
            pair_decays(gamma, rows, pair_decay)
    no_factor = e_in[:0, 0]
    scale_rows(kc[:rows], no_factor, e_out, kd[:rows])
    if scores:
        pair_scores(qs[:rows], kc[:rows], qk, gamma, pair_decay, rule.gated, 0, a)
        scale_rows(qs[:rows], no_factor, e_in, qg[:rows])


@njit(fastmath=FASTMATH)
def advance_state(padded, e_in, rows, rule, kd, u, tiles):
    """S <- exp(Gamma_last) S + kd^T U: the state after the chunk, S the first V columns of
    `padded` (new_states')."""
    state = padded[:, : u.shape[1]]
    decay = np.float32(1.0)
    if rule.gated and e_in.shape[1] == 1:  # one gate a step: the product scales S as it adds
        decay = e_in[rows - 1, 0]
    elif rule.gated:
        for d in range(padded.shape[0]):
            factor = e_in[rows - 1, d]
            for e in range(u.shape[1]):
                padded[d, e] *= factor
    product(kd[:rows], u[:rows], state, 1.0, decay, True, False, tiles)


@njit()
def aligned_float32(shape):
    """An uninitialised float32 array of `shape` (a tuple) starting on a 64-byte line: the
    micro-kernels' vector loads and stores of its rows then never straddle two lines
    (numba's arrays start on 32 bytes)."""
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return aligned_empty(rows, shape[-1], np.empty(0, np.float32)).reshape(shape)


@njit(fastmath=FASTMATH)
def new_scratch(head_dim, gate_dims):
    """chunk_rows' and chunk_gating's scratch arrays, one set per item: gamma, e_in, e_out,
    qs, kc, q_inv, k_inv, a, qg, kd, qk, kk_plain, pair_decay."""
    c, f, rows_of = CHUNK, np.float32, aligned_float32
    return (
        np.zeros((c, gate_dims), np.float64), np.ones((c, gate_dims), f),
        np.ones((c, gate_dims), f), rows_of((c, head_dim)), rows_of((c, head_dim)),
        np.ones(c, f), np.ones(c, f), rows_of((c, c)), rows_of((c, head_dim)),
        rows_of((c, head_dim)), rows_of((c, c)), rows_of((c, c)), rows_of((c, c)),
    )  # fmt: skip


@njit()
def kept_shapes(heads, chunks, head_dim, value_dim, delta):
    """The shapes of what the backward takes of each chunk, (heads, chunks, ...): its start
    state S0 (K, V), and the delta rule's chunk_update results kk (C, C) and u (C, V) (no
    chunks of these for the additive rule, whose u is v; x, a row scaling of k, is
    recomputed)."""
    c = CHUNK
    wy = chunks if delta else 0
    return (heads, chunks, head_dim, value_dim), (heads, wy, c, c), (heads, wy, c, value_dim)


@njit()
def new_kept(heads, chunks, head_dim, value_dim, delta):
    """kept_shapes' arrays (for a thread that recomputes them)."""
    s0, s1, s2 = kept_shapes(heads, chunks, head_dim, value_dim, delta)
    return aligned_float32(s0), aligned_float32(s1), aligned_float32(s2)


@njit(fastmath=FASTMATH)
def new_states(count, head_dim, value_dim):
    """`count` running states (K, V) on lines, each the first V columns of rows STATE_PAD
    floats longer: rows 512 bytes apart (V = 128) put the 64-column panels that the
    products read of a state into half of L1's sets, where they no longer fit (q S0 alone
    at 73% of the FMA peak, 82% padded)."""
    width = value_dim + STATE_PAD
    return aligned_float32((count, head_dim, width))


@njit(fastmath=FASTMATH)
def new_update(head_dim, value_dim):
    """chunk_update's arrays for one chunk: kk, m (C, C), x (C, K), u (C, V)."""
    c, rows_of = CHUNK, aligned_float32
    return rows_of((c, c)), rows_of((c, c)), rows_of((c, head_dim)), rows_of((c, value_dim))
