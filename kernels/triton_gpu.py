"""The triton backend: a fused FlashAttention-2-style GPU kernel, forward and backward.

One program per (query tile, batch x head) loops over key tiles with a running max and sum
in base 2 (log2(e) folded into the scale). Masks are read tile by tile through their
broadcast strides, GQA is index arithmetic, ragged edges are masked. The backward pass is
FlashAttention-2's: a rowsum(dO * O) preprocess, a dK/dV kernel and a dQ kernel,
deterministic (no atomics). Without a GPU the kernels run on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, set before attnperf's kernels are first used).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from attnperf.backend import FEATURES, Capabilities, FusedBackend
from attnperf.inputs import AttentionInputs

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
        and c.kwargs["BLOCK_M"] <= max(_next_power_of_2(args["q_len"]), 64)
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
    triton.heuristics({"EVEN_N": lambda args: args["kv_len"] % args["BLOCK_N"] == 0})
    if triton
    else (lambda f: f)
)
@_jit
def online_softmax_forward_kernel(
    Q, K, V, Mask, Out, Stats,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sob, soh, som, sod,
    q_heads, group, q_len, kv_len, head_dim, value_dim, scale2, q_len_class, kv_len_class,
    left, right, offset, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):  # fmt: skip
    """Out (B, Hq, L, Ev) and Stats (B, Hq, L, 2), each row's base-2 max and sum, for one
    query tile."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // group
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    K_bh = K + b * skb + hk * skh
    V_bh = V + b * svb + hk * svh
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
        Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < value_dim),
    )
    stats = Stats + (bh * q_len + offs_m) * 2
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
    q, K_bh, Mask, Stats, b, h, bh, offs_m, offs_n, q_len, kv_len, head_dim, scale2,
    skn, skd, smb, smh, smm, smn,
    left, right, offset, softcap2, Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """(P, the softcap's gradient factor) of one tile from the rows' saved max and sum:
    kept apart, they hold the sum where max + log2(sum) would round it away (scores near
    finfo.min)."""
    s = tile_scores(q, K_bh, offs_n, kv_len, head_dim, scale2, skn, skd, BLOCK_D, WIDEN_DOT,
                    IEEE)  # fmt: skip
    s, dtanh = modify_scores(
        s, b, h, offs_m, offs_n, q_len, kv_len, Mask, smb, smh, smm, smn, left, right,
        offset, softcap2, Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
        MASK_KIND, HAS_BAND, HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K, False,
    )  # fmt: skip
    stats = Stats + (bh * q_len + offs_m) * 2
    row_max = tl.load(stats, mask=offs_m < q_len, other=0.0)
    row_sum = tl.load(stats + 1, mask=offs_m < q_len, other=0.0)
    inverse = tl.where(row_sum == 0.0, 0.0, 1.0 / tl.where(row_sum == 0.0, 1.0, row_sum))
    return tl.math.exp2(s - row_max[:, None]) * inverse[:, None], dtanh


@_jit
def attention_backward_dkdv_kernel(
    Q, K, V, Mask, GradOut, Stats, Delta, DK, DV,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn, sdb, sdh, sdm, sdd,
    q_heads, kv_heads, group, q_len, kv_len, head_dim, value_dim, scale2, scale,
    left, right, offset, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile, summed over the query heads of its group (no atomics).

    GradOut is contiguous (B, Hq, L, Ev); DK, DV are contiguous like K, V.
    """
    tile = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // kv_heads
    hk = bhk % kv_heads
    start_n = tile * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    K_bh = K + b * skb + hk * skh
    v = tl.load(
        V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
        mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim),
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_lo, q_hi = query_tile_range(start_n, q_len, left, right, offset, BLOCK_M, BLOCK_N)
    for h in range(hk * group, (hk + 1) * group):
        bh = b * q_heads + h
        for start_m in range(q_lo, q_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            if tile_seen(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                         HAS_LAYOUT, LAYOUT_Q, LAYOUT_K):  # fmt: skip
                q = tl.load(
                    Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim),
                    other=0.0,
                )
                p, dtanh = recompute_probabilities(
                    q, K_bh, Mask, Stats, b, h, bh, offs_m, offs_n, q_len, kv_len, head_dim,
                    scale2, skn, skd, smb, smh, smm, smn, left, right, offset, softcap2,
                    Alibi, q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq, MASK_KIND,
                    HAS_BAND, HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K,
                    BLOCK_D, WIDEN_DOT, IEEE,
                )  # fmt: skip
                do = tl.load(
                    GradOut + (bh * q_len + offs_m[:, None]) * value_dim + offs_dv[None, :],
                    mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < value_dim),
                    other=0.0,
                )
                dv += dot_pv(tl.trans(p), do, WIDEN_DOT, IEEE)
                dp = dot_pv(do.to(tl.float32) if WIDEN_DOT else do, tl.trans(v), WIDEN_DOT,
                            IEEE)  # fmt: skip
                delta = tl.load(Delta + bh * q_len + offs_m, mask=offs_m < q_len, other=0.0)
                ds = p * (dp - delta[:, None]) * dtanh
                dk += dot_pv(tl.trans(ds), q, WIDEN_DOT, IEEE)
    out_mask_k = (offs_n[:, None] < kv_len) & (offs_d[None, :] < head_dim)
    out_mask_v = (offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim)
    base = bhk * kv_len + offs_n[:, None]
    tl.store(DK + base * head_dim + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=out_mask_k)  # fmt: skip
    tl.store(DV + base * value_dim + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=out_mask_v)


@_jit
def attention_backward_dq_kernel(
    Q, K, V, Mask, GradOut, Stats, Delta, DQ, DMask,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    smb, smh, smm, smn,
    q_heads, group, q_len, kv_len, head_dim, value_dim, scale2, scale,
    left, right, offset, softcap2, Alibi, Kinds, PartialIndex, Partial, lkb, lkh, lkq,
    MASK_KIND: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LAYOUT: tl.constexpr, LAYOUT_Q: tl.constexpr,
    LAYOUT_K: tl.constexpr, WANT_DMASK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WIDEN_DOT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile; with WANT_DMASK also dS into a contiguous (B, Hq, L, S) DMask
    (zeros where a tile is skipped: its dS is 0)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    hk = h // group
    start_m = tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < q_len
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
        other=0.0,
    )
    do = tl.load(
        GradOut + (bh * q_len + offs_m[:, None]) * value_dim + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < value_dim),
        other=0.0,
    )
    delta = tl.load(Delta + bh * q_len + offs_m, mask=row_ok, other=0.0)
    K_bh = K + b * skb + hk * skh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, _, _, hi = key_tile_range(start_m, q_len, kv_len, left, right, offset, BLOCK_M,
                                  BLOCK_N)  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if tile_seen(Kinds, b, h, offs_m, offs_n, q_len, kv_len, lkb, lkh, lkq,
                     HAS_LAYOUT, LAYOUT_Q, LAYOUT_K):  # fmt: skip
            p, dtanh = recompute_probabilities(
                q, K_bh, Mask, Stats, b, h, bh, offs_m, offs_n, q_len, kv_len, head_dim,
                scale2, skn, skd, smb, smh, smm, smn, left, right, offset, softcap2, Alibi,
                q_heads, Kinds, PartialIndex, Partial, lkb, lkh, lkq, MASK_KIND, HAS_BAND,
                HAS_SOFTCAP, HAS_ALIBI, HAS_LAYOUT, LAYOUT_Q, LAYOUT_K, BLOCK_D, WIDEN_DOT,
                IEEE,
            )  # fmt: skip
            v = tl.load(
                V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=(offs_n[:, None] < kv_len) & (offs_dv[None, :] < value_dim),
                other=0.0,
            )
            dp = dot_pv(do.to(tl.float32) if WIDEN_DOT else do, tl.trans(v), WIDEN_DOT, IEEE)
            ds = p * (dp - delta[:, None])
            if WANT_DMASK:  # the float mask is added after the softcap: its gradient is dS
                tl.store(
                    DMask + (bh * q_len + offs_m[:, None]) * kv_len + offs_n[None, :],
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
        DQ + (bh * q_len + offs_m[:, None]) * head_dim + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < head_dim),
    )


# ---------------------------------------------------------------------------- launchers
def _mask_args(inputs: AttentionInputs, like: Tensor) -> tuple[Tensor, tuple[int, ...], int]:
    """The mask tensor (a dummy when absent), its 4 strides (0 where broadcast) and kind."""
    mask = inputs.attn_mask
    if mask is None:
        return like, (0, 0, 0, 0), MASK_NONE
    return mask.detach(), mask.stride(), MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT


def lower_variant(inputs: AttentionInputs) -> tuple[dict, dict]:
    """The call's variant as the kernels' runtime arguments and constexprs (see UNBOUNDED)."""
    variant, device = inputs.variant, inputs.device
    left, right = inputs.band or (None, None)
    slopes = variant.alibi_slopes
    layout = variant.block_mask
    dummy = torch.zeros(1, dtype=torch.int32, device=device)
    args = {
        "left": UNBOUNDED if left is None else min(left, UNBOUNDED),
        "right": UNBOUNDED if right is None else min(right, UNBOUNDED),
        "offset": inputs.offset,
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
    batch, q_heads, q_len, _ = q.shape
    out_dtype = _store_dtype(q.dtype)
    out = torch.empty((*q.shape[:3], inputs.value_dim), dtype=out_dtype, device=q.device)
    stats = torch.empty((*q.shape[:3], 2), dtype=torch.float32, device=q.device)
    if not inputs.has_pairs:  # no key is seen
        return out.zero_().to(q.dtype), stats.zero_()
    mask, mask_strides, mask_kind = _mask_args(inputs, q)
    variant_args, variant_flags = lower_variant(inputs)
    grid = lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), batch * q_heads)  # noqa: E731
    online_softmax_forward_kernel[grid](
        q, k, v, mask, out, stats, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
        *out.stride(), q_heads, q_heads // inputs.kv_heads, q_len, inputs.kv_len,
        inputs.head_dim, inputs.value_dim, inputs.scale * LOG2E, _next_power_of_2(q_len),
        _next_power_of_2(inputs.kv_len), **variant_args, MASK_KIND=mask_kind,
        **variant_flags, **_kernel_flags(inputs),
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
    attention_backward_dkdv_kernel[(triton.cdiv(kv_len, block), batch * kv_heads)](
        q, k, v, mask, grad_out, stats, delta, dk, dv, *common, *dk.stride(), q_heads, kv_heads,
        q_heads // kv_heads, q_len, kv_len, inputs.head_dim, inputs.value_dim,
        inputs.scale * LOG2E, inputs.scale, **variant_args, MASK_KIND=mask_kind,
        **variant_flags, BLOCK_M=block, BLOCK_N=block, num_stages=stages, **flags,
    )  # fmt: skip
    attention_backward_dq_kernel[(triton.cdiv(q_len, block), batch * q_heads)](
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


class TritonBackend(FusedBackend):
    name = "triton"
    description = "fused FlashAttention-2-style GPU kernel (Triton), online softmax in base 2"
    capabilities = Capabilities(
        devices=("cuda", "cpu") if INTERPRET else ("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        max_head_dim=MAX_HEAD_DIM,
        features=frozenset(FEATURES) - {"dropout"},
    )

    forward = staticmethod(triton_attention_forward)
    backward = staticmethod(triton_attention_backward)

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
