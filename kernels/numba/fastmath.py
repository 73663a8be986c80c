"""Float32 math that LLVM vectorises: exp2 and tanh without libm calls, maxnum, base-2
mask values."""

from __future__ import annotations

import numpy as np

from attnperf.kernels.numba.jit import FASTMATH, cgutils, intrinsic, ir, njit, types, wide_vectors

LOG2E = 1.4426950408889634
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
# 2**f for f in [-0.5, 0.5]: a degree-6 polynomial fitted to the relative error
# (minimax by Lawson's reweighting on Chebyshev nodes, 1.9e-9 before rounding to float32),
# c0 = 1 so that 2**0 is exact. With FMA, exp2 is within 7.9e-8 relative of 2**t (about
# 1.3 ulp) from t = -126 to 40; with the degree-7 Taylor terms before it, 7.0e-8.
# float32 constants, or the polynomial is evaluated in float64 at half the vector width.
EXP2_COEFFS = tuple(
    np.float32(c)
    for c in (
        1.0, 0.6931471824645996, 0.24022646248340607, 0.05550328642129898,
        0.009618489071726799, 0.0013399930903688073, 0.0001534580806037411,
    )
)  # fmt: skip


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 `bits` (vectorises, unlike a view)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def widen(typingctx, x):
    """An element as float32: a bf16 held as its uint16 bits (numpy has no bf16) widened
    exactly (its bits are float32's upper half; vectorises); any other number by value."""
    if not isinstance(x, types.Number):
        return None
    if x != types.uint16:

        def convert(context, builder, signature, args):
            return context.cast(builder, args[0], x, types.float32)

        return types.float32(x), convert

    def codegen(context, builder, signature, args):
        bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def maxnum(typingctx, a, b):
    """LLVM's maxnum: the larger of two float32, NaN ignored; LLVM vectorises its reductions."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        float32 = ir.FloatType()
        function_type = ir.FunctionType(float32, [float32, float32])
        function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.maxnum.f32")
        return builder.call(function, args)

    return sig, codegen


def emit_scaled_minus(builder, scores, factors, shifts):
    """IR of factor * s - shift (float32, scalars or vectors) with the product rounded first,
    never one FMA: the shift is a rounded product (the row's largest factor * s), so the
    row's largest score gets exactly 0 and no other one more. Fused, the product's exact
    value leaves up to half an ulp of it against the shift: 2 ** 47 at scores of 1e21
    (scale=1e20), whose exp2 was inf (and the row NaN) or 0 for the row's largest key.
    numba's fastmath pass gives its flags, "contract" among them, to every float
    instruction that has none: these two carry "nsz" alone."""
    product = builder.fmul(scores, factors, flags=("nsz",))
    return builder.fsub(product, shifts, flags=("nsz",))


@intrinsic
def scaled_minus(typingctx, score, factor, shift):
    """factor * score - shift in float32, never contracted into one FMA
    (`emit_scaled_minus`)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return emit_scaled_minus(builder, *args)

    return sig, codegen


@njit(fastmath=FASTMATH)
def row_maximum(row, cols, start):
    """max(start, row[:cols]); NaN scores are passed over (their exp2 makes the row NaN)."""
    wide_vectors()
    m = start
    for c in range(cols):
        m = maxnum(m, row[c])
    return m


@njit(fastmath=FASTMATH)
def to_whole_steps(row, cols, room):
    """The columns a softmax loop over row[:cols] runs: cols rounded up to a whole step of
    64 within `room`, row[cols:] there set to -inf (their 2 ** x is 0). LLVM's vector loops
    over a row (`row_maximum`, `exp2_shifted`) take 64 columns a step and leave the rest to
    scalar code, which had made 112 keys cost more than 128."""
    wide = min(room, (cols + 63) // 64 * 64)
    for c in range(cols, wide):
        row[c] = -np.inf
    return wide


@njit(fastmath=FASTMATH)
def exp2(t):
    """2 ** t in float32 without a libm call, so that loops over it vectorise.

    2**n is built in a float's exponent field; results below 2**-126.5 flush to 0. NaN stays
    NaN; t must be below 128.
    """
    c0, c1, c2, c3, c4, c5, c6 = EXP2_COEFFS
    # Each select is one vmaxps, whose unordered case gives its second operand: NaN goes
    # on through the polynomial, and the exponent's integer never comes from a NaN (fptosi
    # of NaN is undefined). With a NaN-restoring blend at the end and the degree-7
    # polynomial, a tile's exp2 took much longer.
    clamped = at_least_minus_127(t)
    n = np.floor(clamped + np.float32(0.5))
    f = clamped - n
    p = c6
    p = p * f + c5
    p = p * f + c4
    p = p * f + c3
    p = p * f + c2
    p = p * f + c1
    p = p * f + c0
    return times_two_to(p, n)


@njit(fastmath=FASTMATH)
def at_least_minus_127(t):
    """max(t, -127) as one vmaxps, whose unordered case gives its second operand: NaN goes
    on (into the polynomial) rather than to -127."""
    return np.float32(-127.0) if t < np.float32(-127.0) else t


@njit(fastmath=FASTMATH)
def times_two_to(p, n):
    """p * 2 ** n for an integral n >= -127, 2 ** n built in a float's exponent field: 0
    at n = -127 (a flush to zero), and for a NaN n (whose fptosi would be undefined)."""
    whole = n if n > np.float32(-127.0) else np.float32(-127.0)
    return p * float32_from_bits((np.int32(whole) + 127) << 23)


# The same fit at degree 5: within 1.9e-7 relative (about 3 ulp), for probabilities that are
# rounded to bf16 (2**-9 relative) before they are used.
EXP2_BF16_COEFFS = tuple(
    np.float32(c)
    for c in (
        1.0, 0.6931470036506653, 0.24022242426872253, 0.05550733581185341,
        0.009671512991189957, 0.0013264723820611835,
    )
)  # fmt: skip


@njit(fastmath=FASTMATH)
def exp2_for_bf16(t):
    """`exp2` for softmax probabilities rounded to bf16 next: a degree-5 polynomial on t
    rounded to the nearest integer (one vrndscaleps), 2 ops of 17 fewer a vector; the
    same flush below 2**-126.5 (a masked -inf score gives exactly 0) and NaN."""
    c0, c1, c2, c3, c4, c5 = EXP2_BF16_COEFFS
    clamped = at_least_minus_127(t)
    n = np.rint(clamped)
    f = clamped - n
    p = ((((c5 * f + c4) * f + c3) * f + c2) * f + c1) * f + c0
    return times_two_to(p, n)


@njit(fastmath=FASTMATH)
def exp2_shifted(row, cols, shift, factor):
    """row[c] <- 2 ** (row[c] - shift) * factor in place, vectorised; returns the sum (all
    in float32: a float64 `factor` would otherwise take the loop to half the vector width)."""
    wide_vectors()
    shift32, factor32 = np.float32(shift), np.float32(factor)
    total = np.float32(0.0)
    for c in range(cols):
        y = exp2(row[c] - shift32) * factor32
        row[c] = y
        total += y
    return total


@njit(fastmath=FASTMATH)
def tanh(x):
    """tanh in float32, vectorisable: Cephes' tanhf (an odd polynomial below 0.625, else
    1 - 2 / (e^2|x| + 1)); within 2 ulps of libm's."""
    a = min(abs(x), np.float32(10.0))  # tanh(10) rounds to 1 in float32
    e = exp2(a * np.float32(2 * LOG2E))
    large = np.float32(1.0) - np.float32(2.0) / (e + np.float32(1.0))
    large = large if x >= 0 else -large
    z = x * x
    p = np.float32(-5.70498872745e-3)
    p = p * z + np.float32(2.06390887954e-2)
    p = p * z - np.float32(5.37397155531e-2)
    p = p * z + np.float32(1.33314422036e-1)
    p = p * z - np.float32(3.33332819422e-1)
    small = p * z * x + x
    return small if a < 0.625 else large


@njit(fastmath=FASTMATH)
def base2_bias(value):
    """A float mask's value in base 2: finite stays finite (finfo.min, a common "masked"
    value, times log2(e) would overflow to -inf and empty a row that SDPA averages)."""
    scaled = np.float32(value * LOG2E)
    if np.isfinite(value):
        return min(max(scaled, -FLOAT32_MAX), FLOAT32_MAX)
    return scaled
