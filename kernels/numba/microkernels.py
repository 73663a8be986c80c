"""Register-blocked tile products of our own: fp32 FMAs and bf16 dot products on 16-lane
vectors, emitted as LLVM intrinsics from numba.

One generator writes every micro-kernel: C[mr, :cols] = alpha * A[mr, :depth] @ B[:depth,
:cols] + beta * C, with mr rows of nv 16-lane fp32 accumulators held in registers, each A
element broadcast and each B row streamed as nv vectors (the last one masked to `cols`).

- fp32: A and B float32; one FMA (llvm.fma.v16f32) per A element and B vector.
- bf16: A and B bfloat16 (uint16 arrays: numpy has no bf16), accumulation in fp32. A's
  depth pairs (A[i, 2d], A[i, 2d + 1]) lie side by side; B is in the VNNI layout
  (depth / 2, 2 * columns): a row holds, for each column, its two depth elements side by
  side. One vdpbf16ps per A pair and B vector; where the CPU lacks AVX512-BF16 the same
  sums are two FMAs on the widened halves (exact: a product of two bf16 fits in fp32).
- widened: A float32, B bfloat16 as it lies (a bf16 cache's values), widened in registers
  to fp32 FMAs.

`key_dots` is the other kind of tile: query rows against key rows as they lie, dot
products reduced by a transposing tree, for a decode step that reads its cache in memory
order instead of packing it.

The drivers below walk a whole product in micro-kernels: rows in blocks of 6, columns in
panels as wide as the registers allow, remainders by smaller literal shapes. With AVX-512 a
panel is 64 columns (4 vectors: 24 accumulators of the 32 zmm registers, as BLIS and oneDNN
block for AVX-512); with AVX2 only, 16 (one vector, which LLVM splits in two ymm: 12
accumulators of the 16 ymm registers, BLIS's 6 x 16 Haswell block). On AVX2 (AMD Zen 3)
a 64-column panel spilled and ran at 23-32% of the FMA peak, a 16-column one at 72-92%.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import numpy as np

from attnperf.kernels.numba.amx import AMX_PEAK_FLOPS_PER_ROUND, amx_peak_loop, amx_permitted
from attnperf.kernels.numba.fastmath import EXP2_BF16_COEFFS, EXP2_COEFFS, NO_CONTRACT
from attnperf.kernels.numba.jit import (
    FASTMATH,
    cgutils,
    emit_prefetch,
    intrinsic,
    ir,
    njit,
    numba_host_features,
    types,
    unowned_members,
    wide_vectors,
)

LANES = 16
BLOCK_ROWS = 6  # rows of accumulators a micro-kernel holds
# tile_product's alpha and beta where they are constants: float32 at every call, so that
# one compiled kernel serves them all.
ONE, ZERO = np.float32(1.0), np.float32(0.0)
# The products' kinds (`micro_kernel`): WIDENED fp32 A, bf16 B widened; PAIRED bf16 A in
# pairs, B's bf16 rows as they lie, paired in registers.
FP32, BF16, WIDENED, PAIRED = 0, 1, 2, 3
# A PAIRED product's accumulators: vpunpck{l,h}wd pair two rows' words within each 128-bit
# lane, so the low one holds columns 0-3, 8-11, 16-19, 24-27 of 32 and the high one the
# rest; these put 16 columns back in order from the two (lanes 16-31: the high one's).
UNPACKED_ORDER = (
    [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23],
    [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31],
)


def target_features() -> frozenset[str]:
    """The CPU features numba compiles for, read from its variables as numba reads them.

    Unless NUMBA_CPU_FEATURES is set, numba compiles for the host's features, under any
    NUMBA_CPU_NAME but "generic" (none). A list ("+avx2,+fma,-avx512f") adds to and takes from
    the host's features where NUMBA_CPU_NAME is unset, and to none where it names a CPU: what
    a named CPU implies besides is LLVM's to know, and a narrower route is only slower.
    """
    if numba_host_features is None:
        return frozenset()
    name = os.environ.get("NUMBA_CPU_NAME", "host")
    listed = os.environ.get("NUMBA_CPU_FEATURES")
    if listed is None:
        return frozenset() if name.lower() == "generic" else _host_features()
    return _with_listed(_host_features() if name == "host" else frozenset(), listed)


@functools.cache  # LLVM's query took ~0.1 ms, on every bf16 call
def _host_features() -> frozenset[str]:
    """The host's features as numba hands them to LLVM (NUMBA_ENABLE_AVX=0 takes AVX's away)."""
    return _with_listed(frozenset(), numba_host_features())


def _with_listed(features: frozenset[str], listed: str) -> frozenset[str]:
    """`features` with a feature string's "+name" entries added and "-name" ones taken away;
    without AVX-512F every AVX-512 extension goes too, as LLVM implies."""
    features = set(features)
    for entry in listed.split(","):
        if entry.startswith("+"):
            features.add(entry[1:])
        elif entry.startswith("-"):
            features.discard(entry[1:])
    if "avx512f" not in features:
        features = {feature for feature in features if not feature.startswith("avx512")}
    return frozenset(features)


TILE_CHOICES = ("auto", "blas", "own")
# The environment variables the route depends on.
ROUTE_VARIABLES = ("ATTNPERF_NUMBA_TILES", "ATTNPERF_NUMBA_AMX", "NUMBA_CPU_NAME",
                   "NUMBA_CPU_FEATURES")  # fmt: skip


def tile_route(kind: str) -> tuple[str, str]:
    """(route, why) of the tile products for "fp32" or "bf16" (fp16 runs on fp32 tiles):
    "amx", "avx512-bf16", "avx512" or "avx2" (our tile kernels), or "blas".

    bf16 goes on AMX ("amx") where numba's target has AMX-BF16 and Linux grants its tiles:
    the attention products on our tdpbf16ps tiles (`attention.amx_tiles`).

    ATTNPERF_NUMBA_TILES=blas|own insists on BLAS or on our micro-kernels for fp32 (own
    ones without AVX2 run on LLVM's split vectors: for tests, not speed);
    ATTNPERF_NUMBA_AMX=0 keeps bf16 off AMX.
    """
    # Worked out once per setting of the variables it reads: calls ask it two or three
    # times each, and the whole walk cost a short call ~2 us a time.
    setting = tuple(os.environ.get(name) for name in ROUTE_VARIABLES)
    return _tile_route(kind, setting)


@functools.cache
def _tile_route(kind: str, setting: tuple) -> tuple[str, str]:
    """`tile_route`; `setting`, the values of ROUTE_VARIABLES it reads, only keys the cache."""
    choice = os.environ.get("ATTNPERF_NUMBA_TILES", "auto")
    if choice not in TILE_CHOICES:
        raise ValueError(f"ATTNPERF_NUMBA_TILES must be one of {TILE_CHOICES}, got {choice!r}")
    features = target_features()
    if kind == "bf16" and "avx512bf16" in features:
        why = "AVX512-BF16: our vdpbf16ps micro-kernels, forward and backward"
        if {"amx-bf16", "amx-tile"} <= features:
            # Only a route that may take AMX asks Linux for its tiles.
            if os.environ.get("ATTNPERF_NUMBA_AMX", "1") == "0":
                why += " (AMX present; ATTNPERF_NUMBA_AMX=0 keeps bf16 off it)"
            elif not amx_permitted()[0]:
                why += f" (AMX present but unusable: {amx_permitted()[1]})"
            else:
                return "amx", (
                    "AMX-BF16: our tdpbf16ps tiles, forward and backward, where E and Ev are "
                    "multiples of 32; vdpbf16ps micro-kernels for other head dims"
                )
        return "avx512-bf16", why
    widened = "bf16 widened to " if kind == "bf16" else ""
    if "avx512f" in features:
        own, isa = "avx512", "AVX-512F"
    elif {"avx2", "fma"} <= features:
        own, isa = "avx2", "AVX2 and FMA (6 x 16 blocks)"
    else:
        own, isa = None, None
    if choice == "blas":
        return "blas", f"ATTNPERF_NUMBA_TILES=blas: {widened}BLAS sgemm tiles"
    if choice == "own":
        return own or "own", f"ATTNPERF_NUMBA_TILES=own: {widened}our fp32 micro-kernels"
    if own is None:
        return "blas", f"no AVX2 or AVX-512 in numba's target: {widened}BLAS sgemm tiles"
    return own, f"{isa}: {widened}our fp32 FMA micro-kernels"


class _BFloat(ir.Type if ir is not None else object):
    """LLVM's bfloat, which llvmlite's IR builder lacks."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _function(builder, name, return_type, argument_types):
    function_type = ir.FunctionType(return_type, argument_types)
    return cgutils.get_or_insert_function(builder.module, function_type, name)


def _splat(builder, scalar, vector_type):
    """A vector of `scalar` in every lane."""
    lanes = vector_type.count
    first = builder.insert_element(ir.Constant(vector_type, ir.Undefined), scalar, _i32(0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    return builder.shuffle_vector(first, ir.Constant(vector_type, ir.Undefined), zeros)


def _i32(value):
    return ir.Constant(ir.IntType(32), value)


def _lanes_below(builder, count, lanes=LANES):
    """A mask of `lanes` lanes: those numbered below `count` (an i32)."""
    lane_numbers = ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(lanes)))
    return builder.icmp_signed("<", lane_numbers, _splat(builder, count, lane_numbers.type))


class _Emitter:
    """The IR of one micro-kernel: loads, the multiply-add step, masked stores."""

    def __init__(self, builder, kind, mask, has_bf16):
        self.builder, self.kind, self.mask = builder, kind, mask
        self.f32x16 = ir.VectorType(ir.FloatType(), LANES)
        self.i32x16 = ir.VectorType(ir.IntType(32), LANES)
        self.fma = _function(builder, "llvm.fma.v16f32", self.f32x16, [self.f32x16] * 3)
        self.has_bf16 = has_bf16
        if kind in (BF16, PAIRED) and has_bf16:
            bf16x32 = ir.VectorType(_BFloat(), 2 * LANES)
            self.bf16x32 = bf16x32
            self.dot = _function(
                builder,
                "llvm.x86.avx512bf16.dpbf16ps.512",
                self.f32x16,
                [self.f32x16, bf16x32, bf16x32],
            )

    def load(self, pointer, vector_type, last):
        """A vector at `pointer` (a scalar pointer); the last one of a row masked."""
        builder = self.builder
        address = builder.bitcast(pointer, vector_type.as_pointer())
        if not last:
            return builder.load(address, align=_alignment(vector_type))
        masked = _function(
            builder,
            f"llvm.masked.load.{_suffix(vector_type)}.p0",
            vector_type,
            [vector_type.as_pointer(), ir.IntType(32), self.mask.type, vector_type],
        )
        alignment = _i32(_alignment(vector_type))
        return builder.call(masked, [address, alignment, self.mask, ir.Constant(vector_type, None)])

    def store(self, value, pointer, last):
        builder = self.builder
        address = builder.bitcast(pointer, value.type.as_pointer())
        if not last:
            builder.store(value, address, align=4)
            return
        masked = _function(
            builder,
            f"llvm.masked.store.{_suffix(value.type)}.p0",
            ir.VoidType(),
            [value.type, value.type.as_pointer(), ir.IntType(32), self.mask.type],
        )
        builder.call(masked, [value, address, _i32(4), self.mask])

    def a_operand(self, pointer):
        """A's element (fp32) or depth pair (bf16, as an i32) in every lane."""
        builder = self.builder
        if self.kind not in (BF16, PAIRED):
            return _splat(builder, builder.load(pointer), self.f32x16)
        pair = builder.load(builder.bitcast(pointer, ir.IntType(32).as_pointer()), align=2)
        return _splat(builder, pair, self.i32x16)

    def b_operand(self, pointer, last):
        if self.kind == WIDENED:  # 16 bf16, widened exactly: fp32's upper halves
            halves = self.load(pointer, ir.VectorType(ir.IntType(16), LANES), last)
            words = self.builder.zext(halves, self.i32x16)
            upper = self.builder.shl(words, ir.Constant(self.i32x16, [16] * LANES))
            return self.builder.bitcast(upper, self.f32x16)
        vector_type = self.f32x16 if self.kind == FP32 else self.i32x16
        return self.load(pointer, vector_type, last)

    def multiply_add(self, acc, a, b):
        builder = self.builder
        if self.kind not in (BF16, PAIRED):
            return builder.call(self.fma, [a, b, acc])
        if self.has_bf16:
            a, b = builder.bitcast(a, self.bf16x32), builder.bitcast(b, self.bf16x32)
            return builder.call(self.dot, [acc, a, b])
        # Without vdpbf16ps: bf16 is fp32's upper half; odd elements first, as it sums.
        high = ir.Constant(self.i32x16, [-65536] * LANES)
        for part in (
            lambda x: builder.and_(x, high),
            lambda x: builder.shl(x, ir.Constant(self.i32x16, [16] * LANES)),
        ):
            a_half = builder.bitcast(part(a), self.f32x16)
            b_half = builder.bitcast(part(b), self.f32x16)
            acc = builder.call(self.fma, [a_half, b_half, acc])
        return acc


def _with_prefetching(builder, prefetches, ahead, emit_loop):
    """emit_loop(prefetching): once without prefetching where the caller leaves `ahead` out
    (`prefetches` false), else twice behind a run-time test of ahead != 0 (the loop that
    prefetches B's or the keys' lines `ahead` elements on, and the one that does not)."""
    if not prefetches:
        emit_loop(False)
        return
    nonzero = builder.icmp_signed("!=", ahead, ir.Constant(ahead.type, 0))
    with builder.if_else(nonzero) as (on, off):
        for branch, prefetching in ((on, True), (off, False)):
            with branch:
                emit_loop(prefetching)


@contextlib.contextmanager
def rolled_loop(builder, count):
    """for index in range(count), as a loop that LLVM must not unroll: unrolled twice, a
    micro-kernel's 24 accumulators and their operands no longer fit the 32 vector registers
    and spill to the stack (half the speed). Yields the index."""
    index_type = count.type
    entry = builder.block
    header = builder.append_basic_block("rolled.header")
    body = builder.append_basic_block("rolled.body")
    end = builder.append_basic_block("rolled.end")
    builder.branch(header)
    builder.position_at_end(header)
    index = builder.phi(index_type)
    index.add_incoming(ir.Constant(index_type, 0), entry)
    builder.cbranch(builder.icmp_signed("<", index, count), body, end)
    builder.position_at_end(body)
    yield index
    following = builder.add(index, ir.Constant(index_type, 1))
    index.add_incoming(following, builder.block)
    back = builder.branch(header)
    module = builder.module
    no_unroll = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    loop_id = module.add_metadata([ir.MetaDataString(module, f"attnperf.loop.{id(back)}")])
    loop_id.operands = (loop_id, no_unroll)  # a loop's id names itself (LLVM's convention)
    back.set_metadata("llvm.loop", loop_id)
    builder.position_at_end(end)


def _suffix(vector_type):
    element = vector_type.element
    name = "f32" if isinstance(element, ir.FloatType) else f"i{element.width}"
    return f"v{vector_type.count}{name}"


def _alignment(vector_type):
    """The alignment a vector's elements guarantee: 2 bytes for bf16 bits, else 4."""
    element = vector_type.element
    return 2 if isinstance(element, ir.IntType) and element.width == 16 else 4


def _operand(context, builder, view_type, view):
    """(data pointer, offset, strides...) of an operand view: (array, offset, strides...)."""
    fields = [builder.extract_value(view, i) for i in range(len(view_type))]
    array = context.make_array(view_type[0])(context, builder, fields[0])
    return [array.data, *fields[1:]]


@intrinsic(prefer_literal=True)
def micro_kernel(typingctx, mr, nv, depth, alpha, beta, a_view, b_view, c_view, cols, ahead):
    """C[i, j] = alpha * sum_d A[i, d] B[d, j] + beta * C[i, j] for i < mr, j < cols <=
    16 nv (mr and nv literal; beta = 0 never reads C), fp32 for float32 A and B, bf16 for
    uint16 ones, and for a float32 A with a uint16 B (a bf16 cache's values as they lie)
    fp32 FMAs on B widened in registers; for a uint32 A with a uint16 B, bf16 (PAIRED: A's
    elements bf16 pairs, the even depth low; B's rows bf16 as they lie, rows 2 d and 2 d + 1
    interleaved in registers; the depth counts pairs of B rows). Views count elements:

    - a_view (a, offset, row_stride, depth_stride): A[i, d] = a[offset + i row_stride +
      d depth_stride]; for bf16 d counts pairs: the pair at 2 d depth_stride (stride 1).
    - b_view (b, offset, row_stride, vector_stride): B[d, j] = b[offset + d row_stride +
      (j // 16) vector_stride + j % 16] (bf16: the pair at 2 (j % 16); PAIRED: B row 2 d
      + h at offset + (2 d + h) row_stride, vector_stride 16).
    - c_view (c, offset, row_stride): C[i, j] = c[offset + i row_stride + j].

    With AVX-512 and `ahead` != 0, each B row's lines `ahead` elements on are asked for
    into L2 as the row is loaded (prefetcht1): for B rows that the prefetchers cannot
    foresee, a KV cache's values walked head by head. 0: none.

    Other pairs of dtypes trap: numba types both sides of an `if` on the operands' dtype,
    and such a pair only appears on the side never taken. So does nv above
    `panel_vectors()`, which the drivers never ask for: not compiling those shapes saves
    time.
    """
    if not all(isinstance(value, types.IntegerLiteral) for value in (mr, nv)):
        return None
    rows, vectors = mr.literal_value, nv.literal_value
    a_dtype, b_dtype = a_view[0].dtype, b_view[0].dtype
    kind_value = {(types.float32, types.float32): FP32, (types.uint16, types.uint16): BF16,
                  (types.float32, types.uint16): WIDENED,
                  (types.uint32, types.uint16): PAIRED}.get((a_dtype, b_dtype))  # fmt: skip
    # Callers that never prefetch leave `ahead` out (a default): no second loop compiled.
    prefetches = not isinstance(ahead, types.Omitted)
    sig = types.void(mr, nv, types.intp, types.float32, types.float32, a_view, b_view, c_view,
                     types.intp, types.intp if prefetches else ahead)  # fmt: skip
    has_bf16 = "avx512bf16" in target_features()
    most_vectors = panel_vectors()

    def codegen(context, builder, signature, args):
        depth, alpha, beta, a_view, b_view, c_view, cols, ahead = args[2:]
        if kind_value is None or vectors > most_vectors:
            builder.call(_function(builder, "llvm.trap", ir.VoidType(), []), [])
            return context.get_dummy_value()
        a_data, a_offset, a_row_stride, a_depth_stride = _operand(
            context, builder, signature.args[5], a_view
        )
        b_data, b_offset, b_row_stride, b_vector_stride = _operand(
            context, builder, signature.args[6], b_view
        )
        c_data, c_offset, c_row_stride = _operand(context, builder, signature.args[7], c_view)
        index_type = depth.type

        def constant(value):
            return ir.Constant(index_type, value)

        # The last vector's lanes: those below cols - 16 (nv - 1).
        count = builder.trunc(builder.sub(cols, constant(LANES * (vectors - 1))), _i32(0).type)
        mask = _lanes_below(builder, count)
        # PAIRED loads 32 columns of a row at once: the last two vectors' lanes.
        pair_mask = _lanes_below(builder, builder.add(count, _i32(LANES)), 2 * LANES)
        emit = _Emitter(builder, kind_value, mask, has_bf16)
        zero = ir.Constant(emit.f32x16, None)
        a_step = builder.mul(a_depth_stride, constant(2 if kind_value == BF16 else 1))
        alpha_vector = _splat(builder, alpha, emit.f32x16)
        beta_vector = _splat(builder, beta, emit.f32x16)
        reads_c = builder.fcmp_ordered("!=", beta, ir.Constant(ir.FloatType(), 0.0))

        def prefetch_ahead_of(at):
            emit_prefetch(builder, builder.gep(b_data, [builder.add(at, ahead)]), 2)

        def b_operands(d, masked, prefetching):
            """B's vectors at depth d (PAIRED: the two rows' pairs in unpacked order)."""
            if kind_value == PAIRED:
                return paired_operands(d, masked, prefetching)
            b_row = builder.add(b_offset, builder.mul(d, b_row_stride))
            b_vectors = []
            for j in range(vectors):
                at = builder.add(b_row, builder.mul(constant(j), b_vector_stride))
                b_vectors.append(
                    emit.b_operand(builder.gep(b_data, [at]), masked and j == vectors - 1)
                )
                # A widened B vector is half a line: one prefetch a pair of them.
                if prefetching and (kind_value != WIDENED or j % 2 == 0):
                    prefetch_ahead_of(at)
            return b_vectors

        def paired_operands(d, masked, prefetching):
            rows_at = [builder.add(b_offset, builder.mul(builder.add(builder.mul(d, constant(2)),
                                                                     constant(h)), b_row_stride))
                       for h in (0, 1)]  # fmt: skip
            b_vectors = []
            for j in range(0, vectors, 2):
                last = masked and j + 2 >= vectors
                halves = []
                for row_at in rows_at:
                    at = builder.add(row_at, constant(LANES * j))
                    lanes = 2 * LANES if j + 1 < vectors else LANES
                    emit.mask = pair_mask if lanes > LANES else mask
                    words = ir.VectorType(ir.IntType(16), lanes)
                    halves.append(emit.load(builder.gep(b_data, [at]), words, last))
                    if prefetching:
                        prefetch_ahead_of(at)
                emit.mask = mask
                if j + 1 < vectors:  # vpunpcklwd, vpunpckhwd: words (lanes) of the two rows
                    orders = [[h * 2 * LANES + 8 * lane + k for lane in range(4) for k in part
                               for h in (0, 1)] for part in (range(4), range(4, 8))]  # fmt: skip
                else:  # a last lone vector: its 16 columns paired in order
                    orders = [[h * LANES + k for k in range(LANES) for h in (0, 1)]]
                for order in orders:
                    pairs = _shuffle(builder, *halves, order)
                    b_vectors.append(builder.bitcast(pairs, emit.i32x16))
            return b_vectors

        def in_order(accumulators):
            """A PAIRED product's accumulators of a row with their columns in order."""
            if kind_value != PAIRED:
                return accumulators
            ordered = []
            for j in range(0, vectors, 2):
                if j + 1 == vectors:
                    ordered.append(accumulators[j])
                    continue
                low, high = accumulators[j], accumulators[j + 1]
                ordered += [_shuffle(builder, low, high, lanes) for lanes in UNPACKED_ORDER]
            return ordered

        def block_product(masked, prefetching=False):
            """The depth loop and C's update; the last vector's loads masked or not, B's
            lines `ahead` on prefetched or not."""
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)]
                    for _ in range(rows)]  # fmt: skip
            with rolled_loop(builder, depth) as d:
                b_vectors = b_operands(d, masked, prefetching)
                a_at = builder.add(a_offset, builder.mul(d, a_step))
                for i in range(rows):
                    at = builder.add(a_at, builder.mul(constant(i), a_row_stride))
                    a_value = emit.a_operand(builder.gep(a_data, [at]))
                    for j in range(vectors):
                        acc = builder.load(accs[i][j])
                        builder.store(emit.multiply_add(acc, a_value, b_vectors[j]), accs[i][j])
            for i in range(rows):
                c_row = builder.add(c_offset, builder.mul(constant(i), c_row_stride))
                sums = in_order([builder.load(acc) for acc in accs[i]])
                for j in range(vectors):
                    last = masked and j == vectors - 1
                    pointer = builder.gep(c_data, [builder.add(c_row, constant(LANES * j))])
                    value = builder.fmul(sums[j], alpha_vector)
                    with builder.if_else(reads_c) as (then, otherwise):
                        with then:
                            old = emit.load(pointer, emit.f32x16, last)
                            emit.store(
                                builder.call(emit.fma, [old, beta_vector, value]), pointer, last
                            )
                        with otherwise:
                            emit.store(value, pointer, last)

        if most_vectors > 1:  # AVX-512: masks are free, in registers of their own
            _with_prefetching(builder, prefetches, ahead,
                              lambda prefetching: block_product(True, prefetching))  # fmt: skip
            return context.get_dummy_value()
        # Without AVX-512, whole panels load unmasked: on AVX2 (Zen 3) the masked loads
        # (vmaskmovps), and the mask spilled for want of a 17th register, held the 6 x 16
        # kernel to 56-73% of the FMA peak, against 72-92% unmasked.
        full = builder.icmp_signed("==", cols, constant(LANES * vectors))
        with builder.if_else(full) as (whole, partial):
            with whole:
                block_product(masked=False)
            with partial:
                block_product(masked=True)
        return context.get_dummy_value()

    return sig, codegen


def panel_vectors() -> int:
    """Vectors of 16 columns a micro-kernel holds on numba's target: 4 with AVX-512, else
    1 (two ymm halves with AVX2)."""
    return 4 if "avx512f" in target_features() else 1


@intrinsic
def panel_width(typingctx):
    """Columns a micro-kernel holds (`panel_vectors`), fixed where the code is compiled."""
    width = LANES * panel_vectors()

    def codegen(context, builder, signature, args):
        return context.get_constant(types.intp, width)

    return types.intp(), codegen


@njit(fastmath=FASTMATH, inline="always")
def _row_blocks(nv, depth, alpha, beta, a_view, b_view, c_view, rows, cols, ahead):
    """One panel of `cols` <= 16 nv columns, its rows in blocks of 6; inlined, so that nv,
    a constant at each call, reaches `micro_kernel` as the literal it needs."""
    a, a_offset, a_row_stride, a_depth_stride = a_view
    c, c_offset, c_row_stride = c_view
    full = rows - rows % BLOCK_ROWS
    for i0 in range(0, full, BLOCK_ROWS):
        a_block = (a, a_offset + i0 * a_row_stride, a_row_stride, a_depth_stride)
        c_block = (c, c_offset + i0 * c_row_stride, c_row_stride)
        micro_kernel(BLOCK_ROWS, nv, depth, alpha, beta, a_block, b_view, c_block, cols, ahead)
    a_left = (a, a_offset + full * a_row_stride, a_row_stride, a_depth_stride)
    c_left = (c, c_offset + full * c_row_stride, c_row_stride)
    left = rows - full  # each count a literal shape of its own
    if left == 5:
        micro_kernel(5, nv, depth, alpha, beta, a_left, b_view, c_left, cols, ahead)
    elif left == 4:
        micro_kernel(4, nv, depth, alpha, beta, a_left, b_view, c_left, cols, ahead)
    elif left == 3:
        micro_kernel(3, nv, depth, alpha, beta, a_left, b_view, c_left, cols, ahead)
    elif left == 2:
        micro_kernel(2, nv, depth, alpha, beta, a_left, b_view, c_left, cols, ahead)
    elif left == 1:
        micro_kernel(1, nv, depth, alpha, beta, a_left, b_view, c_left, cols, ahead)


@njit(fastmath=FASTMATH, inline="always")
def inlined_tile_product(depth, alpha, beta, a_view, b_view, c_view, rows, cols, ahead=0):
    """tile_product inlined where it is called, for a caller that calls it for every small
    tile: as calls (tile_product's, then a panel's), with their arguments' arrays counted
    and their views passed, a decoding step's P V took 16.0-16.3 ns a key and kv head in
    fp32 and 10.9-11.2 in bf16 (16-key chunks), inlined 12.8-13.0 and 8.6-8.7 (one
    thread, Zen 4, 4 rows, E = 128, `benches/decode_stream.py`)."""
    b, b_offset, b_row_stride, b_vector_stride = b_view
    c, c_offset, c_row_stride = c_view
    panel = panel_width()
    for j0 in range(0, cols, panel):
        width = min(panel, cols - j0)
        b_panel = (b, b_offset + j0 // LANES * b_vector_stride, b_row_stride, b_vector_stride)
        c_panel = (c, c_offset + j0, c_row_stride)
        if width > 3 * LANES:
            _row_blocks(4, depth, alpha, beta, a_view, b_panel, c_panel, rows, width, ahead)
        elif width > 2 * LANES:
            _row_blocks(3, depth, alpha, beta, a_view, b_panel, c_panel, rows, width, ahead)
        elif width > LANES:
            _row_blocks(2, depth, alpha, beta, a_view, b_panel, c_panel, rows, width, ahead)
        else:
            _row_blocks(1, depth, alpha, beta, a_view, b_panel, c_panel, rows, width, ahead)


@njit(fastmath=FASTMATH)
def tile_product(depth, alpha, beta, a_view, b_view, c_view, rows, cols, ahead=0):
    """C[:rows, :cols] = alpha * A[:rows, :depth] @ B[:depth, :cols] + beta * C in
    micro-kernels (views, kinds and `ahead` as `micro_kernel`'s; for bf16 `depth` counts
    pairs). Columns go in panels (`panel_width`), whose B rows stay in L1 across the
    panel's row blocks."""
    inlined_tile_product(depth, alpha, beta, a_view, b_view, c_view, rows, cols, ahead)


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
    with their arguments' arrays counted and their views passed, its scores took 15.2-15.5
    ns a key and kv head in fp32 and 9.9-10.1 in bf16, inlined 12.6-13.0 and 8.4-8.6 (one
    thread, Zen 4, 4 rows, E = 128, `benches/decode_stream.py`)."""
    full = rows - rows % 4
    for i in range(0, full, 4):
        _dot_blocks(4, depth, alpha, q_view, k_view, s_view, i, keys, ahead)
    i = full
    if rows - i >= 2:
        _dot_blocks(2, depth, alpha, q_view, k_view, s_view, i, keys, ahead)
        i += 2
    if rows - i == 1:
        _dot_blocks(1, depth, alpha, q_view, k_view, s_view, i, keys, ahead)


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
    kept its maxima in memory: 3.5 us of a 512 x 128 tile against ~1.2). AVX-512F."""
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
# masked scores made its softmax ~4x slower (Intel, AMX).
EXP2_FLOOR = -125.0


def _vector_at(context, builder, array_type, array, offset, vector_type):
    """A pointer to the vector of `vector_type` at element `offset` of `array`'s data."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), vector_type.as_pointer())


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


def _scaled_minus(builder, scores, factors, shifts):
    """factor s - shift with the product rounded first, never one FMA: the shift is a
    rounded product (the row's largest factor s), so the row's largest score gets exactly 0
    and no other one more. Fused, the product's exact value leaves up to half an ulp of it
    against the shift: 2 ** 47 at scores of 1e21 (scale=1e20), whose exp2 was inf (and the
    row NaN) or 0 for the row's largest key. `NO_CONTRACT`: see fastmath.scaled_minus."""
    product = builder.fmul(scores, factors, flags=NO_CONTRACT)
    return builder.fsub(product, shifts, flags=NO_CONTRACT)


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
            t = _scaled_minus(builder, scores, factors, shifts)
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
            t = _scaled_minus(builder, builder.load(at, align=4), factors, shifts)
            p = _exp2_vector(builder, t, EXP2_COEFFS)
            builder.store(p, at, align=4)
            builder.store(builder.fadd(builder.load(running), p), running)
        builder.store(builder.load(running), sums, align=4)
        return context.get_dummy_value()

    return sig, codegen


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


def _shuffle(builder, a, b, lanes):
    """Lane i of the result: lane lanes[i] of a, or lane lanes[i] - len(a) of b."""
    return builder.shuffle_vector(
        a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)
    )


def _transpose_quadrants(builder, src_view, rows, cols, dst_view, unit):
    """`transpose_block` without AVX-512: four 8 x 8 transposes of 8-lane vectors. Their
    shuffles are AVX2's unpack, shufps and vperm2f128 (24 per 64 elements), where the
    16-lane perfect shuffle lowered to ~2.7 permutes and blends per element (Zen 3)."""
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
    to dst's even and odd rows. 0.8 us for 128 x 64 (one element at a time: 1.5)."""
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
    for d in range(pairs):  # a loop per half: both in one ran 6x slower (Intel, AVX-512)
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
