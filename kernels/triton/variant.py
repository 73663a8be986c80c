"""A call's variant lowered once for the kernels, and the helpers that every kernel, forward
and backward, shares: the tile ranges of the band and the layout, the score modification
(softcap, mask, ALiBi, band, block layout) and the tile products."""

from __future__ import annotations

import torch
from torch import Tensor

from attnperf.inputs import AttentionInputs
from attnperf.kernels.triton.jit import LOG2E, MASK_BOOL, MASK_FLOAT, MASK_NONE, jit, on_device, tl
from attnperf.serving import KVCacheInputs

# A call's variant is lowered once (`lower_variant`) into runtime arguments shared by every
# kernel: the band (left, right around the diagonal i + offset; UNBOUNDED when open),
# softcap2 = softcap * log2(e), the ALiBi slopes * log2(e) and the block layout (kinds,
# partial_index, partial with their strides), and constexprs saying which are present.
UNBOUNDED = 1 << 30


@jit
def sequence(Sequences, b):
    """(slot, q_start, q_len, k_start, k_len, offset) of sequence b: a row of
    attnperf.inputs.Sequences' table (int64, so that row offsets times strides never
    overflow)."""
    row = Sequences + b * 6
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4), tl.load(row + 5))  # fmt: skip


@jit
def base2_bias(value):
    """A float mask's values in base 2: finite stays finite (finfo.min, a common "masked"
    value, times log2(e) would overflow to -inf and empty a row that SDPA averages)."""
    scaled = value * 1.4426950408889634
    finite = tl.abs(value) < float("inf")
    return tl.where(finite, tl.minimum(tl.maximum(scaled, -3.4028234663852886e38),
                                       3.4028234663852886e38), scaled)  # fmt: skip


@jit
def tanh(x):
    """tanh in fp32 from exp2 (the interpreter has no libdevice): Cephes' tanhf, an odd
    polynomial below 0.625, else 1 - 2 / (e^2|x| + 1)."""
    a = tl.minimum(tl.abs(x), 10.0)
    large = 1.0 - 2.0 / (tl.math.exp2(a * 2.8853900817779268) + 1.0)
    large = tl.where(x >= 0, large, -large)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    return tl.where(a < 0.625, p * z * x + x, large)


@jit
def key_tile_range(start_m, q_len, kv_len, left, right, offset,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(lo, full_lo, full_hi, hi) for query rows start_m ..: the key tiles from lo (a
    multiple of BLOCK_N) up to hi hold every key the band lets them see; those starting in
    [full_lo, full_hi) lie inside the band for every row and need no band mask."""
    last_m = tl.minimum(start_m + BLOCK_M, q_len) - 1
    lo = tl.maximum(start_m + offset - left, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(tl.minimum(last_m + offset + right + 1, kv_len), lo)
    full_lo = (tl.maximum(last_m + offset - left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(start_m + offset + right + 1, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@jit
def query_tile_range(start_n, q_len, left, right, offset,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(lo, hi): query tiles from lo (a multiple of BLOCK_M) up to hi hold every row that
    may see keys start_n .. start_n + BLOCK_N - 1 in the band."""
    lo = tl.maximum(start_n - offset - right, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N - 1 - offset + left + 1, q_len)
    return lo, tl.maximum(hi, lo)


@jit
def layout_kinds(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                 LAYOUT_Q: tl.constexpr, LAYOUT_K: tl.constexpr):  # fmt: skip
    """The block layout's kind of each element's block (EMPTY outside L x S)."""
    in_bounds = (offs_m[:, None] < q_len) & (offs_n[None, :] < kv_len)
    blocks = (offs_m // LAYOUT_Q)[:, None] * lkq + (offs_n // LAYOUT_K)[None, :]
    return tl.load(Kinds + b * lkb + h * lkh + blocks, mask=in_bounds, other=0).to(tl.int32)


@jit
def tile_seen(
    Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
    HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr, LAYOUT_K: tl.constexpr,
):  # fmt: skip
    """Whether the block layout leaves anything of the tile (always, without a layout)."""
    if HAS_LAYOUT:
        kinds = layout_kinds(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                             LAYOUT_Q, LAYOUT_K)  # fmt: skip
        return tl.max(tl.max(kinds, 1), 0) != 0
    return True


@jit
def modify_scores(
    s, b, h, offs_m, offs_n, q_len, kv_len,
    Mask, smb, smh, smm, smn, left, right, offset, softcap2, Alibi, q_heads,
    Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, APPLY_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """Base-2 scaled scores of one tile, modified: softcap, attn_mask, ALiBi, the band
    (where APPLY_BAND), the block layout and the ragged edge; -inf where excluded.
    Returns (scores, the softcap's gradient factor 1 - tanh^2, or 1.0 without one)."""
    dtanh = 1.0
    if HAS_SOFTCAP:
        t = tanh(s / softcap2)
        s = softcap2 * t
        dtanh = 1.0 - t * t
    in_bounds = (offs_m[:, None] < q_len) & (offs_n[None, :] < kv_len)
    if MASK_KIND != 0:
        mask_ptrs = Mask + b * smb + h * smh + offs_m[:, None] * smm + offs_n[None, :] * smn
        if MASK_KIND == 2:
            s += base2_bias(tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32))
        else:  # bool: added as 0 / -inf like SDPA, so a NaN score stays NaN
            allowed = tl.load(mask_ptrs, mask=in_bounds, other=1) != 0
            s += tl.where(allowed, 0.0, float("-inf"))
    # Key j's distance right of row i's diagonal, j - (i + offset).
    distance = offs_n[None, :] - (offs_m[:, None] + offset)
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * q_heads + h)
        s -= slope * tl.abs(distance).to(tl.float32)
    if APPLY_BAND:
        s = tl.where((distance >= -left) & (distance <= right), s, float("-inf"))
    if HAS_LAYOUT:
        kinds = layout_kinds(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                             LAYOUT_Q, LAYOUT_K)  # fmt: skip
        blocks = (offs_m // LAYOUT_Q)[:, None] * lkq + (offs_n // LAYOUT_K)[None, :]
        partial = kinds == 1  # attnperf.layouts.PARTIAL (kernels see literals, not globals)
        index = tl.load(PartialIndex + b * lkb + h * lkh + blocks, mask=partial, other=0)
        inside = (offs_m % LAYOUT_Q)[:, None] * LAYOUT_K + (offs_n % LAYOUT_K)[None, :]
        bits = tl.load(Partial + index.to(tl.int64) * (LAYOUT_Q * LAYOUT_K) + inside,
                       mask=partial, other=0)  # fmt: skip
        s = tl.where((kinds == 2) | (partial & (bits != 0)), s, float("-inf"))  # 2: FULL
    if not EVEN_N:
        s = tl.where(offs_n[None, :] < kv_len, s, float("-inf"))
    return s, dtanh


@jit
def with_sink(m_i, l_i, sink2):
    """(max, sum, rescale) of rows' base-2 statistics with a sink term 2 ** sink2 added to
    each sum, and the factor by which their accumulators shrink. Rows that saw no key (sum
    0) get (sink2, 1, 0)."""
    seen = l_i > 0
    largest = tl.where(seen, tl.maximum(m_i, sink2), sink2)
    rescale = tl.where(seen, tl.math.exp2(m_i - largest), 0.0)
    return largest, l_i * rescale + tl.math.exp2(sink2 - largest), rescale


def sink_args(inputs: AttentionInputs | KVCacheInputs) -> dict:
    """The kernels' Sinks ((Hq,) sinks * log2(e), float32; a dummy without) and HAS_SINKS."""
    sinks = inputs.variant.sinks
    if sinks is None:
        return {"Sinks": torch.zeros(1, dtype=torch.float32, device=inputs.device),
                "HAS_SINKS": False}  # fmt: skip
    return {"Sinks": (sinks.detach().float() * LOG2E).contiguous(), "HAS_SINKS": True}


@jit
def tile_scores(q, K, offs_n, kv_len, head_dim, scale2, skn, skd,
                BLOCK_D: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """scale * log2(e) * q k^T of one tile, in fp32."""
    offs_d = tl.arange(0, BLOCK_D)
    k = tl.load(
        K + offs_n[None, :] * skn + offs_d[:, None] * skd,
        mask=(offs_n[None, :] < kv_len) & (offs_d[:, None] < head_dim),
        other=0.0,
    )
    if WIDEN_DOT:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32))
    elif IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    return s * scale2


@jit
def dot_pv(p, v, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr):
    if WIDEN_DOT:
        return tl.dot(p, v.to(tl.float32))
    if IEEE:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


def mask_args(inputs: AttentionInputs, like: Tensor) -> tuple[Tensor, tuple[int, ...], int]:
    """The mask tensor (a dummy when absent), its 4 strides (0 where broadcast) and kind."""
    mask = inputs.attn_mask
    if mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    return mask.detach(), mask.stride(), MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT


def lower_variant(inputs: AttentionInputs | KVCacheInputs) -> tuple[dict, dict]:
    """The call's variant as the kernels' runtime arguments and constexprs (see UNBOUNDED)."""
    variant, device = inputs.variant, inputs.device
    left, right = inputs.band or (None, None)
    slopes = variant.alibi_slopes
    layout = variant.block_mask
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    args = {
        "left": UNBOUNDED if left is None else min(left, UNBOUNDED),
        "right": UNBOUNDED if right is None else min(right, UNBOUNDED),
        "Sequences": on_device(inputs.sequences.table, device),
        "softcap2": variant.softcap * LOG2E if variant.softcap is not None else 1.0,
        "Alibi": dummy if slopes is None else (slopes * LOG2E).float().contiguous(),
        "Kinds": dummy, "PartialIndex": dummy, "Partial": dummy, "lkb": 0, "lkh": 0, "lkq": 0,
    }  # fmt: skip
    flags = {
        "HAS_BAND": inputs.band is not None,
        "HAS_SOFTCAP": variant.softcap is not None,
        "HAS_ALIBI": slopes is not None,
        "HAS_LAYOUT": layout is not None,
        "LAYOUT_Q": 16,
        "LAYOUT_K": 16,
    }
    if layout is not None:
        kinds = layout.kinds.contiguous()
        args.update(
            Kinds=kinds,
            PartialIndex=layout.partial_index.contiguous(),
            # Never empty: a pointer to nothing would still be read under a false mask.
            Partial=layout.partial if len(layout.partial) else torch.zeros(
                (1, *layout.block_size), dtype=torch.bool, device=device),
            lkb=kinds.stride(0) if kinds.shape[0] > 1 else 0,
            lkh=kinds.stride(1) if kinds.shape[1] > 1 else 0,
            lkq=kinds.stride(2),
        )  # fmt: skip
        flags.update(LAYOUT_Q=layout.block_size[0], LAYOUT_K=layout.block_size[1])
    return args, flags
