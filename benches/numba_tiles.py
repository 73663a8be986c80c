"""Numba tile sizes against the default 128 x 512, same process, turns interleaved.

fp32, B=1, H=8, E=64, L = S = 2048; forward and forward+backward, full and causal; prints
each tile's speed relative to 128 x 512 (median of 5 rounds). Run it under another ISA's
code paths with, e.g., `ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2,+fma python benches/numba_tiles.py` (under
a CPU name alone numba compiles for the host's features).
"""

import statistics
import time

import torch

import attnperf
from attnperf.kernels.numba import attention as numba_attention

TILES = [(128, 512), (64, 256), (128, 256), (64, 512), (256, 512)]


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 64, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 8, 2048, 64)

    def call(causal, backward):
        out = attnperf.attention(q, k, v, is_causal=causal, backend="numba")
        if backward:
            out.backward(grad_out)

    def timed(tile, causal, backward):
        numba_attention.BLOCK_M, numba_attention.BLOCK_N = tile
        start = time.perf_counter()
        call(causal, backward)
        return time.perf_counter() - start

    for causal in (False, True):
        for backward in (False, True):
            times = {tile: [] for tile in TILES}
            for tile in TILES:
                timed(tile, causal, backward)  # warm-up
            for _ in range(5):
                for tile in TILES:
                    times[tile].append(timed(tile, causal, backward))
            base = statistics.median(times[TILES[0]])
            ratios = (f"{m}x{n}: {base / statistics.median(times[m, n]):.2f}" for m, n in TILES)
            name = f"{'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}"
            print(f"{name:14s}", "  ".join(ratios))


if __name__ == "__main__":
    main()
