"""Short attention calls, numba against SDPA in one process, turns interleaved: where
per-call costs (validation, dispatch, packing, waking threads) weigh against the tiles.

Forward, no mask, E = 64, fp32 and bf16, at the shapes of issue #26: BERT-base (B = 32,
H = 12, L = 128), B = 8, H = 12, L = 512, and B = 1, H = 8, L = 64 and 256; and BERT-base
at L = 112 (a length not a multiple of 64: the softmax's vector loops take 64 columns a
step). Each round
times a block of ~20 ms of SDPA calls, then one of numba's; prints the median time of each
and the median of the rounds' ratios with its interquartile range (> 1: numba faster).

    python benches/short_calls.py [--rounds 11] [--dtypes float32 bfloat16]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnperf
from attnperf.machine import cpu_description

SHAPES = ((32, 12, 128, 64), (8, 12, 512, 64), (1, 8, 64, 64), (1, 8, 256, 64), (32, 12, 112, 64))


def block_time(call, repeats: int) -> float:
    """Seconds per call over `repeats` calls back to back."""
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def take_turns(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each named call, one block of ~20 ms of the first call's length
    per round, the calls taking turns in each round."""
    for call in calls.values():  # compiled, warm
        call()
    repeats = max(1, int(0.02 / block_time(next(iter(calls.values())), 3)))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(block_time(call, repeats))
    return times


def race(q, k, v, rounds: int) -> tuple[float, float, list[float]]:
    """(SDPA's median seconds, numba's, the sorted ratios SDPA / numba of the rounds)."""
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "numba": lambda: attnperf.attention(q, k, v, backend="numba"),
    }
    times = take_turns(calls, rounds)
    ratios = sorted(s / n for s, n in zip(times["sdpa"], times["numba"], strict=True))
    return statistics.median(times["sdpa"]), statistics.median(times["numba"]), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads; "
          f"forward, E = 64; medians of {args.rounds} rounds")  # fmt: skip
    torch.manual_seed(0)
    for dtype in args.dtypes:
        for shape in SHAPES:
            q, k, v = (torch.randn(shape, dtype=getattr(torch, dtype)) for _ in range(3))
            sdpa, numba, ratios = race(q, k, v, args.rounds)
            low, _, high = statistics.quantiles(ratios, n=4)
            print(f"{dtype:8s} B={shape[0]:2d} H={shape[1]:2d} L={shape[2]:3d}: sdpa "
                  f"{1e3 * sdpa:7.3f} ms, numba {1e3 * numba:7.3f} ms, numba / sdpa "
                  f"{statistics.median(ratios):.2f}x [{low:.2f}-{high:.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
