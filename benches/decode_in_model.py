"""A decoding step's attention as a model's generate meets it: through the transformers
integration (`attention_forward`, backend "auto", the registered default, and "numba")
against transformers' own
`sdpa_attention_forward`, on a cache that grows by a row each step (DynamicCache's
torch.cat) with an MLP-sized matmul between steps, whose data evict the interpreter's and
torch's from the caches as a layer's weights do. `decode_steps.py` times the same step back
to back, where Python costs 2-4x less.

A Llama-like layer's attention (8/2 heads, E = 128, B = 1, one token), from `--keys`
cached keys on, 32 steps a round, the three taking turns; prints each one's median
microseconds a step over `--rounds` rounds and SDPA's time over attnperf's (> 1: attnperf
faster). Without an `attnperf tune` table, "auto" serves these steps with SDPA; with one,
by its decode rule for the dtype (printed: what "auto" follows).

    python benches/decode_in_model.py [--keys 2048] [--dtype bfloat16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from attnperf import cpu_table
from attnperf.integrations.transformers import attention_forward
from attnperf.machine import cpu_description

Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, STEPS = 8, 2, 128, 1024, 2816, 32


class Layer(torch.nn.Module):
    """What transformers' attention functions read of their module."""

    is_causal = True
    num_key_value_groups = Q_HEADS // KV_HEADS


def round_us(attend, keys: int, dtype: torch.dtype) -> float:
    """Median microseconds of `attend`'s steps over a cache growing from `keys` rows."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, Q_HEADS, 1, HEAD_DIM, dtype=dtype, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, keys, HEAD_DIM, dtype=dtype, generator=generator)
            for _ in range(2))  # fmt: skip
    row = torch.randn(1, KV_HEADS, 1, HEAD_DIM, dtype=dtype, generator=generator)
    x = torch.randn(1, HIDDEN, dtype=dtype, generator=generator)
    weights = torch.randn(HIDDEN, INTERMEDIATE, dtype=dtype, generator=generator)
    layer, times = Layer(), []
    for _ in range(STEPS):
        k, v = torch.cat([k, row], dim=2), torch.cat([v, row], dim=2)
        x @ weights
        start = time.perf_counter()
        attend(layer, q, k, v, None, scaling=HEAD_DIM**-0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    calls = {
        "sdpa": sdpa_attention_forward,
        "auto": lambda *a, **kw: attention_forward(*a, backend="auto", **kw),
        "numba": lambda *a, **kw: attention_forward(*a, backend="numba", **kw),
    }
    for attend in calls.values():  # compiled, warm
        round_us(attend, args.keys, dtype)
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, attend in calls.items():
            times[name].append(round_us(attend, args.keys, dtype))
    sdpa, auto, numba = (statistics.median(times[name]) for name in calls)
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']}, {torch.get_num_threads()} threads; {args.dtype}, "
          f"{Q_HEADS}/{KV_HEADS} heads, E = {HEAD_DIM}, from {args.keys} keys: "
          f"transformers' sdpa {sdpa:.1f} us a step; attnperf \"auto\" {auto:.1f} us, "
          f"{sdpa / auto:.2f}x; attnperf numba {numba:.1f} us, {sdpa / numba:.2f}x")  # fmt: skip
    print(f'"auto" follows: {cpu_table.active_rules()[1]}')


if __name__ == "__main__":
    main()
