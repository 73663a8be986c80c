"""The decoding step's own rate, memory set aside: numba's `attention_with_kvcache` on one
thread with the cache in L2/L3, in nanoseconds a (key, kv head), from the difference of
two cache lengths (the call's fixed costs cancel).

One token, B = 1, a row-major (B, S, H, E) cache of 32/8 heads, E = 128 (4 query rows a kv
head), fp32 and bf16. Where a machine's memory speed moves between runs, as a VM's does,
this is the figure a change to the step's tiles moves; its bandwidth share is not.

    python benches/decode_rate.py [--lengths 192 960]
"""

import argparse
import statistics
import time

import torch

import attnperf
from attnperf.machine import cpu_description

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def median_s(call, repeats: int = 200, blocks: int = 9) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def step_s(keys: int, dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k, v = (torch.randn(1, keys, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    return median_s(lambda: attnperf.attention_with_kvcache(q, k, v, keys, backend="numba"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=(192, 960))
    args = parser.parse_args()
    torch.set_num_threads(1)
    short, long = args.lengths
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']}, 1 thread; S = {short} and {long}, {Q_HEADS}/{KV_HEADS} "
          f"heads, E = {HEAD_DIM}")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        extra = step_s(long, dtype) - step_s(short, dtype)
        units = (long - short) * KV_HEADS
        read = 2 * units * HEAD_DIM * dtype.itemsize
        print(f"{str(dtype)[6:]:8s} {extra / units * 1e9:5.1f} ns a key and kv head "
              f"({read / extra / 1e9:.1f} GB/s of K and V)")  # fmt: skip


if __name__ == "__main__":
    main()
