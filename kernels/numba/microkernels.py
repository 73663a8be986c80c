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

Beside it: `key_dots` (the other kind of tile, a decoding step's query rows against key
rows as they lie), `packing` (operands into these layouts), `vector_ops` (the softmax's
explicit 16-lane operations), `peaks` (the chip's peaks as these kernels reach them).

The drivers below walk a whole product in micro-kernels: rows in blocks of 6, columns in
panels as wide as the registers allow, remainders by smaller literal shapes. With AVX-512 a
panel is 64 columns (4 vectors: 24 accumulators of the 32 zmm registers, as BLIS and oneDNN
block for AVX-512); with AVX2 only, 16 (one vector, which LLVM splits in two ymm: 12
accumulators of the 16 ymm registers, BLIS's 6 x 16 Haswell block): on AVX2 a 64-column
panel spilled and ran at a third of a 16-column one's rate.
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from attnperf.kernels.numba.amx import amx_permitted
from attnperf.kernels.numba.jit import (
    FASTMATH,
    cgutils,
    emit_prefetch,
    intrinsic,
    ir,
    njit,
    numba_host_features,
    types,
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


@functools.cache  # LLVM's query is slow, and every bf16 call asked it
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
    # times each, and the whole walk is a visible part of a short call.
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
        # Without AVX-512, whole panels load unmasked: on AVX2 the masked loads
        # (vmaskmovps), and the mask spilled for want of a 17th register, slowed the 6 x 16
        # kernel.
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
    and their views passed, a decoding step's P V ran a fifth slower."""
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


def _vector_at(context, builder, array_type, array, offset, vector_type):
    """A pointer to the vector of `vector_type` at element `offset` of `array`'s data."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), vector_type.as_pointer())


def _shuffle(builder, a, b, lanes):
    """Lane i of the result: lane lanes[i] of a, or lane lanes[i] - len(a) of b."""
    return builder.shuffle_vector(
        a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)
    )
