"""Attention forward and backward: the online-softmax forward kernel, FlashAttention-2's
backward (preprocess, dK/dV, dQ), and their launchers."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnperf.backend import ROUNDED_DTYPES, rounded_output
from attnperf.inputs import AttentionInputs
from attnperf.kernels.triton.configs import (
    backward_config,
    forward_configs,
    prune_forward_configs,
)
from attnperf.kernels.triton.jit import (
    LOG2E,
    autotune,
    jit,
    kernel_flags,
    next_power_of_2,
    store_dtype,
    tl,
    triton,
)
from attnperf.kernels.triton.variant import (
    dot_pv,
    key_tile_range,
    lower_variant,
    mask_args,
    modify_scores,
    query_tile_range,
    sequence,
    sink_args,
    tile_scores,
    tile_seen,
    with_sink,
)


@autotune(
    configs=forward_configs(),
    key=["q_len_class", "kv_len_class", "head_dim", "value_dim", "MASK_KIND", "HAS_BAND",
         "HAS_SOFTCAP", "HAS_ALIBI", "HAS_LAYOUT", "HAS_SINKS"],
    prune_configs_by={"early_config_prune": prune_forward_configs},
)  # fmt: skip
@(
    triton.heuristics({"EVEN_N": lambda args: args["kv_len_gcd"] % args["BLOCK_N"] == 0})
    if triton
    else (lambda f: f)
)
@jit
def online_softmax_forward_kernel(
    Q, K, V, Mask, Out, Stats,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod,
    q_heads, group, q_rows, head_dim, value_dim, scale2, q_len_class, kv_len_class, kv_len_gcd,
    Sequences, left, right, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    Sinks,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """Out (B, Hq, L, Ev) and Stats (B, Hq, L, 2), each row's base-2 max and sum (the
    sink's term included), for one query tile of one sequence (q_rows: the query array's
    L)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // group
    slot, q_start, q_len, k_start, kv_len, offset = sequence(Sequences, b)
    start_m = tile * BLOCK_M
    if start_m >= q_len:  # past this sequence's end
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + slot * sqb + h * sqh + (q_start + offs_m[:, None]) * sqm + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    K_bh = K + slot * skb + hk * skh + k_start * skn
    V_bh = V + slot * svb + hk * svh + k_start * svn
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Tiles the band cuts come first and last, masked; those inside it need no band mask.
    lo, full_lo, full_hi, hi = key_tile_range(start_m, q_len, kv_len, left, right, offset,
                                              BLOCK_M, BLOCK_N)  # fmt: skip
    for phase in tl.static_range(3):
        first = lo if phase == 0 else (full_lo if phase == 1 else full_hi)
        end = full_lo if phase == 0 else (full_hi if phase == 1 else hi)
        for start_n in range(first, end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            if tile_seen(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                         HAS_LAYOUT, LAYOUT_Q, LAYOUT_K):  # fmt: skip
                s = tile_scores(q, K_bh, offs_n, kv_len, head_dim, scale2, skn, skd, BLOCK_D,
                                WIDEN_DOT, IEEE)  # fmt: skip
                s, _ = modify_scores(
                    s, b, h, offs_m, offs_n, q_len, kv_len, Mask, smb, smh, smm, smn, left,
                    right, offset, softcap2, Alibi, q_heads, Kinds, PartialIndex, Partial,
                    lkb, lkh, lkq, MASK_KIND, HAS_BAND and phase != 1, HAS_SOFTCAP,
                    HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K, EVEN_N,
                )  # fmt: skip
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # A row with nothing allowed yet shifts by 0: its exp2 stays 0, not NaN.
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - shift[:, None])
                alpha = tl.math.exp2(m_i - shift)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    V_bh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                    mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim),
                    other=0.0,
                )
                acc = acc * alpha[:, None] + dot_pv(p, v, WIDEN_DOT, IEEE)
                m_i = m_new
    if HAS_SINKS:
        m_i, l_i, rescale = with_sink(m_i, l_i, tl.load(Sinks + h))
        acc = acc * rescale[:, None]
    # Rows that see no key (sum 0) give 0, and so does their backward (p = 2**s * 0).
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + slot * sob + h * soh + (q_start + offs_m[:, None]) * som + offs_dv[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < value_dim),
    )
    stats = Stats + ((slot * q_heads + h) * q_rows + q_start + offs_m) * 2
    tl.store(stats, tl.where(l_i == 0.0, 0.0, m_i), mask=offs_m < q_len)
    tl.store(stats + 1, l_i, mask=offs_m < q_len)


@jit
def attention_backward_preprocess(
    Out, GradOut, Delta, rows, value_dim, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr
):
    """Delta = rowsum(dO * O) over contiguous (rows, Ev) views, in fp32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < rows) & (offs_dv[None, :] < value_dim)
    ptrs = offs_m[:, None] * value_dim + offs_dv[None, :]
    o = tl.load(Out + ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(GradOut + ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + offs_m, tl.sum(o * do, 1), mask=offs_m < rows)


@jit
def recompute_probabilities(
    q, K_bh, Mask, Stats, b, h, row0, offs_m, offs_n, q_len, kv_len, head_dim, scale2,
    skn, skd, smb, smh, smm, smn,
    left, right, offset, softcap2, Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """(P, the softcap's gradient factor) of one tile from the rows' saved max and sum:
    kept apart, they hold the sum where max + log2(sum) would round it away (scores near
    finfo.min). Row i's stats are row row0 + i of the (rows, 2) Stats."""
    s = tile_scores(q, K_bh, offs_n, kv_len, head_dim, scale2, skn, skd, BLOCK_D, WIDEN_DOT,
                    IEEE)  # fmt: skip
    s, dtanh = modify_scores(
        s, b, h, offs_m, offs_n, q_len, kv_len, Mask, smb, smh, smm, smn, left, right,
        offset, softcap2, Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
        MASK_KIND, HAS_BAND, HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K, False,
    )  # fmt: skip
    stats = Stats + (row0 + offs_m) * 2
    row_max = tl.load(stats, mask=offs_m < q_len, other=0.0)
    row_sum = tl.load(stats + 1, mask=offs_m < q_len, other=0.0)
    inverse = tl.where(row_sum == 0.0, 0.0, 1.0 / tl.where(row_sum == 0.0, 1.0, row_sum))
    return tl.math.exp2(s - row_max[:, None]) * inverse[:, None], dtanh


@jit
def attention_backward_dkdv_kernel(
    Q, K, V, Mask, GradOut, Stats, Delta, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn,
    q_heads, kv_heads, group, q_rows, kv_rows, head_dim, value_dim, scale2, scale,
    Sequences, left, right, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile of one sequence, summed over the query heads of its group (no
    atomics).

    GradOut is contiguous (B, Hq, q_rows, Ev); DK, DV are contiguous (B, H, kv_rows, E).
    """
    tile = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // kv_heads
    hk = bhk % kv_heads
    slot, q_start, q_len, k_start, kv_len, offset = sequence(Sequences, b)
    start_n = tile * BLOCK_N
    if start_n >= kv_len:  # past this sequence's end
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    K_bh = K + slot * skb + hk * skh + k_start * skn
    v = tl.load(
        V + slot * svb + hk * svh + (k_start + offs_n[:, None]) * svn + offs_dv[None, :] * svd,
        mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim),
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_lo, q_hi = query_tile_range(start_n, q_len, left, right, offset, BLOCK_M, BLOCK_N)
    for h in range(hk * group, (hk + 1) * group):
        row0 = (slot * q_heads + h) * q_rows + q_start  # of the sequence's rows in GradOut
        for start_m in range(q_lo, q_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            if tile_seen(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                         HAS_LAYOUT, LAYOUT_Q, LAYOUT_K):  # fmt: skip
                q = tl.load(
                    Q
                    + slot * sqb
                    + h * sqh
                    + (q_start + offs_m[:, None]) * sqm
                    + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim),
                    other=0.0,
                )
                p, dtanh = recompute_probabilities(
                    q, K_bh, Mask, Stats, b, h, row0, offs_m, offs_n, q_len, kv_len, head_dim,
                    scale2, skn, skd, smb, smh, smm, smn, left, right, offset, softcap2,
                    Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq, MASK_KIND,
                    HAS_BAND, HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K,
                    BLOCK_D, WIDEN_DOT, IEEE,
                )  # fmt: skip
                do = tl.load(
                    GradOut + (row0 + offs_m[:, None]) * value_dim + offs_dv[None, :],
                    mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < value_dim),
                    other=0.0,
                )
                dv += dot_pv(tl.trans(p), do, WIDEN_DOT, IEEE)
                dp = dot_pv(do.to(tl.float32) if WIDEN_DOT else do, tl.trans(v), WIDEN_DOT,
                            IEEE)  # fmt: skip
                delta = tl.load(Delta + row0 + offs_m, mask=offs_m < q_len, other=0.0)
                ds = p * (dp - delta[:, None]) * dtanh
                dk += dot_pv(tl.trans(ds), q, WIDEN_DOT, IEEE)
    out_mask_k = (offs_n[:, None] < kv_len) & (offs_d[None, :] < head_dim)
    out_mask_v = (offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim)
    base = (slot * kv_heads + hk) * kv_rows + k_start + offs_n[:, None]
    tl.store(DK + base * head_dim + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=out_mask_k)  # fmt: skip
    tl.store(DV + base * value_dim + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=out_mask_v)


@jit
def attention_backward_dq_kernel(
    Q, K, V, Mask, GradOut, Stats, Delta, DQ, DMask,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn,
    q_heads, group, q_rows, kv_rows, head_dim, value_dim, scale2, scale,
    Sequences, left, right, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, WANT_DMASK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile of one sequence; with WANT_DMASK (plain calls) also dS into a
    contiguous (B, Hq, L, S) DMask (zeros where a tile is skipped: its dS is 0)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // group
    slot, q_start, q_len, k_start, kv_len, offset = sequence(Sequences, b)
    start_m = tile * BLOCK_M
    if start_m >= q_len:  # past this sequence's end
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    row0 = (slot * q_heads + h) * q_rows + q_start  # of the sequence's rows in GradOut, DQ
    q = tl.load(
        Q + slot * sqb + h * sqh + (q_start + offs_m[:, None]) * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    do = tl.load(
        GradOut + (row0 + offs_m[:, None]) * value_dim + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < value_dim),
        other=0.0,
    )
    delta = tl.load(Delta + row0 + offs_m, mask=row_ok, other=0.0)
    K_bh = K + slot * skb + hk * skh + k_start * skn
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, _, _, hi = key_tile_range(start_m, q_len, kv_len, left, right, offset, BLOCK_M,
                                  BLOCK_N)  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if tile_seen(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                     HAS_LAYOUT, LAYOUT_Q, LAYOUT_K):  # fmt: skip
            p, dtanh = recompute_probabilities(
                q, K_bh, Mask, Stats, b, h, row0, offs_m, offs_n, q_len, kv_len, head_dim,
                scale2, skn, skd, smb, smh, smm, smn, left, right, offset, softcap2, Alibi,
                q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq, MASK_KIND, HAS_BAND,
                HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K, BLOCK_D, WIDEN_DOT,
                IEEE,
            )  # fmt: skip
            v = tl.load(
                V
                + slot * svb
                + hk * svh
                + (k_start + offs_n[:, None]) * svn
                + offs_dv[None, :] * svd,
                mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim),
                other=0.0,
            )
            dp = dot_pv(do.to(tl.float32) if WIDEN_DOT else do, tl.trans(v), WIDEN_DOT, IEEE)
            ds = p * (dp - delta[:, None])
            if WANT_DMASK:  # the float mask is added after the softcap: its gradient is dS
                tl.store(
                    DMask + (row0 + offs_m[:, None]) * kv_rows + k_start + offs_n[None, :],
                    ds,
                    mask=row_ok[:, None] & (offs_n[None, :] < kv_len),
                )
            ds = ds * dtanh
            k = tl.load(
                K_bh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=(offs_n[:, None] < kv_len) & (offs_d[None, :] < head_dim),
                other=0.0,
            )
            dq += dot_pv(ds, k, WIDEN_DOT, IEEE)
    tl.store(
        DQ + (row0 + offs_m[:, None]) * head_dim + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
    )


class TritonForward:
    """triton's forward for calls of one metadata: what the call's metadata decides (the
    output's dtype and shape, the variant's kernel arguments with their device tables and
    dummies, the grid and the sizes) worked out once; a call binds its own q, k, v and
    launches. attnperf.plans keeps one per call metadata (`Backend.forward_for`): a GPU
    call's host time is what a short call pays.

    forward(query, key, value) -> (out (B, Hq, L, Ev) in the inputs' dtype, softmax stats
    (B, Hq, L, 2) fp32: each row's base-2 max and sum, 0 and 0 for a row that sees no key,
    a bf16 or fp16 out's rounding residual where an input requires grad, else None:
    `FusedBackend`), of a call with the metadata it was made for, its mask and other tensor
    variants those of the call it was made of."""

    def __init__(self, inputs: AttentionInputs):
        query = inputs.query
        self.dtype, self.device = query.dtype, query.device
        self.keep_residual = inputs.differentiable and query.dtype in ROUNDED_DTYPES
        # Stored in fp32 where a residual is kept: the kernel's rounding leaves none to keep.
        self.out_dtype = torch.float32 if self.keep_residual else store_dtype(query.dtype)
        self.out_shape = (*query.shape[:3], inputs.value_dim)
        self.stats_shape = (*query.shape[:3], 2)
        self.no_work = not inputs.has_pairs and inputs.variant.sinks is None  # no key is seen
        self.zero = inputs.has_padding  # no kernel writes a padded batch's padding rows
        if self.no_work:
            return
        mask, self.mask_strides, mask_kind = mask_args(inputs, query)
        self.mask = None if inputs.attn_mask is None else mask  # None: the query stands for it
        variant_args, variant_flags = lower_variant(inputs)
        sequences = inputs.sequences
        longest, heads = sequences.max_q_len, sequences.count * inputs.q_heads
        self.grid = lambda meta: (triton.cdiv(longest, meta["BLOCK_M"]), heads)
        self.sizes = (
            inputs.q_heads, inputs.q_heads // inputs.kv_heads, inputs.q_len, inputs.head_dim,
            inputs.value_dim, inputs.scale * LOG2E, next_power_of_2(longest),
            next_power_of_2(sequences.max_kv_len), math.gcd(*sequences.table[:, 4].tolist()),
        )  # fmt: skip
        self.keywords = {**variant_args, **sink_args(inputs), "MASK_KIND": mask_kind,
                         **variant_flags, **kernel_flags(inputs)}  # fmt: skip

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        q, k, v = query.detach(), key.detach(), value.detach()
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        stats = torch.empty(self.stats_shape, dtype=torch.float32, device=self.device)
        if self.no_work:
            out, residual = rounded_output(out.zero_(), self.dtype, self.keep_residual)
            return out, stats.zero_(), residual
        if self.zero:
            out.zero_(), stats.zero_()
        mask = q if self.mask is None else self.mask
        online_softmax_forward_kernel[self.grid](
            q, k, v, mask, out, stats, *q.stride(), *k.stride(), *v.stride(), *self.mask_strides,
            *out.stride(), *self.sizes, **self.keywords,
        )  # fmt: skip
        out, residual = rounded_output(out, self.dtype, self.keep_residual)
        return out, stats, residual


def triton_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    """`TritonForward`'s result for this call."""
    return TritonForward(inputs)(inputs.query, inputs.key, inputs.value)


def triton_forward_for(inputs: AttentionInputs) -> TritonForward | None:
    """triton's `Backend.forward_for`: the forward for calls with `inputs`' metadata, where
    no variant is a tensor (a mask, ALiBi slopes, a block layout or sinks: the forward
    holds the call's own), else None."""
    return None if inputs.has_tensor_variant else TritonForward(inputs)


def triton_attention_backward(
    inputs: AttentionInputs,
    out: Tensor,
    stats: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None = None,
    partial_keys: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) by FlashAttention-2's deterministic scheme; `grad_lse`
    (B, Hq, L), the LSE's gradient, only shifts delta = rowsum(dO * O), which serves
    `partial_keys` (out and stats a larger attention's) as it is."""
    q, k, v = inputs.query.detach(), inputs.key.detach(), inputs.value.detach()
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len = inputs.kv_heads, inputs.kv_len
    grad_dtype = store_dtype(q.dtype)
    dq = torch.zeros((*q.shape[:3], inputs.head_dim), dtype=grad_dtype, device=q.device)
    dk = torch.zeros((batch, kv_heads, kv_len, inputs.head_dim), dtype=grad_dtype, device=q.device)
    dv = torch.zeros((batch, kv_heads, kv_len, inputs.value_dim), dtype=grad_dtype, device=q.device)
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask = None  # the float mask's gradient, (B, Hq, L, S) by nature: only when wanted
    if want_dmask:
        dmask = torch.zeros((batch, q_heads, q_len, kv_len), dtype=torch.float32, device=q.device)
    if not inputs.has_pairs:
        return _finish_grads(inputs, dq, dk, dv, dmask)
    grad_out = grad_out.contiguous()
    out = out.contiguous()
    delta = torch.empty((batch, q_heads, q_len), dtype=torch.float32, device=q.device)
    flags = kernel_flags(inputs)
    rows = batch * q_heads * q_len
    attention_backward_preprocess[(triton.cdiv(rows, 64),)](
        out, grad_out, delta, rows, inputs.value_dim, BLOCK_M=64, BLOCK_DV=flags["BLOCK_DV"]
    )
    if grad_lse is not None:  # adds p * dLSE to every dS: the same as lowering delta by it
        delta -= torch.where(stats[..., 1] > 0, grad_lse.detach().float(), 0.0)
    mask, mask_strides, mask_kind = mask_args(inputs, q)
    variant_args, variant_flags = lower_variant(inputs)
    block, stages = backward_config(inputs, q.device.index)
    common = (*q.stride(), *k.stride(), *v.stride(), *mask_strides)
    sequences = inputs.sequences
    dkdv_grid = (triton.cdiv(sequences.max_kv_len, block), sequences.count * kv_heads)
    attention_backward_dkdv_kernel[dkdv_grid](
        q, k, v, mask, grad_out, stats, delta, dk, dv, *common, q_heads, kv_heads,
        q_heads // kv_heads, q_len, kv_len, inputs.head_dim, inputs.value_dim,
        inputs.scale * LOG2E, inputs.scale, **variant_args, MASK_KIND=mask_kind,
        **variant_flags, BLOCK_M=block, BLOCK_N=block, num_stages=stages, **flags,
    )  # fmt: skip
    dq_grid = (triton.cdiv(sequences.max_q_len, block), sequences.count * q_heads)
    attention_backward_dq_kernel[dq_grid](
        q, k, v, mask, grad_out, stats, delta, dq, dq if dmask is None else dmask, *common,
        q_heads, q_heads // kv_heads, q_len, kv_len, inputs.head_dim, inputs.value_dim,
        inputs.scale * LOG2E, inputs.scale, **variant_args, MASK_KIND=mask_kind,
        **variant_flags, WANT_DMASK=want_dmask, BLOCK_M=block, BLOCK_N=block,
        num_stages=stages, **flags,
    )  # fmt: skip
    return _finish_grads(inputs, dq, dk, dv, dmask)


def _finish_grads(inputs, dq, dk, dv, dmask):
    dtype = inputs.dtype
    dmask = None if dmask is None else dmask.to(inputs.attn_mask.dtype)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dmask
