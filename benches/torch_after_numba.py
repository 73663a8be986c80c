"""Does torch's own SDPA slow down after numba ran in the same process? (thread pools)

    python benches/torch_after_numba.py

Two fresh processes: one runs a numba forward+backward between blocks of timed SDPA calls,
the control runs SDPA's own forward+backward there instead. Each prints the medians of SDPA's
time (L = 1024, fp32) before and after each block, and the ratio after/before.
"""

import statistics
import subprocess
import sys
import time

import torch

import attnperf


def sdpa_ms(q: torch.Tensor, calls: int = 15) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        attnperf.attention(q, q, q, backend="sdpa")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def probe(between: str) -> None:
    q = torch.randn(1, 8, 1024, 64)
    x = torch.randn(1, 8, 1024, 64, requires_grad=True)
    sdpa_ms(q)
    before, after = [], []
    for _ in range(6):
        before.append(sdpa_ms(q))
        attnperf.attention(x, x, x, backend=between).sum().backward()
        after.append(sdpa_ms(q))
    ratio = statistics.median(after) / statistics.median(before)
    print(
        f"{between:>5} between: sdpa ms before {[round(t, 1) for t in before]}, "
        f"after {[round(t, 1) for t in after]}: after/before {ratio:.3f}"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        probe(sys.argv[1])
    else:
        for between in ("numba", "sdpa"):
            subprocess.run([sys.executable, __file__, between], check=True)
