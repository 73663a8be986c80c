"""What the launchers share: running a parallel kernel, arrays over torch tensors."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import sys
import threading
import weakref
from contextlib import nullcontext

import numpy as np
import torch
from torch import Tensor

from attnperf.kernels.numba.blas import setup
from attnperf.kernels.numba.jit import numba, serial


def as_numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().numpy()


# Calls from threads take turns: each uses every thread anyway, and numba's workqueue
# layer (where chosen) aborts the process when two Python threads enter it at once (the
# lock costs well under a microsecond against a call's milliseconds).
_PARALLEL_REGION = threading.Lock()
# The count each Python thread last gave numba (numba's count is the calling thread's own).
# numba.set_num_threads is Python, and slow right after a kernel or a large torch op, whose
# data evicted the interpreter's from the caches (a decoding step inside a model), so it is
# called only when torch's count has changed (a count that other code gives numba in
# between goes unnoticed).
_NUMBA_THREADS = threading.local()


# Whether this process was forked from one whose numba threads had started: GNU OpenMP's
# threads do not survive a fork, and numba ends such a child at its first parallel region
# ("fork() called from a process already using GNU OpenMP"). torch runs single-threaded
# there; so do the kernels (a DataLoader worker forked after a step).
_FORKED_AFTER_PARALLEL = False


@functools.cache
def _watch_forks() -> None:
    """Marks the children forked from now on (once per process, at its first parallel
    kernel: a fork before it leaves the child free to start threads of its own)."""

    def in_child() -> None:
        global _FORKED_AFTER_PARALLEL, _PARALLEL_REGION
        _FORKED_AFTER_PARALLEL = True
        _PARALLEL_REGION = threading.Lock()  # another thread may have held it at the fork

    os.register_at_fork(after_in_child=in_child)


def run_parallel(kernel, *args) -> None:
    """Run a prange kernel on torch's thread count, BLAS on one thread inside it; in a
    process forked after the threads started, on its calling thread (`jit.serial`)."""
    _, controller = setup()
    if _FORKED_AFTER_PARALLEL:
        serial(kernel)(*args)
        return
    _watch_forks()
    pinned = controller.limit(limits=1, user_api="blas") if controller else nullcontext()
    with _PARALLEL_REGION, pinned:
        threads = torch.get_num_threads()
        count = min(threads, numba.config.NUMBA_NUM_THREADS)
        if getattr(_NUMBA_THREADS, "count", None) != count:
            numba.set_num_threads(count)
            _NUMBA_THREADS.count = count
        # numba and torch share GNU OpenMP: starting numba's pool (the first call) set the
        # caller's OpenMP thread count to numba's, and torch's with it (a caller's
        # torch.set_num_threads(1) read 2 after the first parallel kernel).
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        kernel(*args)


# Per-thread memory for the operands a call packs and drops (key panels, value pairs),
# kept between calls: a fresh allocation of it faulted its pages in on every call, which
# cost a call of many small heads a third of its time.
_SCRATCH = threading.local()
# Larger packs are allocated per call: their faults weigh little against such calls' work,
# and the memory is not held. A thread keeps at most this much a slot.
SCRATCH_MAX_BYTES = 32 << 20


def on_a_line(raw: np.ndarray, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array of `shape` in `raw`'s bytes (64 more than it needs), starting on a 64-byte
    line."""
    skip = -raw.ctypes.data % 64
    size = math.prod(shape) * np.dtype(dtype).itemsize
    return raw[skip : skip + size].view(dtype).reshape(shape)


def scratch(slot: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array starting on a 64-byte line, in this thread's memory kept
    between calls for `slot` (one array a slot at a time): for operands packed during a call
    and dropped after it."""
    slots = _SCRATCH.__dict__.setdefault("slots", {})
    kept = slots.get(slot)
    # The array of a slot's last request (a repeated call's), as it was: cheaper than
    # carving it again.
    if kept is not None and kept[1].shape == shape and kept[1].dtype == dtype:
        return kept[1]
    size = math.prod(shape) * np.dtype(dtype).itemsize
    if size > SCRATCH_MAX_BYTES:
        raw = np.empty(size + 64, np.uint8)
    else:
        raw = None if kept is None else kept[0]
        if raw is None or raw.size < size + 64:
            raw = np.empty(size + 64, np.uint8)
    array = on_a_line(raw, shape, dtype)
    if size <= SCRATCH_MAX_BYTES:
        slots[slot] = (raw, array)
    return array


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's


@functools.cache
def _madvise():
    """libc's madvise on Linux, else None."""
    return ctypes.CDLL(None).madvise if sys.platform == "linux" else None


def ask_huge_pages(address: int, size: int) -> None:
    """Ask Linux to back the whole 2 MiB pages of [address, address + size) with huge pages
    (as torch's THP_MEM_ALLOC_ENABLE does for all of its allocations; it takes effect where
    transparent huge pages are "always" or "madvise").

    glibc maps each large allocation afresh (its mmap threshold rises to the size freed, and
    an equal request is at it again), so a call's outputs fault in page by page, a
    measurable share of a long call's time and of a decoding step's with a large state.
    """
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + size) // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if end > start and madvise is not None:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def float32_array(shape: tuple[int, ...], zero: bool = False) -> tuple[Tensor, np.ndarray]:
    """A new fp32 torch tensor and a numpy view of its memory for the kernels to write.

    The view is made from the address, not by Tensor.numpy(), which would pin the storage
    (a result that `resize_` refuses, unlike SDPA's); the tensor outlives every kernel call.
    Zeroed by memset, not torch.zeros: a torch op on OpenMP threads just before a kernel
    leaves them spinning on the cores the kernel's threads need.
    """
    return _output(shape, torch.float32, ctypes.c_float, zero)


def empty_output(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A new tensor for a kernel to write, in huge pages where it spans some."""
    return in_huge_pages(torch.empty(*shape, dtype=dtype))  # unpacked: faster


def in_huge_pages(tensor: Tensor) -> Tensor:
    """`tensor`, its memory asked to be backed by huge pages where it spans some."""
    size = tensor.nbytes
    if size >= HUGE_PAGE:
        ask_huge_pages(tensor.data_ptr(), size)
    return tensor


# Memory of recycled outputs (`recycled_float32`) that no tensor uses any more, by size: at
# most RECYCLED_SPARE_BYTES in all, the rest freed. Outputs under RECYCLED_MIN_BYTES are
# plain torch tensors (a page fault or two).
RECYCLED_MIN_BYTES = 1 << 20
RECYCLED_SPARE_BYTES = 128 << 20
_SPARE: dict[int, list[np.ndarray]] = {}
_SPARE_BYTES = [0]
# Reentrant: a recycled array freed by a garbage collection that runs inside the lock
# gives its memory back from the same thread.
_SPARE_LOCK = threading.RLock()


def recycled_float32(shape: tuple[int, ...], zero: bool = False) -> tuple[Tensor, np.ndarray]:
    """float32_array's pair, its memory an earlier such output's once nothing uses that
    (its tensor, views and arrays all freed), where one of the size is spare.

    For arrays a process asks for call after call (a decoding loop's linear-attention state,
    the chunks a forward keeps for its backward). A decoding loop replaces its state each
    step: on fresh memory the new state faulted its pages in, or not, by how glibc had mapped
    the process's earlier allocations, and a step's time varied with it from process to
    process. Recycled, each step writes the memory that the state of two steps before left.
    The tensor's storage is numpy's, which torch does not resize.
    """
    size = math.prod(shape) * 4
    if size < RECYCLED_MIN_BYTES:
        return float32_array(shape, zero)
    with _SPARE_LOCK:
        spare = _SPARE.get(size)
        raw = spare.pop() if spare else None
        if raw is not None:
            _SPARE_BYTES[0] -= raw.nbytes
    if raw is None:
        raw = np.empty(size + 64, np.uint8)
        ask_huge_pages(raw.ctypes.data, raw.nbytes)
    array = on_a_line(raw, shape, np.float32)
    weakref.finalize(array, _give_back, raw, size).atexit = False
    if zero:
        array.fill(0.0)
    return torch.from_numpy(array), array


def spare_bytes() -> int:
    """Bytes of recycled outputs' memory held spare now: resident, though no tensor uses it."""
    with _SPARE_LOCK:
        return _SPARE_BYTES[0]


def _give_back(raw: np.ndarray, size: int) -> None:
    """A recycled output's memory, spare now, kept for the next request of its size."""
    with _SPARE_LOCK:
        if _SPARE_BYTES[0] + raw.nbytes <= RECYCLED_SPARE_BYTES:
            _SPARE.setdefault(size, []).append(raw)
            _SPARE_BYTES[0] += raw.nbytes


# The stats tensor each thread keeps for calls that read none (`stats_output`).
_UNREAD = threading.local()


def stats_output(shape: tuple[int, ...], read: bool) -> tuple[Tensor | None, tuple]:
    """A kernel's fp32 softmax stats of `shape` and their `memory_of`: a new tensor where the
    caller reads them; where nothing does (no gradient or LSE to follow), None and the memory
    of a tensor this thread keeps between calls, its values undefined (a tensor allocated
    for them is a visible part of a short call). Kept up to SCRATCH_MAX_BYTES, allocated
    past it."""
    if not read:
        kept = getattr(_UNREAD, "memory", None)
        if kept is not None and kept[1] == shape:
            return None, kept
        if math.prod(shape) * 4 <= SCRATCH_MAX_BYTES:
            _UNREAD.tensor = torch.empty(shape, dtype=torch.float32)
            _UNREAD.memory = memory_of(_UNREAD.tensor)
            return None, _UNREAD.memory
    stats = empty_output(shape, torch.float32)
    return stats, memory_of(stats)


def zero_memory(tensor: Tensor) -> None:
    """Zero a C-contiguous tensor's memory by memset (see `float32_array` on why not a
    torch op)."""
    if tensor.numel() > 0:
        ctypes.memset(tensor.data_ptr(), 0, tensor.numel() * tensor.element_size())


def _output(shape: tuple[int, ...], dtype: torch.dtype, ctype, zero: bool):
    tensor = empty_output(shape, dtype)
    if tensor.numel() == 0:
        return tensor, np.zeros(shape, np.dtype(ctype))
    if zero:
        zero_memory(tensor)
    memory = (ctype * tensor.numel()).from_address(tensor.data_ptr())
    return tensor, np.ctypeslib.as_array(memory).reshape(shape)


# The kernels' element types: fp32, bf16 as its bits, int8 codes.
ELEMENTS = {
    torch.float32: np.empty(0, np.float32),
    torch.bfloat16: np.empty(0, np.uint16),
    torch.int8: np.empty(0, np.int8),
}


def memory_of(tensor: Tensor) -> tuple[int, tuple[int, ...], np.ndarray]:
    """A C-contiguous fp32, bf16 or int8 tensor's memory as a kernel's `array_at` reads it:
    (address, shape, an empty array of its element type; bf16 as uint16 bits). The caller
    keeps the tensor alive through the call."""
    if not tensor.is_contiguous():
        raise ValueError(f"memory_of needs a C-contiguous tensor, got strides {tensor.stride()}")
    return tensor.data_ptr(), tuple(tensor.shape), ELEMENTS[tensor.dtype]


def memory_at(tensor: Tensor, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...], np.ndarray]:
    """`memory_as` unchecked: for a tensor whose shape the caller's kept metadata fixes (a
    repeated call's, on its short path)."""
    return tensor.data_ptr(), shape, ELEMENTS[tensor.dtype]


def memory_as(tensor: Tensor, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...], np.ndarray]:
    """`memory_of` a tensor read as the C-contiguous array of `shape` that its memory holds:
    a (B, 1, Hq, E) tensor as (B, Hq, 1, E), a (P, rows, H, E) view of (P, H, rows, E) pages
    as those. The caller has checked the layout (the element counts are checked here) and
    keeps the tensor alive through the call."""
    if math.prod(shape) != tensor.numel():
        raise ValueError(f"memory_as: {tuple(tensor.shape)} holds no {shape} array")
    return tensor.data_ptr(), shape, ELEMENTS[tensor.dtype]


def strided_memory(tensor: Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], np.ndarray]:
    """An fp32, bf16 or int8 tensor's memory at any strides, as a kernel's `strided_at`
    reads it: (address, shape, strides in elements, an empty array of its element type;
    bf16 as uint16 bits). The caller keeps the tensor alive through the call."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), ELEMENTS[tensor.dtype]


def any_layout(array: np.ndarray) -> np.ndarray:
    """`array` behind a leading dim of 2 at stride 0, which a kernel reads as `array[0]`:
    numba then types it with layout "A" whatever its strides, so that one compiled kernel
    serves contiguous arrays and strided views ((B, L, H, E) tensors, broadcast masks)
    alike; each layout of each argument was otherwise a compilation of its own (seconds).
    Not a zero-size array: numpy calls it contiguous whatever its strides (the backward
    gives E = 0 a zero column instead)."""
    shape = (2, *array.shape)
    if not array.flags.c_contiguous:
        return np.broadcast_to(array, shape)  # read-only, as below
    # The cheap way (faster than broadcast_to or as_strided; a short call makes three of
    # these), which takes contiguous buffers only.
    view = np.ndarray(shape, array.dtype, array, 0, (0, *array.strides))
    view.flags.writeable = False
    return view


def as_bf16_bits(tensor: Tensor) -> np.ndarray:
    """A bf16 tensor's bits as a uint16 array (numpy has no bf16): a view where it has unit
    stride along the head dim, else a contiguous copy (still bf16)."""
    tensor = tensor.detach()
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    return as_numpy(tensor.view(torch.int16)).view(np.uint16)


def fp32_operand(tensor: Tensor) -> Tensor:
    """`tensor` as the kernels read fp32 operands: itself where BLAS can read it in place
    (fp32, unit stride along the head dim, rows apart: a (B, L, H, E) tensor viewed as
    (B, H, L, E), say), else an fp32 contiguous copy (detached). Kernels read its memory
    (`strided_memory`) or a numpy view (`as_numpy`, which detaches): no detached tensor is
    made for them (three a call)."""
    in_place = (
        tensor.dtype == torch.float32
        and tensor.stride(-1) == 1
        and tensor.stride(-2) >= max(tensor.shape[-1], 1)
    )
    return tensor if in_place else tensor.detach().to(torch.float32).contiguous()


def as_fp32(tensor: Tensor) -> np.ndarray:
    """An fp32 array of `tensor` for the kernels: a view of `fp32_operand`'s tensor."""
    return as_numpy(fp32_operand(tensor))
