"""What `attnperf.attention` adds to the call it dispatches to: the drop-in against torch's
own SDPA, turns interleaved in one process.

Forward, no mask, fp32, E = 64, at short calls (where per-call costs show): B = 1, H = 8,
L = 64 and 256, and B = 32, H = 12, L = 128. Each round times a block of ~20 ms of calls
of each form; prints the median time of each and what attnperf adds to SDPA's call, for
backend="auto" (validation, the "auto" walk, the backend's own steps) and backend="sdpa".
Then the call's validation (`prepare`) alone: back to back, and right after an SDPA call
(whose data then fills the caches, and whose OpenMP workers may still be spinning).

    python benches/dispatch_overhead.py [--rounds 11]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from short_calls import take_turns  # benches/, the script's own folder

import attnperf
from attnperf.inputs import prepare
from attnperf.machine import cpu_description

SHAPES = ((1, 8, 64, 64), (1, 8, 256, 64), (32, 12, 128, 64))


def medians(q, k, v, rounds: int) -> dict[str, float]:
    """Median seconds a call of SDPA itself, of attnperf "auto" and of backend="sdpa"."""
    calls = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "auto": lambda: attnperf.attention(q, k, v),
        "sdpa": lambda: attnperf.attention(q, k, v, backend="sdpa"),
    }
    return {name: statistics.median(t) for name, t in take_turns(calls, rounds).items()}


def validation_times(q, k, v, rounds: int) -> tuple[float, float]:
    """Median seconds of `prepare` back to back, and right after an SDPA call."""
    warm, after = [], []
    for _ in range(rounds * 20):
        start = time.perf_counter()
        prepare(q, k, v)
        warm.append(time.perf_counter() - start)
        F.scaled_dot_product_attention(q, k, v)
        start = time.perf_counter()
        prepare(q, k, v)
        after.append(time.perf_counter() - start)
    return statistics.median(warm), statistics.median(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads; "
          f"forward, fp32, E = 64; medians of {args.rounds} rounds")  # fmt: skip
    torch.manual_seed(0)
    for shape in SHAPES:
        q, k, v = (torch.randn(shape) for _ in range(3))
        median = medians(q, k, v, args.rounds)
        sdpa, chosen = median["F.sdpa"], attnperf.choose_backend(q, k, v)
        print(f"B={shape[0]:2d} H={shape[1]:2d} L={shape[2]:3d}: F.sdpa {1e6 * sdpa:8.1f} us; "
              f"attnperf auto ({chosen}) {1e6 * (median['auto'] - sdpa):+7.1f} us, "
              f"backend='sdpa' {1e6 * (median['sdpa'] - sdpa):+7.1f} us")  # fmt: skip
        warm, after = validation_times(q, k, v, args.rounds)
        print(f"  its validation alone: {1e6 * warm:.1f} us back to back, {1e6 * after:.1f} us "
              "right after an SDPA call")  # fmt: skip


if __name__ == "__main__":
    main()
