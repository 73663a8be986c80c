"""Explicit 16-lane operations of the softmax beside the products: maxima and exponentials
down transposed tiles, bf16 rounding, mask blocks added to a tile."""

from __future__ import annotations

from attnperf.kernels.numba.fastmath import EXP2_BF16_COEFFS, EXP2_COEFFS, emit_scaled_minus
from attnperf.kernels.numba.jit import cgutils, intrinsic, ir, types
from attnperf.kernels.numba.microkernels import (
    LANES,
    _BFloat,
    _function,
    _splat,
    _vector_at,
    target_features,
)
from attnperf.kernels.numba.packing import _transpose_16x16


@intrinsic
def to_bf16(typingctx, x):
    """x (float32) rounded to bf16, nearest even, as its uint16 bits; vectorises. With
    AVX512-BF16 it is vcvtneps2bf16, which flushes fp32 subnormals to zero; elsewhere the
    same rounding in integer ops (LLVM's generic lowering calls a libgcc function that this
    platform's may lack: it crashed the process)."""
    sig = types.uint16(types.float32)
    has_bf16 = "avx512bf16" in target_features()

    def codegen(context, builder, signature, args):
        value = args[0]
        if has_bf16:
            return builder.bitcast(builder.fptrunc(value, _BFloat()), ir.IntType(16))
        int32 = ir.IntType(32)
        bits = builder.bitcast(value, int32)
        upper = builder.lshr(bits, ir.Constant(int32, 16))
        lowest = builder.and_(upper, ir.Constant(int32, 1))
        rounding = builder.add(lowest, ir.Constant(int32, 0x7FFF))
        rounded = builder.lshr(builder.add(bits, rounding), ir.Constant(int32, 16))
        quiet_nan = builder.or_(upper, ir.Constant(int32, 0x40))
        is_nan = builder.fcmp_unordered("uno", value, value)
        return builder.trunc(builder.select(is_nan, quiet_nan, rounded), ir.IntType(16))

    return sig, codegen


MAXIMA_CHAINS = 8  # independent vmaxps chains: the latency of two pipes covered


@intrinsic
def column_maxima(typingctx, s_t, cols, row, largest):
    """largest[row : row + 16] = max(largest there, the maxima of s_t[:cols, row : row +
    16]) (float32, C rows), NaN scores passed over (their exp2 makes the row NaN): one
    load and one vmaxps a vector, on 8 chains held in registers (the loop LLVM vectorises
    kept its maxima in memory, three times slower). AVX-512F."""
    sig = types.void(s_t, types.intp, types.intp, largest)
    served = s_t.dtype == types.float32 and s_t.ndim == 2 and s_t.layout == "C"

    def codegen(context, builder, signature, args):
        if not served or "avx512f" not in target_features():
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        s_t, cols, row, largest = args
        f32x16 = ir.VectorType(ir.FloatType(), LANES)
        scores = context.make_array(signature.args[0])(context, builder, s_t)
        stride = cgutils.unpack_tuple(builder, scores.shape)[1]  # elements a key
        origin = builder.gep(scores.data, [row])
        maxima_data = context.make_array(signature.args[3])(context, builder, largest).data
        maxima_at = builder.bitcast(builder.gep(maxima_data, [row]), f32x16.as_pointer())

        def key_vector(key):
            at = builder.gep(origin, [builder.mul(key, stride)])
            return builder.load(builder.bitcast(at, f32x16.as_pointer()), align=4)

        def larger(score, maximum):  # vmaxps(score, maximum): a NaN score gives maximum
            return builder.select(builder.fcmp_ordered(">", score, maximum), score, maximum)

        chains = [cgutils.alloca_once_value(builder, ir.Constant(f32x16, [float("-inf")] * LANES))
                  for _ in range(MAXIMA_CHAINS)]  # fmt: skip
        step = ir.Constant(cols.type, MAXIMA_CHAINS)
        whole = builder.mul(builder.sdiv(cols, step), step)
        with cgutils.for_range_slice(builder, ir.Constant(cols.type, 0), whole, step) as (key, _):
            for k, chain in enumerate(chains):
                vector = key_vector(builder.add(key, ir.Constant(cols.type, k)))
                builder.store(larger(vector, builder.load(chain)), chain)
        with cgutils.for_range_slice(builder, whole, cols, ir.Constant(cols.type, 1)) as (key, _):
            builder.store(larger(key_vector(key), builder.load(chains[0])), chains[0])
        maxima = [builder.load(chain) for chain in chains] + [builder.load(maxima_at, align=4)]
        while len(maxima) > 1:
            maxima = [larger(*maxima[i : i + 2]) if i + 1 < len(maxima) else maxima[i]
                      for i in range(0, len(maxima), 2)]  # fmt: skip
        builder.store(maxima[0], maxima_at, align=4)
        return context.get_dummy_value()

    return sig, codegen


# The smallest exponent whose 2**t vscalefps gives: p >= 2**-0.5 times 2**-125 is a normal
# float; below it the result is 0 (as `exp2`'s flush below 2**-126.5). A result that
# underflowed into subnormals or to zero cost a microcode assist each: a causal tile's
# masked scores made its softmax several times slower.
EXP2_FLOOR = -125.0


def _exp2_vector(builder, t, coefficients):
    """2 ** t on a 16-lane float32 vector, explicitly: t clamped below at EXP2_FLOOR (one
    vmaxps: NaN goes on into the polynomial), 2 ** (t - n) by `coefficients`' polynomial
    (fastmath's fits, n = rint(t)) and 2 ** n applied by vscalefps; 0 below 2 **
    EXP2_FLOOR. AVX-512F."""
    f32x16 = t.type
    fma = _function(builder, "llvm.fma.v16f32", f32x16, [f32x16] * 3)
    rint = _function(builder, "llvm.rint.v16f32", f32x16, [f32x16])
    scalef = _function(builder, "llvm.x86.avx512.mask.scalef.ps.512", f32x16,
                       [f32x16, f32x16, f32x16, ir.IntType(16), ir.IntType(32)])  # fmt: skip
    floor = ir.Constant(f32x16, [EXP2_FLOOR] * LANES)
    below = builder.fcmp_ordered("<", t, floor)  # NaN is not: it goes on
    clamped = builder.select(below, floor, t)  # a masked -inf gives no NaN here
    n = builder.call(rint, [clamped])
    f = builder.fsub(clamped, n)
    p = ir.Constant(f32x16, [float(coefficients[-1])] * LANES)
    for c in reversed(coefficients[:-1]):
        p = builder.call(fma, [p, f, ir.Constant(f32x16, [float(c)] * LANES)])
    every_lane = ir.Constant(ir.IntType(16), -1)
    current_rounding = ir.Constant(ir.IntType(32), 4)
    scaled = builder.call(scalef, [p, n, p, every_lane, current_rounding])
    return builder.select(below, ir.Constant(f32x16, [0.0] * LANES), scaled)


@intrinsic
def exp2_pairs_to_bf16(typingctx, s_t, at, stride, shift, row, factor, p_t, p_at, total):
    """Softmax probabilities of 16 query rows for two keys, explicitly on 16-lane vectors:
    p = 2 ** (factor s - shift[row : row + 16]) for the key scores s_t[at : at + 16] and
    s_t[at + stride : ...] (float32, flat offsets in elements), total[row : row + 16] += both,
    and both rounded to bf16 into p_t[p_at : p_at + 32] interleaved (AMX's B pairs: row r's
    two keys side by side). `exp2_for_bf16`'s polynomial, with 2 ** n applied by vscalefps
    and the pair rounded by one vcvtne2ps2bf16: 13 vector ops a key where the loop LLVM
    vectorises takes 17; 0 below 2 ** EXP2_FLOOR. Needs AVX-512F and AVX512-BF16 (the AMX
    route's CPUs)."""
    sig = types.void(s_t, types.intp, types.intp, shift, types.intp, types.float32, p_t,
                     types.intp, total)  # fmt: skip
    served = s_t.dtype == types.float32 and p_t.dtype == types.uint16

    def codegen(context, builder, signature, args):
        if not served or not {"avx512f", "avx512bf16"} <= target_features():
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        s_t, at, stride, shift, row, factor, p_t, p_at, total = args
        f32x16 = ir.VectorType(ir.FloatType(), LANES)
        i16x32 = ir.VectorType(ir.IntType(16), 2 * LANES)

        def vector_at(array_type, array, offset, vector_type):
            return _vector_at(context, builder, array_type, array, offset, vector_type)

        arg_types = signature.args
        to_pairs = _function(builder, "llvm.x86.avx512bf16.cvtne2ps2bf16.512",
                             ir.VectorType(_BFloat(), 2 * LANES), [f32x16, f32x16])  # fmt: skip
        shifts = builder.load(vector_at(arg_types[3], shift, row, f32x16), align=4)
        factors = _splat(builder, factor, f32x16)
        probabilities = []
        for offset in (at, builder.add(at, stride)):
            scores = builder.load(vector_at(arg_types[0], s_t, offset, f32x16), align=4)
            t = emit_scaled_minus(builder, scores, factors, shifts)
            probabilities.append(_exp2_vector(builder, t, EXP2_BF16_COEFFS))
        even, odd = probabilities
        sums = vector_at(arg_types[8], total, row, f32x16)
        builder.store(builder.fadd(builder.load(sums, align=4), builder.fadd(even, odd)), sums,
                      align=4)  # fmt: skip
        halves = builder.bitcast(builder.call(to_pairs, [odd, even]), i16x32)  # even's low
        interleave = [half * LANES + lane for lane in range(LANES) for half in (0, 1)]
        pairs = builder.shuffle_vector(halves, ir.Constant(i16x32, ir.Undefined),
                                       ir.Constant(ir.VectorType(ir.IntType(32), 2 * LANES),
                                                   interleave))  # fmt: skip
        builder.store(pairs, vector_at(arg_types[6], p_t, p_at, i16x32), align=2)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def exp2_columns(typingctx, s_t, cols, row, shift, factor, total):
    """Softmax probabilities of 16 query rows in place, explicitly on 16-lane vectors: for
    each key c < cols, s_t[c, row : row + 16] <- p = 2 ** (factor s - shift[row : row +
    16]) (float32, C rows), and total[row : row + 16] += the sums, held in a register over
    the keys. fastmath's degree-6 `exp2` polynomial with 2 ** n by vscalefps (`_exp2_vector`):
    within 2 ulp of 2 ** t like `exp2`; 0 below 2 ** EXP2_FLOOR. AVX-512F."""
    sig = types.void(s_t, types.intp, types.intp, shift, types.float32, total)
    served = s_t.dtype == types.float32 and s_t.ndim == 2 and s_t.layout == "C"

    def codegen(context, builder, signature, args):
        if not served or "avx512f" not in target_features():
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        s_t, cols, row, shift, factor, total = args
        f32x16 = ir.VectorType(ir.FloatType(), LANES)
        arg_types = signature.args

        def vector_at(array_type, array, offset):
            return _vector_at(context, builder, array_type, array, offset, f32x16)

        scores = context.make_array(arg_types[0])(context, builder, s_t)
        stride = cgutils.unpack_tuple(builder, scores.shape)[1]  # elements a key
        origin = builder.gep(scores.data, [row])
        shifts = builder.load(vector_at(arg_types[3], shift, row), align=4)
        factors = _splat(builder, factor, f32x16)
        sums = vector_at(arg_types[5], total, row)
        running = cgutils.alloca_once_value(builder, builder.load(sums, align=4))
        with cgutils.for_range(builder, cols) as loop:
            at = builder.bitcast(builder.gep(origin, [builder.mul(loop.index, stride)]),
                                 f32x16.as_pointer())  # fmt: skip
            t = emit_scaled_minus(builder, builder.load(at, align=4), factors, shifts)
            p = _exp2_vector(builder, t, EXP2_COEFFS)
            builder.store(p, at, align=4)
            builder.store(builder.fadd(builder.load(running), p), running)
        builder.store(builder.load(running), sums, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vector_blocks(typingctx):
    """Whether numba's target has AVX-512F, fixed where the code is compiled: a kernel
    asks it before taking a mask's blocks by `add_block`."""
    present = "avx512f" in target_features()

    def codegen(context, builder, signature, args):
        return context.get_constant(types.boolean, present)

    return types.boolean(), codegen


@intrinsic(prefer_literal=True)
def add_block(typingctx, s, s_at, values, v_at, shut, transposed):
    """A 16 x 16 block of an attn_mask added to scores, explicitly on 16-lane vectors: for
    i < 16, s[s_at + i w : + 16] += row i of the block values[v_at : v_at + 256] (rows of
    16; w: s's row stride in elements), or its column i where `transposed` (a literal; the
    block transposed in registers by four rounds of the perfect shuffle), or -inf where
    `shut`. s: float32 rows of unit stride; values: float32 (P, 16, 16), C-contiguous.
    LLVM's loops over 16 elements ran their vector body only from 64 on, leaving such
    blocks to scalar code (0.41 ns an element against 0.06 for a long loop). AVX-512F."""
    if not isinstance(transposed, types.BooleanLiteral):
        return None
    sig = types.void(s, types.intp, values, types.intp, types.boolean, transposed)
    served = s.dtype == types.float32 and s.ndim == 2
    served = served and values.dtype == types.float32 and values.layout == "C"
    across = transposed.literal_value

    def codegen(context, builder, signature, args):
        if not served or "avx512f" not in target_features():
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        s, s_at, values, v_at, shut = args[:5]
        f32x16 = ir.VectorType(ir.FloatType(), LANES)
        scores = context.make_array(signature.args[0])(context, builder, s)
        row_bytes = cgutils.unpack_tuple(builder, scores.strides)[0]
        stride = builder.sdiv(row_bytes, ir.Constant(row_bytes.type, 4))
        origin = builder.gep(scores.data, [s_at])
        block = context.make_array(signature.args[2])(context, builder, values).data
        block = builder.gep(block, [v_at])

        def vector_at(base, offset):
            return builder.bitcast(builder.gep(base, [offset]), f32x16.as_pointer())

        def constant(value):
            return ir.Constant(s_at.type, value)

        with builder.if_else(shut) as (shut_block, values_block):
            with shut_block:
                minus_inf = ir.Constant(f32x16, [float("-inf")] * LANES)
                for i in range(LANES):
                    at = vector_at(origin, builder.mul(constant(i), stride))
                    builder.store(builder.fadd(builder.load(at, align=4), minus_inf), at, align=4)
            with values_block:
                rows = [builder.load(vector_at(block, constant(LANES * i)), align=4)
                        for i in range(LANES)]  # fmt: skip
                if across:
                    rows = _transpose_16x16(builder, rows)
                for i, row in enumerate(rows):
                    at = vector_at(origin, builder.mul(constant(i), stride))
                    builder.store(builder.fadd(builder.load(at, align=4), row), at, align=4)
        return context.get_dummy_value()

    return sig, codegen
