"""Numba, guarded: the decorator every kernel uses, prange, and why numba is missing."""

from __future__ import annotations

import numpy as np

try:
    import numba
    import scipy  # noqa: F401  (scipy's BLAS serves when torch exports no sgemm)
    from llvmlite import binding as llvm_binding
    from llvmlite import ir
    from numba import literally
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    MISSING = None
except ImportError as error:
    numba = cgutils = ir = llvm_binding = types = None
    MISSING = f"numba and scipy are needed ({error}); pip install 'attnperf[cpu]'"


def njit(**options):
    """numba.njit with an on-disk cache; without numba the plain function (never run).

    error_model="numpy": IEEE division (inf/NaN, no ZeroDivisionError branch), which lets
    loops that divide vectorise (the softcap's tanh was 10x slower without).
    """
    if numba is None:
        return lambda function: function
    return numba.njit(cache=True, nogil=True, error_model="numpy", **options)


prange = numba.prange if numba is not None else range
if numba is None:  # kernels are never run then; their modules only need the names

    def intrinsic(function=None, **options):
        return function if function is not None else (lambda function: function)

    def literally(value):
        return value


# Reassociation and contraction let LLVM vectorise the row loops; no "nnan"/"ninf", so
# NaN and inf propagate as in SDPA.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


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


@njit()
def array_at(memory):
    """The C-contiguous array in memory = (address, shape, an empty array of its dtype)
    that a torch tensor owns (`launch.memory_of`): a kernel reads the tensor without a
    numpy array made for it in Python (~2.5 us each, more inside a model's step)."""
    address, shape, like = memory
    return numba.carray(pointer_at(address, like), shape)


@njit()
def split_index(item, heads, tiles):
    """(batch, head, tile) of a flat prange index (prange indices are unsigned)."""
    item = np.int64(item)
    return item // (heads * tiles), (item // tiles) % heads, item % tiles
