"""The delta rule's stages, over one chunk of one value head: its WY form (the matrix M, the
triangular solves by blocks, U = (I + M)^-1 Z) and that form's backward. The rules' shared
stages are linear_stages'; linear.py walks the chunks.

    M_ij = beta_i sum_d k_id k_jd exp(Gamma_id - Gamma_jd), j < i,
    X = diag(beta) (k exp(Gamma)), Z = diag(beta) v - X S0, U = (I + M)^-1 Z
"""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.jit import FASTMATH, njit
from attnperf.kernels.numba.linear_stages import (
    add_gate_terms,
    gate_row,
    load_rows,
    pair_scores,
    pair_scores_backward,
    scale_rows,
)
from attnperf.kernels.numba.tiles import product

# Rows of a block of the triangular solves: the rows of earlier blocks reach a block in one
# product, the block's own by substitution (row pairs of V-wide vectors).
SOLVE_ROWS = 16


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
def delta_update(v, beta, slot, hv, t0, rows, rule, state, scratch, kk, m, x, u, tiles):
    """U = (I + M)^-1 Z of value head hv's chunk from the state S0 before it, after
    chunk_rows (with its pairs) and chunk_gating: kk (M without beta), m = M, x = X and u =
    U, all (C, ...), [:rows] meaningful."""
    gamma, e_in, kc, kk_plain, pair_decay = (scratch[0], scratch[1], scratch[4], scratch[11],
                                             scratch[12])  # fmt: skip
    no_factor = e_in[:0, 0]
    b_c = beta[slot, t0 : t0 + rows, hv]
    pair_scores(kc[:rows], kc[:rows], kk_plain, gamma, pair_decay, rule.gated, 1, kk)
    delta_matrix(kk, b_c, rows, m)
    scale_rows(kc[:rows], b_c, e_in, x[:rows])
    load_rows(v, slot, t0, rows, hv, b_c, np.float32(1.0), False, u, no_factor)
    product(x[:rows], state, u[:rows], -1.0, 1.0, False, False, tiles)
    solve_unit_lower(m, rows, u, tiles)


@njit(fastmath=FASTMATH)
def delta_backward(v, beta, slot, hv, t0, rows, rule, s0, ds, kk, u, update, scratch, work, dv,
                   dbeta, tiles):  # fmt: skip
    """The WY form's backward for value head hv's chunk, from dU (work's du) and the chunk's
    kept kk and u: dv and dbeta of its rows written, dS0's term added to ds, dk's and the
    gates' terms added to work's dk_c, own and dg_c (backward_item's buffers; `update`:
    new_update's kk, m, x, u, of which m and x are filled here)."""
    _, m, x, _ = update
    _, du, _, _, _, _, dk_c, dg_c, own, _, dx, dz, dkk, row, decays = work
    gamma, e_in, kc = scratch[0], scratch[1], scratch[4]
    head_dim, value_dim = kc.shape[1], v.shape[3]
    k_c = kc[:rows]
    b_c = beta[slot, t0 : t0 + rows, hv]
    delta_matrix(kk, b_c, rows, m)
    dz[:rows] = du[:rows]
    solve_unit_lower_transposed(m, rows, dz, tiles)
    scale_rows(k_c, b_c, e_in, x[:rows])
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
    pair_scores_backward(dkk, kk, k_c, k_c, gamma, rule.gated, 1, dk_c[:rows], dk_c[:rows], dg_c,
                         tiles)  # fmt: skip
