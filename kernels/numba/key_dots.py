"""A decoding step's scores as dot products of up to 4 query rows against up to 16 key rows
as they lie in the cache (`key_dots`), reduced by a transposing tree of shuffles."""

from __future__ import annotations

from attnperf.kernels.numba.jit import FASTMATH, cgutils, emit_prefetch, intrinsic, ir, njit, types
from attnperf.kernels.numba.microkernels import (
    BF16,
    FP32,
    LANES,
    _Emitter,
    _function,
    _i32,
    _lanes_below,
    _operand,
    _shuffle,
    _splat,
    _with_prefetching,
    rolled_loop,
    target_features,
)

KEY_BLOCKS = {4: 4, 2: 8, 1: 16}  # key_dots' shapes: query rows -> keys, 16 accumulators


@intrinsic(prefer_literal=True)
def key_dots(typingctx, mr, depth, alpha, q_view, k_view, s_view, keys, ahead):
    """S[i, t] = alpha * sum_d Q[i, d] K[t, d] for i < mr and t < keys <= 16 / mr (mr 1, 2
    or 4, literal): dot products of query rows with key rows as they lie (no packing, so a
    cache is read in memory order), mr x 16 / mr vector accumulators reduced at the end by a
    transposing tree (15 adds for 16 sums, no horizontal sum per key). fp32 for float32 q
    and k, bf16 pairs (vdpbf16ps; depth counts pairs) for uint16 ones. Views count
    elements: (array, offset, row_stride); key rows past `keys` are never read. With
    `ahead` != 0, each key vector's line `ahead` elements on is asked for into L2 as the
    vector is loaded (as `micro_kernel`'s B rows; the depth's last partial vector not)."""
    if not isinstance(mr, types.IntegerLiteral) or mr.literal_value not in KEY_BLOCKS:
        return None
    rows = mr.literal_value
    key_block = KEY_BLOCKS[rows]
    kind_value = FP32 if q_view[0].dtype == types.float32 else BF16
    prefetches = not isinstance(ahead, types.Omitted)  # as micro_kernel's
    sig = types.void(mr, types.intp, types.float32, q_view, k_view, s_view, types.intp,
                     types.intp if prefetches else ahead)  # fmt: skip
    has_bf16 = "avx512bf16" in target_features()

    def codegen(context, builder, signature, args):
        depth, alpha, q_view, k_view, s_view, keys, ahead = args[1:]
        if signature.args[3][0].dtype != signature.args[4][0].dtype:  # a side never taken
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        q_data, q_offset, q_stride = _operand(context, builder, signature.args[3], q_view)
        k_data, k_offset, k_stride = _operand(context, builder, signature.args[4], k_view)
        s_data, s_offset, s_stride = _operand(context, builder, signature.args[5], s_view)
        index_type = depth.type

        def constant(value):
            return ir.Constant(index_type, value)

        emit = _Emitter(builder, kind_value, None, has_bf16)
        vector_type = emit.f32x16 if kind_value == FP32 else emit.i32x16
        unit = constant(1 if kind_value == FP32 else 2)  # array elements per lane
        zero = ir.Constant(emit.f32x16, None)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(key_block)]
                for _ in range(rows)]  # fmt: skip
        # Keys past `keys` read the last one again (their sums are never stored).
        last_key = builder.sub(keys, constant(1))
        key_rows = []
        for t in range(key_block):
            t_value = constant(t)
            row = builder.select(builder.icmp_signed("<", t_value, keys), t_value, last_key)
            key_rows.append(builder.add(k_offset, builder.mul(row, k_stride)))
        q_rows = [builder.add(q_offset, builder.mul(constant(i), q_stride)) for i in range(rows)]

        def depth_step(at, mask, prefetching=False):
            emit.mask = mask
            masked = mask is not None
            queries = [emit.load(builder.gep(q_data, [builder.add(q_row, at)]), vector_type,
                                 masked) for q_row in q_rows]  # fmt: skip
            for t in range(key_block):
                key_at = builder.add(key_rows[t], at)
                key = emit.load(builder.gep(k_data, [key_at]), vector_type, masked)
                if prefetching:
                    emit_prefetch(builder, builder.gep(k_data, [builder.add(key_at, ahead)]), 2)
                for i in range(rows):
                    acc = builder.load(accs[i][t])
                    builder.store(emit.multiply_add(acc, queries[i], key), accs[i][t])

        whole = builder.sdiv(depth, constant(LANES))

        def depth_loop(prefetching):
            with rolled_loop(builder, whole) as d:
                depth_step(builder.mul(builder.mul(d, constant(LANES)), unit), None, prefetching)

        _with_prefetching(builder, prefetches, ahead, depth_loop)
        left = builder.trunc(builder.srem(depth, constant(LANES)), ir.IntType(32))
        with builder.if_then(builder.icmp_signed(">", left, _i32(0))):
            at = builder.mul(builder.mul(whole, constant(LANES)), unit)
            depth_step(at, _lanes_below(builder, left))

        # The tree: each vector holds blocks of equal lanes, each block one (row, key)'s
        # partial sums; a pair of vectors becomes one of twice the blocks, each half as wide.
        vectors = [builder.load(accs[i][t]) for i in range(rows) for t in range(key_block)]
        labels = [[(i, t)] for i in range(rows) for t in range(key_block)]
        while len(vectors) > 1:
            width = LANES // len(labels[0])
            half = width // 2
            merged, merged_labels = [], []
            pairs = zip(vectors[0::2], labels[0::2], vectors[1::2], labels[1::2], strict=True)
            for a, a_labels, b, b_labels in pairs:
                low, high, order = [], [], []
                for block, (a_label, b_label) in enumerate(zip(a_labels, b_labels, strict=True)):
                    start = block * width
                    low += list(range(start, start + half))
                    low += list(range(LANES + start, LANES + start + half))
                    high += list(range(start + half, start + width))
                    high += list(range(LANES + start + half, LANES + start + width))
                    order += [a_label, b_label]
                merged.append(builder.fadd(_shuffle(builder, a, b, low),
                                           _shuffle(builder, a, b, high)))  # fmt: skip
                merged_labels.append(order)
            vectors, labels = merged, merged_labels
        lane_of = {label: lane for lane, label in enumerate(labels[0])}
        in_order = [lane_of[(i, t)] for i in range(rows) for t in range(key_block)]
        sums = _shuffle(builder, vectors[0], vectors[0], in_order)
        sums = builder.fmul(sums, _splat(builder, alpha, emit.f32x16))
        key_mask = _lanes_below(builder, builder.trunc(keys, ir.IntType(32)), key_block)
        emit.mask = key_mask
        for i in range(rows):
            own_lanes = list(range(i * key_block, (i + 1) * key_block))
            row = sums if key_block == LANES else _shuffle(builder, sums, sums, own_lanes)
            at = builder.add(s_offset, builder.mul(constant(i), s_stride))
            emit.store(row, builder.gep(s_data, [at]), True)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=FASTMATH, inline="always")
def _dot_blocks(mr, depth, alpha, q_view, k_view, s_view, i, keys, ahead):
    """Query rows i .. i + mr - 1 against every key, in key_dots of mr rows; inlined, so
    that mr, a constant at each call, reaches `key_dots` as the literal it needs."""
    q, q_offset, q_stride = q_view
    k, k_offset, k_stride = k_view
    s, s_offset, s_stride = s_view
    step = LANES // mr
    for t in range(0, keys, step):
        key_dots(mr, depth, alpha, (q, q_offset + i * q_stride, q_stride),
                 (k, k_offset + t * k_stride, k_stride),
                 (s, s_offset + i * s_stride + t, s_stride), min(step, keys - t),
                 ahead)  # fmt: skip


@njit(fastmath=FASTMATH, inline="always")
def scores_by_dots(depth, alpha, q_view, k_view, s_view, rows, keys, ahead=0):
    """S[:rows, :keys] = alpha * Q K^T for query rows against key rows as they lie (views,
    kinds and `ahead` as `key_dots`'), in blocks of 4 query rows by 4 keys, then 2 by 8, 1
    by 16. Inlined where it is called (a decoding step's every 16-key chunk): as calls,
    with their arguments' arrays counted and their views passed, its scores ran a sixth
    slower."""
    full = rows - rows % 4
    for i in range(0, full, 4):
        _dot_blocks(4, depth, alpha, q_view, k_view, s_view, i, keys, ahead)
    i = full
    if rows - i >= 2:
        _dot_blocks(2, depth, alpha, q_view, k_view, s_view, i, keys, ahead)
        i += 2
    if rows - i == 1:
        _dot_blocks(1, depth, alpha, q_view, k_view, s_view, i, keys, ahead)
