"""First-call time of the numba backend in a fresh process, with a cold and a warm disk cache.

    python benches/numba_first_call.py [--dtype float32 bfloat16]

Each run is a new Python process whose NUMBA_CACHE_DIR is one temporary folder: the first
process compiles (cold), the second loads what the first cached (warm). The call is the
one a user makes first: B = 1, H = 8, L = 1024, E = 64, a forward, then a forward+backward.
Whether torch's own ops slow down after numba ran is benches/torch_after_numba.py's question.
"""

import argparse
import os
import subprocess
import sys
import tempfile

PROBE = r"""
import sys, time, torch
import attnperf

dtype = getattr(torch, sys.argv[1])
q, k, v = (torch.randn(1, 8, 1024, 64, dtype=dtype, requires_grad=True) for _ in range(3))
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba")
forward = time.perf_counter() - start
start = time.perf_counter()
attnperf.attention(q, k, v, backend="numba").sum().backward()
backward = time.perf_counter() - start
print(f"{forward:.2f} {backward:.2f}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    for dtype in args.dtype:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            for label in ("cold cache", "warm cache"):
                command = [sys.executable, "-c", PROBE, dtype]
                run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                out = run.stdout.split()
                forward, backward = (float(x) for x in out)
                print(f"{dtype}, {label}: first forward call {forward:.2f} s, then the first "
                      f"forward+backward {backward:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
