"""Linear attention on GPU, forward and backward: by chunks (fla's "chunk" form) for scalar
or no gates, token by token (its "fused recurrent" form) for per-key-dim gates and for short
calls without a backward.

Chunked: for the delta rule, every chunk's WY system (its inverse T and the state-free
parts W, U0 of its update) is solved first, all chunks at once (linear_chunk_system_kernel);
then one program per (block of value columns, sequence x value head) keeps its (K, BV) slice
of the state in registers and walks the chunks, each chunk's intra-chunk attention and
update by products on tiles (linear_chunk_kernel); the backward walks them in reverse from
the start states the forward stored, recomputing each chunk (linear_chunk_backward_kernel).
Token by token: the same programs walk the steps: S = diag(exp(g_t)) S; additive S += k v^T,
or delta u = beta (v - S^T k), S += k u^T; o = S^T (scale q); the forward stores the state
every CHUNK steps, and the backward replays each such chunk from it (keeping its states in a
scratch buffer) and walks it in reverse. Value columns are independent in every step, so the
state's slices never meet; gradients that sum over value columns (q, k, beta, g) are written
per column block and summed by the launcher. q and k are l2-normalised by the launcher, in
float32, when the call asks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnperf.kernels.triton.jit import jit, next_power_of_2, on_device, tl, triton
from attnperf.linear_inputs import L2NORM_EPS, LinearAttentionInputs, l2norm

CHUNK = 64  # token by token: steps between stored states (the backward replays a chunk at a time)
# Up to this many steps (decoding, speculative steps), the forward goes token by token.
RECURRENT_MAX_STEPS = 16
# The forward keeps its chunks' start states for the backward when they take at most this
# many bytes; beyond, the backward runs the forward again for them (fla always does).
KEPT_MAX_BYTES = 512 << 20


@jit
def gated_step(S, k, v, G, Beta, step, head_dim, offs_k, mask_k, HAS_GATE: tl.constexpr,
               VECTOR_GATE: tl.constexpr, DELTA: tl.constexpr):  # fmt: skip
    """One step of the recurrence on a state slice: (S'_t = diag(exp(g)) S, u, S_t); `step`
    is the (row, value head) index of the step's gate and beta."""
    if HAS_GATE:
        if VECTOR_GATE:
            g = tl.load(G + step * head_dim + offs_k, mask=mask_k, other=0.0)
            S = S * tl.exp(g)[:, None]
        else:
            S = S * tl.exp(tl.load(G + step))
    if DELTA:
        b = tl.load(Beta + step)
        u = b * (v - tl.sum(S * k[:, None], 0))
    else:
        u = v
    return S, u, S + k[:, None] * u[None, :]


@jit
def state_slice(pid_v, pid, Sequences, heads, key_heads, head_dim, value_dim,
                BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """What program (pid_v, pid) works on: sequence n, value head hv and its key head hk;
    the sequence's (slot, start, length); the key and value offsets and masks of its (K, BV)
    state slice, and the slice's offsets and mask in a (K, V) state."""
    n, hv = pid // heads, pid % heads
    hk = hv // (heads // key_heads)
    slot, start, length = (tl.load(Sequences + n * 3), tl.load(Sequences + n * 3 + 1),
                           tl.load(Sequences + n * 3 + 2))  # fmt: skip
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < head_dim, offs_v < value_dim
    tile = offs_k[:, None] * value_dim + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    return n, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, tile, mask


@jit
def state_tile(States, n, hv, heads, head_dim, value_dim, tile, mask, PRESENT: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """(the offset of state (n, hv) in a (N, HV, K, V) tensor, this program's slice of it in
    States, or zeros where the call has no such tensor: h0, or the final state's gradient)."""
    state = (n * heads + hv).to(tl.int64) * head_dim * value_dim
    if PRESENT:
        return state, tl.load(States + state + tile, mask=mask, other=0.0)
    return state, tl.zeros((BK, BV), dtype=tl.float32)


@jit
def linear_forward_kernel(
    Q, K, V, G, Beta, H0, Out, Final, Saved, Sequences,
    scale, heads, key_heads, steps, head_dim, value_dim, chunks,
    HAS_GATE: tl.constexpr, VECTOR_GATE: tl.constexpr, DELTA: tl.constexpr,
    HAS_H0: tl.constexpr, SAVE: tl.constexpr, CHUNK_STEPS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    """out (B, T, HV, V) and final (N, HV, K, V); with SAVE the state before every chunk
    into saved (N, HV, chunks, K, V). Inputs are fp32, contiguous, (B, T, heads, dim)."""
    pid_v, pid = tl.program_id(0), tl.program_id(1)
    n, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, tile, mask = state_slice(
        pid_v, pid, Sequences, heads, key_heads, head_dim, value_dim, BK, BV
    )
    state, S = state_tile(H0, n, hv, heads, head_dim, value_dim, tile, mask, HAS_H0, BK, BV)
    for i in range(0, length):
        if SAVE:  # noqa: SIM102 (a constexpr, then a value: triton compiles them apart)
            if i % CHUNK_STEPS == 0:
                saved = ((n * heads + hv).to(tl.int64) * chunks + i // CHUNK_STEPS) * head_dim
                tl.store(Saved + saved * value_dim + tile, S, mask=mask)
        row = (slot * steps + start + i).to(tl.int64)
        q = tl.load(Q + (row * key_heads + hk) * head_dim + offs_k, mask=mask_k, other=0.0)
        k = tl.load(K + (row * key_heads + hk) * head_dim + offs_k, mask=mask_k, other=0.0)
        v = tl.load(V + (row * heads + hv) * value_dim + offs_v, mask=mask_v, other=0.0)
        _, _, S = gated_step(S, k, v, G, Beta, row * heads + hv, head_dim, offs_k, mask_k, HAS_GATE,
                             VECTOR_GATE, DELTA)  # fmt: skip
        out = tl.sum(S * (q * scale)[:, None], 0)
        tl.store(Out + (row * heads + hv) * value_dim + offs_v, out, mask=mask_v)
    tl.store(Final + state + tile, S, mask=mask)


@jit
def linear_backward_kernel(
    Q, K, V, G, Beta, DOut, DFinal, Saved, Scratch, DQ, DK, DV, DG, DBeta, DH0, Sequences,
    scale, heads, key_heads, steps, head_dim, value_dim, chunks, count, rows_per_block,
    HAS_GATE: tl.constexpr, VECTOR_GATE: tl.constexpr, DELTA: tl.constexpr,
    HAS_DFINAL: tl.constexpr, CHUNK_STEPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Gradients, chunk by chunk in reverse, each chunk's states replayed from saved into
    this program's scratch (CHUNK, K, BV). dq, dk (blocks, B, T, HV, K), dg (blocks, B, T,
    HV, gate dims) and dbeta (blocks, B, T, HV) per value-column block; dv (B, T, HV, V) and
    dh0 (N, HV, K, V) whole."""
    pid_v, pid = tl.program_id(0), tl.program_id(1)
    n, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, tile, mask = state_slice(
        pid_v, pid, Sequences, heads, key_heads, head_dim, value_dim, BK, BV
    )
    local = offs_k[:, None] * BV + tl.arange(0, BV)[None, :]
    scratch = (pid_v * count * heads + pid).to(tl.int64) * CHUNK_STEPS * BK * BV
    state, dS = state_tile(DFinal, n, hv, heads, head_dim, value_dim, tile, mask, HAS_DFINAL,
                           BK, BV)  # fmt: skip
    block = pid_v.to(tl.int64) * rows_per_block  # B * T * HV rows of partials per block
    gate_dims = head_dim if VECTOR_GATE else 1
    for back in range(0, (length + CHUNK_STEPS - 1) // CHUNK_STEPS):
        c = (length + CHUNK_STEPS - 1) // CHUNK_STEPS - 1 - back
        rows = tl.minimum(CHUNK_STEPS, length - c * CHUNK_STEPS)
        saved = ((n * heads + hv).to(tl.int64) * chunks + c) * head_dim
        S = tl.load(Saved + saved * value_dim + tile, mask=mask, other=0.0)
        for i in range(0, rows):  # replay: the state before each step
            tl.store(Scratch + scratch + i * BK * BV + local, S)
            row = (slot * steps + start + c * CHUNK_STEPS + i).to(tl.int64)
            k = tl.load(K + (row * key_heads + hk) * head_dim + offs_k, mask=mask_k, other=0.0)
            v = tl.load(V + (row * heads + hv) * value_dim + offs_v, mask=mask_v, other=0.0)
            _, _, S = gated_step(S, k, v, G, Beta, row * heads + hv, head_dim, offs_k, mask_k,
                                 HAS_GATE, VECTOR_GATE, DELTA)  # fmt: skip
        for r in range(0, rows):
            i = rows - 1 - r
            row = (slot * steps + start + c * CHUNK_STEPS + i).to(tl.int64)
            before = tl.load(Scratch + scratch + i * BK * BV + local)
            q = tl.load(Q + (row * key_heads + hk) * head_dim + offs_k, mask=mask_k, other=0.0)
            k = tl.load(K + (row * key_heads + hk) * head_dim + offs_k, mask=mask_k, other=0.0)
            v = tl.load(V + (row * heads + hv) * value_dim + offs_v, mask=mask_v, other=0.0)
            do = tl.load(DOut + (row * heads + hv) * value_dim + offs_v, mask=mask_v, other=0.0)
            decayed, u, S = gated_step(before, k, v, G, Beta, row * heads + hv, head_dim, offs_k,
                                       mask_k, HAS_GATE, VECTOR_GATE, DELTA)  # fmt: skip
            dS += (q * scale)[:, None] * do[None, :]  # o = S_t^T (scale q)
            dq = tl.sum(S * do[None, :], 1) * scale
            dk = tl.sum(dS * u[None, :], 1)  # S_t = S'_t + k u^T
            du = tl.sum(dS * k[:, None], 0)
            partial = block + row * heads + hv
            if DELTA:  # u = beta (v - S'^T k)
                b = tl.load(Beta + row * heads + hv).to(tl.float32)
                tl.store(DBeta + partial, tl.sum(du * (v - tl.sum(decayed * k[:, None], 0))))
                dv = b * du
                dpred = -b * du
                dS += k[:, None] * dpred[None, :]
                dk += tl.sum(decayed * dpred[None, :], 1)
            else:
                dv = du
            if HAS_GATE:  # S'_t = diag(exp(g)) S_{t-1}
                if VECTOR_GATE:
                    g = tl.load(G + (row * heads + hv) * head_dim + offs_k, mask=mask_k, other=0.0)
                    tl.store(DG + partial * gate_dims + offs_k, tl.sum(dS * decayed, 1),
                             mask=mask_k)  # fmt: skip
                    dS = dS * tl.exp(g.to(tl.float32))[:, None]
                else:
                    tl.store(DG + partial, tl.sum(tl.sum(dS * decayed, 1), 0))
                    dS = dS * tl.exp(tl.load(G + row * heads + hv).to(tl.float32))
            tl.store(DV + (row * heads + hv) * value_dim + offs_v, dv, mask=mask_v)
            tl.store(DQ + partial * head_dim + offs_k, dq, mask=mask_k)
            tl.store(DK + partial * head_dim + offs_k, dk, mask=mask_k)
    tl.store(DH0 + state + tile, dS, mask=mask)


@jit
def dot(a, b):
    """a @ b in IEEE fp32, never TF32: the state is held to the float64 recurrence."""
    return tl.dot(a, b, input_precision="ieee")


@jit
def chunk_tiles(Q, K, V, G, c, length, first_row, hk, hv, heads, key_heads, head_dim,
                value_dim, scale, offs_k, offs_v, mask_k, mask_v, HAS_GATE: tl.constexpr,
                CHUNK_STEPS: tl.constexpr):  # fmt: skip
    """Chunk c of a sequence whose row 0 is `first_row` (rows of (B, T, heads, dim)): its
    rows and which exist; q^ = scale q, k, v, with the offsets and mask of the value rows;
    exp(Gamma_i), exp(Gamma_last - Gamma_i), exp(Gamma_last) and decay_ij = exp(Gamma_i -
    Gamma_j) for j <= i, 0 above; Gamma is the cumulative gate within the chunk, summed in
    float64 (rows past the sequence add 0), and only its non-positive differences are
    exponentiated."""
    offs_c = tl.arange(0, CHUNK_STEPS)
    lower = offs_c[:, None] >= offs_c[None, :]
    valid = c * CHUNK_STEPS + offs_c < length
    row = (first_row + c * CHUNK_STEPS + offs_c).to(tl.int64)
    keys = (row * key_heads + hk)[:, None] * head_dim + offs_k[None, :]
    rows_k = valid[:, None] & mask_k[None, :]
    q = tl.load(Q + keys, mask=rows_k, other=0.0) * scale
    k = tl.load(K + keys, mask=rows_k, other=0.0)
    values = (row * heads + hv)[:, None] * value_dim + offs_v[None, :]
    rows_v = valid[:, None] & mask_v[None, :]
    v = tl.load(V + values, mask=rows_v, other=0.0)
    if HAS_GATE:
        gamma = tl.cumsum(tl.load(G + row * heads + hv, mask=valid, other=0.0)
                          .to(tl.float64), 0)  # fmt: skip
        last = tl.sum(tl.where(offs_c == CHUNK_STEPS - 1, gamma, 0.0), 0)
        difference = (gamma[:, None] - gamma[None, :]).to(tl.float32)
        return (row, valid, q, k, v, values, rows_v, tl.exp(gamma.to(tl.float32)),
                tl.exp((last - gamma).to(tl.float32)), tl.exp(last.to(tl.float32)),
                tl.exp(tl.where(lower, difference, float("-inf"))))  # fmt: skip
    ones = tl.full((CHUNK_STEPS,), 1.0, tl.float32)
    return row, valid, q, k, v, values, rows_v, ones, ones, 1.0, tl.where(lower, 1.0, 0.0)


@jit
def chunk_system(k, v, b, e_in, decay, CHUNK_STEPS: tl.constexpr):
    """The delta rule's chunk system without the state: T = (I + M)^-1 with M = diag(beta)
    kk, kk = k k^T * decay below the diagonal (0 on and above it), by forward substitution;
    W = T X with X = diag(beta exp(Gamma)) k, and U0 = T diag(beta) v, so that the chunk's
    update from its start state S0 is U = U0 - W S0. Returns (T, W, U0)."""
    offs_c = tl.arange(0, CHUNK_STEPS)
    kk = tl.where(offs_c[:, None] > offs_c[None, :], dot(k, tl.trans(k)) * decay, 0.0)
    m = kk * b[:, None]
    t = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    for i in range(1, CHUNK_STEPS):  # row i of T: the identity's minus M's rows j < i of T
        m_i = tl.sum(tl.where(offs_c[:, None] == i, m, 0.0), 0)
        t -= tl.where(offs_c[:, None] == i, tl.sum(m_i[:, None] * t, 0)[None, :], 0.0)
    return t, dot(t, k * (b * e_in)[:, None]), dot(t, v * b[:, None])


@jit
def linear_chunk_system_kernel(
    Q, K, V, G, Beta, T, W, U0, Sequences,
    scale, heads, key_heads, steps, head_dim, value_dim,
    HAS_GATE: tl.constexpr, CHUNK_STEPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """chunk_system for every (chunk, sequence x value head) at once, into its rows of T
    (B, T, HV, CHUNK_STEPS), W (B, T, HV, K) and U0 (B, T, HV, V). None depends on the state,
    so the sequential walks over chunks are left with products alone (with the row-by-row
    solve inside it, the walk was many times fla's whole forward)."""
    c, pid = tl.program_id(0), tl.program_id(1)
    _, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, _, _ = state_slice(
        0, pid, Sequences, heads, key_heads, head_dim, value_dim, BK, BV
    )
    if c * CHUNK_STEPS >= length:  # past this sequence's end
        return
    row, valid, _, k, v, values, rows_v, e_in, _, _, decay = chunk_tiles(
        Q, K, V, G, c, length, slot * steps + start, hk, hv, heads, key_heads, head_dim,
        value_dim, scale, offs_k, offs_v, mask_k, mask_v, HAS_GATE, CHUNK_STEPS,
    )  # fmt: skip
    b = tl.load(Beta + row * heads + hv, mask=valid, other=0.0)
    t, w, u0 = chunk_system(k, v, b, e_in, decay, CHUNK_STEPS)
    offs_c = tl.arange(0, CHUNK_STEPS)
    tl.store(T + (row * heads + hv)[:, None] * CHUNK_STEPS + offs_c[None, :], t,
             mask=valid[:, None])  # fmt: skip
    tl.store(W + (row * heads + hv)[:, None] * head_dim + offs_k[None, :], w,
             mask=valid[:, None] & mask_k[None, :])  # fmt: skip
    tl.store(U0 + values, u0, mask=rows_v)


@jit
def chunk_update(T, W, U0, S, row, valid, values, rows_v, hv, heads, head_dim, offs_k, mask_k,
                 CHUNK_STEPS: tl.constexpr):  # fmt: skip
    """The delta rule's chunk update from the state S0 before it, from the chunk's rows of
    linear_chunk_system_kernel's outputs: (T, U = U0 - W S0)."""
    offs_c = tl.arange(0, CHUNK_STEPS)
    t = tl.load(T + (row * heads + hv)[:, None] * CHUNK_STEPS + offs_c[None, :],
                mask=valid[:, None], other=0.0)  # fmt: skip
    w = tl.load(W + (row * heads + hv)[:, None] * head_dim + offs_k[None, :],
                mask=valid[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
    return t, tl.load(U0 + values, mask=rows_v, other=0.0) - dot(w, S)


@jit
def linear_chunk_kernel(
    Q, K, V, G, H0, Out, Final, Saved, T, W, U0, Sequences,
    scale, heads, key_heads, steps, head_dim, value_dim, chunks,
    HAS_GATE: tl.constexpr, DELTA: tl.constexpr, HAS_H0: tl.constexpr, SAVE: tl.constexpr,
    CHUNK_STEPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """linear_forward_kernel's results by chunks of CHUNK_STEPS (no per-key-dim gates): per
    chunk (see chunk_tiles), with q^ = scale q,

        A = tril(q^ k^T * decay);  U = v (additive rule), or U0 - W S0 (delta rule: see
        chunk_update);
        O = (q^ exp(Gamma)) S0 + A U;  S1 = exp(Gamma_last) S0 + (k exp(Gamma_last - Gamma))^T U

    With SAVE, S0 of every chunk goes to saved, for the backward."""
    pid_v, pid = tl.program_id(0), tl.program_id(1)
    n, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, tile, mask = state_slice(
        pid_v, pid, Sequences, heads, key_heads, head_dim, value_dim, BK, BV
    )
    state, S = state_tile(H0, n, hv, heads, head_dim, value_dim, tile, mask, HAS_H0, BK, BV)
    for c in range(0, tl.cdiv(length, CHUNK_STEPS)):
        if SAVE:
            saved = ((n * heads + hv).to(tl.int64) * chunks + c) * head_dim
            tl.store(Saved + saved * value_dim + tile, S, mask=mask)
        row, valid, q, k, v, values, rows_v, e_in, e_out, e_last, decay = chunk_tiles(
            Q, K, V, G, c, length, slot * steps + start, hk, hv, heads, key_heads, head_dim,
            value_dim, scale, offs_k, offs_v, mask_k, mask_v, HAS_GATE, CHUNK_STEPS,
        )  # fmt: skip
        u = v
        if DELTA:
            _, u = chunk_update(T, W, U0, S, row, valid, values, rows_v, hv, heads, head_dim,
                                offs_k, mask_k, CHUNK_STEPS)  # fmt: skip
        a = dot(q, tl.trans(k)) * decay
        out = dot(q * e_in[:, None], S) + dot(a, u)
        tl.store(Out + values, out, mask=rows_v)
        S = S * e_last + dot(tl.trans(k * e_out[:, None]), u)
    tl.store(Final + state + tile, S, mask=mask)


@jit
def linear_chunk_backward_kernel(
    Q, K, V, G, Beta, DOut, DFinal, Saved, T, W, U0, DQ, DK, DV, DG, DBeta, DH0, Sequences,
    scale, heads, key_heads, steps, head_dim, value_dim, chunks, rows_per_block,
    HAS_GATE: tl.constexpr, DELTA: tl.constexpr, HAS_DFINAL: tl.constexpr,
    CHUNK_STEPS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """linear_backward_kernel's gradients by chunks (no per-key-dim gates), in reverse, each
    chunk recomputed from its saved S0: the reverse mode of linear_chunk_kernel's lines. The
    WY form's dM is -dZ U^T, with dZ = T^T dU (T = (I + M)^-1, see chunk_system). A gate
    g_s reaches every Gamma_i with i >= s: the terms of exp(Gamma_i) add up from the end of
    the chunk, those of exp(Gamma_last - Gamma_i) from its start, and a pair (i, j)'s decay
    reaches the steps j < s <= i (summed as such, never as a difference of sums)."""
    pid_v, pid = tl.program_id(0), tl.program_id(1)
    n, hv, hk, slot, start, length, offs_k, offs_v, mask_k, mask_v, tile, mask = state_slice(
        pid_v, pid, Sequences, heads, key_heads, head_dim, value_dim, BK, BV
    )
    state, dS = state_tile(DFinal, n, hv, heads, head_dim, value_dim, tile, mask, HAS_DFINAL,
                           BK, BV)  # fmt: skip
    block = pid_v.to(tl.int64) * rows_per_block  # B * T * HV rows of partials per block
    offs_c = tl.arange(0, CHUNK_STEPS)
    strict = offs_c[:, None] > offs_c[None, :]
    from_s = tl.where(offs_c[None, :] >= offs_c[:, None], 1.0, 0.0)  # [s, i]: i >= s
    count = tl.cdiv(length, CHUNK_STEPS)
    for back in range(0, count):
        c = count - 1 - back
        saved = ((n * heads + hv).to(tl.int64) * chunks + c) * head_dim
        S = tl.load(Saved + saved * value_dim + tile, mask=mask, other=0.0)
        row, valid, q, k, v, values, rows_v, e_in, e_out, e_last, decay = chunk_tiles(
            Q, K, V, G, c, length, slot * steps + start, hk, hv, heads, key_heads, head_dim,
            value_dim, scale, offs_k, offs_v, mask_k, mask_v, HAS_GATE, CHUNK_STEPS,
        )  # fmt: skip
        do = tl.load(DOut + values, mask=rows_v, other=0.0)
        u = v
        if DELTA:
            b = tl.load(Beta + row * heads + hv, mask=valid, other=0.0)
            t, u = chunk_update(T, W, U0, S, row, valid, values, rows_v, hv, heads, head_dim,
                                offs_k, mask_k, CHUNK_STEPS)  # fmt: skip
            kk = tl.where(strict, dot(k, tl.trans(k)) * decay, 0.0)
            x = k * (b * e_in)[:, None]
        a = dot(q, tl.trans(k)) * decay
        qg, kd = q * e_in[:, None], k * e_out[:, None]
        du = dot(tl.trans(a), do) + dot(kd, dS)  # O = qg S0 + A U, S1 = e_last S0 + kd^T U
        da = dot(do, tl.trans(u))
        dqg = dot(do, tl.trans(S))
        dkd = dot(u, tl.trans(dS))
        own = tl.zeros((CHUNK_STEPS,), dtype=tl.float32)  # terms of exp(Gamma_i)
        if HAS_GATE:
            own_last = tl.sum(tl.sum(dS * S, 1), 0) * e_last
            own += tl.where(offs_c == CHUNK_STEPS - 1, own_last, 0.0)
            dS = dS * e_last
        dS += dot(tl.trans(qg), do)
        dq = dot(da * decay, k)  # A = q^ k^T * decay
        dk = dot(tl.trans(da * decay), q)
        pairs = tl.where(strict, da * a, 0.0)  # each pair's gate term
        if DELTA:  # Z = diag(beta) v - X S0, U = (I + M)^-1 Z, M = diag(beta) kk
            dz = dot(tl.trans(t), du)
            dm = tl.where(strict, -dot(dz, tl.trans(u)), 0.0)
            dx = -dot(dz, tl.trans(S))
            dS -= dot(tl.trans(x), dz)
            tl.store(DV + values, dz * b[:, None], mask=rows_v)
            dbeta = tl.sum(dx * k * e_in[:, None], 1) + tl.sum(dz * v, 1) + tl.sum(dm * kk, 1)
            tl.store(DBeta + block + row * heads + hv, dbeta, mask=valid)
            dk += dx * (b * e_in)[:, None]
            own += tl.sum(dx * x, 1)
            dkk = dm * b[:, None]  # kk = k k^T * decay, strictly lower
            dk += dot(dkk * decay, k) + dot(tl.trans(dkk * decay), k)
            pairs += dkk * kk
        else:
            tl.store(DV + values, du, mask=rows_v)
        dq += dqg * e_in[:, None]
        own += tl.sum(dqg * qg, 1)
        dk += dkd * e_out[:, None]
        partial = block + row * heads + hv
        keys = partial[:, None] * head_dim + offs_k[None, :]
        rows_k = valid[:, None] & mask_k[None, :]
        tl.store(DQ + keys, dq * scale, mask=rows_k)
        tl.store(DK + keys, dk, mask=rows_k)
        if HAS_GATE:
            to_last = tl.sum(dkd * kd, 1)  # terms of exp(Gamma_last - Gamma_i)
            dg = tl.sum(from_s * own[None, :], 1)
            dg += tl.sum(tl.where(offs_c[None, :] < offs_c[:, None], to_last[None, :], 0.0), 1)
            dg += tl.sum(tl.where(strict, dot(from_s, pairs), 0.0), 1)
            tl.store(DG + partial, dg, mask=valid)
    tl.store(DH0 + state + tile, dS, mask=mask)


# ---------------------------------------------------------------------------- launchers
def _blocks(inputs: LinearAttentionInputs) -> tuple[int, int, int]:
    """(BK, BV, value-column blocks)."""
    bk = max(next_power_of_2(inputs.head_dim), 16)
    bv = min(max(next_power_of_2(inputs.value_dim), 16), 32)
    return bk, bv, triton.cdiv(inputs.value_dim, bv)


def _fp32(tensor: Tensor | None, like: Tensor) -> Tensor:
    """A contiguous fp32 copy of the tensor (a dummy for None)."""
    if tensor is None:
        return like.new_zeros(1, dtype=torch.float32)
    return tensor.detach().to(torch.float32).contiguous()


def _normalised(inputs: LinearAttentionInputs) -> tuple[Tensor, Tensor]:
    """q and k as the kernels read them: fp32, l2-normalised when the call asks."""
    q, k = (t.detach().to(torch.float32) for t in (inputs.query, inputs.key))
    if inputs.l2norm:
        q, k = l2norm(q), l2norm(k)
    return q.contiguous(), k.contiguous()


def _plan(inputs: LinearAttentionInputs, save: bool) -> tuple[bool, int, dict]:
    """(chunked, chunks of the longest sequence, the kernels' flags). The chunked kernels
    serve scalar or no gates past a few steps, or where a backward follows; their chunk
    shrinks as the head dim grows, so that the backward's tiles fit in shared memory (64 /
    32 / 16 steps at K <= 64 / 128 / 256), and they are not software-pipelined (the buffers
    of its stages took the additive backward past it); benches/triton_compile_check.py
    checks them against sm_80's 163 KiB per block. Else token by token, the state stored
    every CHUNK steps."""
    longest = int(inputs.sequences[:, 2].max()) if inputs.count else 0
    flags = {"HAS_GATE": inputs.g is not None, "DELTA": inputs.beta is not None}
    if inputs.gate == "vector" or not (save or longest > RECURRENT_MAX_STEPS):
        flags |= {"VECTOR_GATE": inputs.gate == "vector", "CHUNK_STEPS": CHUNK}
        return False, max(triton.cdiv(longest, CHUNK), 1), flags
    bk = _blocks(inputs)[0]
    steps = 64 if bk <= 64 else 32 if bk <= 128 else 16
    flags |= {"CHUNK_STEPS": steps, "num_stages": 1}
    return True, max(triton.cdiv(longest, steps), 1), flags


def _saved_shape(inputs: LinearAttentionInputs, chunks: int) -> tuple[int, ...]:
    """(N, HV, chunks, K, V): the chunks' start states the forward stores when it saves."""
    return (*inputs.state_shape[:2], chunks, *inputs.state_shape[2:])


def _run_forward(inputs: LinearAttentionInputs, save: bool) -> tuple[Tensor, Tensor, Tensor]:
    q, k = _normalised(inputs)
    v = _fp32(inputs.value, q)
    device = v.device
    out = torch.zeros(v.shape, dtype=torch.float32, device=device)
    final = torch.zeros(inputs.state_shape, dtype=torch.float32, device=device)
    chunked, chunks, flags = _plan(inputs, save)
    saved = torch.empty(_saved_shape(inputs, chunks) if save else (1,), dtype=torch.float32,
                        device=device)  # fmt: skip
    bk, bv, blocks = _blocks(inputs)
    if not final.numel():
        return out, final, saved
    g, beta = _fp32(inputs.g, v), _fp32(inputs.beta, v)
    sequences = on_device(inputs.sequences, device)
    heads = inputs.value_heads
    common = (inputs.scale, heads, inputs.key_heads, v.shape[1], inputs.head_dim,
              inputs.value_dim)  # fmt: skip
    if not chunked:
        linear_forward_kernel[(blocks, inputs.count * heads)](
            q, k, v, g, beta, _fp32(inputs.initial_state, v), out, final, saved, sequences,
            *common, chunks, HAS_H0=inputs.initial_state is not None, SAVE=save, BK=bk, BV=bv,
            **flags,
        )  # fmt: skip
        return out, final, saved
    linear_chunk_kernel[(blocks, inputs.count * heads)](
        q, k, v, g, _fp32(inputs.initial_state, v), out, final, saved,
        *_chunk_systems(inputs, q, k, v, g, beta, sequences, chunks, flags), sequences,
        *common, chunks, HAS_H0=inputs.initial_state is not None, SAVE=save, BK=bk, BV=bv,
        **flags,
    )  # fmt: skip
    return out, final, saved


def _chunk_systems(inputs, q, k, v, g, beta, sequences, chunks, flags) -> tuple:
    """(T, W, U0) of linear_chunk_system_kernel for the delta rule; dummies (never read)
    for the additive rule. The backward solves them again (one parallel pass over q, k, v)
    rather than keeping them beside the forward's start states."""
    if not flags["DELTA"]:
        return v, v, v
    batch, steps, heads = v.shape[:3]
    t = torch.empty((batch, steps, heads, flags["CHUNK_STEPS"]), device=v.device)
    w = torch.empty((batch, steps, heads, inputs.head_dim), device=v.device)
    u0 = torch.empty_like(v)
    linear_chunk_system_kernel[(chunks, inputs.count * heads)](
        q, k, v, g, beta, t, w, u0, sequences, inputs.scale, heads, inputs.key_heads, steps,
        inputs.head_dim, inputs.value_dim, HAS_GATE=flags["HAS_GATE"],
        CHUNK_STEPS=flags["CHUNK_STEPS"], BK=_blocks(inputs)[0],
        BV=max(next_power_of_2(inputs.value_dim), 16),
    )  # fmt: skip
    return t, w, u0


def triton_linear_forward(
    inputs: LinearAttentionInputs, backward: bool
) -> tuple[Tensor, Tensor, tuple]:
    """(out (B, T, HV, V) in the call's dtype, final state (N, HV, K, V) float32, (the
    chunks' start states,) when a `backward` follows and they take at most KEPT_MAX_BYTES,
    else ())."""
    saved_bytes = 4 * math.prod(_saved_shape(inputs, _plan(inputs, save=True)[1]))
    keep = backward and saved_bytes <= KEPT_MAX_BYTES
    out, final, saved = _run_forward(inputs, save=keep)
    return out.to(inputs.dtype), final, (saved,) if keep else ()


def triton_linear_backward(
    inputs: LinearAttentionInputs,
    kept: tuple,
    grad_out: Tensor | None,
    grad_state: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dg, dbeta, dinitial_state), each in its input's dtype, None where the
    call has no such input. Takes the chunks' start states the forward kept, or runs it
    again for them, and walks the chunks back: by tiles where the forward runs by chunks,
    else token by token."""
    saved = kept[0] if kept else _run_forward(inputs, save=True)[2]
    q, k = _normalised(inputs)
    v = _fp32(inputs.value, q)
    batch, steps, heads = v.shape[:3]
    device = v.device
    bk, bv, blocks = _blocks(inputs)
    gate_dims = inputs.head_dim if inputs.gate == "vector" else 1
    partial = (blocks, batch, steps, heads)
    dq, dk = (torch.zeros((*partial, inputs.head_dim), device=device) for _ in range(2))
    dg = torch.zeros((*partial, gate_dims), device=device)
    dbeta = torch.zeros(partial, device=device)
    dv = torch.zeros(v.shape, device=device)
    dh0 = torch.zeros(inputs.state_shape, device=device)
    do = torch.zeros(v.shape, device=device) if grad_out is None else _fp32(grad_out, v)
    chunked, chunks, flags = _plan(inputs, save=True)
    if dh0.numel() and chunked:
        g, beta = _fp32(inputs.g, v), _fp32(inputs.beta, v)
        sequences = on_device(inputs.sequences, device)
        linear_chunk_backward_kernel[(blocks, inputs.count * heads)](
            q, k, v, g, beta, do, _fp32(grad_state, v), saved,
            *_chunk_systems(inputs, q, k, v, g, beta, sequences, chunks, flags), dq, dk, dv, dg,
            dbeta, dh0, sequences, inputs.scale, heads, inputs.key_heads, steps, inputs.head_dim,
            inputs.value_dim, chunks, batch * steps * heads, HAS_DFINAL=grad_state is not None,
            BK=bk, BV=bv, **flags,
        )  # fmt: skip
    elif dh0.numel():
        scratch = torch.empty((blocks, inputs.count * heads, CHUNK, bk, bv), device=device)
        linear_backward_kernel[(blocks, inputs.count * heads)](
            q, k, v, _fp32(inputs.g, v), _fp32(inputs.beta, v), do, _fp32(grad_state, v), saved,
            scratch, dq, dk, dv, dg, dbeta, dh0, on_device(inputs.sequences, device), inputs.scale,
            heads, inputs.key_heads, steps, inputs.head_dim, inputs.value_dim, chunks,
            inputs.count, batch * steps * heads, HAS_DFINAL=grad_state is not None, BK=bk,
            BV=bv, **flags,
        )  # fmt: skip
    group = heads // inputs.key_heads
    shape = (batch, steps, inputs.key_heads, group, inputs.head_dim)
    dq, dk = (t.sum(0).view(shape).sum(3) for t in (dq, dk))
    if inputs.l2norm:  # through x / sqrt(sum(x^2) + eps): r (dn - n (n . dn))
        for grad, raw in ((dq, inputs.query), (dk, inputs.key)):
            raw = raw.detach().to(torch.float32)
            inverse = torch.rsqrt(raw.square().sum(-1, keepdim=True) + L2NORM_EPS)
            normal = raw * inverse
            grad.copy_(inverse * (grad - normal * (normal * grad).sum(-1, keepdim=True)))
    return inputs.as_gradients(dq, dk, dv, dg.sum(0), dbeta.sum(0), dh0)
