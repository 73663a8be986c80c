"""The sgemm that the kernels' tiles call, bound once at the first call.

The sgemm is the MKL one inside torch's own library where torch exports it (x86-64 builds),
else scipy's OpenBLAS. Kernels call it by a name of ours, bound to an address at the first
call, so that the code cached on disk does not depend on which one serves.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np
import torch

from attnperf.kernels.numba.jit import (
    FASTMATH,
    cgutils,
    intrinsic,
    ir,
    llvm_binding,
    njit,
    numba,
    types,
)

SGEMM_SYMBOL = "attnperf_sgemm"
BLAS_THREADS_SYMBOL = "attnperf_blas_set_num_threads_local"


@intrinsic
def fortran_sgemm(typingctx, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """sgemm_(&trans_a, &trans_b, &m, ..., c, &ldc): BLAS's Fortran interface, column-major."""
    sig = types.void(
        types.boolean, types.boolean, types.intp, types.intp, types.intp, types.float32, a,
        types.intp, b, types.intp, types.float32, c, types.intp,
    )  # fmt: skip

    def codegen(context, builder, signature, args):
        by_reference = []
        for value, kind in zip(args, signature.args, strict=True):
            if isinstance(kind, types.Array):  # a matrix: its data pointer
                by_reference.append(context.make_array(kind)(context, builder, value).data)
                continue
            if kind == types.boolean:  # a transpose flag: 'T' or 'N'
                char = ir.IntType(8)
                value = builder.select(value, char(ord("T")), char(ord("N")))
            elif kind == types.intp:  # Fortran INTEGER of an LP64 BLAS: 32 bits
                value = builder.trunc(value, ir.IntType(32))
            slot = cgutils.alloca_once(builder, value.type)
            builder.store(value, slot)
            by_reference.append(slot)
        function_type = ir.FunctionType(ir.VoidType(), [value.type for value in by_reference])
        function = cgutils.get_or_insert_function(builder.module, function_type, SGEMM_SYMBOL)
        builder.call(function, by_reference)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def set_blas_threads_local(typingctx, count):
    """Set the calling thread's BLAS thread count (MKL_Set_Num_Threads_Local): the old one."""
    sig = types.int32(types.int32)

    def codegen(context, builder, signature, args):
        int32 = ir.IntType(32)
        function_type = ir.FunctionType(int32, [int32])
        function = cgutils.get_or_insert_function(
            builder.module, function_type, BLAS_THREADS_SYMBOL
        )
        return builder.call(function, args)

    return sig, codegen


@njit(fastmath=FASTMATH)
def gemm(a, b, c, alpha, beta, trans_a, trans_b):
    """c = alpha * op(a) @ op(b) + beta * c for 2-D float32 views with unit column stride,
    on the calling thread only (inside prange loops: no oversubscription).

    A row-major c is the column-major c.T = op(b).T @ op(a).T: BLAS gets b before a.
    """
    rows, cols = c.shape
    inner = a.shape[0] if trans_a else a.shape[1]
    if rows == 0 or cols == 0:
        return
    if inner == 0:  # an empty product is 0 (and BLAS refuses the leading dimension 0)
        for r in range(rows):
            for col in range(cols):
                c[r, col] = beta * c[r, col] if beta != 0 else 0.0
        return
    blas_threads = set_blas_threads_local(1)  # nothing against a tile's product
    fortran_sgemm(
        trans_b, trans_a, cols, rows, inner, np.float32(alpha), b, b.strides[0] // 4, a,
        a.strides[0] // 4, np.float32(beta), c, c.strides[0] // 4,
    )  # fmt: skip
    set_blas_threads_local(blas_threads)


BLAS_CHOICES = ("auto", "torch", "scipy")


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _torch_mkl() -> tuple[int, int] | None:
    """Addresses of sgemm_ and MKL_Set_Num_Threads_Local in torch's library, if exported."""
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            library = ctypes.CDLL(str(path))
            return _address(library.sgemm_), _address(library.MKL_Set_Num_Threads_Local)
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _keep_blas_threads():
    """A C callback that leaves BLAS's threads alone: scipy's OpenBLAS is pinned from
    outside (threadpoolctl). Cached: the kernels call its code for the process's lifetime."""
    return numba.cfunc(types.int32(types.int32))(lambda count: np.int32(0))


def _scipy_openblas() -> tuple[int, int]:
    """Addresses of scipy's sgemm and of a no-op thread setter (a C callback, no GIL)."""
    import scipy.linalg.cython_blas

    capsule = scipy.linalg.cython_blas.__pyx_capi__["sgemm"]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    sgemm = api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))
    return sgemm, _keep_blas_threads().address


@functools.cache
def setup() -> tuple[str, object]:
    """Bind the kernels' BLAS and pick the threading layer, once, at the first call.

    Returns the BLAS's name and what pins it to one thread from outside (None where gemm
    pins it itself, per calling thread). torch's MKL serves where torch exports it, else
    scipy's OpenBLAS; ATTNPERF_NUMBA_BLAS=torch|scipy insists on one. Numba's threads are
    its OpenMP layer where it loads: its "workqueue" pool cost a short parallel region
    much and a long one a sixth of its speed. GNU OpenMP is not fork-safe: a process
    forked after a parallel kernel
    runs the kernels on its calling thread (`launch.run_parallel`). A layer chosen by the
    user (NUMBA_THREADING_LAYER) is respected.
    """
    choice = os.environ.get("ATTNPERF_NUMBA_BLAS", "auto")
    if choice not in BLAS_CHOICES:
        raise ValueError(f"ATTNPERF_NUMBA_BLAS must be one of {BLAS_CHOICES}, got {choice!r}")
    mkl = _torch_mkl() if choice != "scipy" else None
    if mkl is None and choice == "torch":
        raise RuntimeError("ATTNPERF_NUMBA_BLAS=torch, but torch's library exports no MKL sgemm_")
    if mkl is not None:
        name, (sgemm, set_threads), controller = "torch's MKL", mkl, None
    else:
        from threadpoolctl import ThreadpoolController

        name, (sgemm, set_threads) = "scipy's OpenBLAS", _scipy_openblas()
        controller = ThreadpoolController()
    llvm_binding.add_symbol(SGEMM_SYMBOL, sgemm)
    llvm_binding.add_symbol(BLAS_THREADS_SYMBOL, set_threads)
    if numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    return name, controller
