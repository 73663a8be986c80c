"""The numba backend: a fused, tiled FlashAttention-style CPU kernel (forward and backward).

Query tiles x key tiles, scores from BLAS (np.dot on tiles), softmax kept online in base 2
(running max and sum, the accumulator rescaled as the max grows), logsumexp saved for the
backward pass, which recomputes the probabilities tile by tile. Extra memory is O(tile)
per thread, never O(L x S) (except the float mask's own gradient, which is L x S by nature).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from attnperf.backend import Backend, Capabilities, FusedAttention
from attnperf.inputs import AttentionInputs

try:
    import numba
    import scipy  # noqa: F401  (numba's np.dot calls scipy's BLAS)

    _MISSING = None
except ImportError as error:
    numba = None
    _MISSING = f"numba and scipy are needed ({error}); pip install 'attnperf[cpu]'"


def _njit(**options):
    """numba.njit with an on-disk cache; without numba the plain function (never run)."""
    if numba is None:
        return lambda function: function
    return numba.njit(cache=True, nogil=True, **options)


prange = numba.prange if numba is not None else range

# Tile sizes: of 64/128/256 x 128/256/512, 128 x 256 was as fast as any on a 2-core AVX-512
# machine (`attnperf bench --backends numba sdpa --lengths 2048 --causal both`).
BLOCK_M = 128
BLOCK_N = 256
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Reassociation and contraction let LLVM vectorise the row loops; no "nnan"/"ninf", so
# NaN and inf propagate as in SDPA.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
# exp(f * ln 2) for f in [-0.5, 0.5]: Taylor terms ln2^i / i!, error < 1e-8 relative.
EXP2_COEFFS = tuple(LN2**i / math.factorial(i) for i in range(8))
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


@_njit(fastmath=FASTMATH)
def exp2_rows(x, row_max, rows, cols, bits):
    """x[r, c] <- 2 ** (x[r, c] - row_max[r]) in place, vectorisable (no libm call).

    `bits` is int32 scratch of x's shape; 2**n is built in its exponent field. Values below
    2**-126 flush to 0 (they vanish next to the row's max, which maps to 1).
    """
    c0, c1, c2, c3, c4, c5, c6, c7 = EXP2_COEFFS
    scale = bits.view(np.float32)
    for r in range(rows):
        m = row_max[r]
        for c in range(cols):
            t = x[r, c] - m
            clamped = t if t > -127.0 else np.float32(-127.0)  # -inf and NaN clamp too
            n = np.floor(clamped + np.float32(0.5))
            f = clamped - n
            p = c7
            p = p * f + c6
            p = p * f + c5
            p = p * f + c4
            p = p * f + c3
            p = p * f + c2
            p = p * f + c1
            p = p * f + c0
            x[r, c] = p if t == t else t  # NaN stays NaN (times a 0 scale below)
            bits[r, c] = (np.int32(n) + 127) << 23
        for c in range(cols):
            t = x[r, c] * scale[r, c]
            x[r, c] = t
    return x


@_njit(fastmath=FASTMATH)
def tile_row_max(s, rows, cols, current, out):
    """out[r] = max(current[r], s[r, :cols]), over 16 lanes so that LLVM vectorises it.

    NaN scores are passed over here; exp2_rows turns their whole row NaN, as in SDPA.
    """
    lanes = np.empty(16, np.float32)
    full = cols - cols % 16
    for r in range(rows):
        lanes[:] = current[r]
        for c0 in range(0, full, 16):
            for lane in range(16):
                x = s[r, c0 + lane]
                lanes[lane] = x if x > lanes[lane] else lanes[lane]
        m = lanes[0]
        for lane in range(1, 16):
            m = lanes[lane] if lanes[lane] > m else m
        for c in range(full, cols):
            m = s[r, c] if s[r, c] > m else m
        out[r] = m


@_njit()
def split_index(item, heads, tiles):
    """(batch, head, tile) of a flat prange index (prange indices are unsigned)."""
    item = np.int64(item)
    return item // (heads * tiles), (item // tiles) % heads, item % tiles


@_njit(fastmath=FASTMATH)
def scaled_masked_scores(s, mask, mask_kind, b, h, i0, j0, rows, cols, causal, scale2):
    """Scores of one tile in base 2: s * scale * log2(e) + mask * log2(e), causal applied."""
    for r in range(rows):
        for c in range(cols):
            s[r, c] *= scale2
        if mask_kind == MASK_FLOAT:
            for c in range(cols):
                s[r, c] += mask[b, h, i0 + r, j0 + c] * LOG2E
        elif mask_kind == MASK_BOOL:
            for c in range(cols):
                if not mask[b, h, i0 + r, j0 + c]:
                    s[r, c] += -np.inf  # like SDPA: a NaN score stays NaN
        if causal:  # top-left aligned: row i sees keys 0..i
            for c in range(max(i0 + r + 1 - j0, 0), cols):
                s[r, c] = -np.inf


@_njit(parallel=True, fastmath=FASTMATH)
def online_softmax_forward(q, k, v, mask, mask_kind, causal, scale, out, lse, block_m, block_n):
    """out (B, Hq, L, Ev) and base-e lse (B, Hq, L, fp64) for fp32 C-contiguous q, k, v."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, kv_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    q_tiles = (q_len + block_m - 1) // block_m
    scale2 = np.float32(scale * LOG2E)
    for item in prange(batch * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        hk = h // group
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        q_tile = q[b, h, i0 : i0 + rows]
        acc = np.zeros((rows, value_dim), np.float32)
        row_max = np.full(rows, -np.inf, np.float32)
        new_max = np.empty(rows, np.float32)
        row_sum = np.zeros(rows, np.float32)
        shift = np.zeros(rows, np.float32)
        alpha = np.zeros(rows, np.float32)
        bits = np.empty((rows, block_n), np.int32)
        kv_end = min(kv_len, i0 + rows) if causal else kv_len
        for j0 in range(0, kv_end, block_n):
            cols = min(block_n, kv_end - j0)
            s = np.dot(q_tile, k[b, hk, j0 : j0 + cols].T)
            scaled_masked_scores(s, mask, mask_kind, b, h, i0, j0, rows, cols, causal, scale2)
            tile_row_max(s, rows, cols, row_max, new_max)
            for r in range(rows):
                # A row with nothing allowed so far shifts by 0: its exp() stays 0, not NaN.
                shift[r] = new_max[r] if new_max[r] != -np.inf else 0.0
                alpha[r] = 2.0 ** (row_max[r] - shift[r]) if row_max[r] != -np.inf else 0.0
                row_max[r] = new_max[r]
            exp2_rows(s, shift, rows, cols, bits)
            for r in range(rows):
                total = np.float32(0.0)
                for c in range(cols):
                    total += s[r, c]
                row_sum[r] = row_sum[r] * alpha[r] + total
                for e in range(value_dim):
                    acc[r, e] *= alpha[r]
            acc += np.dot(s, v[b, hk, j0 : j0 + cols])
        for r in range(rows):
            # Fully masked rows (sum 0) give 0, and lse = +inf makes their backward p = 0.
            inv = 1.0 / row_sum[r] if row_sum[r] != 0 else 0.0
            for e in range(value_dim):
                out[b, h, i0 + r, e] = acc[r, e] * inv
            if row_sum[r] != 0:
                lse[b, h, i0 + r] = (shift[r] + math.log2(row_sum[r])) * LN2
            else:
                lse[b, h, i0 + r] = np.inf


@_njit(fastmath=FASTMATH)
def probabilities(q_tile, k_tile, mask, mask_kind, b, h, i0, j0, causal, scale2, lse2, bits):
    """P of one (query tile, key tile), recomputed from the saved base-2 logsumexp."""
    rows, cols = q_tile.shape[0], k_tile.shape[0]
    s = np.dot(q_tile, k_tile.T)
    scaled_masked_scores(s, mask, mask_kind, b, h, i0, j0, rows, cols, causal, scale2)
    return exp2_rows(s, lse2, rows, cols, bits)


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dq(
    q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, dq, dmask, block_m, block_n
):
    """dq (and the float mask's gradient dS when dmask has L x S) per query tile."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    q_tiles = (q_len + block_m - 1) // block_m
    scale2 = np.float32(scale * LOG2E)
    want_dmask = dmask.shape[2] == q_len and dmask.shape[3] == kv_len
    for item in prange(batch * q_heads * q_tiles):
        b, h, tile = split_index(item, q_heads, q_tiles)
        hk = h // group
        i0 = tile * block_m
        rows = min(block_m, q_len - i0)
        q_tile = q[b, h, i0 : i0 + rows]
        do_tile = grad_out[b, h, i0 : i0 + rows]
        lse2 = (lse[b, h, i0 : i0 + rows] * LOG2E).astype(np.float32)
        acc = np.zeros((rows, head_dim), np.float32)
        bits = np.empty((rows, block_n), np.int32)
        kv_end = min(kv_len, i0 + rows) if causal else kv_len
        for j0 in range(0, kv_end, block_n):
            cols = min(block_n, kv_end - j0)
            p = probabilities(
                q_tile, k[b, hk, j0 : j0 + cols], mask, mask_kind, b, h, i0, j0, causal,
                scale2, lse2, bits,
            )  # fmt: skip
            ds = np.dot(do_tile, v[b, hk, j0 : j0 + cols].T)
            for r in range(rows):
                d = delta[b, h, i0 + r]
                for c in range(cols):
                    ds[r, c] = p[r, c] * (ds[r, c] - d)
            if want_dmask:
                dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
            acc += np.dot(ds, k[b, hk, j0 : j0 + cols])
        dq[b, h, i0 : i0 + rows] = acc * np.float32(scale)


@_njit(fastmath=FASTMATH)
def key_tile_gradients(
    q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, dq, dk, dv, dmask,
    b, hk, j0, cols, block_m, bits, with_dq,
):  # fmt: skip
    """dk, dv of keys j0..j0+cols of head hk, summed over the query heads of its group.

    With `with_dq`, also dq += dS K and, when dmask is L x S, dS into dmask: the caller owns
    every query row of the group then, so no other thread writes them.
    """
    q_heads, q_len = q.shape[1], q.shape[2]
    group = q_heads // k.shape[1]
    scale2 = np.float32(scale * LOG2E)
    want_dmask = with_dq and dmask.shape[2] == q_len and dmask.shape[3] == k.shape[2]
    k_tile = k[b, hk, j0 : j0 + cols]
    v_tile = v[b, hk, j0 : j0 + cols]
    dk_acc = np.zeros((cols, k.shape[3]), np.float32)
    dv_acc = np.zeros((cols, v.shape[3]), np.float32)
    q_start = j0 if causal else 0  # rows above j0 see none of these keys
    for h in range(hk * group, (hk + 1) * group):
        for i0 in range(q_start - q_start % block_m, q_len, block_m):
            rows = min(block_m, q_len - i0)
            q_tile = q[b, h, i0 : i0 + rows]
            do_tile = grad_out[b, h, i0 : i0 + rows]
            lse2 = (lse[b, h, i0 : i0 + rows] * LOG2E).astype(np.float32)
            p = probabilities(
                q_tile, k_tile, mask, mask_kind, b, h, i0, j0, causal, scale2, lse2, bits
            )
            dv_acc += np.dot(p.T, do_tile)
            ds = np.dot(do_tile, v_tile.T)
            for r in range(rows):
                d = delta[b, h, i0 + r]
                for c in range(cols):
                    ds[r, c] = p[r, c] * (ds[r, c] - d)
            dk_acc += np.dot(ds.T, q_tile)
            if with_dq:
                if want_dmask:
                    dmask[b, h, i0 : i0 + rows, j0 : j0 + cols] = ds
                dq[b, h, i0 : i0 + rows] += np.dot(ds, k_tile) * np.float32(scale)
    dk[b, hk, j0 : j0 + cols] = dk_acc * np.float32(scale)
    dv[b, hk, j0 : j0 + cols] = dv_acc


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_dkdv(
    q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, dk, dv, block_m, block_n
):
    """dk, dv per key tile, summed over every query head of the key/value head's group."""
    batch, kv_heads, kv_len = k.shape[0], k.shape[1], k.shape[2]
    kv_tiles = (kv_len + block_n - 1) // block_n
    unused = np.zeros((1, 1, 1, 1), np.float32)
    for item in prange(batch * kv_heads * kv_tiles):
        b, hk, tile = split_index(item, kv_heads, kv_tiles)
        j0 = tile * block_n
        cols = min(block_n, kv_len - j0)
        bits = np.empty((block_m, cols), np.int32)
        key_tile_gradients(
            q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, unused, dk, dv,
            unused, b, hk, j0, cols, block_m, bits, False,
        )  # fmt: skip


@_njit(parallel=True, fastmath=FASTMATH)
def attention_backward_fused(
    q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, dq, dk, dv, dmask,
    block_m, block_n,
):  # fmt: skip
    """dq, dk, dv += (and dS into an L x S dmask) in one pass: P and dP are computed once.

    One prange item per (batch, key/value head) owns every query head of its group, so its
    dq updates need no atomics; worth it when there are enough items for the threads.
    """
    batch, kv_heads, kv_len = k.shape[0], k.shape[1], k.shape[2]
    for item in prange(batch * kv_heads):
        b, hk, _ = split_index(item, kv_heads, 1)
        bits = np.empty((block_m, block_n), np.int32)
        for j0 in range(0, kv_len, block_n):
            key_tile_gradients(
                q, k, v, mask, mask_kind, causal, scale, lse, grad_out, delta, dq, dk, dv,
                dmask, b, hk, j0, min(block_n, kv_len - j0), block_m, bits, True,
            )  # fmt: skip


def _as_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _mask_for_kernel(inputs: AttentionInputs) -> tuple[np.ndarray, int]:
    """The mask as a strided array (broadcast dims keep stride 0) and its kind."""
    mask = inputs.attn_mask
    if mask is None:
        return np.zeros((1, 1, 1, 1), np.float32), MASK_NONE
    if mask.dtype == torch.bool:
        return _as_numpy(mask), MASK_BOOL
    # Convert only the mask's own elements, then broadcast again: never a full-size copy.
    compact = mask.detach()
    for dim in range(4):
        if compact.stride(dim) == 0:
            compact = compact.narrow(dim, 0, 1)
    return _as_numpy(compact.float().expand(mask.shape)), MASK_FLOAT


@functools.cache
def _blas_controller():
    """Set up threads once, at the first call (never at import).

    Numba's "workqueue" layer is its own pthread pool: no second OpenMP runtime to fight
    torch's OpenMP pool, and OpenBLAS sees no OpenMP loop around its calls. A layer chosen
    by the user (NUMBA_THREADING_LAYER) is respected.
    """
    import scipy.linalg.cython_blas  # noqa: F401  (loads the BLAS that numba's np.dot calls)
    from threadpoolctl import ThreadpoolController

    if numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "workqueue"
    return ThreadpoolController()


def _run_parallel(kernel, *args) -> None:
    """Run a prange kernel on torch's thread count, with BLAS pinned to one thread per tile."""
    controller = _blas_controller()
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    with controller.limit(limits=1, user_api="blas"):
        kernel(*args)


def _fp32(tensor: Tensor) -> np.ndarray:
    return _as_numpy(tensor.detach().to(torch.float32).contiguous())


def _block_n(inputs: AttentionInputs) -> int:
    # Causal: key tiles as tall as query tiles, so diagonal tiles waste no half-tile.
    return BLOCK_M if inputs.is_causal else BLOCK_N


def numba_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, L, Ev) in the inputs' dtype, natural-log lse (B, Hq, L) fp64)."""
    q, k, v = _fp32(inputs.query), _fp32(inputs.key), _fp32(inputs.value)
    mask, mask_kind = _mask_for_kernel(inputs)
    out = np.empty((*q.shape[:3], v.shape[3]), np.float32)
    lse = np.empty(q.shape[:3], np.float64)  # fp64: large logits lose no bits in backward
    if q.size and k.shape[2]:
        _run_parallel(
            online_softmax_forward, q, k, v, mask, mask_kind, inputs.is_causal, inputs.scale,
            out, lse, BLOCK_M, _block_n(inputs),
        )  # fmt: skip
    else:  # no keys: zeros; lse = +inf makes the backward pass zero as well
        out[:], lse[:] = 0.0, np.inf
    return torch.from_numpy(out).to(inputs.dtype), torch.from_numpy(lse)


def numba_attention_backward(
    inputs: AttentionInputs, out: Tensor, lse: Tensor, grad_out: Tensor, fused: bool | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) in the inputs' dtypes, by FlashAttention-2 recomputation.

    `fused`: one pass over (batch, kv head) items, or a dq pass and a dk/dv pass over tiles;
    None picks the fused pass when there are at least two items per thread.
    """
    q, k, v = _fp32(inputs.query), _fp32(inputs.key), _fp32(inputs.value)
    mask, mask_kind = _mask_for_kernel(inputs)
    do = grad_out.to(torch.float32).contiguous()
    delta = _as_numpy((do * out.to(torch.float32)).sum(-1).contiguous())
    do, lse = _as_numpy(do), _as_numpy(lse.contiguous())
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask = np.zeros(mask.shape if want_dmask else (1, 1, 1, 1), np.float32)
    if fused is None:
        fused = inputs.batch * inputs.kv_heads >= 2 * torch.get_num_threads()
    if q.size and k.shape[2]:
        common = (q, k, v, mask, mask_kind, inputs.is_causal, inputs.scale, lse, do, delta)
        blocks = (BLOCK_M, _block_n(inputs))
        if fused:
            _run_parallel(attention_backward_fused, *common, dq, dk, dv, dmask, *blocks)
        else:
            _run_parallel(attention_backward_dq, *common, dq, dmask, *blocks)
            _run_parallel(attention_backward_dkdv, *common, dk, dv, *blocks)
    grads = [torch.from_numpy(g).to(inputs.dtype) for g in (dq, dk, dv)]
    dmask_t = torch.from_numpy(dmask).to(inputs.attn_mask.dtype) if want_dmask else None
    return (*grads, dmask_t)


class NumbaBackend(Backend):
    name = "numba"
    description = "fused tiled online-softmax CPU kernel (Numba, BLAS tiles), O(tile) memory"
    capabilities = Capabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        max_head_dim=None,
        bool_mask=True,
        float_mask=True,
        causal=True,
        gqa=True,
        dropout=False,
        backward=True,
    )

    def unavailable_reason(self) -> str | None:
        return _MISSING

    def run(self, inputs: AttentionInputs) -> Tensor:
        launchers = (numba_attention_forward, numba_attention_backward)
        return FusedAttention.apply(
            launchers, inputs, inputs.query, inputs.key, inputs.value, inputs.attn_mask
        )


BACKEND = NumbaBackend()
