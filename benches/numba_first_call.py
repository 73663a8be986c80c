"""First-call time of the numba backend in a fresh process, with a cold and a warm disk cache.

    python benches/numba_first_call.py

Each run is a new Python process whose NUMBA_CACHE_DIR is one temporary folder: the first
process compiles (cold), the second loads what the first cached (warm). Whether torch's
own ops slow down after numba ran is benches/torch_after_numba.py's question.
"""

import os
import subprocess
import sys
import tempfile

PROBE = r"""
import time, torch
import attnperf

q, k, v = (torch.randn(1, 8, 256, 64, requires_grad=True) for _ in range(3))
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba")
forward = time.perf_counter() - start
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba").sum().backward()
backward = time.perf_counter() - start
print(f"{forward:.2f} {backward:.2f}")
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold cache", "warm cache"):
            out = subprocess.run(
                [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
            ).stdout.split()
            forward, backward = (float(x) for x in out)
            print(
                f"{label}: first forward call {forward:.2f} s, "
                f"then first forward+backward {backward:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
