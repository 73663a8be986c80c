"""One decoding step alone: `attention_with_kvcache` (numba) against SDPA with the query
heads of each group packed as rows, in one process, where a step's per-call costs show.

One token, B = 1, E = 128, fp32 and bf16 caches: transformers' layout (a (B, H, S, E)
cache, 8/2 heads, as a Llama-like model's generate passes it) at S = 256 and 2048, and a
row-major (B, S, H, E) cache of 32/8 heads at S = 512 and 16384. Prints the median of 7
blocks of calls of each, and SDPA's time over numba's (> 1: numba faster).

    python benches/decode_steps.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

import attnperf
from attnperf.machine import cpu_description

# (query heads, kv heads, keys, transformers' head-major cache)
STEPS = ((8, 2, 256, True), (8, 2, 2048, True), (32, 8, 512, False), (32, 8, 16384, False))
HEAD_DIM = 128


def median_us(call, repeats: int) -> float:
    for _ in range(20):
        call()
    blocks = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        blocks.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(blocks)


def cache(heads: int, keys: int, head_major: bool, dtype: torch.dtype) -> torch.Tensor:
    """A full (B, S, H, E) cache, a view of a (B, H, S, E) one where head-major."""
    if head_major:
        return torch.randn(1, heads, keys, HEAD_DIM, dtype=dtype).transpose(1, 2)
    return torch.randn(1, keys, heads, HEAD_DIM, dtype=dtype)


def step_times(q_heads, kv_heads, keys, head_major, dtype) -> tuple[float, float]:
    """Median microseconds of numba's step and of SDPA with the group packed as rows."""
    k_cache, v_cache = (cache(kv_heads, keys, head_major, dtype) for _ in range(2))
    q = torch.randn(1, 1, q_heads, HEAD_DIM, dtype=dtype)
    rows = q.view(1, kv_heads, q_heads // kv_heads, HEAD_DIM)
    k, v = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    repeats = 300 if keys < 4096 else 40
    numba = median_us(
        lambda: attnperf.attention_with_kvcache(q, k_cache, v_cache, keys, backend="numba"),
        repeats,
    )
    return numba, median_us(lambda: F.scaled_dot_product_attention(rows, k, v), repeats)


def main() -> None:
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']}, {torch.get_num_threads()} threads; one token, E = {HEAD_DIM}")
    for dtype in (torch.float32, torch.bfloat16):
        for q_heads, kv_heads, keys, head_major in STEPS:
            numba, sdpa = step_times(q_heads, kv_heads, keys, head_major, dtype)
            layout = "(B, H, S, E)" if head_major else "(B, S, H, E)"
            print(f"{str(dtype)[6:]:8s} {q_heads}/{kv_heads} heads S = {keys:5d} {layout}: "
                  f"numba {numba:7.1f} us, sdpa packed as rows {sdpa:7.1f} us, "
                  f"{sdpa / numba:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
