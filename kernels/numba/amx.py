"""bf16 tile products on AMX (Intel's Advanced Matrix Extensions), emitted as LLVM's AMX
intrinsics from numba.

An AMX tile register holds 16 rows of 64 bytes: 16 x 16 fp32 accumulators, 16 x 32 bf16 of
A, or 16 rows of 16 bf16 pairs of B in the VNNI layout (`pack_vnni`'s and
`pack_key_panels`' bf16 layout). One tdpbf16ps adds a 16 x 32 by 32 x 16 product into an
accumulator tile: 16 K FLOPs, where a vdpbf16ps does 64.

`amx_product` walks C in blocks of 2 x 2 accumulator tiles (tiles 0-3; A's two tiles 4-5,
B's 6-7), or, for one or two steps of depth (QK^T at E <= 64), keeps A's tiles in the
registers while B's stream past (`_resident_rows`); every operand in whole tiles: rows and
columns in sixteens, depth in steps of 16 pairs. The callers pad their operands to that
(zero depth pairs on both sides; extra rows and columns only reach C's padding), so no
tile ever needs another shape than the one configuration (`TILE_CONFIG`). Tile loads and
stores, not the dots, bound these products (a tileloadd takes several tdpbf16ps' time),
so the layouts load each tile as few times as they can.

Linux hands AMX's tile state to a process only on request (arch_prctl
ARCH_REQ_XCOMP_PERM): `amx_permitted` asks once, at the first call that would use it.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from attnperf.kernels.numba.jit import cgutils, intrinsic, ir, njit, types, unowned

TILE_ROWS = 16  # rows of every tile; a row is 64 bytes: 16 fp32 or 16 bf16 pairs
TILE_PAIRS = 16  # bf16 pairs of depth one tdpbf16ps takes
# ldtilecfg's 64-byte palette 1: every tile 16 rows of 64 bytes.
TILE_CONFIG = np.zeros(64, np.uint8)
TILE_CONFIG[0] = 1
TILE_CONFIG[16:32] = np.frombuffer(np.full(8, 64, np.uint16).tobytes(), np.uint8)
TILE_CONFIG[48:56] = TILE_ROWS

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def amx_permitted() -> tuple[bool, str]:
    """(granted, why not): Linux's permission for this process to use AMX's tile data."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as error:
        return False, f"arch_prctl could not be called ({error})"
    if result != 0:
        return False, f"Linux refused AMX's tile data (arch_prctl errno {ctypes.get_errno()})"
    return True, ""


_I8 = ir.IntType(8) if ir is not None else None


def _target_has_amx(context) -> bool:
    """Whether the machine code numba emits may hold AMX's bf16 instructions (numba's
    target machine's features: with no default, so that a numba without them fails loudly
    instead of trapping every AMX call)."""
    features = context.codegen()._tm_features.split(",")
    return "+amx-tile" in features and "+amx-bf16" in features


def _call(context, builder, name, argument_types, values):
    # A kernel whose AMX branch is decided at run time (the bf16 backward's `amx`) compiles
    # that branch on every CPU, and LLVM cannot select AMX's instructions for a target
    # without them (an abort, not an exception). There the branch is never taken (the
    # dispatch routes to AMX only where numba's target has it), so it compiles to a trap.
    if not _target_has_amx(context):
        name, argument_types, values = "llvm.trap", [], []
    function_type = ir.FunctionType(ir.VoidType(), argument_types)
    function = cgutils.get_or_insert_function(builder.module, function_type, name)
    builder.call(function, values)


def _tile(number):
    return ir.Constant(_I8, number)


def _address(context, builder, array_type, array, offset):
    """The byte address of array's element `offset` (counting elements)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), _I8.as_pointer())


@intrinsic
def configure_tiles(typingctx, config):
    """ldtilecfg: this thread's tiles shaped by `config` (64 bytes, uint8)."""
    sig = types.void(config)

    def codegen(context, builder, signature, args):
        address = _address(
            context, builder, signature.args[0], args[0], ir.Constant(ir.IntType(64), 0)
        )
        _call(context, builder, "llvm.x86.ldtilecfg", [_I8.as_pointer()], [address])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def release_tiles(typingctx):
    """tilerelease: this thread's tiles back to their initial state."""

    def codegen(context, builder, signature, args):
        _call(context, builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.void(), codegen


def _memory_op(name):
    @intrinsic(prefer_literal=True)
    def tile_memory(typingctx, tile, array, offset, row_stride):
        if not isinstance(tile, types.IntegerLiteral):
            return None
        number = tile.literal_value
        itemsize = array.dtype.bitwidth // 8

        def codegen(context, builder, signature, args):
            address = _address(context, builder, signature.args[1], args[1], args[2])
            stride = builder.mul(args[3], ir.Constant(args[3].type, itemsize))
            argument_types = [_I8, _I8.as_pointer(), ir.IntType(64)]
            _call(context, builder, name, argument_types, [_tile(number), address, stride])
            return context.get_dummy_value()

        return types.void(tile, array, types.intp, types.intp), codegen

    return tile_memory


tile_load = _memory_op("llvm.x86.tileloadd64")
tile_load.__doc__ = """tileloadd: tile (literal) <- 16 rows of 64 bytes from array[offset:],
rows `row_stride` elements apart."""
tile_store = _memory_op("llvm.x86.tilestored64")
tile_store.__doc__ = """tilestored: tile (literal) -> 16 rows of 64 bytes at array[offset:],
rows `row_stride` elements apart."""


@intrinsic(prefer_literal=True)
def tile_zero(typingctx, tile):
    """tilezero: tile (literal) <- zeros."""
    if not isinstance(tile, types.IntegerLiteral):
        return None
    number = tile.literal_value

    def codegen(context, builder, signature, args):
        _call(context, builder, "llvm.x86.tilezero", [_I8], [_tile(number)])
        return context.get_dummy_value()

    return types.void(tile), codegen


@intrinsic(prefer_literal=True)
def tile_dot(typingctx, c, a, b):
    """tdpbf16ps: tile c += tile a (16 x 32 bf16) @ tile b (16 pairs x 16, VNNI), in fp32;
    tiles literal."""
    if not all(isinstance(tile, types.IntegerLiteral) for tile in (c, a, b)):
        return None
    numbers = [tile.literal_value for tile in (c, a, b)]

    def codegen(context, builder, signature, args):
        _call(context, builder, "llvm.x86.tdpbf16ps", [_I8] * 3, [_tile(n) for n in numbers])
        return context.get_dummy_value()

    return types.void(c, a, b), codegen


@njit()
def whole_tiles(count):
    """count rounded up to a multiple of 16: rows or columns in whole tiles."""
    return (count + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS


@njit()
def depth_steps(count):
    """Steps of depth (16 pairs: 32 bf16 keys or rows) that cover count elements."""
    return (count + 2 * TILE_PAIRS - 1) // (2 * TILE_PAIRS)


@njit()
def zero_to_step(x, rows, cols):
    """x[:rows, cols:] <- 0 to the end of the last step of depth that holds column cols - 1
    (A's depth past the data must be zeros); returns the steps."""
    steps = depth_steps(cols)
    for r in range(rows):
        x[r, cols : steps * 2 * TILE_PAIRS] = 0
    return steps


@njit()
def _tile_block(a_view, b_view, c_view, two_rows, two_cols, steps, accumulate):
    """One block of C: 1-2 x 1-2 accumulator tiles over `steps` tiles of depth."""
    a, a_at, a_stride = a_view
    b, b_at, b_stride, b_block = b_view
    c, c_at, c_stride = c_view
    c_down = c_at + TILE_ROWS * c_stride
    if accumulate:
        tile_load(0, c, c_at, c_stride)
        if two_cols:
            tile_load(1, c, c_at + TILE_ROWS, c_stride)
        if two_rows:
            tile_load(2, c, c_down, c_stride)
            if two_cols:
                tile_load(3, c, c_down + TILE_ROWS, c_stride)
    else:
        tile_zero(0)
        tile_zero(1)
        tile_zero(2)
        tile_zero(3)
    a_down = a_at + TILE_ROWS * a_stride
    for step in range(steps):
        a_step, b_step = step * 2 * TILE_PAIRS, b_at + step * TILE_PAIRS * b_stride
        tile_load(4, a, a_at + a_step, a_stride)
        tile_load(6, b, b_step, b_stride)
        tile_dot(0, 4, 6)
        if two_cols:
            tile_load(7, b, b_step + b_block, b_stride)
            tile_dot(1, 4, 7)
        if two_rows:
            tile_load(5, a, a_down + a_step, a_stride)
            tile_dot(2, 5, 6)
            if two_cols:
                tile_dot(3, 5, 7)
    tile_store(0, c, c_at, c_stride)
    if two_cols:
        tile_store(1, c, c_at + TILE_ROWS, c_stride)
    if two_rows:
        tile_store(2, c, c_down, c_stride)
        if two_cols:
            tile_store(3, c, c_down + TILE_ROWS, c_stride)


@njit()
def _resident_rows(a_view, b_view, c_view, two_rows, col_tiles, steps):
    """C's 1-2 row tiles, every column tile, over 1-2 steps of depth (overwritten): A's up
    to 4 tiles (4-7) loaded once, each column tile's B (tiles 2-3) once, accumulators 0-1.
    Faster than the 2 x 2 walk, which loads A again for every block."""
    a, a_at, a_stride = a_view
    b, b_at, b_stride, b_block = b_view
    c, c_at, c_stride = c_view
    a_down, c_down, b_step = (
        a_at + TILE_ROWS * a_stride,
        c_at + TILE_ROWS * c_stride,
        TILE_PAIRS * b_stride,
    )
    tile_load(4, a, a_at, a_stride)
    if two_rows:
        tile_load(6, a, a_down, a_stride)
    if steps == 2:
        tile_load(5, a, a_at + 2 * TILE_PAIRS, a_stride)
        if two_rows:
            tile_load(7, a, a_down + 2 * TILE_PAIRS, a_stride)
    for j in range(col_tiles):
        b_tile = b_at + j * b_block
        tile_zero(0)
        tile_load(2, b, b_tile, b_stride)
        tile_dot(0, 4, 2)
        if two_rows:
            tile_zero(1)
            tile_dot(1, 6, 2)
        if steps == 2:
            tile_load(3, b, b_tile + b_step, b_stride)
            tile_dot(0, 5, 3)
            if two_rows:
                tile_dot(1, 7, 3)
        tile_store(0, c, c_at + j * TILE_ROWS, c_stride)
        if two_rows:
            tile_store(1, c, c_down + j * TILE_ROWS, c_stride)


@njit()
def amx_product(a_view, b_view, c_view, row_tiles, col_tiles, steps, accumulate):
    """C[:16 row_tiles, :16 col_tiles] (+)= A @ B over `steps` steps of 16 pairs of depth, in
    bf16 with fp32 accumulation (`accumulate`: add to C, else overwrite it). Views count
    elements:

    - a_view (a, offset, row_stride): A's row i, depth pair d at a[offset + i row_stride +
      2 d] (uint16: bf16 bits);
    - b_view (b, offset, row_stride, block_stride): B's depth pair d of column j at
      b[offset + d row_stride + (j // 16) block_stride + 2 (j % 16)] (uint16, VNNI);
    - c_view (c, offset, row_stride): C[i, j] at c[offset + i row_stride + j] (float32).

    Every tile is whole: the caller pads its operands (zero depth pairs in A and B)."""
    a, a_at, a_stride = a_view
    b, b_at, b_stride, b_block = b_view
    c, c_at, c_stride = c_view
    # Each block's views below would otherwise count references to the operands' memory,
    # atomically, two threads on one count (18% of the bf16 backward's samples, L = 4096).
    a, b, c = unowned(a), unowned(b), unowned(c)
    configure_tiles(TILE_CONFIG)
    if steps <= 2 and not accumulate:  # QK^T at E <= 64: A's tiles stay, B's stream
        for i in range(0, row_tiles, 2):
            a_block = (a, a_at + i * TILE_ROWS * a_stride, a_stride)
            c_block = (c, c_at + i * TILE_ROWS * c_stride, c_stride)
            _resident_rows(a_block, b_view, c_block, i + 1 < row_tiles, col_tiles, steps)
        release_tiles()
        return
    for i in range(0, row_tiles, 2):
        two_rows = i + 1 < row_tiles
        a_block = (a, a_at + i * TILE_ROWS * a_stride, a_stride)
        for j in range(0, col_tiles, 2):
            b_cols = (b, b_at + j * b_block, b_stride, b_block)
            c_block = (c, c_at + i * TILE_ROWS * c_stride + j * TILE_ROWS, c_stride)
            _tile_block(a_block, b_cols, c_block, two_rows, j + 1 < col_tiles, steps, accumulate)
    release_tiles()


AMX_PEAK_FLOPS_PER_ROUND = 4 * TILE_ROWS * TILE_ROWS * 2 * TILE_PAIRS * 2  # 4 tdpbf16ps


@njit()
def amx_peak_loop(iterations):
    """`iterations` rounds of 4 independent tdpbf16ps on tiles held in registers: AMX's
    peak, as the register-only loops of `peaks.peak_flops` time the vector units'."""
    configure_tiles(TILE_CONFIG)
    tile_zero(0)
    tile_zero(1)
    tile_zero(2)
    tile_zero(3)
    tile_zero(4)
    tile_zero(5)
    tile_zero(6)
    tile_zero(7)
    for _ in range(iterations):
        tile_dot(0, 4, 6)
        tile_dot(1, 4, 7)
        tile_dot(2, 5, 6)
        tile_dot(3, 5, 7)
    release_tiles()
