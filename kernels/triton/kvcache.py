"""KV-cache decoding: split-K attention over a paged cache (a contiguous one is B pages),
merged exactly by a second kernel."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnperf.kernels.triton.jit import (
    INTERPRET,
    LOG2E,
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
    modify_scores,
    sequence,
    sink_args,
    with_sink,
)
from attnperf.serving import KVCacheInputs


@jit
def kvcache_split_kernel(
    Q, KPages, VPages, KScale, VScale, BlockTable, PartialOut, PartialStats,
    sqb, sqh, sqm, sqd, skp, skn, skh, skd, svp, svn, svh, svd, sbb,
    sksp, sksn, sksh, svsp, svsn, svsh, k_group, v_group,
    batch, q_heads, kv_heads, group, q_len, head_dim, value_dim, page_size, splits, scale2,
    Sequences, left, right, softcap2, Alibi,
    HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    QUANTIZED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One split of one (sequence, key/value head) over a paged cache: the rows of every
    query head of the group together (FlashAttention's "pack GQA": K and V read once per
    key/value head), row r being head hk * group + r // Lq at position r % Lq. Stores the
    unnormalised accumulator in PartialOut (splits, B, Hq, Lq, Ev) and each row's base-2
    max and sum in PartialStats (splits, B, Hq, Lq, 2), contiguous. QUANTIZED: the pages
    hold int8 codes, dequantized as they load with KScale, VScale (one float32 per group of
    k_group / v_group values of a row; unit stride along the groups), products in IEEE
    fp32."""
    split = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // kv_heads
    hk = bhk % kv_heads
    _, _, _, k_start, kv_len, offset = sequence(Sequences, b)
    offs_r = tl.arange(0, BLOCK_M)
    heads = hk * group + offs_r // q_len
    positions = offs_r % q_len
    row_ok = offs_r < group * q_len
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * sqb + heads[:, None] * sqh + positions[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # BLOCK_M >= Lq: the range of query rows 0 .. Lq - 1.
    lo, _, _, hi = key_tile_range(0, q_len, kv_len, left, right, offset, BLOCK_M, BLOCK_N)
    chunk = tl.cdiv(tl.cdiv(hi - lo, splits), BLOCK_N) * BLOCK_N
    first = lo + split * chunk
    end = tl.minimum(first + chunk, hi)
    for start_n in range(first, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        cache_rows = k_start + offs_n  # key j is cache row k_start + j
        page = tl.load(BlockTable + b * sbb + cache_rows // page_size, mask=in_range, other=0)
        rows_k = page * skp + (cache_rows % page_size) * skn + hk * skh
        k_mask = in_range[None, :] & (offs_d[:, None] < head_dim)
        k = tl.load(KPages + rows_k[None, :] + offs_d[:, None] * skd, mask=k_mask, other=0)
        if QUANTIZED:
            scales_k = page * sksp + (cache_rows % page_size) * sksn + hk * sksh
            k_scale = tl.load(KScale + scales_k[None, :] + (offs_d // k_group)[:, None],
                              mask=k_mask, other=0.0)  # fmt: skip
            k = k.to(tl.float32) * k_scale
            s = tl.dot(q.to(tl.float32), k, input_precision="ieee")
        elif WIDEN_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        elif IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s, _dtanh = modify_scores(
            s * scale2, b, heads[:, None], positions, offs_n, q_len, end, Q, 0, 0, 0, 0, left,
            right, offset, softcap2, Alibi, q_heads, Q, Q, Q, 0, 0, 0, 0, HAS_BAND,
            HAS_SOFTCAP, HAS_ALIBI, False, 16, 16, False,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - shift[:, None])
        alpha = tl.math.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        rows_v = page * svp + (cache_rows % page_size) * svn + hk * svh
        v_mask = in_range[:, None] & (offs_dv[None, :] < value_dim)
        v = tl.load(VPages + rows_v[:, None] + offs_dv[None, :] * svd, mask=v_mask, other=0)
        if QUANTIZED:
            scales_v = page * svsp + (cache_rows % page_size) * svsn + hk * svsh
            v_scale = tl.load(VScale + scales_v[:, None] + (offs_dv // v_group)[None, :],
                              mask=v_mask, other=0.0)  # fmt: skip
            pv = tl.dot(p, v.to(tl.float32) * v_scale, input_precision="ieee")
        else:
            pv = dot_pv(p, v, WIDEN_DOT, IEEE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    rows = ((split * batch + b) * q_heads + heads) * q_len + positions
    tl.store(PartialOut + rows[:, None] * value_dim + offs_dv[None, :], acc,
             mask=row_ok[:, None] & (offs_dv[None, :] < value_dim))  # fmt: skip
    tl.store(PartialStats + rows * 2, tl.where(l_i == 0.0, 0.0, m_i), mask=row_ok)
    tl.store(PartialStats + rows * 2 + 1, l_i, mask=row_ok)


@jit
def merge_splits_kernel(
    PartialOut, PartialStats, Out, Stats, Sinks, rows, splits, value_dim, q_heads, q_len,
    HAS_SINKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Out (rows, Ev) and Stats (rows, 2) of the splits' partial softmaxes combined exactly:
    merge_attention's rule in base 2, on unnormalised accumulators; row r is head
    (r // q_len) % q_heads, whose sink, if any, is applied once here."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_r < rows
    largest = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for split in range(splits):
        stats = PartialStats + (split * rows + offs_r) * 2
        part_max = tl.load(stats, mask=row_ok, other=0.0)
        part_sum = tl.load(stats + 1, mask=row_ok, other=0.0)
        largest = tl.where(part_sum > 0, tl.maximum(largest, part_max), largest)
    shift = tl.where(largest == float("-inf"), 0.0, largest)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for split in range(splits):
        stats = PartialStats + (split * rows + offs_r) * 2
        part_max = tl.load(stats, mask=row_ok, other=0.0)
        part_sum = tl.load(stats + 1, mask=row_ok, other=0.0)
        weight = tl.where(part_sum > 0, tl.math.exp2(part_max - shift), 0.0)
        total += part_sum * weight
        part_rows = PartialOut + (split * rows + offs_r[:, None]) * value_dim
        part_mask = row_ok[:, None] & (offs_dv[None, :] < value_dim)
        part = tl.load(part_rows + offs_dv[None, :], mask=part_mask, other=0.0)
        acc += part * weight[:, None]
    if HAS_SINKS:
        sink2 = tl.load(Sinks + (offs_r // q_len) % q_heads)
        shift, total, rescale = with_sink(shift, total, sink2)
        acc = acc * rescale[:, None]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(Out + offs_r[:, None] * value_dim + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < value_dim))  # fmt: skip
    tl.store(Stats + offs_r * 2, shift, mask=row_ok)
    tl.store(Stats + offs_r * 2 + 1, total, mask=row_ok)


def kvcache_splits(inputs: KVCacheInputs) -> int:
    """How many chunks each sequence's keys are split into: as asked, else enough that the
    (batch, kv head, split) programs fill the GPU's SMs twice over, with at least
    MIN_SPLIT_KEYS keys each (1 under the interpreter)."""
    if inputs.num_splits or INTERPRET:
        return inputs.num_splits or 1
    items = inputs.batch * inputs.kv_heads
    sms = torch.cuda.get_device_properties(inputs.device).multi_processor_count
    if items == 0 or items >= sms:
        return 1
    return max(1, min(math.ceil(2 * sms / items), inputs.sequences.max_kv_len // MIN_SPLIT_KEYS))


MIN_SPLIT_KEYS = 256


def triton_kvcache_forward(inputs: KVCacheInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Lq, Ev) in the inputs' dtype, stats (B, Hq, Lq, 2)): split-K over a
    paged cache (a contiguous one is B pages), merged exactly by a second kernel."""
    q = inputs.query
    batch, q_heads, q_len, _ = q.shape
    shape = (batch, q_heads, q_len)
    splits = kvcache_splits(inputs)
    partial_out = torch.empty((splits, *shape, inputs.value_dim), dtype=torch.float32,
                              device=q.device)  # fmt: skip
    partial_stats = torch.empty((splits, *shape, 2), dtype=torch.float32, device=q.device)
    out = torch.zeros((*shape, inputs.value_dim), dtype=store_dtype(q.dtype), device=q.device)
    stats = torch.zeros((*shape, 2), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or q_heads == 0:
        return out.to(q.dtype), stats
    variant_args, variant_flags = lower_variant(inputs)
    flags = kernel_flags(inputs)
    k_pages, v_pages, table = inputs.k_pages.detach(), inputs.v_pages.detach(), inputs.block_table
    group = q_heads // inputs.kv_heads
    quantized = inputs.quantized
    if quantized:
        k_scale, v_scale = inputs.k_scale.contiguous(), inputs.v_scale.contiguous()
        groups = (inputs.head_dim // k_scale.shape[3], inputs.value_dim // v_scale.shape[3])
        scale_strides = (*k_scale.stride()[:3], *v_scale.stride()[:3])
    else:  # dummies, never read
        k_scale = v_scale = partial_stats
        groups, scale_strides = (1, 1), (0,) * 6
    kvcache_split_kernel[(splits, batch * inputs.kv_heads)](
        q.detach(), k_pages, v_pages, k_scale, v_scale, table, partial_out, partial_stats,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), table.stride(0), *scale_strides,
        *groups, batch, q_heads, inputs.kv_heads,
        group, q_len, inputs.head_dim, inputs.value_dim, inputs.page_size, splits,
        inputs.scale * LOG2E, variant_args["Sequences"], variant_args["left"],
        variant_args["right"], variant_args["softcap2"], variant_args["Alibi"],
        HAS_BAND=variant_flags["HAS_BAND"], HAS_SOFTCAP=variant_flags["HAS_SOFTCAP"],
        HAS_ALIBI=variant_flags["HAS_ALIBI"], QUANTIZED=quantized,
        BLOCK_M=max(16, next_power_of_2(group * q_len)),
        BLOCK_N=16 if INTERPRET else 64, **flags,
    )  # fmt: skip
    rows = batch * q_heads * q_len
    sinks = sink_args(inputs)
    merge_splits_kernel[(triton.cdiv(rows, 16),)](
        partial_out, partial_stats, out, stats, sinks["Sinks"], rows, splits,
        inputs.value_dim, q_heads, q_len, HAS_SINKS=sinks["HAS_SINKS"], BLOCK_R=16,
        BLOCK_DV=flags["BLOCK_DV"],
    )  # fmt: skip
    return out.to(q.dtype), stats
