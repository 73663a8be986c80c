"""numba's linear attention, forward+backward, with the forward keeping each chunk's start
state (and the delta rule's WY results) for the backward, against the backward recomputing
them (KEPT_MAX_BYTES = 0, fla's way).

    python benches/linear_kept.py [--steps 2048] [--rounds 5]

Qwen3-Next's heads (16 key heads, 32 value heads, K = V = 128), B = 1, fp32, q and k
l2-normalised. One process, the two ways taking turns round by round; medians.
"""

import argparse
import statistics
import time

import torch

import attnperf.kernels.numba.linear as numba_linear
from attnperf.bench.linear import LinearCall
from attnperf.machine import cpu_description

WAYS = {"kept": numba_linear.KEPT_MAX_BYTES, "recomputed": 0}


def timed(call, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads, fp32, "
          f"T = {args.steps}")  # fmt: skip
    for rule in ("additive", "gated delta"):
        call = LinearCall("numba", rule, args.steps, backward=True)()
        call()  # compiles
        times = {way: [] for way in WAYS}
        for round_ in range(args.rounds):
            for way in list(WAYS)[:: 1 if round_ % 2 == 0 else -1]:
                numba_linear.KEPT_MAX_BYTES = WAYS[way]
                times[way] += timed(call, 3)
        numba_linear.KEPT_MAX_BYTES = WAYS["kept"]
        kept, recomputed = (statistics.median(times[way]) for way in WAYS)
        print(f"{rule}: forward+backward {kept * 1e3:.0f} ms kept, {recomputed * 1e3:.0f} ms "
              f"recomputed: {recomputed / kept:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
