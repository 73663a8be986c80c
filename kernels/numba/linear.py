"""Linear attention: chunked forward and backward (additive, gated, delta rule) and a fused
per-token step for decoding.

Per value head and chunk of C steps (positions i, j within it), with Gamma_i the cumulative
gate of the chunk up to i (per key dim for vector gates, else one per step), q^ = scale q:

    A_ij = sum_d q^_id k_jd exp(Gamma_id - Gamma_jd), j <= i    (the chunk's own attention)
    delta rule: M_ij = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd), j < i, T = (I + M)^-1,
        X = diag(beta) (k exp(Gamma)), U = T (diag(beta) v - X S0)    (the WY form);
        additive rule: U = v
    O = (q^ exp(Gamma)) S0 + A U
    S1 = exp(Gamma_last) S0 + (k exp(Gamma_last - Gamma))^T U

S0 and S1 are the state before and after the chunk. Every exponential is of a non-positive
difference (gates <= 0), so strong decay underflows to 0 and never overflows. The products
run on `product`'s tiles (our micro-kernels where AVX2 or AVX-512 serves, else BLAS), those
with a triangular side on its lower blocks only; the WY form's (I + M)^-1 is applied by
blocked substitution, never formed. An item is a sequence's value heads of one key head
(the forward's: fewer where the items would not fill the threads), chunk by chunk: they
share the key head's rows and plain products, and in the backward sum their dq and dk
first. The backward takes each chunk's S0 and WY results as the forward kept them, or
recomputes them in a first pass over the chunks, and walks the chunks in reverse
(reverse-mode of the lines above).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from attnperf.kernels.numba.fastmath import LOG2E, exp2
from attnperf.kernels.numba.jit import (
    FASTMATH,
    aligned_empty,
    njit,
    prange,
    prefetch_line,
    run_bounds,
    serial,
    wide_vectors,
)
from attnperf.kernels.numba.launch import (
    as_numpy,
    float32_array,
    recycled_float32,
    run_parallel,
)
from attnperf.kernels.numba.tiles import product, tiles_flag
from attnperf.linear_inputs import L2NORM_EPS, LinearAttentionInputs

# Steps per chunk: the intra-chunk work (C^2 (K + V) per chunk) against the state's (C K V).
# A forward that keeps nothing for a backward takes chunks of FORWARD_CHUNK steps: fewer
# FLOPs in the triangles, and its per-chunk costs paid no more often than the state's
# products amortise them (gated delta forward, T = 4096, in one process: 0.93-0.94x the
# time of 64-step chunks on AVX-512, on BLAS tiles too, 0.95x on AVX2 code; additive and
# scalar-gate rules 0.97-0.99x; chunks of 16 steps as fast as 32). A forward that keeps
# its chunks takes 64: the backward over 32-step chunks took 1.04x the time (twice the
# start states kept and read).
CHUNK = 64
FORWARD_CHUNK = 32
# The forward keeps each chunk's start state (and the delta rule's WY results) for the
# backward when they take at most this many bytes per call (T x HV x 1.75 KiB at K = V =
# 128 with the delta rule: 112 MiB at T = 2048, HV = 32); beyond, the backward recomputes them:
# a forward pass of products, ~23% of the backward's time (T = 2048, the AMD EPYC). Every
# layer of a model being trained holds its call's until the backward: 0 always recomputes,
# as fla does.
KEPT_MAX_BYTES = 512 << 20
# Sequences up to this many steps run the per-token kernel when no gradient is needed:
# decoding and speculative steps (the chunked form's fixed costs dominate short sequences).
RECURRENT_MAX_STEPS = 16
# Rows of a block of the delta rule's triangular solves: the rows of earlier blocks reach a
# block in one product, the block's own by substitution (row pairs of V-wide vectors).
SOLVE_ROWS = 16
# Rows of a block of the products with a triangular side: a block of rows i0 .. i0 + 15
# reads (or writes) columns up to i0 + 15 only, 10/16 of the whole square's work at C = 64
# (the micro-kernels hold 16 columns a vector).
TRIANGLE_ROWS = 16
# Below this many bytes of state, the per-token kernel runs on the calling thread: a gated
# delta step of Qwen3-Next's heads took 0.24-0.25 / 0.37-0.39 / 0.64-0.74 ms there at B = 1
# / 2 / 4 (2 to 8 MiB) against 0.19-0.20 / 0.26 / 0.39-0.43 ms on two threads
# (benches/linear_decode_threads.py, two processes, the AMD EPYC Zen 4).
PARALLEL_MIN_BYTES = 2 << 20
# The chunked forward's items take as many value heads of one key head as leave at least
# this many items a thread. Value heads in one item share their key head's loads and plain
# products: Qwen3-Next's heads (two value heads a key head), T = 4096, gated delta rule:
# 81 ms against 95-100 ms for an item a value head (Intel Xeon, 2 threads).
ITEMS_PER_THREAD = 2
# load_rows asks for the row this many ahead: rows of a (B, T, H, K) tensor lie H K floats
# apart, a stride no prefetcher follows (gated delta forward, T = 4096: 2% faster at 2
# rows ahead than at none, 1.5% than at 8; Intel Xeon).
PREFETCH_ROWS = 2
# Floats a running state's rows run past V (new_states).
STATE_PAD = 16


# ---------------------------------------------------------------------------- helpers
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
def delta_matrix(kk, b_c, rows, m):
    """m[i, j] <- b_c[i] kk[i, j] below the diagonal (j < i < rows): the WY form's M (only
    its entries below the diagonal are ever read)."""
    for i in range(rows):
        for j in range(i):
            m[i, j] = b_c[i] * kk[i, j]


@njit(fastmath=FASTMATH)
def solve_unit_lower(m, rows, x, tiles):
    """x[:rows] <- (I + m)^-1 x[:rows] for m strictly lower triangular (only its entries
    below the diagonal are read): forward substitution by blocks of SOLVE_ROWS rows, each
    block first taking the earlier rows' share in one product. Cheaper than forming the
    inverse (whose row-by-row substitution ran on short, mostly scalar loops) and then
    multiplying by it."""
    for i0 in range(0, rows, SOLVE_ROWS):
        i1 = min(i0 + SOLVE_ROWS, rows)
        if i0 > 0:
            product(m[i0:i1, :i0], x[:i0], x[i0:i1], -1.0, 1.0, False, False, tiles)
        for i in range(i0 + 1, i1):
            for j in range(i0, i):
                coefficient = m[i, j]
                for e in range(x.shape[1]):
                    x[i, e] -= coefficient * x[j, e]


@njit(fastmath=FASTMATH)
def solve_unit_lower_transposed(m, rows, x, tiles):
    """x[:rows] <- (I + m)^-T x[:rows] for m strictly lower triangular: back substitution
    by blocks of SOLVE_ROWS rows from the last (solve_unit_lower's transpose)."""
    for i0 in range((rows - 1) // SOLVE_ROWS * SOLVE_ROWS, -1, -SOLVE_ROWS):
        i1 = min(i0 + SOLVE_ROWS, rows)
        if i1 < rows:
            product(m[i1:rows, i0:i1], x[i1:rows], x[i0:i1], -1.0, 1.0, True, False, tiles)
        for i in range(i1 - 2, i0 - 1, -1):
            for j in range(i + 1, i1):
                coefficient = m[j, i]
                for e in range(x.shape[1]):
                    x[i, e] -= coefficient * x[j, e]


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
def chunk_rows(q, k, scale, l2norm, slot, hk, t0, rows, gated, scores, delta, scratch, tiles):
    """What the value heads of key head hk share of chunk t0 .. t0 + rows - 1, into `scratch`
    (new_scratch's arrays, (C, ...); only [:rows] is meaningful): kc = k
    (normalised when asked), k_inv its rows' inverse norms; with `scores` also qs = q^
    (scaled; normalised when asked), q_inv, and qk = plain_pair_products(qs, kc); with
    `delta` kk_plain = plain_pair_products(kc, kc)."""
    gamma, e_in, _, qs, kc, q_inv, k_inv, _, _, _, qk, kk_plain, _ = scratch
    no_factor = e_in[:0, 0]
    load_rows(k, slot, t0, rows, hk, no_factor, np.float32(1.0), l2norm, kc, k_inv)
    if scores:
        load_rows(q, slot, t0, rows, hk, no_factor, scale, l2norm, qs, q_inv)
        plain_pair_products(qs[:rows], kc[:rows], gamma, gated, qk, tiles)
    if delta:
        plain_pair_products(kc[:rows], kc[:rows], gamma, gated, kk_plain, tiles)


@njit(fastmath=FASTMATH)
def chunk_gating(g, slot, hv, t0, rows, gated, scores, scratch):
    """Value head hv's share of a chunk, after chunk_rows, into `scratch`: gamma, e_in,
    e_out (chunk_gates; 0, 1, 1 when ungated), pair_decay (pair_decays, for a gate a step), kd
    = k exp(Gamma_last - Gamma); with `scores` also a = A and qg = q^ exp(Gamma)."""
    gamma, e_in, e_out, qs, kc, _, _, a, qg, kd, qk, _, pair_decay = scratch
    if gated:
        chunk_gates(g, slot, t0, rows, hv, gamma, e_in, e_out)
        if gamma.shape[1] == 1:
            pair_decays(gamma, rows, pair_decay)
    no_factor = e_in[:0, 0]
    scale_rows(kc[:rows], no_factor, e_out, kd[:rows])
    if scores:
        pair_scores(qs[:rows], kc[:rows], qk, gamma, pair_decay, gated, 0, a)
        scale_rows(qs[:rows], no_factor, e_in, qg[:rows])


@njit(fastmath=FASTMATH)
def chunk_update(v, beta, slot, hv, t0, rows, gated, delta, state, scratch, kk, m, x, u, tiles):
    """U, what the chunk writes into the state, from the state S0 before it: v (the additive
    rule), or the WY form U = (I + M)^-1 Z (delta rule), with kk (M without beta), m = M,
    x = beta k exp(Gamma) and Z = beta v - x S0; all (C, ...), [:rows] meaningful."""
    gamma, e_in, kc, kk_plain, pair_decay = (scratch[0], scratch[1], scratch[4], scratch[11],
                                             scratch[12])  # fmt: skip
    no_factor = e_in[:0, 0]
    if not delta:
        load_rows(v, slot, t0, rows, hv, no_factor, np.float32(1.0), False, u, no_factor)
        return
    b_c = beta[slot, t0 : t0 + rows, hv]
    pair_scores(kc[:rows], kc[:rows], kk_plain, gamma, pair_decay, gated, 1, kk)
    delta_matrix(kk, b_c, rows, m)
    scale_rows(kc[:rows], b_c, e_in, x[:rows])
    load_rows(v, slot, t0, rows, hv, b_c, np.float32(1.0), False, u, no_factor)
    product(x[:rows], state, u[:rows], -1.0, 1.0, False, False, tiles)
    solve_unit_lower(m, rows, u, tiles)


@njit(fastmath=FASTMATH)
def advance_state(padded, e_in, rows, gated, kd, u, tiles):
    """S <- exp(Gamma_last) S + kd^T U: the state after the chunk, S the first V columns of
    `padded` (new_states')."""
    state = padded[:, : u.shape[1]]
    decay = np.float32(1.0)
    if gated and e_in.shape[1] == 1:  # one gate a step: the product scales S as it adds
        decay = e_in[rows - 1, 0]
    elif gated:
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


# ---------------------------------------------------------------------------- kernels
@njit(parallel=True, fastmath=FASTMATH)
def linear_forward_chunked(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta, out,
                           final, kept, firsts, per_item, chunk_steps, tiles):  # fmt: skip
    """out (B, T, HV, V) and final (N, HV, K, V) by chunks of chunk_steps <= CHUNK steps; h0
    (N, HV, K, V) or empty. With `kept` (kept_shapes' arrays over every sequence's chunks,
    sequence n's from firsts[n], chunk_steps = CHUNK; no chunks: nothing kept), what the
    backward takes of each chunk. An item is a sequence's `per_item` value heads of one key
    head (a divisor of the group), chunk by chunk: they share each chunk's rows of q and k
    and their plain products (chunk_rows)."""
    heads, value_dim = v.shape[2], v.shape[3]
    group = heads // k.shape[2]
    head_dim = k.shape[3]
    runs = heads // per_item
    for item in prange(sequences.shape[0] * runs):
        n, first_head = np.int64(item) // runs, np.int64(item) % runs * per_item
        slot, start, length = sequences[n, 0], sequences[n, 1], sequences[n, 2]
        states = new_states(per_item, head_dim, value_dim)
        for hv in range(first_head, first_head + per_item):
            if h0.shape[0] > 0:
                states[hv - first_head, :, :value_dim] = h0[n, hv]
            else:
                states[hv - first_head, :, :value_dim] = 0.0
        scratch = new_scratch(head_dim, g.shape[3])
        _, e_in, _, _, _, _, _, a, qg, kd, _, _, _ = scratch
        kk, m, x, u = new_update(head_dim, value_dim)
        starts, kks, us = kept
        for c, t0 in enumerate(range(start, start + length, chunk_steps)):
            rows = min(chunk_steps, start + length - t0)
            chunk = firsts[n] + c
            chunk_rows(q, k, scale, l2norm, slot, first_head // group, t0, rows, gated, True,
                       delta, scratch, tiles)  # fmt: skip
            for hv in range(first_head, first_head + per_item):
                padded = states[hv - first_head]
                state = padded[:, :value_dim]
                if starts.shape[1] > 0:
                    starts[hv, chunk] = state
                if kks.shape[1] > 0:
                    kk, u = kks[hv, chunk], us[hv, chunk]
                chunk_gating(g, slot, hv, t0, rows, gated, True, scratch)
                chunk_update(v, beta, slot, hv, t0, rows, gated, delta, state, scratch, kk, m,
                             x, u, tiles)  # fmt: skip
                o = out[slot, t0 : t0 + rows, hv]
                product(qg[:rows], state, o, 1.0, 0.0, False, False, tiles)
                lower_times(a[:rows, :rows], u[:rows], o, 1.0, 1.0, tiles)
                advance_state(padded, e_in, rows, gated, kd, u, tiles)
        for hv in range(first_head, first_head + per_item):
            final[n, hv] = states[hv - first_head, :, :value_dim]


@njit(parallel=True, fastmath=FASTMATH)
def linear_backward_chunked(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta,
                            grad_out, grad_final, kept, firsts, dq, dk, dv, dg, dbeta, dh0,
                            threads, tiles):  # fmt: skip
    """Gradients by chunks in reverse: dq, dk (B, T, H, K), dv, dg (B, T, HV, gate dims),
    dbeta (B, T, HV), dh0 (N, HV, K, V); grad_final empty when none; `kept` and firsts as
    the forward wrote them, or kept without chunks: recomputed here.

    An item is a (sequence, key head) with its value heads (backward_item). Each thread
    takes every `workers`-th item, with buffers of its own for the longest sequence."""
    heads, value_dim = v.shape[2], v.shape[3]
    key_heads, head_dim, gate_dims = k.shape[2], k.shape[3], g.shape[3]
    group = heads // key_heads
    items = sequences.shape[0] * key_heads
    workers = min(threads, items)
    longest = 0
    for n in range(sequences.shape[0]):
        longest = max(longest, sequences[n, 2])
    most = (longest + CHUNK - 1) // CHUNK
    grads = (dq, dk, dv, dg, dbeta, dh0)
    recompute = kept[0].shape[1] == 0
    for worker in prange(workers):
        buffers = backward_buffers(group, most if recompute else 0, head_dim, value_dim,
                                   gate_dims, delta)  # fmt: skip
        for item in range(worker, items, workers):
            n, hk = np.int64(item) // key_heads, np.int64(item) % key_heads
            backward_item(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta,
                          grad_out, grad_final, kept, firsts[n], grads, n, hk, buffers,
                          tiles)  # fmt: skip


@njit(fastmath=FASTMATH)
def backward_buffers(group, chunks, head_dim, value_dim, gate_dims, delta):
    """One thread's arrays for backward_item: what it keeps of each chunk when it recomputes
    them (new_kept, `group` heads of `chunks`), the group's running states, new_scratch's
    arrays, chunk_update's arrays, and the second pass's gradients of one chunk (and the
    group's dS)."""
    c, f, rows_of = CHUNK, np.float32, aligned_float32
    work = (
        new_states(group, head_dim, value_dim), rows_of((c, value_dim)), rows_of((c, c)),
        rows_of((c, head_dim)), rows_of((c, head_dim)), rows_of((c, head_dim)),
        rows_of((c, head_dim)), np.empty((c, gate_dims), f), np.empty((c, gate_dims), f),
        np.empty((c, gate_dims), f), rows_of((c, head_dim)), rows_of((c, value_dim)),
        rows_of((c, c)), np.empty(head_dim, f), np.empty(head_dim, f),
    )  # fmt: skip
    return (
        new_kept(group, chunks, head_dim, value_dim, delta),
        new_states(group, head_dim, value_dim), new_scratch(head_dim, gate_dims),
        new_update(head_dim, value_dim), work,
    )  # fmt: skip


@njit(fastmath=FASTMATH)
def backward_item(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta, grad_out,
                  grad_final, kept, first, grads, n, hk, buffers, tiles):  # fmt: skip
    """Sequence n, key head hk of linear_backward_chunked with its value heads, in its
    thread's buffers: each value head's chunk start states (and WY results) from `kept`
    (its chunks from `first`), or when it has none, from a first pass over the chunks; then
    the chunks in reverse, each value head's dS carried from the last to the first. The
    value heads share each chunk's rows of q and k and their plain products, and their dq
    and dk add up before they reach the raw q and k."""
    dq, dk, dv, dg, dbeta, dh0 = grads
    own_kept, states, scratch, update, work = buffers
    kk, m, x, u = update
    dss, du, da, dqg, dkd, dqs, dk_c, dg_c, own, to_last, dx, dz, dkk, row, decays = work
    heads, value_dim = v.shape[2], v.shape[3]
    head_dim, gate_dims = k.shape[3], g.shape[3]
    group = heads // k.shape[2]
    first_head = hk * group
    slot, start, length = sequences[n, 0], sequences[n, 1], sequences[n, 2]
    chunks = (length + CHUNK - 1) // CHUNK
    gamma, e_in, e_out, qs, kc, q_inv, k_inv, a, qg, kd, _, _, _ = scratch
    recompute = kept[0].shape[1] == 0  # the forward kept nothing: into own_kept, here
    kept_head = first_head  # the group's first head in kept's arrays
    if recompute:
        kept, first, kept_head = own_kept, 0, 0
    starts, kks, us = kept
    if recompute:
        for member in range(group):
            if h0.shape[0] > 0:
                states[member, :, :value_dim] = h0[n, first_head + member]
            else:
                states[member, :, :value_dim] = 0.0
        for c in range(chunks):
            t0 = start + c * CHUNK
            rows = min(CHUNK, start + length - t0)
            chunk_rows(q, k, scale, l2norm, slot, hk, t0, rows, gated, False, delta, scratch,
                       tiles)  # fmt: skip
            for member in range(group):
                hv, padded = first_head + member, states[member]
                state = padded[:, :value_dim]
                starts[member, c] = state
                if delta:
                    kk, u = kks[member, c], us[member, c]
                chunk_gating(g, slot, hv, t0, rows, gated, False, scratch)
                chunk_update(v, beta, slot, hv, t0, rows, gated, delta, state, scratch, kk, m, x,
                             u, tiles)  # fmt: skip
                advance_state(padded, e_in, rows, gated, kd, u, tiles)
    for member in range(group):
        if grad_final.shape[0] > 0:
            dss[member, :, :value_dim] = grad_final[n, first_head + member]
        else:
            dss[member, :, :value_dim] = 0.0
    for c in range(chunks - 1, -1, -1):
        t0 = start + c * CHUNK
        rows = min(CHUNK, start + length - t0)
        chunk_rows(q, k, scale, l2norm, slot, hk, t0, rows, gated, True, False, scratch, tiles)
        dqs[:rows] = 0.0
        dk_c[:rows] = 0.0
        for member in range(group):
            hv, at, chunk = first_head + member, kept_head + member, first + c
            s0, ds_padded = starts[at, chunk], dss[member]
            ds = ds_padded[:, :value_dim]
            chunk_gating(g, slot, hv, t0, rows, gated, True, scratch)
            if delta:
                kk, u = kks[at, chunk], us[at, chunk]
            else:
                chunk_update(v, beta, slot, hv, t0, rows, gated, delta, s0, scratch, kk, m, x,
                             u, tiles)  # fmt: skip
            k_c = kc[:rows]
            do = grad_out[slot, t0 : t0 + rows, hv]
            dg_c[:rows] = 0.0
            own[:rows] = 0.0
            to_last[:rows] = 0.0
            # O = qg S0 + A U and S1 = exp(Gamma_last) S0 + kd^T U:
            product(a[:rows, :rows], do, du[:rows], 1.0, 0.0, True, False, tiles)
            product(kd[:rows], ds, du[:rows], 1.0, 1.0, False, False, tiles)
            product(do, u[:rows], da[:rows, :rows], 1.0, 0.0, False, True, tiles)
            product(do, s0, dqg[:rows], 1.0, 0.0, False, True, tiles)
            product(u[:rows], ds, dkd[:rows], 1.0, 0.0, False, True, tiles)
            if gated:  # S1's exp(Gamma_last) S0 term, before ds becomes dS0
                for d in range(head_dim):
                    gd = d if gate_dims > 1 else 0
                    factor = e_in[rows - 1, gd]
                    total = np.float32(0.0)
                    for e in range(value_dim):
                        total += ds_padded[d, e] * s0[d, e]
                    own[rows - 1, gd] += total * factor
                    for e in range(value_dim):
                        ds_padded[d, e] *= factor
            product(qg[:rows], do, ds, 1.0, 1.0, True, False, tiles)
            if delta:  # U = (I + M)^-1 Z, Z = diag(beta) v - X S0, M = diag(beta) kk
                b_c = beta[slot, t0 : t0 + rows, hv]
                delta_matrix(kk, b_c, rows, m)
                dz[:rows] = du[:rows]
                solve_unit_lower_transposed(m, rows, dz, tiles)
                scale_rows(kc[:rows], b_c, e_in, x[:rows])
                product(dz[:rows], s0, dx[:rows], -1.0, 0.0, False, True, tiles)
                product(x[:rows], dz[:rows], ds, -1.0, 1.0, True, False, tiles)
                # dM = -T^T (dU Z^T) T^T = -dZ U^T; its entries below the diagonal are read
                product(dz[:rows], u[:rows], dkk[:rows, :rows], -1.0, 0.0, False, True, tiles)
                for i in range(rows):  # x = beta kg, kg = k exp(Gamma); z = beta v - x S0
                    b = b_c[i]
                    gate_row(e_in, i, decays)
                    total = np.float32(0.0)
                    for d in range(head_dim):
                        kg = k_c[i, d] * decays[d]
                        total += dx[i, d] * kg
                        dk_c[i, d] += dx[i, d] * b * decays[d]
                        row[d] = dx[i, d] * b * kg
                    add_gate_terms(row, own, i)
                    for e in range(value_dim):
                        total += dz[i, e] * v[slot, t0 + i, hv, e]
                        dv[slot, t0 + i, hv, e] = dz[i, e] * b
                    for j in range(i):
                        total += dkk[i, j] * kk[i, j]
                        dkk[i, j] *= b
                    dbeta[slot, t0 + i, hv] = total
                pair_scores_backward(dkk, kk, k_c, k_c, gamma, gated, 1, dk_c[:rows],
                                     dk_c[:rows], dg_c, tiles)  # fmt: skip
            else:
                dv[slot, t0 : t0 + rows, hv] = du[:rows]
            pair_scores_backward(da, a, qs[:rows], k_c, gamma, gated, 0, dqs[:rows], dk_c[:rows],
                                 dg_c, tiles)  # fmt: skip
            for i in range(rows):  # qg = q^ exp(Gamma), kd = k exp(Gamma_last - Gamma)
                gate_row(e_in, i, decays)
                for d in range(head_dim):
                    dqs[i, d] += dqg[i, d] * decays[d]
                    row[d] = dqg[i, d] * qg[i, d]
                add_gate_terms(row, own, i)
                gate_row(e_out, i, decays)
                for d in range(head_dim):
                    dk_c[i, d] += dkd[i, d] * decays[d]
                    row[d] = dkd[i, d] * kd[i, d]
                add_gate_terms(row, to_last, i)
            if gated:  # Gamma_i = sum_{s <= i} g_s
                for d in range(gate_dims):
                    total = np.float32(0.0)  # own terms of i >= s
                    for i in range(rows - 1, -1, -1):
                        total += own[i, d]
                        dg_c[i, d] += total
                    total = np.float32(0.0)  # pairs (i, last) with i < s
                    for i in range(1, rows):
                        total += to_last[i - 1, d]
                        dg_c[i, d] += total
                dg[slot, t0 : t0 + rows, hv] = dg_c[:rows]
        for i in range(rows):  # to the raw q and k (through their l2norm, when asked)
            to_raw(dqs[i], qs[i], scale, q_inv[i], l2norm, dq[slot, t0 + i, hk])
            to_raw(dk_c[i], kc[i], np.float32(1.0), k_inv[i], l2norm, dk[slot, t0 + i, hk])
    for member in range(group):
        dh0[n, first_head + member] = dss[member, :, :value_dim]


@njit(fastmath=FASTMATH)
def recurrent_scratch(head_dim, value_dim):
    """recurrent_item's scratch: q^ and k rows, their norms, the step's decays, S^T k, S^T q^
    and the update."""
    f = np.float32
    return (np.empty((2, head_dim), f), np.empty(2, f), np.ones(head_dim, f),
            np.empty(value_dim, f), np.empty(value_dim, f), np.empty(value_dim, f))  # fmt: skip


@njit(fastmath=FASTMATH)
def recurrent_item(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta, out, final,
                   n, hv, scratch):  # fmt: skip
    """The recurrence token by token for sequence n, value head hv, fused: its state is
    read, updated in `final` and written once; for decoding and short sequences."""
    value_dim, head_dim = v.shape[3], k.shape[3]
    hk = hv // (v.shape[2] // k.shape[2])
    slot, start, length = sequences[n, 0], sequences[n, 1], sequences[n, 2]
    state = final[n, hv]
    source = state  # the state before the step: h0's row at first, read in place
    if h0.shape[0] > 0:
        source = h0[n, hv]
    else:
        state[:] = 0.0
    if length == 0:
        state[:] = source
    rows, no_norms, step_decay, read_k, read_q, update = scratch
    no_factor = no_norms[:0]
    for t in range(start, start + length):
        load_rows(q, slot, t, 1, hk, no_factor, scale, l2norm, rows[0:1], no_norms)
        load_rows(k, slot, t, 1, hk, no_factor, np.float32(1.0), l2norm, rows[1:2], no_norms)
        q_t, k_t, v_t = rows[0], rows[1], v[slot, t, hv]
        if gated:
            for d in range(head_dim):
                step_decay[d] = np.exp(g[slot, t, hv, d if g.shape[3] > 1 else 0])
        # S' = diag(step_decay) S: S'^T k = S^T (step_decay k), S'^T q^ likewise.
        read_k[:] = 0.0
        read_q[:] = 0.0
        overlap = np.float32(0.0)
        for d in range(head_dim):
            overlap += k_t[d] * q_t[d]
            kd, qd = k_t[d] * step_decay[d], q_t[d] * step_decay[d]
            row = source[d]
            for e in range(value_dim):
                read_k[e] += row[e] * kd
                read_q[e] += row[e] * qd
        b = beta[slot, t, hv] if delta else np.float32(1.0)
        for e in range(value_dim):
            update[e] = b * (v_t[e] - read_k[e]) if delta else v_t[e]
            out[slot, t, hv, e] = read_q[e] + update[e] * overlap
        for d in range(head_dim):
            row, old, kd, dd = state[d], source[d], k_t[d], step_decay[d]
            for e in range(value_dim):
                row[e] = dd * old[e] + kd * update[e]
        source = state


@njit(parallel=True, fastmath=FASTMATH)
def linear_forward_recurrent(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta, out,
                             final, threads):  # fmt: skip
    """recurrent_item of every (sequence, value head), in parallel: a run of items a thread,
    its scratch made once (made per item, six arrays an item, the kernel of a B = 8 step,
    256 items, took 0.99 ms, against 0.64: AMD EPYC Zen 4, 2 threads)."""
    heads = v.shape[2]
    items = sequences.shape[0] * heads
    workers = min(threads, items)
    for worker in prange(workers):
        scratch = recurrent_scratch(k.shape[3], v.shape[3])
        first, last = run_bounds(worker, workers, items)
        for item in range(first, last):
            recurrent_item(q, k, v, g, beta, h0, sequences, scale, l2norm, gated, delta, out,
                           final, item // heads, item % heads, scratch)  # fmt: skip


# ---------------------------------------------------------------------------- launchers
def contiguous_fp32(tensor: Tensor | None, empty_shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous fp32 array of `tensor` (a view when it is one already), or an empty
    array of `empty_shape` for None."""
    if tensor is None:
        return np.zeros(empty_shape, np.float32)
    return as_numpy(tensor.detach().to(torch.float32).contiguous())


def _arrays(inputs: LinearAttentionInputs) -> tuple:
    """(q, k, v, g (B, T, HV, gate dims), beta, h0, sequences) for the kernels."""
    q, k, v = (contiguous_fp32(t, ()) for t in (inputs.query, inputs.key, inputs.value))
    g = inputs.g
    if g is not None and g.dim() == 3:
        g = g[..., None]
    return (
        q, k, v, contiguous_fp32(g, (0, 0, 0, 1)), contiguous_fp32(inputs.beta, (0, 0, 0)),
        contiguous_fp32(inputs.initial_state, (0, 0, 0, 0)), inputs.sequences.numpy(),
    )  # fmt: skip


def chunk_firsts(inputs: LinearAttentionInputs) -> tuple[np.ndarray, int]:
    """(each sequence's first chunk in kept_shapes' arrays (N,) int64, the chunks of all)."""
    lengths = inputs.sequences.numpy()[:, 2].astype(np.int64)
    chunks = (lengths + CHUNK - 1) // CHUNK
    return np.concatenate(([0], np.cumsum(chunks)[:-1])).astype(np.int64), int(chunks.sum())


def value_heads_per_item(inputs: LinearAttentionInputs, threads: int) -> int:
    """The most value heads of one key head (a divisor of the group) that an item of the
    chunked forward can take while leaving ITEMS_PER_THREAD items to each thread; 1 at
    least."""
    group = inputs.value_heads // inputs.key_heads
    for per_item in range(group, 1, -1):
        items = inputs.count * inputs.value_heads // per_item
        if group % per_item == 0 and items >= ITEMS_PER_THREAD * threads:
            return per_item
    return 1


def _kept_shapes(inputs: LinearAttentionInputs, chunks: int) -> tuple:
    """kept_shapes of the call's value heads for `chunks` chunks."""
    return kept_shapes(inputs.value_heads, chunks, inputs.head_dim, inputs.value_dim,
                       inputs.beta is not None)  # fmt: skip


def _kept(inputs: LinearAttentionInputs, chunks: int) -> tuple[tuple[Tensor, ...], tuple]:
    """kept_shapes' arrays for `chunks` chunks (none: nothing kept), as tensors and arrays,
    on the memory of an earlier call's once its backward freed them (`recycled_float32`).

    Mapped afresh each call, they fault in again where idle memory goes back to the host:
    on the 2-core AMD EPYC's VM (Firecracker), after 5 s idle, a gated delta forward+backward
    at T = 2048 (112 MiB kept) took 295-407 ms against 206-264 recycled (~205 back to back
    either way; one process each, alternating).
    """
    pairs = [recycled_float32(shape) for shape in _kept_shapes(inputs, chunks)]
    return tuple(tensor for tensor, _ in pairs), tuple(array for _, array in pairs)


def numba_linear_forward(
    inputs: LinearAttentionInputs, backward: bool
) -> tuple[Tensor, Tensor, tuple]:
    """(out (B, T, HV, V) in the call's dtype, final state (N, HV, K, V) float32, what the
    backward takes: each chunk's start state and WY results, when a `backward` follows and
    they fit in KEPT_MAX_BYTES, else ()): the per-token kernel for short sequences without
    a backward, else the chunked one."""
    runs = math.prod(inputs.state_shape) > 0  # else nothing to compute: zeros
    # The kernels write every row of the output and the state (the sequences cover T).
    longest = int(inputs.sequences.numpy()[:, 2].max()) if inputs.count else 0
    recurrent = longest <= RECURRENT_MAX_STEPS and not backward
    out, out_array = float32_array(inputs.value.shape, zero=not runs)
    # A decoding step's new state, on the memory of a replaced one (see recycled_float32).
    new_state = recycled_float32 if recurrent else float32_array
    final, final_array = new_state(inputs.state_shape, zero=not runs)
    args = (*_arrays(inputs), np.float32(inputs.scale), inputs.l2norm, inputs.g is not None,
            inputs.beta is not None, out_array, final_array)  # fmt: skip
    if recurrent:
        if runs and math.prod(inputs.state_shape) * 4 >= PARALLEL_MIN_BYTES:
            run_parallel(linear_forward_recurrent, *args, torch.get_num_threads())
        elif runs:
            serial(linear_forward_recurrent)(*args, 1)
        return out.to(inputs.dtype), final, ()
    firsts, chunks = chunk_firsts(inputs)
    kept_bytes = 4 * sum(math.prod(shape) for shape in _kept_shapes(inputs, chunks))
    keep = runs and backward and kept_bytes <= KEPT_MAX_BYTES
    kept, kept_arrays = _kept(inputs, chunks if keep else 0)
    if runs:
        per_item = value_heads_per_item(inputs, torch.get_num_threads())
        steps = CHUNK if keep else FORWARD_CHUNK
        run_parallel(linear_forward_chunked, *args, kept_arrays, firsts, per_item, steps,
                     tiles_flag())  # fmt: skip
    return out.to(inputs.dtype), final, kept if keep else ()


def numba_linear_backward(
    inputs: LinearAttentionInputs, kept: tuple, grad_out: Tensor | None, grad_state: Tensor | None
) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dg, dbeta, dinitial_state), each in its input's dtype, None where the
    call has no such input; `kept` as the forward returned it (() to recompute it)."""
    batch, steps, heads = inputs.value.shape[:3]
    head_dim, gate_dims = inputs.head_dim, 1 if inputs.gate != "vector" else inputs.head_dim
    arrays = _arrays(inputs)
    if grad_out is None:
        grad_out = torch.zeros(inputs.value.shape)
    do = contiguous_fp32(grad_out, ())
    d_final = contiguous_fp32(grad_state, (0, 0, 0, 0))
    firsts, _ = chunk_firsts(inputs)
    kept_arrays = tuple(as_numpy(t) for t in kept) if kept else _kept(inputs, 0)[1]
    per_key_head = (batch, steps, inputs.key_heads, head_dim)
    runs = inputs.count > 0 and heads > 0  # the kernel then writes every row of every buffer
    buffers = [
        float32_array(shape, zero=not runs)
        for shape in (per_key_head, per_key_head, inputs.value.shape,
                      (batch, steps, heads, gate_dims), (batch, steps, heads), inputs.state_shape)
    ]  # fmt: skip
    if runs:
        run_parallel(linear_backward_chunked, *arrays, np.float32(inputs.scale), inputs.l2norm,
                     inputs.g is not None, inputs.beta is not None, do, d_final, kept_arrays,
                     firsts, *(array for _, array in buffers),
                     torch.get_num_threads(), tiles_flag())  # fmt: skip
    return inputs.as_gradients(*(tensor for tensor, _ in buffers))
