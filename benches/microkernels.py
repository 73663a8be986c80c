"""Each tile product alone, one thread, at the shapes the dense kernels use: GFLOP/s and its
share of the chip's peak (fp32 FMA or bf16 dot, register-only loops, same run), beside MKL's
sgemm and oneDNN's bf16 GEMM (torch.mm, one thread) on the same shapes.

    python benches/microkernels.py [--head-dims 64 128] [--rounds 5]

Products, a 128-row query tile against a 512-key tile as the forward walks them:
- QK^T: scores (128, 512) = Q (128, E) @ K^T, K packed once in panels of 16 keys;
- PV: acc (128, Ev) += P (128, 512) @ V, V read in place (fp32) or in pairs (bf16);
- dq: dq (128, E) += dS (128, 512) @ K through gemm_fp32 (the backward's products);
- dS^T Q: dk (512, E) += dS^T @ Q, A read transposed;
- QK^T by gemm_fp32 with a transposed B, packed per call (the backward's scores);
- bf16 dO^T P: dv^T (E, 512) += dO^T (E, 128) @ P, P's rows in pairs (the bf16 backward's
  products over query rows; its others have the forward's shapes);
- on AMX, the bf16 forward's two with the scores transposed: S^T (512, 128) = K Q^T (the
  keys' rows as they lie, Q^T in panels) and O^T (Ev, 128) += V^T P^T (P^T in key pairs).

And a decode step's products, a GQA group of 4 query rows against a tile of 192 keys, as
`micro_kernel_tile` walks them: the scores by `scores_by_dots` on key rows as they lie, and
acc += P V in chunks of 32 keys (`VALUE_CHUNK`) on values as they lie (a bf16 cache's
paired in registers for vdpbf16ps, as the step runs them, or widened for fp32 FMAs); where
bf16 runs on AMX, as `amx_tile` runs them: S^T = K Q^T with the key rows as they lie as A,
and acc += P V with the tile's values packed in pairs first (the packing counted in).

Then the fp32 forward's tile step by step, each alone: QK^T, the online softmax on the
score tile (row max, exp2, sums, the accumulator rescaled: each row's max rising by 0.5
as in a later key tile), PV; and each one's share of the tile. Likewise with the scores
transposed (AVX-512's route: S^T, the softmax down the keys, O^T), and the bf16 forward's
on AMX (S^T, the softmax down the keys with P^T rounded to bf16, O^T).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from attnperf.kernels.numba.amx import amx_product, depth_steps
from attnperf.kernels.numba.fastmath import LOG2E
from attnperf.kernels.numba.jit import FASTMATH, aligned_empty, njit
from attnperf.kernels.numba.key_dots import scores_by_dots
from attnperf.kernels.numba.kvcache_tiles import (
    AMX,
    VALUE_CHUNK,
    amx_buffers,
    amx_key_scores,
    amx_query_pairs,
    pack_value_pairs,
)
from attnperf.kernels.numba.microkernels import (
    LANES,
    inlined_tile_product,
    target_features,
    tile_product,
)
from attnperf.kernels.numba.packing import gemm_fp32, pack_key_panels, pack_vnni, transpose_bf16
from attnperf.kernels.numba.peaks import peak_flops
from attnperf.kernels.numba.softmax import (
    online_softmax_rescale,
    transposed_softmax,
    transposed_softmax_to_bf16,
)
from attnperf.machine import cpu_description

ROWS, KEYS = 128, 512
DECODE_ROWS, DECODE_KEYS = 4, 192


@njit()
def repeat_product(reps, depth, a_view, b_view, c_view, rows, cols):
    for _ in range(reps):
        tile_product(depth, np.float32(1.0), np.float32(1.0), a_view, b_view, c_view, rows, cols)


@njit()
def repeat_amx(reps, a_view, b_view, c_view, row_tiles, col_tiles, steps, accumulate):
    for _ in range(reps):
        amx_product(a_view, b_view, c_view, row_tiles, col_tiles, steps, accumulate)


@njit()
def repeat_gemm(reps, a, b, c, trans_a, trans_b):
    for _ in range(reps):
        gemm_fp32(a, b, c, np.float32(1.0), np.float32(1.0), trans_a, trans_b)


@njit(fastmath=FASTMATH)
def repeat_softmax(reps, scores, start, s, acc, row_max, row_sum, shift):
    """The online softmax step `reps` times, each on a fresh copy of `scores` whose rows'
    running max was `start`."""
    for _ in range(reps):
        s[:] = scores
        row_max[:] = start
        online_softmax_rescale(s, s.shape[0], s.shape[1], acc, row_max, row_sum, shift)


@njit(fastmath=FASTMATH)
def repeat_transposed_softmax(reps, s_t, factor, p_t, acc_t, row_max, row_sum, shift):
    """The AMX forward's softmax step `reps` times (it never writes s_t), each row's
    running max reset to -inf."""
    work = np.empty((3, s_t.shape[1]), np.float32)
    for _ in range(reps):
        row_max[:] = -np.inf
        transposed_softmax_to_bf16(s_t, factor, p_t, s_t.shape[0], acc_t, row_max, row_sum,
                                   shift, work)  # fmt: skip


@njit(fastmath=FASTMATH)
def repeat_fp32_transposed_softmax(reps, scores_t, factor, s_t, acc_t, row_max, row_sum, shift):
    """The fp32 forward's transposed softmax step `reps` times, each on a fresh copy of
    `scores_t` (it writes P^T in place), each row's running max reset to -inf."""
    work = np.empty((3, s_t.shape[1]), np.float32)
    for _ in range(reps):
        s_t[:] = scores_t
        row_max[:] = -np.inf
        transposed_softmax(s_t, factor, s_t.shape[0], acc_t, row_max, row_sum, shift, work)


@njit(fastmath=FASTMATH)
def repeat_copy(reps, scores, s):
    for _ in range(reps):
        s[:] = scores


@njit()
def repeat_scores(reps, depth, q_view, k_view, s_view, rows, keys):
    """The scores in chunks of LANES keys, inlined as the step's (`micro_kernel_tile`)."""
    k, k_offset, k_stride = k_view
    s, s_offset, s_stride = s_view
    for _ in range(reps):
        for c in range(0, keys, LANES):
            scores_by_dots(depth, np.float32(1.0), q_view, (k, k_offset + c * k_stride, k_stride),
                           (s, s_offset + c, s_stride), rows, min(LANES, keys - c))  # fmt: skip


@njit()
def repeat_chunked_product(reps, p_view, v_view, acc_view, rows, keys, cols, pair):
    """P V in chunks of VALUE_CHUNK keys, inlined as the step's (`chunked_values`); pair 2:
    P's bf16 bits in pairs (uint32), V's rows paired."""
    p, p_offset, p_stride, p_depth_stride = p_view
    v, v_offset, v_stride, v_vector_stride = v_view
    for _ in range(reps):
        for c in range(0, keys, VALUE_CHUNK):
            p_chunk = (p, p_offset + c // pair, p_stride, p_depth_stride)
            v_chunk = (v, v_offset + c * v_stride, v_stride, v_vector_stride)
            keys_here = min(VALUE_CHUNK, keys - c)
            inlined_tile_product(keys_here // pair, np.float32(1.0), np.float32(1.0), p_chunk,
                                 v_chunk, acc_view, rows, cols)  # fmt: skip


@njit()
def repeat_amx_key_scores(reps, q_pairs, keys, cols, k_tail, st):
    for _ in range(reps):
        amx_key_scores(q_pairs, keys, False, cols, k_tail, st, False)  # from cache: no prefetch


@njit()
def repeat_amx_values(reps, values, cols, v_pairs, p16, acc):
    for _ in range(reps):
        pack_value_pairs(values, False, cols, 1, v_pairs)
        amx_product((p16, 0, p16.shape[1]), (v_pairs, 0, v_pairs.shape[1], 16),
                    (acc, 0, acc.shape[1]), 1, acc.shape[1] // 16, depth_steps(cols),
                    True)  # fmt: skip


def repeated(kernel, *args):
    """run(n): kernel(n, *args), n repetitions."""
    return lambda reps: kernel(reps, *args)


def median_seconds(run, reps, rounds):
    run(1)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run(reps)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def bits(tensor):
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)


def aligned_zeros(shape, dtype=np.float32):
    """Zeros starting on a 64-byte line (`jit.aligned_empty`), as the kernels' own buffers
    and torch's tensors do: numpy's own arrays of 16 KiB and more started 16 bytes past one
    (glibc, Intel Xeon), and a micro-kernel whose B vectors straddle two lines ran at 67-78%
    of the FMA peak against 86-90% on lines (one thread, E = 64)."""
    rows = math.prod(shape[:-1])
    array = aligned_empty(rows, shape[-1], np.empty(0, dtype)).reshape(shape)
    array[...] = 0
    return array


def aligned_copy(array):
    """A copy of `array` starting on a 64-byte line (`aligned_zeros`)."""
    copy = aligned_zeros(array.shape, array.dtype)
    copy[...] = array
    return copy


def products(dim, rounds):
    """(name, dtype, FLOPs, ours s, torch.mm s) per product."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, p = (torch.randn(*shape, generator=gen) for shape in
                  ((ROWS, dim), (KEYS, dim), (KEYS, dim), (ROWS, KEYS)))  # fmt: skip
    flops = 2 * ROWS * KEYS * dim
    reps = max(1, int(2e9 / flops))
    scores, acc = aligned_zeros((ROWS, KEYS)), aligned_zeros((ROWS, dim))
    panels = aligned_zeros((KEYS // 16, dim, 16))
    pack_key_panels(k.numpy(), panels)
    k_view = (panels, 0, 16, dim * 16)
    rows = []

    def ours(depth, a_view, b_view, c_view, cols):
        return median_seconds(
            lambda n: repeat_product(n, depth, a_view, b_view, c_view, ROWS, cols), reps, rounds
        )

    def torch_mm(a, b):
        return median_seconds(lambda n: [torch.mm(a, b) for _ in range(n)], reps, rounds)

    qk = ours(dim, (q.numpy(), 0, dim, 1), k_view, (scores, 0, KEYS), KEYS)
    rows.append(("QK^T", "fp32", flops, qk, torch_mm(q, k.T)))
    pv = ours(KEYS, (p.numpy(), 0, KEYS, 1), (v.numpy(), 0, dim, 16), (acc, 0, dim), dim)
    rows.append(("PV", "fp32", flops, pv, torch_mm(p, v)))
    dq = median_seconds(lambda n: repeat_gemm(n, p.numpy(), k.numpy(), acc, False, False), reps,
                        rounds)  # fmt: skip
    rows.append(("dS K (gemm_fp32)", "fp32", flops, dq, torch_mm(p, k)))
    dk = aligned_zeros((KEYS, dim))
    dkt = median_seconds(lambda n: repeat_gemm(n, p.numpy(), q.numpy(), dk, True, False), reps,
                         rounds)  # fmt: skip
    rows.append(("dS^T Q (gemm_fp32)", "fp32", flops, dkt, torch_mm(p.T, q)))
    qkt = median_seconds(lambda n: repeat_gemm(n, q.numpy(), k.numpy(), scores, False, True),
                         reps, rounds)  # fmt: skip
    rows.append(("QK^T (gemm_fp32, B packed per call)", "fp32", flops, qkt, torch_mm(q, k.T)))
    # The fp32 forward's two with the scores transposed (AVX-512), as `fp32_query_tile`
    # runs them: S^T = K Q^T (K's rows as they lie, Q^T in panels of 16 query rows), O^T +=
    # V^T P^T (V as A where it lies, P^T the score tile).
    s_t_args, o_t_args = fp32_transposed_views(q.numpy(), k.numpy(), v.numpy(), p.numpy())
    qk_t = median_seconds(repeated(repeat_product, *s_t_args), reps, rounds)
    rows.append(("S^T = K Q^T (transposed)", "fp32", flops, qk_t, torch_mm(q, k.T)))
    pv_t = median_seconds(repeated(repeat_product, *o_t_args), reps, rounds)
    rows.append(("O^T += V^T P^T (transposed)", "fp32", flops, pv_t, torch_mm(p, v)))

    q16, k16, v16, p16 = (t.bfloat16() for t in (q, k, v, p))
    panels16 = aligned_zeros((KEYS // 16, dim // 2, 32), np.uint16)
    pack_key_panels(bits(k16), panels16)
    qk16 = ours(dim // 2, (bits(q16), 0, dim, 1), (panels16, 0, 32, dim * 16),
                (scores, 0, KEYS), KEYS)  # fmt: skip
    rows.append(("QK^T", "bf16", flops, qk16, torch_mm(q16, k16.T)))
    v_pairs = aligned_zeros((KEYS // 2, 2 * dim), np.uint16)
    pack_vnni(bits(v16), v_pairs)
    pv16 = ours(KEYS // 2, (bits(p16), 0, KEYS, 1), (v_pairs, 0, 2 * dim, 32), (acc, 0, dim), dim)
    rows.append(("PV", "bf16", flops, pv16, torch_mm(p16, v16)))
    # The backward's products over query rows, transposed: dV^T (E, 512) += dO^T P, the
    # rows of P in pairs (dK^T += Q^T dS likewise).
    q_t, p_pairs = bits(q16.T), aligned_zeros((ROWS // 2, 2 * KEYS), np.uint16)
    pack_vnni(bits(p16), p_pairs)
    dv_t = aligned_zeros((dim, KEYS))
    views = ((q_t, 0, ROWS, 1), (p_pairs, 0, 2 * KEYS, 32), (dv_t, 0, KEYS))
    dvt16 = median_seconds(lambda n: repeat_product(n, ROWS // 2, *views, dim, KEYS), reps, rounds)
    rows.append(("dO^T P (E x 512, rows paired)", "bf16", flops, dvt16, torch_mm(q16.T, p16)))
    if peak_flops("amx") is None or dim % 32:
        return rows
    # The forward's two products on AMX tiles as `forward_amx.amx_query_tile` runs them, the
    # scores transposed: S^T = K Q^T (keys' rows as they lie, Q^T in panels of 16 rows),
    # O^T += V^T P^T (V^T packed, P^T in pairs).
    q_t, v_t, p_t = amx_forward_operands(q16, v16, p16)
    scores_t, acc_t = aligned_zeros((KEYS, ROWS)), aligned_zeros((dim, ROWS))
    qk_args, pv_args = amx_forward_views(bits(k16), q_t, v_t, p_t, scores_t, acc_t)
    qk_amx = median_seconds(repeated(repeat_amx, *qk_args), reps, rounds)
    rows.append(("S^T = K Q^T (AMX tiles)", "amx", flops, qk_amx, torch_mm(q16, k16.T)))
    pv_amx = median_seconds(repeated(repeat_amx, *pv_args), reps, rounds)
    rows.append(("O^T += V^T P^T (AMX tiles)", "amx", flops, pv_amx, torch_mm(p16, v16)))
    return rows


def fp32_transposed_views(q, k, v, p):
    """`tile_product`'s arguments (after the repetitions) for S^T = K Q^T and O^T += V^T
    P^T as `forward_fp32.fp32_query_tile` calls them; p (ROWS, KEYS) stands for P, its
    transpose for P^T."""
    dim = q.shape[1]
    q_t = aligned_zeros((ROWS // 16, dim, 16))
    pack_key_panels(q, q_t)
    scores_t = aligned_zeros((KEYS, ROWS))
    p_t, acc_t = aligned_copy(p.T), aligned_zeros((dim, ROWS))
    s_t_args = (dim, (k, 0, dim, 1), (q_t, 0, 16, dim * 16), (scores_t, 0, ROWS), KEYS, ROWS)
    o_t_args = (KEYS, (v, 0, 1, dim), (p_t, 0, ROWS, 16), (acc_t, 0, ROWS), dim, ROWS)
    return s_t_args, o_t_args


def amx_forward_operands(q16, v16, p16):
    """(Q^T in panels of 16 query rows, V^T, P^T in pairs of keys) as bf16 bits: the AMX
    forward's B and A operands."""
    dim = q16.shape[1]
    q_t = aligned_zeros((ROWS // 16, dim // 2, 32), np.uint16)
    pack_key_panels(bits(q16), q_t)
    v_t = aligned_zeros((dim, KEYS + 32), np.uint16)
    transpose_bf16(bits(v16), v_t, aligned_zeros((dim // 2, 2 * KEYS), np.uint16))
    p_t = bits(p16).reshape(ROWS, KEYS // 2, 2).transpose(1, 0, 2).reshape(KEYS // 2, 2 * ROWS)
    return q_t, v_t, aligned_copy(p_t)


def amx_forward_views(k_bits, q_t, v_t, p_t, scores_t, acc_t):
    """`amx_product`'s arguments for S^T = K Q^T into scores_t and O^T += V^T P^T into
    acc_t, as the AMX forward calls it."""
    dim = k_bits.shape[1]
    qk = ((k_bits, 0, dim), (q_t, 0, 32, dim * 16), (scores_t, 0, ROWS), KEYS // 16, ROWS // 16,
          dim // 32, False)  # fmt: skip
    pv = ((v_t, 0, v_t.shape[1]), (p_t, 0, 2 * ROWS, 32), (acc_t, 0, ROWS), dim // 16,
          ROWS // 16, KEYS // 32, True)  # fmt: skip
    return qk, pv


def decode_products(dim, rounds):
    """(name, dtype, FLOPs, ours s, torch.mm s) of a decode step's two products, fp32 and
    bf16."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, p = (torch.randn(*shape, generator=gen) for shape in
                  ((DECODE_ROWS, dim), (DECODE_KEYS, dim), (DECODE_KEYS, dim),
                   (DECODE_ROWS, DECODE_KEYS)))  # fmt: skip
    flops = 2 * DECODE_ROWS * DECODE_KEYS * dim
    reps = max(1, int(5e8 / flops))
    scores = aligned_zeros((DECODE_ROWS, DECODE_KEYS))
    acc = aligned_zeros((DECODE_ROWS, dim))
    rows = []

    def torch_mm(a, b):
        return median_seconds(lambda n: [torch.mm(a, b) for _ in range(n)], reps, rounds)

    for dtype, pair in (("fp32", 1), ("bf16", 2)):
        low = (lambda t: t) if pair == 1 else (lambda t: t.bfloat16())
        q_in, k_in, v_in = (t.numpy() if pair == 1 else bits(low(t)) for t in (q, k, v))
        score_args = (dim // pair, (q_in, 0, dim), (k_in, 0, dim), (scores, 0, DECODE_KEYS),
                      DECODE_ROWS, DECODE_KEYS)  # fmt: skip
        qk = median_seconds(repeated(repeat_scores, *score_args), reps, rounds)
        rows.append((f"decode QK^T ({DECODE_ROWS} rows, scores_by_dots)", dtype, flops, qk,
                     torch_mm(low(q), low(k).T)))  # fmt: skip
        p_forms = (
            {"": p.numpy()}
            if pair == 1
            else {
                ", V widened": p.bfloat16().float().numpy(),
                ", V paired": bits(low(p)).view(np.uint32),
            }
        )
        for form, p_in in p_forms.items():
            step = 2 if p_in.dtype == np.uint32 else 1
            value_args = ((p_in, 0, DECODE_KEYS // step, 1), (v_in, 0, dim, 16), (acc, 0, dim),
                          DECODE_ROWS, DECODE_KEYS, dim, step)  # fmt: skip
            pv = median_seconds(repeated(repeat_chunked_product, *value_args), reps, rounds)
            rows.append((f"decode PV ({VALUE_CHUNK}-key chunks{form})", dtype, flops, pv,
                         torch_mm(low(p), low(v))))  # fmt: skip
    if peak_flops("amx") is None or dim % 32:
        return rows
    k16, v16, p16 = (bits(t.bfloat16()) for t in (k, v, p))
    q_pairs = amx_query_pairs(bits(q.bfloat16())[None], 16)
    st, k_tail, p_tile, v_pairs = amx_buffers(AMX, 1, 16, DECODE_KEYS, dim, dim)
    p_tile[:DECODE_ROWS] = p16
    acc16 = aligned_zeros((16, dim))
    score_args = (q_pairs, (k16, 0, 0, dim), DECODE_KEYS, k_tail, st)
    qk = median_seconds(repeated(repeat_amx_key_scores, *score_args), reps, rounds)
    rows.append((f"decode S^T = K Q^T ({DECODE_ROWS} rows, AMX tiles)", "amx", flops, qk,
                 torch_mm(k.bfloat16(), q.bfloat16().T)))  # fmt: skip
    value_args = ((v16, 0, 0, dim), DECODE_KEYS, v_pairs, p_tile, acc16)
    pv = median_seconds(repeated(repeat_amx_values, *value_args), reps, rounds)
    rows.append((f"decode PV ({DECODE_ROWS} rows, AMX tiles, V paired per tile)", "amx",
                 flops, pv, torch_mm(p.bfloat16(), v.bfloat16())))  # fmt: skip
    return rows


def forward_tile(dim, rounds):
    """Seconds of the fp32 forward's tile steps alone: {"QK^T", "online softmax", "PV"}."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, dim, generator=gen).numpy() for rows in (ROWS, KEYS, KEYS))
    panels = aligned_zeros((KEYS // 16, dim, 16))
    pack_key_panels(k, panels)
    scores, acc = aligned_zeros((ROWS, KEYS)), aligned_zeros((ROWS, dim))
    scale2 = np.float32(dim**-0.5 * LOG2E)
    views = ((q, 0, dim, 1), (panels, 0, 16, dim * 16), (scores, 0, KEYS))
    repeat_product(1, dim, *views, ROWS, KEYS)  # scores in base 2, scaled once
    scores *= scale2
    start = scores.max(1) - np.float32(0.5)
    s, stats = aligned_zeros(scores.shape), [np.zeros(ROWS, np.float32) for _ in range(3)]
    reps = max(1, int(1e9 / (4 * ROWS * KEYS * dim)))
    qk = median_seconds(lambda n: repeat_product(n, dim, *views, ROWS, KEYS), reps, rounds)
    softmax = median_seconds(
        lambda n: repeat_softmax(n, scores, start, s, acc, *stats), reps, rounds
    )
    copy = median_seconds(lambda n: repeat_copy(n, scores, s), reps, rounds)
    pv_views = ((s, 0, KEYS, 1), (v, 0, dim, 16), (acc, 0, dim))
    pv = median_seconds(lambda n: repeat_product(n, KEYS, *pv_views, ROWS, dim), reps, rounds)
    return {"QK^T": qk, "online softmax": softmax - copy, "PV": pv}


def fp32_transposed_tile(dim, rounds):
    """Seconds of the fp32 forward's tile steps alone with the scores transposed (AVX-512):
    {"S^T = K Q^T", "online softmax", "O^T += V^T P^T"} (the softmax with the scale in its
    pass, P^T written in place)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, dim, generator=gen).numpy() for rows in (ROWS, KEYS, KEYS))
    s_t_args, o_t_args = fp32_transposed_views(q, k, v, aligned_zeros((ROWS, KEYS)))
    scores_t = s_t_args[3][0]
    reps = max(1, int(1e9 / (4 * ROWS * KEYS * dim)))
    qk = median_seconds(repeated(repeat_product, *s_t_args), reps, rounds)
    scores_t[:] = 0  # the repetitions added up: the scores of one product, unscaled
    repeat_product(1, *s_t_args)
    factor = np.float32(dim**-0.5 * LOG2E)
    s_t, acc_t = aligned_zeros(scores_t.shape), aligned_zeros((dim, ROWS))
    stats = [np.zeros(ROWS, np.float32) for _ in range(3)]
    softmax = median_seconds(
        repeated(repeat_fp32_transposed_softmax, scores_t, factor, s_t, acc_t, *stats), reps,
        rounds,
    )  # fmt: skip
    copy = median_seconds(lambda n: repeat_copy(n, scores_t, s_t), reps, rounds)
    pv = median_seconds(repeated(repeat_product, *o_t_args), reps, rounds)
    return {"S^T = K Q^T": qk, "online softmax": softmax - copy, "O^T += V^T P^T": pv}


def amx_forward_tile(dim, rounds):
    """Seconds of the bf16 forward's tile steps on AMX alone, the scores transposed:
    {"S^T = K Q^T", "online softmax", "O^T += V^T P^T"} (the softmax with the scale and
    P's rounding to bf16 in its pass)."""
    gen = torch.Generator().manual_seed(0)
    q16, k16, v16 = (torch.randn(rows, dim, generator=gen).bfloat16()
                     for rows in (ROWS, KEYS, KEYS))  # fmt: skip
    q_t, v_t, p_t = amx_forward_operands(q16, v16, torch.zeros(ROWS, KEYS).bfloat16())
    scores_t, acc_t = aligned_zeros((KEYS, ROWS)), aligned_zeros((dim, ROWS))
    qk_args, pv_args = amx_forward_views(bits(k16), q_t, v_t, p_t, scores_t, acc_t)
    reps = max(1, int(1e9 / (4 * ROWS * KEYS * dim)))
    qk = median_seconds(repeated(repeat_amx, *qk_args), reps, rounds)
    factor = np.float32(dim**-0.5 * LOG2E)
    stats = [np.zeros(ROWS, np.float32) for _ in range(3)]
    softmax = median_seconds(
        repeated(repeat_transposed_softmax, scores_t, factor, p_t, acc_t, *stats), reps, rounds
    )
    pv = median_seconds(repeated(repeat_amx, *pv_args), reps, rounds)
    return {"S^T = K Q^T": qk, "online softmax": softmax, "O^T += V^T P^T": pv}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    peaks = {kind: peak_flops(kind) for kind in ("fp32", "bf16", "amx")}
    cpu = cpu_description()
    print(f"{cpu['cpu_model']} ({cpu['vector_isa']}), one thread; peaks from register-only "
          f"loops: fp32 FMA {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 dot "
          + (f"{peaks['bf16'] / 1e9:.0f} GFLOP/s" if peaks["bf16"] else "none")
          + (f", AMX bf16 {peaks['amx'] / 1e9:.0f} GFLOP/s" if peaks["amx"] else ""))  # fmt: skip
    columns = ("E", "product", "dtype", "ours GFLOP/s", "of peak", "torch.mm GFLOP/s",
               "of peak", "ours / torch")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in args.head_dims:
        for name, dtype, flops, ours, theirs in products(dim, args.rounds) + decode_products(
            dim, args.rounds
        ):
            peak = peaks[dtype] or peaks["fp32"]
            print(f"| {dim} | {name} | {dtype} | {flops / ours / 1e9:.0f} | "
                  f"{flops / ours / peak:.0%} | {flops / theirs / 1e9:.0f} | "
                  f"{flops / theirs / peak:.0%} | {theirs / ours:.2f}x |")  # fmt: skip
    print_tile_steps(f"The fp32 forward's {ROWS} x {KEYS} tile", forward_tile, args.head_dims,
                     args.rounds)  # fmt: skip
    if "avx512f" in target_features():
        print_tile_steps(f"The fp32 forward's {ROWS} x {KEYS} tile with its scores transposed "
                         "(AVX-512's route)", fp32_transposed_tile, args.head_dims,
                         args.rounds)  # fmt: skip
    if peaks["amx"] is None:
        return
    print_tile_steps(f"The bf16 forward's {ROWS} x {KEYS} tile on AMX", amx_forward_tile,
                     [dim for dim in args.head_dims if dim % 32 == 0], args.rounds,
                     decimals=1)  # fmt: skip


def print_tile_steps(title, tile_steps, head_dims, rounds, decimals=0):
    """`title`, step by step: each head dim's tile time and each step's time and share, from
    tile_steps(dim, rounds) -> {step: seconds}."""
    print(f"\n{title}, step by step (each alone):")
    for dim in head_dims:
        steps = tile_steps(dim, rounds)
        tile = sum(steps.values())
        shares = (f"{name} {t * 1e6:.{decimals}f} us ({t / tile:.0%})"
                  for name, t in steps.items())  # fmt: skip
        print(f"E = {dim}: tile {tile * 1e6:.0f} us; " + ", ".join(shares))


if __name__ == "__main__":
    main()
