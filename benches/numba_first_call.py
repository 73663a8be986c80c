"""First-call time of the numba backend in a fresh process, with a cold and a warm disk cache.

    python benches/numba_first_call.py

Each run is a new Python process whose NUMBA_CACHE_DIR is one temporary folder: the first
process compiles (cold), the second loads what the first cached (warm). It also checks
that torch's own SDPA is not slower after numba ran in the same process (thread pools).
"""

import os
import subprocess
import sys
import tempfile

PROBE = r"""
import time, statistics, torch
import attnperf

def sdpa_ms():
    q = torch.randn(1, 8, 1024, 64)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        attnperf.attention(q, q, q, backend="sdpa")
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3

before = sdpa_ms()
q, k, v = (torch.randn(1, 8, 256, 64, requires_grad=True) for _ in range(3))
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba")
forward = time.perf_counter() - start
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba").sum().backward()
backward = time.perf_counter() - start
after = sdpa_ms()
print(f"{forward:.2f} {backward:.2f} {before:.2f} {after:.2f}")
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold cache", "warm cache"):
            out = subprocess.run(
                [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
            ).stdout.split()
            forward, backward, before, after = (float(x) for x in out)
            print(
                f"{label}: first forward call {forward:.2f} s, then first forward+backward "
                f"{backward:.2f} s; torch sdpa L=1024 before numba {before:.1f} ms, "
                f"after {after:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
