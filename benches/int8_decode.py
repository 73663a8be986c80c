"""One decoding step over an int8 KV cache against the same step over fp32 and bf16 caches,
each contender in its own worker process, taking turns; and the int8 cache's error.

    python benches/int8_decode.py                        # S = 16k and 64k, 5 rounds
    python benches/int8_decode.py --lengths 16384 --rounds 9

B = 1, Llama-3-8B's heads (32 query heads over 8 key/value heads, E = 128), one fp32 query
token. Contenders: numba over an int8 cache (quantize_kv's codes, one scale per row, and
groups of 32), numba over the fp32 cache, and SDPA over fp32 and bf16 caches with the
group's query heads packed as the rows of their key/value head (the careful form, no
mask). Each gets its median time, the bytes it must read per second (int8: codes and their
float32 scales) and that rate's share of the same run's read bandwidth; ratios are the
peer's time over numba int8's (> 1: int8 faster).

The accuracy report (information, not a bar): the attention output over the int8 cache
against the output over the fp32 cache it was quantized from, on keys shaped like a real
model's (a few outlier channels 10-20x the rest, as LLM keys have) and normal values: the
max and mean, over query rows, of ||out_int8 - out_fp32|| / ||out_fp32||, for each G.
"""

from __future__ import annotations

import argparse

import torch

import attnperf
from attnperf.bench.serving import (
    DECODE_HEAD_DIM,
    DECODE_HEADS,
    DECODE_KV_HEADS,
    DecodeCall,
    Int8DecodeCall,
    SdpaDecodeCall,
    ServingConfig,
    race,
    read_bandwidth,
)
from attnperf.machine import cpu_description

SHAPE = (DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM)


def bytes_read(length: int, kind: str) -> int:
    """K and V bytes a step reads at B = 1: int8 codes (+ float32 scales per group of G),
    bf16 or fp32 values."""
    values = 2 * length * DECODE_KV_HEADS * DECODE_HEAD_DIM
    if kind.startswith("int8"):
        group = DECODE_HEAD_DIM if kind == "int8" else int(kind.split("G=")[1])
        return values + 4 * values // group
    return values * (2 if kind == "bf16" else 4)


def accuracy(length: int, groups: list[int]) -> list[tuple[int, float, float]]:
    """(G, max, mean relative error of the output rows) of int8 caches against fp32."""
    gen = torch.Generator().manual_seed(3)
    channel_scale = torch.ones(DECODE_HEAD_DIM)
    outliers = torch.randperm(DECODE_HEAD_DIM, generator=gen)[:4]
    channel_scale[outliers] = 10 + 10 * torch.rand(4, generator=gen)
    k = torch.randn(1, length, DECODE_KV_HEADS, DECODE_HEAD_DIM, generator=gen) * channel_scale
    v = torch.randn(1, length, DECODE_KV_HEADS, DECODE_HEAD_DIM, generator=gen)
    q = torch.randn(1, 4, DECODE_HEADS, DECODE_HEAD_DIM, generator=gen)
    exact = attnperf.attention_with_kvcache(q, k, v, length, backend="numba")
    rows = []
    for group in groups:
        (k8, ks), (v8, vs) = (attnperf.quantize_kv(t, group_size=group) for t in (k, v))
        out = attnperf.attention_with_kvcache(q, k8, v8, length, k_scale=ks, v_scale=vs,
                                              backend="numba")  # fmt: skip
        error = (out - exact).norm(dim=-1) / exact.norm(dim=-1)
        rows.append((group, float(error.max()), float(error.mean())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = ServingConfig(rounds=args.rounds)
    _, bandwidth = read_bandwidth(config)
    cpu = cpu_description()
    print(f"decode step, B = 1, {DECODE_HEADS}/{DECODE_KV_HEADS} heads, E = {DECODE_HEAD_DIM}, "
          f"fp32 query, {config.threads} threads, cpu {cpu['cpu_model']} ({cpu['vector_isa']}); "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; medians of {args.rounds} "
          "rounds")  # fmt: skip
    for length in args.lengths:
        calls = {
            "int8": Int8DecodeCall(1, length, *SHAPE),
            "int8 G=32": Int8DecodeCall(1, length, *SHAPE, group_size=32),
            "fp32": DecodeCall("numba", 1, length, *SHAPE),
            "sdpa rows fp32": SdpaDecodeCall("rows", 1, length, *SHAPE),
            "sdpa rows bf16": SdpaDecodeCall("rows", 1, length, *SHAPE, dtype=torch.bfloat16),
        }
        timed = race(config, calls)
        int8 = timed["int8"].median_s
        print(f"  S = {length}:")
        for label, result in timed.items():
            kind = label.removeprefix("sdpa rows ")
            rate = bytes_read(length, kind) / result.median_s
            who = label if label.startswith("sdpa") else f"numba {label}"
            ratio = result.median_s / int8
            print(f"    {who:16s} {result.median_s * 1e3:7.2f} ms  {rate / 1e9:5.1f} GB/s "
                  f"({rate / bandwidth:4.0%} of read)  {ratio:5.2f}x int8's")  # fmt: skip
        per_row, grouped = int8, timed["int8 G=32"].median_s
        print(f"    G = 32 takes {grouped / per_row:.2f}x the per-row step's time")
    print("  int8 against fp32, relative error of the output rows (keys with outlier channels):")
    for group, worst, mean in accuracy(4096, [DECODE_HEAD_DIM, 64, 32, 16]):
        print(f"    G = {group:3d}: max {worst:.2e}, mean {mean:.2e}")


if __name__ == "__main__":
    main()
