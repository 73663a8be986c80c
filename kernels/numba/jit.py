"""Numba, guarded: the decorator every kernel uses, prange, and why numba is missing."""

from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import sys
import threading
import time
import types as pytypes

import numpy as np

try:
    import numba
    import scipy  # noqa: F401  (scipy's BLAS serves when torch exports no sgemm)
    from llvmlite import binding as llvm_binding
    from llvmlite import ir
    from numba.core import caching, cgutils, event, types
    from numba.core.codegen import get_host_cpu_features as numba_host_features
    from numba.extending import intrinsic, overload
    from numba.np.arrayobj import populate_array

    MISSING = None
except ImportError as error:
    numba = caching = cgutils = event = ir = llvm_binding = numba_host_features = None
    populate_array = None
    types = None
    MISSING = f"numba and scipy are needed ({error}); pip install 'attnperf[cpu]'"


def njit(**options):
    """numba.njit with an on-disk cache; without numba the plain function (never run).

    error_model="numpy": IEEE division (inf/NaN, no ZeroDivisionError branch), which lets
    loops that divide vectorise (the softcap's tanh was many times slower without).
    """
    if numba is None:
        return lambda function: function
    _stamp_kernels_by_folder()
    _note_compiles()
    return numba.njit(cache=True, nogil=True, error_model="numpy", **options)


KERNELS_FOLDER = os.path.dirname(os.path.abspath(__file__))


def in_kernels_folder(path: str) -> bool:
    """Whether the source file `path` is a module of KERNELS_FOLDER."""
    return os.path.dirname(os.path.abspath(path)) == KERNELS_FOLDER


def folder_stamp(folder: str = KERNELS_FOLDER) -> str:
    """A hash of every module of `folder`, by content: the cache stamp of each kernel
    there. numba stamps a cached kernel with its own file alone, but inlines the helpers of
    other files into it: after an edit to a helper module (or a `git pull` that changes
    one) the kernels of the other files kept their stale code, silently."""
    files = []
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        stat = os.stat(path)
        files.append((path, stat.st_mtime_ns, stat.st_size))
    return _hash_of(tuple(files))


@functools.lru_cache(maxsize=16)
def _hash_of(files: tuple) -> str:
    digest = hashlib.sha256()
    for path, _, _ in files:
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()


class _FolderStamp:
    """A numba cache locator's stamp for this folder's kernels: `folder_stamp`."""

    def get_source_stamp(self):
        return folder_stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not in_kernels_folder(py_file):
            return None
        return super().from_function(py_func, py_file)


@functools.cache
def _stamp_kernels_by_folder() -> None:
    """Puts a `_FolderStamp` twin ahead of each of numba's file-backed cache locators (its
    own cache folder, a user's NUMBA_CACHE_DIR, the user-wide one), for this folder's
    kernels only; a numba without that list keeps its own stamps."""
    impl = getattr(caching, "CacheImpl", getattr(caching, "_CacheImpl", None))  # by version
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    bases = [getattr(caching, name, None) for name in names]
    if impl is None or not hasattr(impl, "_locator_classes"):
        return
    ordered = []
    for locator in impl._locator_classes:
        if locator in bases:
            ordered.append(type(f"Folder{locator.__name__}", (_FolderStamp, locator), {}))
        ordered.append(locator)
    impl._locator_classes = ordered


# A kernel's compile still running after this long says so on stderr, once, in one line.
COMPILE_NOTE_AFTER_S = 2.0


class _CompileNote:
    """numba's compile events, as one line on stderr for a kernel of this folder whose
    compile takes long: a first call in an environment waits tens of seconds, which a
    user should not have to guess at. A cache hit raises no event, so a kernel speaks once
    per machine (until its sources change). Short compiles (helpers, small kernels) stay
    silent; nested compiles belong to their outermost."""

    def __init__(self):
        self.depth = 0
        self.timer = None
        self.said = False

    def on_start(self, event_):
        self.depth += 1
        if self.depth == 1:
            self._start(event_.data["dispatcher"].py_func)

    def on_end(self, event_):
        self.depth -= 1
        if self.depth == 0:
            self._end()

    def _start(self, function):
        if not in_kernels_folder(function.__code__.co_filename):
            return
        self.started, self.said = time.perf_counter(), False
        name = function.__qualname__

        def say():
            self.said = True
            print(f"attnperf: numba compiles {name} for this CPU, once (cached for later "
                  "processes; `attnperf warmup` compiles ahead) ...", end="", file=sys.stderr,
                  flush=True)  # fmt: skip

        if COMPILE_NOTE_AFTER_S <= 0:
            say()
        elif math.isfinite(COMPILE_NOTE_AFTER_S):
            self.timer = threading.Timer(COMPILE_NOTE_AFTER_S, say)
            self.timer.daemon = True
            self.timer.start()

    def _end(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
            self.timer = None
        if self.said:
            print(f" {time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)
            self.said = False


@functools.cache
def _note_compiles() -> None:
    event.register("numba:compile", type("CompileNote", (_CompileNote, event.Listener), {})())


@functools.cache
def serial(kernel):
    """A parallel kernel (an njit of `prange` loops) compiled without `parallel`: its
    prange loops run as plain loops on the calling thread, never entering numba's
    threading layer. For calls too small to wake the threads, and for a process forked
    after the layer started (GNU OpenMP's threads do not survive a fork; numba ends such a
    child at its first parallel region). Its own name, so its own cache files: numba names
    them by the function's qualified name and line, not by its options."""
    function = kernel.py_func
    twin = pytypes.FunctionType(function.__code__, function.__globals__,
                                f"{function.__name__}_serial", function.__defaults__,
                                function.__closure__)  # fmt: skip
    twin.__qualname__ = f"{function.__qualname__}_serial"
    twin.__module__, twin.__doc__ = function.__module__, function.__doc__
    return njit(fastmath=kernel.targetoptions.get("fastmath", False))(twin)


prange = numba.prange if numba is not None else range
if numba is None:  # kernels are never run then; their modules only need the names

    def intrinsic(function=None, **options):
        return function if function is not None else (lambda function: function)

    def overload(function, **options):
        return lambda typing: typing


# Reassociation and contraction let LLVM vectorise the row loops; no "nnan"/"ninf", so
# NaN and inf propagate as in SDPA.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def compiled_where(serves):
    """A decorator: the jitted `function` as kernels call it where `serves(*argument types)`
    holds, and nothing where it does not (a branch the caller never takes for those
    types). Chosen by type as numba compiles the caller, so that code which can never run
    is not compiled: a decoding step's tile routes (kvcache.py), whose first call took
    half as long again with every route compiled."""

    def decorate(function):
        def stand_in(*args):  # typed by the overload below; never run in Python
            raise NotImplementedError(f"{function.__name__} runs in jitted code only")

        @overload(stand_in, jit_options={"fastmath": FASTMATH})
        def choose(*args):
            if serves(*args):
                return lambda *args: function(*args)
            return lambda *args: None

        stand_in.__name__ = stand_in.__qualname__ = f"{function.__name__}_where_served"
        return stand_in

    return decorate


@intrinsic
def wide_vectors(typingctx):
    """Marks the calling function for LLVM's loop vectoriser to use the widest vectors:
    LLVM's Intel AVX-512 CPUs prefer 256 bits (for the clock the wide units cost on old
    chips), which held our loops to half the width of their explicit 512-bit products.
    Call it in every function whose loops should vectorise wide, callers too: a loop
    inlined into a caller takes the caller's preference."""

    def codegen(context, builder, signature, args):
        # llvmlite knows no string attributes: added to the set as LLVM IR spells them.
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def pointer_at(typingctx, address, like):
    """A pointer to elements of `like`'s dtype at `address` (an int)."""
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(types.intp, like), codegen


@intrinsic
def data_address(typingctx, array):
    """The address of an array's first element, as an int."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, context.get_value_type(types.intp))

    return types.intp(array), codegen


@intrinsic
def unowned(typingctx, array):
    """`array` (same type) holding no reference to its memory: the views, tuples and calls
    made of it then count none (see `row_view`). Only of an array held elsewhere while the
    result lives, as a function's argument is by its caller: numba frees a local array
    right after its last use, which `unowned` would be."""

    def codegen(context, builder, signature, args):
        return _unowned_value(context, builder, signature.args[0], args[0])

    return array(array), codegen


def _unowned_value(context, builder, array_type, value):
    """An array value of array_type with no memory owner (`unowned`'s codegen)."""
    view = context.make_array(array_type)(context, builder, value)
    view.meminfo = cgutils.get_null_value(view.meminfo.type)
    view.parent = cgutils.get_null_value(view.parent.type)
    return view._getvalue()


@intrinsic
def any_strides(typingctx, array):
    """`array` itself, typed as an array of any strides (layout "A", writable): a helper
    called with views of several layouts then compiles once, not once per combination of
    its arguments' types (`tiles.product`). Inside jitted code; `launch.any_layout` does
    the same for a kernel's arguments from Python. Only for a helper that reads strides at
    run time and writes no array it was given read-only, as the tile products."""
    if not isinstance(array, types.Array):
        return None
    result = types.Array(array.dtype, array.ndim, "A")

    def codegen(context, builder, signature, args):
        # One data model for every layout and flag; the result is a new reference.
        context.nrt.incref(builder, signature.args[0], args[0])
        return args[0]

    return result(array), codegen


@intrinsic
def unowned_members(typingctx, values):
    """`values` (a tuple, the same type) with each array member holding no reference to its
    memory (`unowned`): a kernel's variant, whose ten arrays numba otherwise counts (an
    atomic add and subtract each) at every call of a helper that takes the tuple, ~7% of a
    64 x 64 query tile's time. Only of a tuple held elsewhere while the result lives: a
    kernel's own argument."""
    if not isinstance(values, types.BaseTuple):
        return None

    def codegen(context, builder, signature, args):
        result = args[0]
        for i, member in enumerate(signature.args[0].types):
            if isinstance(member, types.Array):
                view = _unowned_value(context, builder, member, builder.extract_value(result, i))
                result = builder.insert_value(result, view, i)
        return result

    return values(values), codegen


@njit()
def aligned_empty(rows, cols, like):
    """An uninitialised (rows, cols) array of like's dtype whose data starts on a 64-byte
    line: a tile's rows then lie in whole lines (numba's arrays start on 32 bytes; off a
    line, QK^T's tile stores and P V's tile loads took up to twice the time)."""
    extra = 64 // like.itemsize
    flat = np.empty(rows * cols + extra, like.dtype)
    skip = (-flat.ctypes.data % 64) // like.itemsize
    return flat[skip : skip + rows * cols].reshape((rows, cols))


@njit()
def row_view(matrix, r):
    """matrix[r] of a C-contiguous 2-D array, as a view that holds no reference to the
    matrix's memory (the caller keeps the matrix alive). numba's own view takes one, an
    atomic add and subtract on the memory's count, per row: a fifth of a 64 x 64 query
    tile's time, and more where two threads count one array."""
    address = data_address(matrix) + r * matrix.strides[0]
    return numba.carray(pointer_at(address, matrix), matrix.shape[1])


@njit()
def carve(address, at, shape, like):
    """An array of like's dtype and `shape` (a tuple) at address + at, at rounded up to a
    64-byte line, holding no reference to the memory (its owner outlives it); and the
    offset past it. From address 0 it only measures: the offsets a workspace needs."""
    at = (at + 63) // 64 * 64
    size = like.itemsize
    for n in shape:
        size *= n
    return numba.carray(pointer_at(address + at, like), shape), at + size


@njit()
def array_at(memory):
    """The C-contiguous array in memory = (address, shape, an empty array of its dtype)
    that a torch tensor owns (`launch.memory_of`): a kernel reads the tensor without a
    numpy array made for it in Python (each a visible part of a short call)."""
    address, shape, like = memory
    return numba.carray(pointer_at(address, like), shape)


@intrinsic
def strided_array(typingctx, address, shape, strides, like):
    """A read-only array of like's dtype at `address` (an int), of `shape` and `strides`
    (tuples of ints, strides in elements, as torch counts them), holding no reference to the
    memory: typed as `launch.any_layout`'s views index (layout "A", read-only), so that
    kernels compiled for those serve it."""
    array_type = types.Array(like.dtype, shape.count, "A", readonly=True)

    def codegen(context, builder, signature, args):
        array = context.make_array(array_type)(context, builder)
        data = builder.inttoptr(args[0], context.get_value_type(types.CPointer(like.dtype)))
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(
            context.get_data_type(like.dtype)))  # fmt: skip
        strides = [builder.mul(stride, itemsize) for stride in
                   cgutils.unpack_tuple(builder, args[2])]  # fmt: skip
        populate_array(array, data=data, shape=cgutils.unpack_tuple(builder, args[1]),
                       strides=strides, itemsize=itemsize, meminfo=None)  # fmt: skip
        return array._getvalue()

    return array_type(address, shape, strides, like), codegen


@njit()
def strided_at(memory):
    """The array in memory = (address, shape, strides in elements, an empty array of its
    dtype) that a torch tensor owns, at any strides (`launch.strided_memory`), as a
    read-only layout "A" array (`strided_array`)."""
    address, shape, strides, like = memory
    return strided_array(address, shape, strides, like)


@njit()
def run_bounds(run, runs, items):
    """(first, last + 1) of run `run` of `runs` runs of consecutive items, as even as can
    be (prange's static schedule)."""
    run = np.int64(run)  # prange's indices are unsigned
    return run * items // runs, (run + 1) * items // runs


@njit()
def split_index(item, heads, tiles):
    """(batch, head, tile) of a flat prange index (prange indices are unsigned)."""
    item = np.int64(item)
    return item // (heads * tiles), (item // tiles) % heads, item % tiles


@intrinsic
def prefetch_line(typingctx, array, at):
    """Asks for the cache line of array[at] (a tuple of indices, never checked) into the
    caches, without waiting for it: for rows the prefetchers cannot foresee."""

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        indices = cgutils.unpack_tuple(builder, args[1])
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, indices,
                                           wraparound=False, boundscheck=False)  # fmt: skip
        emit_prefetch(builder, pointer, 3)
        return context.get_dummy_value()

    return types.void(array, at), codegen


def emit_prefetch(builder, pointer, locality):
    """llvm.prefetch of a read at `pointer`; locality 3: into L1, 2: into L2."""
    byte_pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
    i32 = ir.IntType(32)
    function_type = ir.FunctionType(ir.VoidType(), [byte_pointer.type, i32, i32, i32])
    function = cgutils.get_or_insert_function(builder.module, function_type, "llvm.prefetch.p0")
    builder.call(function, [byte_pointer, i32(0), i32(locality), i32(1)])
