"""The chip's peaks as the micro-kernels reach them: FMA and vdpbf16ps loops timed on one
thread (the benchmarks' share of the limit)."""

from __future__ import annotations

import time

from attnperf.kernels.numba.amx import AMX_PEAK_FLOPS_PER_ROUND, amx_peak_loop
from attnperf.kernels.numba.jit import cgutils, intrinsic, ir, njit, types
from attnperf.kernels.numba.microkernels import (
    BF16,
    LANES,
    _Emitter,
    _function,
    _i32,
    target_features,
    tile_route,
)

PEAK_ACCUMULATORS = 12  # independent chains: enough to cover the FMA latency of two pipes


def fma_lanes() -> int:
    """fp32 lanes of the widest FMA numba's target has: 16 with AVX-512, else 8 (AVX2)."""
    return LANES if "avx512f" in target_features() else LANES // 2


@intrinsic
def _peak_loop(typingctx, iterations, bf16):
    """`iterations` rounds of 12 independent vector FMAs (`fma_lanes` wide) or, with a
    literal True bf16, vdpbf16ps, on registers only; returns a lane of their sum so that
    none is dropped."""
    if not isinstance(bf16, types.BooleanLiteral):
        return None
    use_dot = bf16.literal_value
    lanes = LANES if use_dot else fma_lanes()
    sig = types.float32(types.intp, bf16)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), lanes)
        if use_dot:
            emit = _Emitter(builder, BF16, None, True)
            x = ir.Constant(emit.i32x16, [1] * LANES)
            step = emit.multiply_add
        else:
            fma = _function(builder, f"llvm.fma.v{lanes}f32", vector, [vector] * 3)
            x = ir.Constant(vector, [1.0000001] * lanes)

            def step(acc, a, b):
                return builder.call(fma, [a, b, acc])

        accs = [cgutils.alloca_once_value(builder, ir.Constant(vector, [float(i)] * lanes))
                for i in range(PEAK_ACCUMULATORS)]  # fmt: skip
        with cgutils.for_range(builder, args[0]):
            for acc in accs:
                builder.store(step(builder.load(acc), x, x), acc)
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        return builder.extract_element(total, _i32(0))

    return sig, codegen


@njit()
def fma_peak_loop(iterations):
    return _peak_loop(iterations, False)


@njit()
def dot_peak_loop(iterations):
    return _peak_loop(iterations, True)


def peak_flops(kind: str, seconds: float = 0.3) -> float | None:
    """The calling thread's peak rate in FLOP/s of the fp32 FMA ("fp32"), the bf16 dot
    product ("bf16"; None without AVX512-BF16) or AMX's bf16 tiles ("amx"; None off the
    AMX route): a register-only loop timed for about `seconds` (best of 3)."""
    if kind == "bf16" and "avx512bf16" not in target_features():
        return None
    if kind == "amx" and tile_route("bf16")[0] != "amx":
        return None
    if kind == "fp32":
        loop, flops_per_round = fma_peak_loop, PEAK_ACCUMULATORS * fma_lanes() * 2
    elif kind == "bf16":
        loop, flops_per_round = dot_peak_loop, PEAK_ACCUMULATORS * LANES * 4
    else:
        loop, flops_per_round = amx_peak_loop, AMX_PEAK_FLOPS_PER_ROUND
    loop(1000)  # compiled
    iterations, elapsed = 1000, 0.0
    while elapsed < seconds / 10:
        iterations *= 4
        start = time.perf_counter()
        loop(iterations)
        elapsed = time.perf_counter() - start
    best = min(_timed(loop, iterations) for _ in range(3))
    return iterations * flops_per_round / best


def _timed(loop, iterations):
    start = time.perf_counter()
    loop(iterations)
    return time.perf_counter() - start
