"""The triton backend: a fused FlashAttention-2-style GPU kernel, forward and backward.

One program per (query tile, batch x head) loops over key tiles with a running max and sum
in base 2 (log2(e) folded into the scale). Masks are read tile by tile through their
broadcast strides, GQA is index arithmetic, ragged edges are masked. The backward pass is
FlashAttention-2's: a rowsum(dO * O) preprocess, a dK/dV kernel and a dQ kernel,
deterministic (no atomics). Without a GPU the kernels run on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, set before attnperf's kernels are first used).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from attnperf.backend import FEATURES, Capabilities, FusedBackend
from attnperf.inputs import AttentionInputs
from attnperf.serving import KVCacheInputs

try:
    import triton
    import triton.language as tl

    _MISSING = None
except ImportError as error:
    triton = tl = None
    _MISSING = f"triton is not installed ({error}); pip install 'attnperf[gpu]'"

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
MAX_HEAD_DIM = 256


def _jit(function):
    return triton.jit(function) if triton is not None else function


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ---------------------------------------------------------------------------- tuning
def forward_configs() -> list:
    """Autotune space of the forward kernel; one small config under the interpreter."""
    if triton is None:
        return []
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # (BLOCK_M, BLOCK_N, warps, stages): few enough that tuning every key stays in seconds;
    # the last ones are small enough for fp32 at head dim 256 (and a last resort).
    shapes = (
        (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3), (64, 32, 4, 4),
        (32, 32, 4, 2), (32, 16, 4, 1),
    )  # fmt: skip
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


def shared_memory_limit(device_index: int) -> int:
    """Bytes of shared memory one block may use on this GPU (what Triton checks at launch)."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return properties["max_shared_mem"]


def forward_shared_bytes(config, head_dim: int, value_dim: int, element: int, masked: bool):
    """Shared memory of the forward kernel: K and V tiles per pipeline stage, the Q tile, a
    mask tile. Never below what the compiler took for sm_90 in
    `python benches/triton_compile_check.py` (fp16, bf16, fp32; head dims 64 to 256)."""
    m, n, stages = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages
    kv_tiles = stages * n * (head_dim + value_dim) * element
    return kv_tiles + m * head_dim * element + (m * n * 4 if masked else 0) + 1024


def prune_forward_configs(configs, named_args, **kwargs):
    """Keep the tiles that fit this GPU's shared memory, are not too large for the registers
    at large head dims, and do not dwarf short sequences; at worst the smallest tile."""
    args = {**named_args, **kwargs}
    head_dim, value_dim = args["BLOCK_D"], args["BLOCK_DV"]
    query = args["Q"]
    limit = shared_memory_limit(query.device.index)
    masked = args["MASK_KIND"] != MASK_NONE
    kept = [
        c
        for c in configs
        if c.kwargs["BLOCK_N"] * max(head_dim, value_dim) <= 128 * 128
        and c.kwargs["BLOCK_M"] * max(head_dim, value_dim) <= 128 * 256
        and c.kwargs["BLOCK_M"] <= max(args["q_len_class"], 64)
        and forward_shared_bytes(c, head_dim, value_dim, query.element_size(), masked) <= limit
    ]
    return kept or configs[-1:]


# Backward (BLOCK_M = BLOCK_N, pipeline stages, shared bytes per padded head-dim element per
# input byte), fastest first. The bytes are the most that the dK/dV or the dQ kernel took
# compiled for sm_90 (`python benches/triton_compile_check.py`, fp16 and fp32, head dims 64
# to 256); a mask adds a tile.
BACKWARD_CONFIGS = (
    (64, 3, 704),
    (64, 2, 512),
    (32, 3, 264),
    (32, 2, 168),
    (64, 1, 288),
    (32, 1, 136),
)


def backward_config(inputs: AttentionInputs, device_index: int) -> tuple[int, int]:
    """(block, stages) of the backward kernels: the fastest that fits the GPU's shared memory."""
    if INTERPRET:
        return 32, 1
    dim = max(_next_power_of_2(inputs.head_dim), _next_power_of_2(inputs.value_dim), 16)
    element = inputs.query.element_size()
    limit = shared_memory_limit(device_index)
    for block, stages, per_element in BACKWARD_CONFIGS:
        mask_tile = block * block * 4 if inputs.attn_mask is not None else 0
        if per_element * dim * element + mask_tile + 1024 <= limit:
            return block, stages
    raise RuntimeError(
        f"triton backward: head dim {inputs.head_dim} in {inputs.dtype} needs more shared "
        f"memory per block than this GPU's {limit} bytes"
    )


def _autotune(**kwargs):
    if triton is None:
        return lambda function: function
    return triton.autotune(**kwargs)


# ---------------------------------------------------------------------------- kernels
# A call's variant is lowered once (`lower_variant`) into runtime arguments shared by every
# kernel: the band (left, right around the diagonal i + offset; UNBOUNDED when open),
# softcap2 = softcap * log2(e), the ALiBi slopes * log2(e) and the block layout (kinds,
# partial_index, partial with their strides), and constexprs saying which are present.
UNBOUNDED = 1 << 30


@_jit
def sequence(Sequences, b):
    """(slot, q_start, q_len, k_start, k_len, offset) of sequence b: a row of
    attnperf.inputs.Sequences' table (int64, so that row offsets times strides never
    overflow)."""
    row = Sequences + b * 6
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4), tl.load(row + 5))  # fmt: skip


@_jit
def base2_bias(value):
    """A float mask's values in base 2: finite stays finite (finfo.min, a common "masked"
    value, times log2(e) would overflow to -inf and empty a row that SDPA averages)."""
    scaled = value * 1.4426950408889634
    finite = tl.abs(value) < float("inf")
    return tl.where(finite, tl.minimum(tl.maximum(scaled, -3.4028234663852886e38),
                                       3.4028234663852886e38), scaled)  # fmt: skip


@_jit
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


@_jit
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


@_jit
def query_tile_range(start_n, q_len, left, right, offset,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(lo, hi): query tiles from lo (a multiple of BLOCK_M) up to hi hold every row that
    may see keys start_n .. start_n + BLOCK_N - 1 in the band."""
    lo = tl.maximum(start_n - offset - right, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N - 1 - offset + left + 1, q_len)
    return lo, tl.maximum(hi, lo)


@_jit
def layout_kinds(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                 LAYOUT_Q: tl.constexpr, LAYOUT_K: tl.constexpr):  # fmt: skip
    """The block layout's kind of each element's block (EMPTY outside L x S)."""
    in_bounds = (offs_m[:, None] < q_len) & (offs_n[None, :] < kv_len)
    blocks = (offs_m // LAYOUT_Q)[:, None] * lkq + (offs_n // LAYOUT_K)[None, :]
    return tl.load(Kinds + b * lkb + h * lkh + blocks, mask=in_bounds, other=0).to(tl.int32)


@_jit
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


@_jit
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


@_jit
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


@_jit
def dot_pv(p, v, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr):
    if WIDEN_DOT:
        return tl.dot(p, v.to(tl.float32))
    if IEEE:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@_autotune(
    configs=forward_configs(),
    key=["q_len_class", "kv_len_class", "head_dim", "value_dim", "MASK_KIND", "HAS_BAND",
         "HAS_SOFTCAP", "HAS_ALIBI", "HAS_LAYOUT"],
    prune_configs_by={"early_config_prune": prune_forward_configs},
)  # fmt: skip
@(
    triton.heuristics({"EVEN_N": lambda args: args["kv_len_gcd"] % args["BLOCK_N"] == 0})
    if triton
    else (lambda f: f)
)
@_jit
def online_softmax_forward_kernel(
    Q, K, V, Mask, Out, Stats,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod,
    q_heads, group, q_rows, head_dim, value_dim, scale2, q_len_class, kv_len_class, kv_len_gcd,
    Sequences, left, right, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """Out (B, Hq, L, Ev) and Stats (B, Hq, L, 2), each row's base-2 max and sum, for one
    query tile of one sequence (q_rows: the query array's L)."""
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


@_jit
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


@_jit
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


@_jit
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


@_jit
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


@_jit
def kvcache_split_kernel(
    Q, KPages, VPages, BlockTable, PartialOut, PartialStats,
    sqb, sqh, sqm, sqd, skp, skn, skh, skd, svp, svn, svh, svd, sbb,
    batch, q_heads, kv_heads, group, q_len, head_dim, value_dim, page_size, splits, scale2,
    Sequences, left, right, softcap2, Alibi,
    HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One split of one (sequence, key/value head) over a paged cache: the rows of every
    query head of the group together (FlashAttention's "pack GQA": K and V read once per
    key/value head), row r being head hk * group + r // Lq at position r % Lq. Stores the
    unnormalised accumulator in PartialOut (splits, B, Hq, Lq, Ev) and each row's base-2
    max and sum in PartialStats (splits, B, Hq, Lq, 2), contiguous."""
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
        k = tl.load(KPages + rows_k[None, :] + offs_d[:, None] * skd,
                    mask=in_range[None, :] & (offs_d[:, None] < head_dim), other=0.0)  # fmt: skip
        if WIDEN_DOT:
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
        v = tl.load(VPages + rows_v[:, None] + offs_dv[None, :] * svd,
                    mask=in_range[:, None] & (offs_dv[None, :] < value_dim), other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + dot_pv(p, v, WIDEN_DOT, IEEE)
        m_i = m_new
    rows = ((split * batch + b) * q_heads + heads) * q_len + positions
    tl.store(PartialOut + rows[:, None] * value_dim + offs_dv[None, :], acc,
             mask=row_ok[:, None] & (offs_dv[None, :] < value_dim))  # fmt: skip
    tl.store(PartialStats + rows * 2, tl.where(l_i == 0.0, 0.0, m_i), mask=row_ok)
    tl.store(PartialStats + rows * 2 + 1, l_i, mask=row_ok)


@_jit
def merge_splits_kernel(
    PartialOut, PartialStats, Out, Stats, rows, splits, value_dim,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Out (rows, Ev) and Stats (rows, 2) of the splits' partial softmaxes combined exactly:
    merge_attention's rule in base 2, on unnormalised accumulators."""
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
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(Out + offs_r[:, None] * value_dim + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < value_dim))  # fmt: skip
    tl.store(Stats + offs_r * 2, shift, mask=row_ok)
    tl.store(Stats + offs_r * 2 + 1, total, mask=row_ok)


# ---------------------------------------------------------------------------- launchers
def _mask_args(inputs: AttentionInputs, like: Tensor) -> tuple[Tensor, tuple[int, ...], int]:
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
        "Sequences": inputs.sequences.table.to(device),
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


def _kernel_flags(inputs: AttentionInputs) -> dict:
    return {
        "BLOCK_D": max(_next_power_of_2(inputs.head_dim), 16),
        "BLOCK_DV": max(_next_power_of_2(inputs.value_dim), 16),
        # The interpreter's low-precision dot is wrong: widen to fp32 there only.
        "WIDEN_DOT": INTERPRET,
        # fp32 inputs are computed in IEEE fp32, not TF32, so they match SDPA's fp32.
        "IEEE": inputs.dtype == torch.float32,
    }


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter casts fp32 to bf16 by truncation: there, results are stored in fp32
    and rounded by torch."""
    return torch.float32 if INTERPRET and dtype == torch.bfloat16 else dtype


def triton_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, L, Ev) in the inputs' dtype, softmax stats (B, Hq, L, 2) fp32: each
    row's base-2 max and sum, 0 and 0 for a row that sees no key)."""
    q, k, v = inputs.query.detach(), inputs.key.detach(), inputs.value.detach()
    q_heads, q_len = q.shape[1], q.shape[2]
    out_dtype = _store_dtype(q.dtype)
    out = torch.empty((*q.shape[:3], inputs.value_dim), dtype=out_dtype, device=q.device)
    stats = torch.empty((*q.shape[:3], 2), dtype=torch.float32, device=q.device)
    if not inputs.has_pairs:  # no key is seen
        return out.zero_().to(q.dtype), stats.zero_()
    if inputs.has_padding:  # no kernel writes a padded batch's padding rows
        out.zero_(), stats.zero_()
    mask, mask_strides, mask_kind = _mask_args(inputs, q)
    variant_args, variant_flags = lower_variant(inputs)
    sequences = inputs.sequences
    longest = sequences.max_q_len
    heads = sequences.count * q_heads
    grid = lambda meta: (triton.cdiv(longest, meta["BLOCK_M"]), heads)  # noqa: E731
    online_softmax_forward_kernel[grid](
        q, k, v, mask, out, stats, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
        *out.stride(), q_heads, q_heads // inputs.kv_heads, q_len, inputs.head_dim,
        inputs.value_dim, inputs.scale * LOG2E, _next_power_of_2(longest),
        _next_power_of_2(sequences.max_kv_len), math.gcd(*sequences.table[:, 4].tolist()),
        **variant_args, MASK_KIND=mask_kind, **variant_flags, **_kernel_flags(inputs),
    )  # fmt: skip
    return out.to(q.dtype), stats


def triton_attention_backward(
    inputs: AttentionInputs,
    out: Tensor,
    stats: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) by FlashAttention-2's deterministic scheme; `grad_lse`
    (B, Hq, L), the LSE's gradient, only shifts delta = rowsum(dO * O)."""
    q, k, v = inputs.query.detach(), inputs.key.detach(), inputs.value.detach()
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len = inputs.kv_heads, inputs.kv_len
    grad_dtype = _store_dtype(q.dtype)
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
    flags = _kernel_flags(inputs)
    rows = batch * q_heads * q_len
    attention_backward_preprocess[(triton.cdiv(rows, 64),)](
        out, grad_out, delta, rows, inputs.value_dim, BLOCK_M=64, BLOCK_DV=flags["BLOCK_DV"]
    )
    if grad_lse is not None:  # adds p * dLSE to every dS: the same as lowering delta by it
        delta -= torch.where(stats[..., 1] > 0, grad_lse.detach().float(), 0.0)
    mask, mask_strides, mask_kind = _mask_args(inputs, q)
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
    out = torch.zeros((*shape, inputs.value_dim), dtype=_store_dtype(q.dtype), device=q.device)
    stats = torch.zeros((*shape, 2), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or q_heads == 0:
        return out.to(q.dtype), stats
    variant_args, variant_flags = lower_variant(inputs)
    flags = _kernel_flags(inputs)
    k_pages, v_pages, table = inputs.k_pages.detach(), inputs.v_pages.detach(), inputs.block_table
    group = q_heads // inputs.kv_heads
    kvcache_split_kernel[(splits, batch * inputs.kv_heads)](
        q.detach(), k_pages, v_pages, table, partial_out, partial_stats, *q.stride(),
        *k_pages.stride(), *v_pages.stride(), table.stride(0), batch, q_heads, inputs.kv_heads,
        group, q_len, inputs.head_dim, inputs.value_dim, inputs.page_size, splits,
        inputs.scale * LOG2E, variant_args["Sequences"], variant_args["left"],
        variant_args["right"], variant_args["softcap2"], variant_args["Alibi"],
        HAS_BAND=variant_flags["HAS_BAND"], HAS_SOFTCAP=variant_flags["HAS_SOFTCAP"],
        HAS_ALIBI=variant_flags["HAS_ALIBI"], BLOCK_M=max(16, _next_power_of_2(group * q_len)),
        BLOCK_N=16 if INTERPRET else 64, **flags,
    )  # fmt: skip
    rows = batch * q_heads * q_len
    merge_splits_kernel[(triton.cdiv(rows, 16),)](
        partial_out, partial_stats, out, stats, rows, splits, inputs.value_dim, BLOCK_R=16,
        BLOCK_DV=flags["BLOCK_DV"],
    )  # fmt: skip
    return out.to(q.dtype), stats


def _finish_grads(inputs, dq, dk, dv, dmask):
    dtype = inputs.dtype
    dmask = None if dmask is None else dmask.to(inputs.attn_mask.dtype)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dmask


class TritonBackend(FusedBackend):
    name = "triton"
    description = "fused FlashAttention-2-style GPU kernel (Triton), online softmax in base 2"
    capabilities = Capabilities(
        devices=("cuda", "cpu") if INTERPRET else ("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        max_head_dim=MAX_HEAD_DIM,
        features=frozenset(FEATURES) - {"dropout", "kvcache_backward"},
    )

    forward = staticmethod(triton_attention_forward)
    backward = staticmethod(triton_attention_backward)
    kvcache_forward = staticmethod(triton_kvcache_forward)

    def unavailable_reason(self) -> str | None:
        if _MISSING:
            return _MISSING
        if not INTERPRET and not torch.cuda.is_available():
            return (
                "no CUDA GPU (TRITON_INTERPRET=1, set before attnperf's kernels are first "
                "used, runs them on CPU through Triton's interpreter)"
            )
        return None


BACKEND = TritonBackend()
