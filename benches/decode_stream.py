"""A decoding step's stream from memory beside the machine's own, and where its time goes.

1. numba's step over caches larger than L3 (by default B = 1, 64k keys, 32/8 heads, E =
   128: 512 MiB of fp32 K and V, 256 of bf16; `--batches` and `--lengths` for others, such
   as the decode bench's points) against a sequential read of the same bytes (torch's sum
   of K, then of V) on the same threads, one and two, the two timed in alternation in one
   process: a VM's memory speed moves between processes more than between neighbouring
   calls, so the step's share of the read is steadier than its share of a probe read in a
   process of its own.
2. The step's tile walk taken apart on one thread (`micro_kernel_tile`'s pieces on a plain
   tile: the scores' walk, the online softmax (bf16: with P rounded and its bits paired),
   P V's walk), fp32 and bf16, each alone and the three in turn, with K and V in cache
   (one 192-key tile: 1.5 MiB of fp32, in L2 and L3) and in memory (64k keys), in
   nanoseconds a (key, kv head): a phase slower from memory than from cache waits on it.

    python benches/decode_stream.py [--rounds 7] [--batches 1 4] [--lengths 16384 65536]
        [--threads 2]
"""

import argparse
import itertools
import statistics
import time

import numpy as np
import torch
from decode_steps import HEAD_DIM  # benches/, the script's own folder

import attnperf
from attnperf.kernels.numba.jit import FASTMATH, aligned_empty, njit
from attnperf.kernels.numba.key_dots import scores_by_dots
from attnperf.kernels.numba.kvcache import DECODE_BLOCK_N, prefetches
from attnperf.kernels.numba.kvcache_tiles import (
    ahead_of,
    chunked_values,
    memory_order,
    round_to_bf16,
)
from attnperf.kernels.numba.microkernels import LANES
from attnperf.kernels.numba.softmax import online_softmax_rescale
from attnperf.machine import cpu_description

Q_HEADS, KV_HEADS, KEYS = 32, 8, 65536
ROWS = Q_HEADS // KV_HEADS  # a kv head's query rows: its group, one token
SCORES, SOFTMAX, VALUES = 1, 2, 4  # the walk's phases, as bits


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def stream_rates(dtype: torch.dtype, batch: int, keys: int, threads: int,
                 rounds: int) -> tuple[float, float]:  # fmt: skip
    """(step, sequential read) GB/s of K and V: medians of `rounds` alternating calls."""
    torch.set_num_threads(threads)
    k_cache, v_cache = (torch.randn(batch, keys, KV_HEADS, HEAD_DIM, dtype=dtype)
                        for _ in range(2))  # fmt: skip
    q = torch.randn(batch, 1, Q_HEADS, HEAD_DIM, dtype=dtype)

    def step():
        attnperf.attention_with_kvcache(q, k_cache, v_cache, keys, backend="numba")

    def read():
        k_cache.sum()
        v_cache.sum()

    step(), read()
    step_s, read_s = [], []
    for _ in range(rounds):
        step_s.append(seconds(step))
        read_s.append(seconds(read))
    nbytes = 2 * k_cache.numel() * dtype.itemsize
    return nbytes / statistics.median(step_s) / 1e9, nbytes / statistics.median(read_s) / 1e9


@njit(fastmath=FASTMATH)
def tile_walk(phases, q_rows, keys, values, count, s, p_pairs, acc, row_max, row_sum, shift,
              prefetch):  # fmt: skip
    """micro_kernel_tile's walk over `count` keys of row-major (keys, H, E) K and V,
    flattened, fp32 or bf16 bits (then q_rows too, and P's bits go to p_pairs), in tiles of
    DECODE_BLOCK_N, its `phases` only (bits: SCORES, SOFTMAX, VALUES)."""
    kv_heads, rows, width = s.shape
    dim = q_rows.shape[2]
    bf16 = keys.itemsize == 2
    row = kv_heads * dim
    for j0 in range(0, count, width):
        cols = min(width, count - j0)
        chunks = (cols + LANES - 1) // LANES
        if phases & SCORES:
            ahead = ahead_of(prefetch, row, 1)
            for item in range(chunks * kv_heads):
                c, hk = memory_order(item, chunks, kv_heads, False, LANES)
                scores_by_dots(dim // 2 if bf16 else dim, np.float32(0.01),
                               (q_rows, hk * rows * dim, dim),
                               (keys, (j0 + c) * row + hk * dim, row),
                               (s, hk * rows * width + c, width), rows, min(LANES, cols - c),
                               ahead)  # fmt: skip
        if phases & SOFTMAX:
            for hk in range(kv_heads):
                online_softmax_rescale(s[hk], rows, cols, acc[hk], row_max[hk], row_sum[hk],
                                       shift[hk])  # fmt: skip
                if bf16:
                    round_to_bf16(s[hk], rows, cols, p_pairs[hk].view(np.uint16))
        if phases & VALUES:
            chunked_values(s, p_pairs, (values, j0 * row, dim, row), False, cols, acc, prefetch)


def as_read(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's memory as the step reads it: fp32, or bf16 bits (uint16); torch's
    allocations start on a 64-byte line, as the step's tensors do."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def phase_times(dtype: torch.dtype, count: int, rounds: int) -> dict:
    """ns a (key, kv head) of each phase alone and of the three in turn, over `count` keys
    (medians of `rounds`)."""
    q_rows = as_read(torch.randn(KV_HEADS, ROWS, HEAD_DIM).to(dtype))
    keys, values = (as_read(torch.randn(count * KV_HEADS * HEAD_DIM).to(dtype)) for _ in "kv")
    s = np.zeros((KV_HEADS, ROWS, DECODE_BLOCK_N), np.float32)
    pair_shape = (KV_HEADS, ROWS, DECODE_BLOCK_N // 2) if dtype == torch.bfloat16 else (0, 0, 0)
    p_pairs = np.zeros(pair_shape, np.uint32)
    acc = aligned_empty(KV_HEADS * ROWS, HEAD_DIM, s).reshape(KV_HEADS, ROWS, HEAD_DIM)
    acc[:] = 0
    repeats = max(1, 200_000 // count)
    times = {}
    for _ in range(rounds):
        for name, phases in (("scores", SCORES), ("softmax", SOFTMAX), ("P V", VALUES),
                             ("all three", SCORES | SOFTMAX | VALUES)):  # fmt: skip
            row_max = np.full((KV_HEADS, ROWS), -np.inf, np.float32)
            row_sum, shift = np.zeros_like(row_max), np.zeros_like(row_max)
            args = (phases, q_rows, keys, values, count, s, p_pairs, acc, row_max, row_sum,
                    shift, prefetches())  # fmt: skip
            tile_walk(*args)
            start = time.perf_counter()
            for _ in range(repeats):
                tile_walk(*args)
            elapsed = time.perf_counter() - start
            times.setdefault(name, []).append(elapsed / repeats / count / KV_HEADS * 1e9)
    return {name: statistics.median(ns) for name, ns in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--lengths", type=int, nargs="+", default=[KEYS])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']}; {Q_HEADS}/{KV_HEADS} heads, E = {HEAD_DIM}, row-major "
          "cache\n")  # fmt: skip
    print("| cache | B | S | threads | step GB/s | sequential read GB/s | step / read |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, keys in itertools.product(args.batches, args.lengths):
            for threads in args.threads:
                step, read = stream_rates(dtype, batch, keys, threads, args.rounds)
                print(f"| {str(dtype)[6:]} | {batch} | {keys} | {threads} | {step:.1f} | "
                      f"{read:.1f} | {step / read:.0%} |")  # fmt: skip
    torch.set_num_threads(1)
    print("\nThe walk's phases, one thread, ns a (key, kv head):\n")
    print("| cache | K and V in | scores | softmax | P V | sum of the three | all three in turn "
          "| GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for where, count in (("cache", DECODE_BLOCK_N), ("memory", KEYS)):
            ns = phase_times(dtype, count, args.rounds)
            parts = ns["scores"] + ns["softmax"] + ns["P V"]
            rate = 2 * HEAD_DIM * dtype.itemsize / ns["all three"]
            cells = (ns["scores"], ns["softmax"], ns["P V"], parts, ns["all three"], rate)
            print(f"| {str(dtype)[6:]} | {where} | " + " | ".join(f"{x:.1f}" for x in cells) + " |")


if __name__ == "__main__":
    main()
