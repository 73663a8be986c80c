"""KV-cache decoding: split-K attention over a contiguous or paged cache, merged exactly; the
walk of a split over its key tiles (each tile on the route its cache takes: kvcache_tiles'
micro-kernels or AMX, or kvcache_loops' per-key loops), and the step's launchers."""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
from torch import Tensor

from attnperf.backend import lse_from_stats
from attnperf.inputs import Sequences
from attnperf.kernels.numba.amx import TILE_PAIRS, whole_tiles
from attnperf.kernels.numba.fastmath import LOG2E
from attnperf.kernels.numba.jit import (
    FASTMATH,
    aligned_empty,
    array_at,
    compiled_where,
    njit,
    prange,
    serial,
    split_index,
    types,
    unowned_members,
)
from attnperf.kernels.numba.kvcache_loops import (
    LOOPS,
    cached_scores,
    cached_values,
    quantized_scores,
    quantized_values,
)
from attnperf.kernels.numba.kvcache_tiles import (
    AMX,
    amx_buffers,
    amx_query_pairs,
    amx_tile,
    micro_kernel_tile,
    tile_softmax,
)
from attnperf.kernels.numba.launch import (
    HUGE_PAGE,
    as_numpy,
    empty_output,
    memory_as,
    memory_at,
    memory_of,
    run_parallel,
    stats_output,
)
from attnperf.kernels.numba.microkernels import BF16, FP32, tile_route
from attnperf.kernels.numba.variant import (
    LoweredVariant,
    key_range,
    lower_variant,
    tile_structure,
    with_sequences,
    with_sink,
)
from attnperf.kernels.numba.vector_ops import to_bf16
from attnperf.machine import cpu_vendor
from attnperf.serving import KVCacheInputs


def _route_by_dtypes(test):
    """`compiled_where` for a tile route, taken where test(dtype of its first argument (the
    queries or P), dtype of its pages) holds (bf16 as its bits, uint16)."""
    return compiled_where(lambda q_rows, pages, *rest: test(q_rows.dtype, pages.dtype))


# A step's key tile, each route compiled only for the caches that can take it (`decode_kind`):
# AMX for bf16 pages, the micro-kernels for fp32 or bf16 pages under queries of the same
# dtype, the per-key loops over codes for int8 pages and over values for the others.
amx_route = _route_by_dtypes(lambda q, pages: q == pages == types.uint16)(amx_tile)
micro_kernel_route = _route_by_dtypes(lambda q, pages: q == pages)(micro_kernel_tile)
quantized_scores_route = _route_by_dtypes(lambda q, pages: pages == types.int8)(quantized_scores)
cached_scores_route = _route_by_dtypes(lambda q, pages: pages != types.int8)(cached_scores)
quantized_values_route = _route_by_dtypes(lambda p, pages: pages == types.int8)(quantized_values)
cached_values_route = _route_by_dtypes(lambda p, pages: pages != types.int8)(cached_values)


@njit(fastmath=FASTMATH)
def kvcache_split(
    q_rows, k_pages, v_pages, k_scales, v_scales, head_major, block_table, variant, scale,
    block_n, kind, prefetch, partial_out, partial_stats, b, split,
):  # fmt: skip
    """Split `split` of sequence b: split-K attention of its query rows over a paged KV cache
    (pages (P, page_size, H, E), or `head_major` (P, H, page_size, E), transformers' layout;
    block_table (B, pages)) for the s-th of equal chunks of the keys its rows see, into
    partial_out[split] (B, Hq, Lq, Ev), unnormalised, and partial_stats[split] (B, Hq, Lq,
    2), each row's base-2 max and sum. q_rows (B, H, group Lq, E): each kv head's group of
    query heads as its rows (FlashAttention's "pack GQA": K and V are read once), fp32, or
    bf16 bits for kinds BF16 and AMX. An int8 cache's pages hold codes, with k_scales,
    v_scales (P, page_size, H, groups) beside them (empty for a float cache).

    It walks its keys in tiles, in memory order (a head at a time over (rows, H, E) pages,
    its rows a page apart, defeats the prefetchers): on AMX tiles (kind AMX, see amx_tile),
    the micro-kernels (kind FP32 or BF16, see micro_kernel_tile), both prefetching ahead
    where `prefetch` (`prefetches`), or in per-key loops (LOOPS, see decode_kind).
    """
    splits, _, q_heads, q_len, value_dim = partial_out.shape
    kv_heads = q_rows.shape[1]
    page_size = k_pages.shape[2] if head_major else k_pages.shape[1]
    group = q_heads // kv_heads
    rows = group * q_len
    scale2 = np.float32(scale * LOG2E)
    slot = variant.sequences[b, 0]  # the sequence's batch entry: rows may be reordered
    k_start, kv_len = variant.sequences[b, 3], variant.sequences[b, 4]
    first, end = key_range(variant, b, 0, q_len, kv_len)
    chunk = ((end - first + splits - 1) // splits + 15) // 16 * 16
    lo, hi = first + split * chunk, min(first + (split + 1) * chunk, end)
    # Score tiles in whole sixteens (AMX's transposes write whole ones), no wider than the
    # split's keys: a short cache's step then allocates and zeroes less.
    width = min(whole_tiles(block_n), whole_tiles(max(hi - lo, 0)))
    queries = amx_query_pairs(q_rows[slot], whole_tiles(rows)) if kind == AMX else q_rows[slot]
    s = np.empty((kv_heads, rows, width), np.float32)
    p_pairs = np.empty((kv_heads, rows, (width + 1) // 2) if kind == BF16 else (0, 0, 0),
                       np.uint32)  # fmt: skip
    tile_rows = whole_tiles(rows) if kind == AMX else rows
    acc = aligned_empty(kv_heads * tile_rows, value_dim, s)
    acc[:] = 0
    acc = acc.reshape((kv_heads, tile_rows, value_dim))
    buffers = amx_buffers(kind, kv_heads, rows, width, k_pages.shape[3], value_dim)
    row_max = np.full((kv_heads, rows), -np.inf, np.float32)
    row_sum = np.zeros((kv_heads, rows), np.float32)
    shift = np.zeros((kv_heads, rows), np.float32)
    # Key j is cache row k_start + j; pages hold page_size rows; tiles never cross one.
    page_start = (k_start + lo) // page_size * page_size
    while page_start < k_start + hi:
        page = block_table[slot, page_start // page_size]
        k_first = max(lo, page_start - k_start)
        k_end = min(hi, page_start + page_size - k_start)
        for j0 in range(k_first, k_end, block_n):
            cols = min(block_n, k_end - j0)
            first_row = k_start + j0 - page_start
            structure = tile_structure(variant, b, 0, 0, q_len, j0, cols)
            if kind == AMX:
                amx_route(queries, k_pages, v_pages, head_major, page, first_row, cols, variant,
                          b, q_len, j0, structure, scale2, s, buffers, acc, row_max, row_sum,
                          shift, prefetch)  # fmt: skip
                continue
            if kind != LOOPS:
                micro_kernel_route(queries, k_pages, v_pages, head_major, page, first_row, cols,
                                   variant, b, q_len, j0, structure, scale2, s, p_pairs, acc,
                                   row_max, row_sum, shift, prefetch)  # fmt: skip
                continue
            if k_scales.shape[0]:
                quantized_scores_route(queries, k_pages[page], k_scales[page], first_row, cols,
                                       s, scale2)  # fmt: skip
            else:
                cached_scores_route(queries, k_pages[page], head_major, first_row, cols, s,
                                    scale2)  # fmt: skip
            for hk in range(kv_heads):
                tile_softmax(s, hk, q_len, cols, variant, b, j0, structure, acc, row_max,
                             row_sum, shift)  # fmt: skip
            if v_scales.shape[0]:
                quantized_values_route(s, v_pages[page], v_scales[page], first_row, cols, acc)
            else:
                cached_values_route(s, v_pages[page], head_major, first_row, cols, acc)
        page_start += page_size
    for hk in range(kv_heads):
        for g in range(group):
            for t in range(q_len):
                r, h = g * q_len + t, hk * group + g
                partial_out[split, slot, h, t] = acc[hk, r]
                partial_stats[split, slot, h, t, 0] = shift[hk, r]
                partial_stats[split, slot, h, t, 1] = row_sum[hk, r]


@njit(fastmath=FASTMATH)
def merge_splits(partial_out, partial_stats, variant, out, stats):
    """out (B, Hq, L, Ev) (fp32, or bf16 bits: rounded) and stats (B, Hq, L, 2) of the
    splits' partial softmaxes combined exactly: merge_attention's rule in base 2, on
    unnormalised accumulators; the sinks, if any, applied once here.

    On the calling thread: a few microseconds of work, less than waking numba's threads.
    """
    splits, batch, heads, q_len, value_dim = partial_out.shape
    row = np.empty(value_dim, np.float32)
    bf16_bits = out.itemsize == 2
    for item in range(batch * heads):
        b, h, _ = split_index(item, heads, 1)
        for t in range(q_len):
            largest = -np.inf
            for split in range(splits):
                if partial_stats[split, b, h, t, 1] > 0:
                    largest = max(largest, partial_stats[split, b, h, t, 0])
            total = np.float32(0.0)
            row[:] = 0.0
            for split in range(splits):
                part_sum = partial_stats[split, b, h, t, 1]
                if part_sum > 0:
                    weight = np.float32(2.0 ** (partial_stats[split, b, h, t, 0] - largest))
                    total += part_sum * weight
                    for e in range(value_dim):
                        row[e] += weight * partial_out[split, b, h, t, e]
            largest, total, inverse = with_sink(variant, h, largest if total > 0 else 0.0,
                                                total)  # fmt: skip
            inverse = np.float32(inverse)
            out_row = out[b, h, t]
            for e in range(value_dim):
                if bf16_bits:
                    out_row[e] = to_bf16(row[e] * inverse)
                else:
                    out_row[e] = row[e] * inverse
            stats[b, h, t, 0] = largest
            stats[b, h, t, 1] = total


@njit()
def kvcache_arrays(memory):
    """(q_rows, k_pages, v_pages, out, stats) in a step's tensors' memory (`array_at`)."""
    return (array_at(memory[0]), array_at(memory[1]), array_at(memory[2]), array_at(memory[3]),
            array_at(memory[4]))  # fmt: skip


@njit(parallel=True, fastmath=FASTMATH)
def kvcache_forward_splits(
    memory, k_scales, v_scales, head_major, block_table, variant, scale, block_n, kind,
    prefetch, splits,
):  # fmt: skip
    """Every (sequence, split) of kvcache_split, in parallel, then merge_splits into out
    and stats (in the same call: a call into numba is a visible part of a step). memory: q_rows,
    k_pages, v_pages, out and stats, torch tensors' memory (`kvcache_arrays`). The splits'
    partial results are made here, never leaving the call."""
    variant = LoweredVariant(*unowned_members(variant))  # held by the caller; see LoweredVariant
    q_rows, k_pages, v_pages, out, stats = kvcache_arrays(memory)
    partial_out = np.empty((splits, *out.shape), np.float32)
    partial_stats = np.empty((splits, *stats.shape), np.float32)
    for item in prange(q_rows.shape[0] * splits):
        b, _, split = split_index(item, 1, splits)
        kvcache_split(
            q_rows, k_pages, v_pages, k_scales, v_scales, head_major, block_table, variant,
            scale, block_n, kind, prefetch, partial_out, partial_stats, b, split,
        )  # fmt: skip
    merge_splits(partial_out, partial_stats, variant, out, stats)


def step_threads(kv_bytes: int) -> int:
    """The threads a step of `kv_bytes` of K and V runs on: torch's count from
    PARALLEL_MIN_BYTES on, else 1 (the calling thread)."""
    return torch.get_num_threads() if kv_bytes >= PARALLEL_MIN_BYTES else 1


def kvcache_splits(inputs: KVCacheInputs, threads: int) -> int:
    """How many chunks each sequence's keys are split into (`split_count`)."""
    return split_count(inputs.num_splits, inputs.batch, inputs.sequences.max_kv_len, threads)


def split_count(num_splits: int, batch: int, longest: int, threads: int) -> int:
    """num_splits if asked, else enough that the (batch, split) items fill the threads
    evenly, with at least MIN_SPLIT_KEYS of the longest sequence's keys each."""
    if num_splits:
        return num_splits
    items = batch  # an item walks every head (see kvcache_forward_splits)
    if items == 0 or items >= threads:
        return 1
    return max(1, min(threads // math.gcd(items, threads), longest // MIN_SPLIT_KEYS))


# Keys per tile of a KV-cache step: the fastest of 32 to 512 measured (benches/README.md,
# "Behind the code"). Every head's scores of the tile (8 x 4 x 192 floats) stay in L1.
DECODE_BLOCK_N = 192
# Below this many bytes of K and V per call, a step runs on the calling thread (waking a
# second one gained nothing below it), and a split holds at least MIN_SPLIT_KEYS keys.
PARALLEL_MIN_BYTES = 1 << 20
# A split's fixed cost (its partial rows, the merge) is a few microseconds: below ~128 keys
# it outweighs what a second thread saves.
MIN_SPLIT_KEYS = 128


@functools.cache
def prefetches() -> bool:
    """Whether a step's walk prefetches ahead (`ahead_of`), on the micro-kernels and on AMX
    tiles: on AMD's and Intel's CPUs, where measured faster (benches/README.md, "Behind
    the code")."""
    return cpu_vendor() in ("AMD", "Intel")


def _is_head_major(pages: Tensor) -> bool:
    """Whether (P, rows, H, E) pages are a view of C-contiguous (P, H, rows, E) ones (and not
    C-contiguous themselves: one head or one row is both). From the strides, as torch
    judges contiguity (a dim of one has any stride): no transposed view made per step."""
    if pages.is_contiguous():
        return False
    shape, strides, expected = pages.shape, pages.stride(), 1
    for dim in (3, 1, 2, 0):  # (P, H, rows, E)'s dims, the last first
        if shape[dim] != 1 and strides[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def _page_views(k_pages: Tensor, v_pages: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(k, v, head_major): their (P, H, rows, E) views where both pages are views of
    C-contiguous ones (transformers' (B, H, S, E) cache), else the pages as they are."""
    if _is_head_major(k_pages) and _is_head_major(v_pages):
        return k_pages.transpose(1, 2), v_pages.transpose(1, 2), True
    return k_pages, v_pages, False


def _pages(inputs: KVCacheInputs) -> tuple[Tensor, Tensor, bool]:
    """(k pages, v pages, head_major) as the kernel reads them, C-contiguous: (P, rows, H,
    E), or (P, H, rows, E) where the caller's float cache is a view of that (transformers'
    (B, H, S, E)). The caller's own fp32, bf16 (its bits, widened in registers) or int8
    memory, other strides copied, an fp16 cache converted to fp32 (a contiguous one's
    filled rows only)."""
    k_pages, v_pages = inputs.k_pages, inputs.v_pages
    if inputs.quantized:
        return k_pages.contiguous(), v_pages.contiguous(), False
    in_place = inputs.dtype in (torch.float32, torch.bfloat16)
    if inputs.contiguous and not in_place:  # converted: the filled rows only
        filled = int((inputs.sequences.table[:, 3] + inputs.sequences.table[:, 4]).max())
        k_pages, v_pages = k_pages[:, :filled], v_pages[:, :filled]
    k_pages, v_pages, head_major = _page_views(k_pages, v_pages)
    if not in_place:
        k_pages, v_pages = k_pages.float(), v_pages.float()
    return k_pages.contiguous(), v_pages.contiguous(), head_major


def decode_kind(inputs: KVCacheInputs) -> int:
    """The step's kind: AMX (`amx_tile`) for a bf16 cache whose E and Ev are multiples of
    32 where bf16 runs on AMX (faster than vdpbf16ps, the more so with more tokens); else the
    micro-kernels (`micro_kernel_tile`): BF16 for another bf16 cache of even E where the
    CPU has the bf16 dot product, FP32 for an fp32 (or fp16, converted) cache where our
    AVX-512 tiles serve; else LOOPS.

    LOOPS serve int8 caches, and AVX2, where key_dots' 16 accumulators of two ymm halves
    each would spill. Either page layout runs on the tiles: on transformers' head-major
    pages, since P V takes a head's whole tile at once, the tiles ran faster than the
    loops, fp32 and bf16 alike.
    """
    if inputs.quantized:
        return LOOPS
    bf16 = inputs.dtype == torch.bfloat16
    route = tile_route("bf16")[0] if bf16 else tile_route("fp32")[0]
    dims = (inputs.head_dim, inputs.value_dim)
    if bf16 and route == "amx" and all(d % (2 * TILE_PAIRS) == 0 for d in dims):
        return AMX
    if bf16:
        even = inputs.head_dim % 2 == 0  # a pair past an odd row's end would be read
        return BF16 if even and route in ("amx", "avx512-bf16") else LOOPS  # AMX: vdpbf16ps too
    return FP32 if route == "avx512" else LOOPS


def query_rows(query: Tensor, kv_heads: int, kind: int) -> Tensor:
    """The query (B, Hq, Lq, E) as C-contiguous (B, H, group Lq, E) rows, each kv head's
    group of query heads stacked (group g's token t is row g Lq + t): fp32, or for BF16 and
    AMX bf16 with E padded even."""
    rows = (query.shape[0], kv_heads, query.shape[1] // kv_heads * query.shape[2])
    if kind in (AMX, BF16):
        if query.shape[3] % 2:
            query = torch.nn.functional.pad(query, (0, 1))
        return query.contiguous().reshape(*rows, query.shape[3])
    return query.float().contiguous().reshape(*rows, query.shape[3])


# An fp32 or bf16 cache's step has no int8 scales.
NO_SCALES = np.zeros((0, 0, 0, 0), np.float32)


def launch_step(
    q_rows: tuple, k_pages: tuple, v_pages: tuple, head_major: bool, kind: int, scales: tuple,
    table: np.ndarray, variant: LoweredVariant, scale: float, splits: int, threads: int, out: tuple,
    stats: tuple,
) -> None:  # fmt: skip
    """Run kvcache_forward_splits on `threads` > 1 where there are two (batch, split) items
    or more (waking numba's threads for one only costs), else on the calling thread, over
    a step's memory (`memory_of`'s tuples, whose tensors the caller keeps alive): q_rows
    (B, H, group Lq, E) (`query_rows`), the pages (`_pages`), out (B, Hq, Lq, Ev) in fp32
    or bf16 (written rounded by merge_splits, no fp32 copy converted) and stats (B, Hq, Lq,
    2). The kernel reads the tensors' memory: a decoding step is short, and each numpy
    array made for it in Python is a visible part of it."""
    memory = (q_rows, k_pages, v_pages, out, stats)
    args = (memory, *scales, head_major, table, variant, scale, DECODE_BLOCK_N, kind,
            prefetches(), splits)  # fmt: skip
    batch = q_rows[1][0]  # memory_of's (address, shape, element type)
    if threads > 1 and batch * splits > 1:
        run_parallel(kvcache_forward_splits, *args)
    else:
        serial(kvcache_forward_splits)(*args)


# Each thread's sequence table for the steps it runs (`step_sequences`); not a `scratch`
# slot, whose lookup cost a step more inside a model's generate.
_STEP_SEQUENCES = threading.local()


def step_sequences(batch: int, q_len: int, k_len: int) -> np.ndarray:
    """`Sequences.dense_table(batch, q_len, k_len, "bottom_right")` in an array this thread
    keeps, rewritten in place for each step (the kernel reads it during the call only):
    cheaper than a new array inside a model's generate."""
    table = getattr(_STEP_SEQUENCES, "table", None)
    if table is None or table.shape[0] != batch:
        table = _STEP_SEQUENCES.table = Sequences.dense_table(batch, q_len, k_len, "bottom_right")
    else:
        set_lengths(table, q_len, k_len)
    return table


@njit()
def set_lengths(table, q_len, k_len):
    """A dense table's lengths and offsets rewritten for q_len queries against k_len keys
    (numpy's column writes cost more, in a model's step most)."""
    for b in range(table.shape[0]):
        table[b, 2] = q_len
        table[b, 4] = k_len
        table[b, 5] = k_len - q_len


class KVCacheLauncher:
    """numba's launcher of KV-cache calls of one metadata: what the metadata decides (the
    step's kind, the variant, the shapes) worked out once, then either

    - `run(inputs)`: the call it was made of, whole (`numba_kvcache_forward`: any cache,
      paged, int8, ragged lengths, new keys already written), or
    - `__call__(q, k_cache, v_cache, cache_seqlens)`: a plain step of that metadata but for
      the cache's length (`Backend.kvcache_step`: a contiguous fp32 or bf16 cache, one int
      length for every sequence, no new keys, left padding, ALiBi, sinks or int8 scales),
      kept by attnperf.plans and run on the call's own tensors alone: a whole call's checks
      and conversions cost a model's step more than the kernel.

    Both launch `kvcache_forward_splits` through `launch_step`."""

    def __init__(self, inputs: KVCacheInputs):
        self.kind = decode_kind(inputs)
        self.variant = lower_variant(inputs)
        self.table = as_numpy(inputs.block_table.cpu())
        self.batch, self.q_len, self.kv_heads = inputs.batch, inputs.q_len, inputs.kv_heads
        self.out_shape = (inputs.batch, inputs.q_heads, inputs.q_len, inputs.value_dim)
        self.rows_shape = (inputs.batch, inputs.kv_heads, inputs.q_heads // inputs.kv_heads,
                           inputs.head_dim)  # one token's  # fmt: skip
        self.out_dtype = inputs.dtype
        # One token's out has q's shape, dtype and (C-contiguous) layout, and is small.
        out_bytes = math.prod(self.out_shape) * inputs.dtype.itemsize
        self.out_like_q = inputs.value_dim == inputs.head_dim and out_bytes < HUGE_PAGE
        self.key_bytes = inputs.key_bytes
        self.num_splits, self.scale = inputs.num_splits, inputs.scale
        self.return_lse = inputs.variant.return_lse
        self.step_variant = None  # (a step table, the variant with its sequences)

    def run(self, inputs: KVCacheInputs) -> tuple[Tensor, Tensor]:
        """(out (B, Hq, Lq, Ev) in the inputs' dtype, stats (B, Hq, Lq, 2)) of the call this
        launcher was made of: split-K over (batch, split) items, merged exactly."""
        k_pages, v_pages, head_major = _pages(inputs)
        scales = (NO_SCALES, NO_SCALES)
        if inputs.quantized:  # read in place: codes and scales, C-contiguous
            scales = tuple(as_numpy(t.contiguous()) for t in (inputs.k_scale, inputs.v_scale))
        threads = step_threads(inputs.kv_bytes)
        out_dtype = torch.bfloat16 if inputs.dtype == torch.bfloat16 else torch.float32
        out = empty_output(self.out_shape, out_dtype)
        stats = empty_output((*self.out_shape[:3], 2), torch.float32)
        rows = query_rows(inputs.query, self.kv_heads, self.kind)
        if rows.numel() == 0:  # no rows, or E = 0: the merge, which writes every row, never runs
            return out.zero_().to(inputs.dtype), stats.zero_()
        launch_step(
            memory_of(rows), memory_of(k_pages), memory_of(v_pages), head_major, self.kind,
            scales, self.table, self.variant, self.scale, kvcache_splits(inputs, threads),
            threads, memory_of(out), memory_of(stats),
        )  # fmt: skip
        return out.to(inputs.dtype), stats

    def __call__(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: int,
        heads_first: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """attention_with_kvcache(q, k_cache, v_cache, cache_seqlens) of a step whose
        metadata is the call's this launcher was made of (a cache of another length), its
        values checked (`serving.check_step`); heads_first: q, k_cache and v_cache in SDPA's
        (B, H, L, E) layout, the output as ever. One token's step makes no view: its query,
        the pages and its output are read and written where they lie (`memory_as`; inside a
        model's generate each view was a visible part of the step's Python)."""
        if heads_first and k_cache.is_contiguous() and v_cache.is_contiguous():
            head_major, k_memory, v_memory = True, memory_of(k_cache), memory_of(v_cache)
        else:
            if heads_first:
                k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
            k_memory, v_memory = _head_major_memory(k_cache), _head_major_memory(v_cache)
            head_major = k_memory is not None and v_memory is not None
            if not head_major:  # other strides: judged in full, copied where they must be
                head_major = _is_head_major(k_cache) and _is_head_major(v_cache)
                if not head_major:
                    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # to the end
                k_memory, v_memory = (_page_memory(t, head_major) for t in (k_cache, v_cache))
        one_token = self.q_len == 1 and q.is_contiguous() and q.dtype == _ROWS_DTYPE[self.kind]
        batch, heads, q_len, value_dim = self.out_shape
        if one_token:  # (B, 1, Hq, E) is (B, H, group, E) rows, and the output's layouts agree
            rows = memory_at(q, self.rows_shape)
            if self.out_like_q and not heads_first:  # q's dtype too: _ROWS_DTYPE's is the cache's
                out = torch.empty_like(q)
            else:
                out = empty_output((batch, 1, heads, value_dim), self.out_dtype)
        else:
            query = q if heads_first else q.transpose(1, 2)
            query = query_rows(query, self.kv_heads, self.kind)  # alive to the return
            rows = memory_of(query)
            out = empty_output(self.out_shape, self.out_dtype)
        stats, stats_memory = stats_output((batch, heads, q_len, 2), self.return_lse)
        if q.numel() == 0:  # no rows, or E = 0: the merge, which writes every row, never runs
            out.zero_()
            if stats is not None:
                stats.zero_()
        else:
            table = step_sequences(batch, q_len, cache_seqlens)
            threads = step_threads(batch * cache_seqlens * self.key_bytes)
            launch_step(
                rows, k_memory, v_memory, head_major, self.kind, (NO_SCALES, NO_SCALES),
                self.table, self.with_step_sequences(table), self.scale,
                split_count(self.num_splits, batch, cache_seqlens, threads), threads,
                memory_at(out, self.out_shape), stats_memory,
            )  # fmt: skip
        out = out if one_token else out.transpose(1, 2)
        return (out, lse_from_stats(stats)) if self.return_lse else out

    def with_step_sequences(self, table: np.ndarray) -> LoweredVariant:
        """The variant with a step's sequence table (`step_sequences`, a thread's array,
        rewritten in place each step): made once per table, not per step."""
        kept = self.step_variant  # read once: another thread may replace it
        if kept is not None and kept[0] is table:
            return kept[1]
        variant = with_sequences(self.variant, table)
        self.step_variant = (table, variant)
        return variant


# The dtype of a step's query rows by kind (`query_rows`): bf16 on the bf16 tiles, else fp32.
_ROWS_DTYPE = {AMX: torch.bfloat16, BF16: torch.bfloat16, FP32: torch.float32,
               LOOPS: torch.float32}  # fmt: skip


def _head_major_memory(pages: Tensor) -> tuple | None:
    """The memory of (P, rows, H, E) pages as (P, H, rows, E) where they are a view of such
    C-contiguous pages at exactly those strides (transformers' cache each step), else None
    (`_is_head_major` judges the rest, as torch judges contiguity)."""
    count, rows, heads, dim = pages.shape
    if pages.stride() != (heads * rows * dim, dim, rows * dim, 1) or heads == 1 or rows == 1:
        return None
    return memory_at(pages, (count, heads, rows, dim))


def _page_memory(pages: Tensor, head_major: bool) -> tuple:
    """The memory of (P, rows, H, E) pages as the kernel reads them: (P, H, rows, E) where
    they are a view of such C-contiguous pages (`_is_head_major`), else as they are."""
    if not head_major:
        return memory_of(pages)
    pages_count, rows, heads, dim = pages.shape
    return memory_as(pages, (pages_count, heads, rows, dim))


def numba_kvcache_forward(inputs: KVCacheInputs) -> tuple[Tensor, Tensor]:
    """(out (B, Hq, Lq, Ev) in the inputs' dtype, stats (B, Hq, Lq, 2)) of a KV-cache call:
    split-K over (batch, split) items, merged exactly (`KVCacheLauncher.run`)."""
    return KVCacheLauncher(inputs).run(inputs)


def numba_kvcache_step(inputs: KVCacheInputs) -> KVCacheLauncher | None:
    """numba's `Backend.kvcache_step`: the KVCacheLauncher of an fp32 or bf16 cache's call
    (an fp16 one is converted per call, its filled rows only: the whole call's path), else
    None."""
    if inputs.dtype not in (torch.float32, torch.bfloat16) or inputs.quantized:
        return None
    return KVCacheLauncher(inputs)
