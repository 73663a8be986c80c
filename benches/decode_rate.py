"""The decoding step's own rate, memory set aside: numba's `attention_with_kvcache` on one
thread with the cache in L2/L3, in nanoseconds a (key, kv head), from the difference of
two cache lengths (the call's fixed costs cancel).

One token, B = 1, a row-major (B, S, H, E) cache of 32/8 heads, E = 128 (4 query rows a kv
head), fp32 and bf16. Where a machine's memory speed moves between runs, as a VM's does,
this is the figure a change to the step's tiles moves; its bandwidth share is not.

    python benches/decode_rate.py [--lengths 192 960]
"""

import argparse

import torch
from decode_steps import HEAD_DIM, cache, median_us  # benches/, the script's own folder

import attnperf
from attnperf.machine import cpu_description

Q_HEADS, KV_HEADS = 32, 8


def step_s(keys: int, dtype: torch.dtype) -> float:
    """Median seconds of one step over a full row-major cache of `keys` keys."""
    k_cache, v_cache = (cache(KV_HEADS, keys, False, dtype) for _ in range(2))
    q = torch.randn(1, 1, Q_HEADS, HEAD_DIM, dtype=dtype)

    def step():
        return attnperf.attention_with_kvcache(q, k_cache, v_cache, keys, backend="numba")

    return median_us(step, 200) / 1e6


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
