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

from attnperf.kernels.numba.jit import FASTMATH, njit, prange, run_bounds, serial
from attnperf.kernels.numba.launch import as_numpy, float32_array, recycled_float32, run_parallel
from attnperf.kernels.numba.linear_delta import delta_backward, delta_update
from attnperf.kernels.numba.linear_stages import (
    CHUNK,
    FORWARD_CHUNK,
    LinearRule,
    add_gate_terms,
    advance_state,
    aligned_float32,
    chunk_gating,
    chunk_rows,
    gate_row,
    kept_shapes,
    load_rows,
    lower_times,
    new_kept,
    new_scratch,
    new_states,
    new_update,
    pair_scores_backward,
    to_raw,
)
from attnperf.kernels.numba.tiles import product, tiles_flag
from attnperf.linear_inputs import LinearAttentionInputs

# The forward keeps each chunk's start state (and the delta rule's WY results) for the
# backward when they take at most this many bytes per call (T x HV x 1.75 KiB at K = V =
# 128 with the delta rule: 112 MiB at T = 2048, HV = 32); beyond, the backward recomputes them:
# a forward pass of products, a fair share of the backward's time. Every
# layer of a model being trained holds its call's until the backward: 0 always recomputes,
# as fla does.
KEPT_MAX_BYTES = 512 << 20
# Sequences up to this many steps run the per-token kernel when no gradient is needed:
# decoding and speculative steps (the chunked form's fixed costs dominate short sequences).
RECURRENT_MAX_STEPS = 16
# Below this many bytes of state, the per-token kernel runs on the calling thread; from it
# on, two threads were faster (benches/linear_decode_threads.py).
PARALLEL_MIN_BYTES = 2 << 20
# The chunked forward's items take as many value heads of one key head as leave at least
# this many items a thread. Value heads in one item share their key head's loads and plain
# products: faster than an item a value head where the items still fill the threads.
ITEMS_PER_THREAD = 2


# ---------------------------------------------------------------------------- kernels
def linear_rule(inputs: LinearAttentionInputs) -> LinearRule:
    """The call's rule as the kernels read it."""
    return LinearRule(np.float32(inputs.scale), inputs.l2norm, inputs.g is not None,
                      inputs.beta is not None)  # fmt: skip


@njit(fastmath=FASTMATH)
def chunk_update(v, beta, slot, hv, t0, rows, rule, state, scratch, kk, m, x, u, tiles):
    """U, what value head hv's chunk writes into the state, from the state S0 before it: v
    (the additive rule), or the delta rule's WY form (`delta_update`: kk, m and x filled
    too); all (C, ...), [:rows] meaningful."""
    if rule.delta:
        delta_update(v, beta, slot, hv, t0, rows, rule, state, scratch, kk, m, x, u, tiles)
        return
    no_factor = scratch[1][:0, 0]
    load_rows(v, slot, t0, rows, hv, no_factor, np.float32(1.0), False, u, no_factor)


@njit(parallel=True, fastmath=FASTMATH)
def linear_forward_chunked(q, k, v, g, beta, h0, sequences, rule, out, final, kept, firsts,
                           per_item, chunk_steps, tiles):  # fmt: skip
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
            chunk_rows(q, k, rule, slot, first_head // group, t0, rows, True, rule.delta,
                       scratch, tiles)  # fmt: skip
            for hv in range(first_head, first_head + per_item):
                padded = states[hv - first_head]
                state = padded[:, :value_dim]
                if starts.shape[1] > 0:
                    starts[hv, chunk] = state
                if kks.shape[1] > 0:
                    kk, u = kks[hv, chunk], us[hv, chunk]
                chunk_gating(g, slot, hv, t0, rows, rule, True, scratch)
                chunk_update(v, beta, slot, hv, t0, rows, rule, state, scratch, kk, m, x, u,
                             tiles)  # fmt: skip
                o = out[slot, t0 : t0 + rows, hv]
                product(qg[:rows], state, o, 1.0, 0.0, False, False, tiles)
                lower_times(a[:rows, :rows], u[:rows], o, 1.0, 1.0, tiles)
                advance_state(padded, e_in, rows, rule, kd, u, tiles)
        for hv in range(first_head, first_head + per_item):
            final[n, hv] = states[hv - first_head, :, :value_dim]


@njit(parallel=True, fastmath=FASTMATH)
def linear_backward_chunked(q, k, v, g, beta, h0, sequences, rule, grad_out, grad_final, kept,
                            firsts, dq, dk, dv, dg, dbeta, dh0, threads, tiles):  # fmt: skip
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
                                   gate_dims, rule.delta)  # fmt: skip
        for item in range(worker, items, workers):
            n, hk = np.int64(item) // key_heads, np.int64(item) % key_heads
            backward_item(q, k, v, g, beta, h0, sequences, rule, grad_out, grad_final, kept,
                          firsts[n], grads, n, hk, buffers, tiles)  # fmt: skip


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
def backward_item(q, k, v, g, beta, h0, sequences, rule, grad_out, grad_final, kept, first,
                  grads, n, hk, buffers, tiles):  # fmt: skip
    """Sequence n, key head hk of linear_backward_chunked with its value heads, in its
    thread's buffers: each value head's chunk start states (and WY results) from `kept`
    (its chunks from `first`), or when it has none, from a first pass over the chunks; then
    the chunks in reverse, each value head's dS carried from the last to the first. The
    value heads share each chunk's rows of q and k and their plain products, and their dq
    and dk add up before they reach the raw q and k."""
    dq, dk, dv, dg, dbeta, dh0 = grads
    own_kept, states, scratch, update, work = buffers
    kk, m, x, u = update
    dss, du, da, dqg, dkd, dqs, dk_c, dg_c, own, to_last, _, _, _, row, decays = work
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
            chunk_rows(q, k, rule, slot, hk, t0, rows, False, rule.delta, scratch, tiles)
            for member in range(group):
                hv, padded = first_head + member, states[member]
                state = padded[:, :value_dim]
                starts[member, c] = state
                if rule.delta:
                    kk, u = kks[member, c], us[member, c]
                chunk_gating(g, slot, hv, t0, rows, rule, False, scratch)
                chunk_update(v, beta, slot, hv, t0, rows, rule, state, scratch, kk, m, x, u,
                             tiles)  # fmt: skip
                advance_state(padded, e_in, rows, rule, kd, u, tiles)
    for member in range(group):
        if grad_final.shape[0] > 0:
            dss[member, :, :value_dim] = grad_final[n, first_head + member]
        else:
            dss[member, :, :value_dim] = 0.0
    for c in range(chunks - 1, -1, -1):
        t0 = start + c * CHUNK
        rows = min(CHUNK, start + length - t0)
        chunk_rows(q, k, rule, slot, hk, t0, rows, True, False, scratch, tiles)
        dqs[:rows] = 0.0
        dk_c[:rows] = 0.0
        for member in range(group):
            hv, at, chunk = first_head + member, kept_head + member, first + c
            s0, ds_padded = starts[at, chunk], dss[member]
            ds = ds_padded[:, :value_dim]
            chunk_gating(g, slot, hv, t0, rows, rule, True, scratch)
            if rule.delta:
                kk, u = kks[at, chunk], us[at, chunk]
            else:
                chunk_update(v, beta, slot, hv, t0, rows, rule, s0, scratch, kk, m, x, u, tiles)
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
            if rule.gated:  # S1's exp(Gamma_last) S0 term, before ds becomes dS0
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
            if rule.delta:  # U = (I + M)^-1 Z, Z = diag(beta) v - X S0, M = diag(beta) kk
                delta_backward(v, beta, slot, hv, t0, rows, rule, s0, ds, kk, u, update,
                               scratch, work, dv, dbeta, tiles)  # fmt: skip
            else:
                dv[slot, t0 : t0 + rows, hv] = du[:rows]
            pair_scores_backward(da, a, qs[:rows], k_c, gamma, rule.gated, 0, dqs[:rows],
                                 dk_c[:rows], dg_c, tiles)  # fmt: skip
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
            if rule.gated:  # Gamma_i = sum_{s <= i} g_s
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
            to_raw(dqs[i], qs[i], rule.scale, q_inv[i], rule.l2norm, dq[slot, t0 + i, hk])
            to_raw(dk_c[i], kc[i], np.float32(1.0), k_inv[i], rule.l2norm, dk[slot, t0 + i, hk])
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
def recurrent_item(q, k, v, g, beta, h0, sequences, rule, out, final, n, hv, scratch):
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
        load_rows(q, slot, t, 1, hk, no_factor, rule.scale, rule.l2norm, rows[0:1], no_norms)
        load_rows(k, slot, t, 1, hk, no_factor, np.float32(1.0), rule.l2norm, rows[1:2],
                  no_norms)  # fmt: skip
        q_t, k_t, v_t = rows[0], rows[1], v[slot, t, hv]
        if rule.gated:
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
        b = beta[slot, t, hv] if rule.delta else np.float32(1.0)
        for e in range(value_dim):
            update[e] = b * (v_t[e] - read_k[e]) if rule.delta else v_t[e]
            out[slot, t, hv, e] = read_q[e] + update[e] * overlap
        for d in range(head_dim):
            row, old, kd, dd = state[d], source[d], k_t[d], step_decay[d]
            for e in range(value_dim):
                row[e] = dd * old[e] + kd * update[e]
        source = state


@njit(parallel=True, fastmath=FASTMATH)
def linear_forward_recurrent(q, k, v, g, beta, h0, sequences, rule, out, final, threads):
    """recurrent_item of every (sequence, value head), in parallel: a run of items a thread,
    its scratch made once (made per item, six arrays an item, it was a third of a
    step's time)."""
    heads = v.shape[2]
    items = sequences.shape[0] * heads
    workers = min(threads, items)
    for worker in prange(workers):
        scratch = recurrent_scratch(k.shape[3], v.shape[3])
        first, last = run_bounds(worker, workers, items)
        for item in range(first, last):
            recurrent_item(q, k, v, g, beta, h0, sequences, rule, out, final, item // heads,
                           item % heads, scratch)  # fmt: skip


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

    Mapped afresh each call, they fault in again where idle memory goes back to the host
    (a VM's balloon): a call after an idle spell then ran far slower.
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
    args = (*_arrays(inputs), linear_rule(inputs), out_array, final_array)
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
        run_parallel(linear_backward_chunked, *arrays, linear_rule(inputs), do, d_final,
                     kept_arrays, firsts, *(array for _, array in buffers),
                     torch.get_num_threads(), tiles_flag())  # fmt: skip
    return inputs.as_gradients(*(tensor for tensor, _ in buffers))
