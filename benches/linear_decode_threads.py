"""numba's linear-attention decoding step (the gated delta rule, Qwen3-Next's heads, a new
state each step) on the calling thread against numba's threads, per batch size: where
attnperf.kernels.numba.linear.PARALLEL_MIN_BYTES sits.

    python benches/linear_decode_threads.py [--batches 1 2 4 8] [--rounds 5]

One process, the two ways taking turns round by round; medians of 10-step turns.
"""

import argparse
import statistics
import time

import torch

import attnperf.kernels.numba.linear as numba_linear
from attnperf.bench.linear import STEPS_PER_TURN, DecodeStep
from attnperf.machine import cpu_description

WAYS = {"calling thread": 1 << 62, "numba's threads": 0}  # PARALLEL_MIN_BYTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads, fp32")
    chosen = numba_linear.PARALLEL_MIN_BYTES
    for batch in args.batches:
        steps = DecodeStep("numba", batch)()
        steps()  # compiles
        times = {way: [] for way in WAYS}
        for round_ in range(args.rounds):
            for way in list(WAYS)[:: 1 if round_ % 2 == 0 else -1]:
                numba_linear.PARALLEL_MIN_BYTES = WAYS[way]
                for _ in range(3):
                    start = time.perf_counter()
                    steps()
                    times[way].append((time.perf_counter() - start) / STEPS_PER_TURN)
        numba_linear.PARALLEL_MIN_BYTES = chosen
        serial, parallel = (statistics.median(times[way]) * 1e3 for way in WAYS)
        state_mib = batch * 32 * 128 * 128 * 4 / 2**20
        print(f"B = {batch} ({state_mib:.0f} MiB state): {serial:.2f} ms on the calling thread, "
              f"{parallel:.2f} ms on numba's threads")  # fmt: skip


if __name__ == "__main__":
    main()
