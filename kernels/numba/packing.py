"""Operands into the products' layouts (key panels, VNNI pairs, transposes of 16 x 16 blocks
in registers), and a whole fp32 gemm on the micro-kernels over them (`gemm_fp32`)."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.jit import (
    FASTMATH,
    intrinsic,
    ir,
    njit,
    types,
    unowned_members,
    wide_vectors,
)
from attnperf.kernels.numba.microkernels import (
    FP32,
    LANES,
    _Emitter,
    _function,
    _i32,
    _lanes_below,
    _operand,
    _shuffle,
    _splat,
    target_features,
    tile_product,
)


@njit(fastmath=FASTMATH)
def gemm_fp32(a, b, c, alpha, beta, trans_a, trans_b):
    """blas.gemm's contract on our fp32 micro-kernels: c = alpha * op(a) @ op(b) + beta * c
    for 2-D float32 views, c with unit column stride. op(a) is read at any strides (its
    elements are broadcast one by one); a transposed b is first packed in panels, as keys
    are (`pack_key_panels`)."""
    rows, cols = c.shape
    if rows == 0 or cols == 0:
        return
    # Held by the caller: the views below then count no references (an atomic add and
    # subtract for each array at every micro-kernel's call).
    a, b, c = unowned_members((a, b, c))
    depth = a.shape[0] if trans_a else a.shape[1]
    a_row_stride, a_depth_stride = a.strides[0] // 4, a.strides[1] // 4
    if trans_a:
        a_row_stride, a_depth_stride = a_depth_stride, a_row_stride
    a_view = (a, 0, a_row_stride, a_depth_stride)
    c_view = (c, 0, c.strides[0] // 4)
    alpha, beta = np.float32(alpha), np.float32(beta)
    if trans_b:
        packed = np.empty(((cols + LANES - 1) // LANES, depth, LANES), np.float32)
        pack_key_panels(b, packed)
        b_view = (packed, 0, LANES, depth * LANES)
        tile_product(depth, alpha, beta, a_view, b_view, c_view, rows, cols)
    else:
        b_view = (b, 0, b.strides[0] // 4, LANES)
        tile_product(depth, alpha, beta, a_view, b_view, c_view, rows, cols)


@intrinsic
def transpose_block(typingctx, src_view, rows, cols, dst_view):
    """dst[d_offset + c d_stride + r] = src[s_offset + r s_stride + c] for r < 16 and c <
    cols <= 16, zeros for r >= rows: a 16 x 16 block of 32-bit elements transposed in
    registers (with AVX-512 16 masked loads, four rounds of the perfect shuffle and 16
    stores; without, `_transpose_quadrants`); float32, or pairs of bf16 (uint16 arrays:
    element i is the pair at 2 i, offsets and strides count uint16). Views: src_view
    (src, offset, row_stride), dst_view (dst, offset, row_stride); rows past `rows` are
    never read. Other dtypes trap."""
    sig = types.void(src_view, types.intp, types.intp, dst_view)
    dtypes = src_view[0].dtype, dst_view[0].dtype
    served = dtypes in ((types.float32, types.float32), (types.uint16, types.uint16))
    unit = 2 if dtypes[0] == types.uint16 else 1  # array elements per 32-bit element
    in_quadrants = "avx512f" not in target_features()

    def codegen(context, builder, signature, args):
        if not served:  # on a side of an `if` never taken
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        src_view, rows, cols, dst_view = args
        src, s_offset, s_stride = _operand(context, builder, signature.args[0], src_view)
        dst, d_offset, d_stride = _operand(context, builder, signature.args[3], dst_view)
        if in_quadrants:
            _transpose_quadrants(builder, (src, s_offset, s_stride), rows, cols,
                                 (dst, d_offset, d_stride), unit)  # fmt: skip
            return context.get_dummy_value()
        index_type = rows.type
        in_cols = _lanes_below(builder, builder.trunc(cols, ir.IntType(32)))
        emit = _Emitter(builder, FP32, None, False)
        vectors = []
        for r in range(LANES):
            present = builder.icmp_signed("<", ir.Constant(index_type, r), rows)
            emit.mask = builder.and_(in_cols, _splat(builder, present, in_cols.type))
            at = builder.add(s_offset, builder.mul(ir.Constant(index_type, r), s_stride))
            vectors.append(emit.load(builder.gep(src, [at]), emit.f32x16, True))
        for c, vector in enumerate(_transpose_16x16(builder, vectors)):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(index_type, c), cols)):
                at = builder.add(d_offset, builder.mul(ir.Constant(index_type, c), d_stride))
                emit.store(vector, builder.gep(dst, [at]), False)
        return context.get_dummy_value()

    return sig, codegen


def _transpose_16x16(builder, rows):
    """The columns of 16 rows of 16 lanes: four rounds of the perfect shuffle (log2(16)),
    each interleaving the first eight vectors with the last eight."""
    # Interleaving a with b: their first halves (low), their second halves (high).
    low = [lane // 2 + (LANES if lane % 2 else 0) for lane in range(LANES)]
    high = [lane + LANES // 2 for lane in low]
    half = LANES // 2
    for _ in range(4):
        shuffled = []
        for a, b in zip(rows[:half], rows[half:], strict=True):
            shuffled += [_shuffle(builder, a, b, low), _shuffle(builder, a, b, high)]
        rows = shuffled
    return rows


def _transpose_quadrants(builder, src_view, rows, cols, dst_view, unit):
    """`transpose_block` without AVX-512: four 8 x 8 transposes of 8-lane vectors. Their
    shuffles are AVX2's unpack, shufps and vperm2f128 (24 per 64 elements), where the
    16-lane perfect shuffle lowered to ~2.7 permutes and blends per element."""
    (src, s_offset, s_stride), (dst, d_offset, d_stride) = src_view, dst_view
    index_type = rows.type
    f32x8 = ir.VectorType(ir.FloatType(), 8)
    cols32 = builder.trunc(cols, ir.IntType(32))
    emit = _Emitter(builder, FP32, None, False)

    def at(base, shift, index, stride):
        """base + shift + index * stride (shift and index Python ints)."""
        offset = builder.mul(ir.Constant(index_type, index), stride)
        return builder.add(builder.add(base, ir.Constant(index_type, shift)), offset)

    for c0 in (0, 8):
        in_cols = _lanes_below(builder, builder.sub(cols32, _i32(c0)), 8)
        for r0 in (0, 8):
            vectors = []
            for r in range(r0, r0 + 8):
                present = builder.icmp_signed("<", ir.Constant(index_type, r), rows)
                emit.mask = builder.and_(in_cols, _splat(builder, present, in_cols.type))
                where = at(s_offset, c0 * unit, r, s_stride)
                vectors.append(emit.load(builder.gep(src, [where]), f32x8, True))
            for c, vector in enumerate(_transpose_8x8(builder, vectors)):
                inside = builder.icmp_signed("<", ir.Constant(index_type, c0 + c), cols)
                with builder.if_then(inside):
                    where = at(d_offset, r0 * unit, c0 + c, d_stride)
                    emit.store(vector, builder.gep(dst, [where]), False)


def _transpose_8x8(builder, rows):
    """The columns of 8 rows of 8 lanes: pairs of rows interleaved (unpcklps, unpckhps),
    then pairs of those (shufps), then the 128-bit halves exchanged (vperm2f128)."""
    pairs = []
    for a, b in zip(rows[0::2], rows[1::2], strict=True):
        pairs += [_shuffle(builder, a, b, [0, 8, 1, 9, 4, 12, 5, 13]),
                  _shuffle(builder, a, b, [2, 10, 3, 11, 6, 14, 7, 15])]  # fmt: skip
    quads = []
    for first in (0, 4):  # rows 0-3, then rows 4-7
        low_a, high_a, low_b, high_b = pairs[first : first + 4]
        for a, b in ((low_a, low_b), (high_a, high_b)):
            quads += [_shuffle(builder, a, b, [0, 1, 8, 9, 4, 5, 12, 13]),
                      _shuffle(builder, a, b, [2, 3, 10, 11, 6, 7, 14, 15])]  # fmt: skip
    first_halves = [0, 1, 2, 3, 8, 9, 10, 11]
    second_halves = [4, 5, 6, 7, 12, 13, 14, 15]
    return [_shuffle(builder, quads[c], quads[c + 4], first_halves) for c in range(4)] + [
        _shuffle(builder, quads[c], quads[c + 4], second_halves) for c in range(4)
    ]


@njit(fastmath=FASTMATH)
def pack_key_panels(k, packed):
    """packed (ceil(S / 16), depth, 16 w) <- k (S, E) as B = K^T in panels of 16 keys: for
    fp32 (w = 1) packed[p, d, t] = k[16 p + t, d]; for bf16 (w = 2, depth = ceil(E / 2))
    the pair packed[p, d, 2 t + u] = k[16 p + t, 2 d + u]. Zeros past S and E."""
    keys, dim = k.shape
    panels, depth, width = packed.shape
    pair = width // LANES
    if k.strides[1] == k.itemsize and dim % pair == 0:  # 16 x 16 blocks in registers
        row_stride = k.strides[0] // k.itemsize
        for p in range(panels):
            rows = max(0, min(LANES, keys - p * LANES))
            for d0 in range(0, depth, LANES):  # fp32 elements or bf16 pairs
                block = (packed, (p * depth + d0) * width, width)
                transpose_block((k, p * LANES * row_stride + d0 * pair, row_stride), rows,
                                min(LANES, depth - d0), block)  # fmt: skip
        return
    for p in range(panels):
        out = packed[p]
        for t in range(LANES):
            j = p * LANES + t
            if j >= keys:
                out[:, t * pair : (t + 1) * pair] = 0
                continue
            row = k[j]
            if pair == 1:
                for e in range(dim):
                    out[e, t] = row[e]
                continue
            for d in range(dim // 2):  # bf16: the lane's pairs
                out[d, 2 * t] = row[2 * d]
                out[d, 2 * t + 1] = row[2 * d + 1]
            if dim % 2:
                out[depth - 1, 2 * t] = row[dim - 1]
                out[depth - 1, 2 * t + 1] = 0


@njit(fastmath=FASTMATH)
def pack_vnni(src, dst):
    """dst (ceil(depth / 2), 2 cols) <- src (depth, cols) bf16 in the VNNI layout: dst[d,
    2 j + u] = src[2 d + u, j], zeros past depth."""
    depth, cols = src.shape
    for d in range(dst.shape[0]):
        for u in range(2):
            row = 2 * d + u
            if row < depth:  # a shorter sequence than dst holds: never read past its rows
                for j in range(cols):
                    dst[d, 2 * j + u] = src[row, j]
            else:
                for j in range(cols):
                    dst[d, 2 * j + u] = 0


@njit(fastmath=FASTMATH)
def transpose_bf16(src, dst, pairs_t):
    """dst[:cols, :rows] <- src (rows, cols) transposed, bf16 bits (cols even), zeros in
    dst's columns past rows: 16 x 16 blocks of pairs transposed in registers into pairs_t
    (>= cols / 2, >= 2 whole_tiles(rows), `transpose_block`), whose pairs' halves then go
    to dst's even and odd rows (twice as fast as one element at a time)."""
    wide_vectors()
    rows, cols = src.shape
    pairs = cols // 2
    if src.strides[1] != src.itemsize:
        for e in range(cols):
            for j in range(rows):
                dst[e, j] = src[j, e]
        dst[:cols, rows:] = 0
        return
    row_stride = src.strides[0] // src.itemsize
    for p in range(0, rows, LANES):
        for d0 in range(0, pairs, LANES):
            transpose_block((src, p * row_stride + 2 * d0, row_stride), min(LANES, rows - p),
                            min(LANES, pairs - d0), (pairs_t, d0 * pairs_t.shape[1] + 2 * p,
                            pairs_t.shape[1]))  # fmt: skip
    halves = pairs_t.view(np.uint32)
    for d in range(pairs):  # a loop per half: both in one ran several times slower
        pair_row, even = halves[d], dst[2 * d]
        for j in range(rows):
            even[j] = np.uint16(pair_row[j] & np.uint32(0xFFFF))
        odd = dst[2 * d + 1]
        for j in range(rows):
            odd[j] = np.uint16(pair_row[j] >> np.uint32(16))
    dst[:cols, rows:] = 0


@njit(fastmath=FASTMATH)
def transpose_tile(src, dst, rows, cols):
    """dst[:cols, :rows] <- src[:rows, :cols]^T, 32-bit elements in C rows, rows and cols
    multiples of 16: 16 x 16 blocks in registers (`transpose_block`)."""
    for r in range(0, rows, LANES):
        for c in range(0, cols, LANES):
            transpose_block((src, r * src.shape[1] + c, src.shape[1]), LANES, LANES,
                            (dst, c * dst.shape[1] + r, dst.shape[1]))  # fmt: skip
