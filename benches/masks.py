"""attn_mask calls: numba against SDPA under the same mask, one process, turns interleaved.

Forward, 8/2 heads (GQA), E = 128, L = S = 2048 (`--length`), fp32 and bf16, the masks that
users and transformers pass: causal bool (transformers' sdpa mask), causal with batch 0's
first quarter of keys padded (bool, B = 2), causal -inf (float), causal finfo.min (float,
transformers' eager form), and a random bool mask (no 16 x 16 block open or shut: every
element read); numba's is_causal beside them. Each
round times a block of calls of each; prints the medians, SDPA's time over numba's (> 1:
numba faster) and numba's share of the chip's peak over the pairs that the mask lets
through (4 E FLOPs a pair and head). Then BERT-base's padding masks (B = 32, 12 heads,
L = 128, E = 64, sequences of 64-128 tokens, (B, 1, 1, S)), bool and `(1 - keep) *
finfo.min`, with numba unmasked beside them.

    python benches/masks.py [--length 2048] [--rounds 5] [--dtypes float32 bfloat16]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnperf
from attnperf.bench.serving import peak_kind, peak_rate
from attnperf.machine import cpu_description

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def masks(length: int, dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """Each mask by name (None: is_causal), (B, 1, L, S) or (L, S)."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    padded = causal.expand(2, 1, length, length).clone()
    padded[0, ..., : length // 4] = False
    zeros = torch.zeros(length, length, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    return {
        "is_causal": None,
        "causal bool": causal,
        "padded causal bool": padded,
        "causal -inf": zeros.masked_fill(~causal, float("-inf")),
        "causal finfo.min": zeros.masked_fill(~causal, torch.finfo(dtype).min),
        "random bool": torch.rand(length, length, generator=gen) > 0.5,
    }


def block_time(call, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def race(calls: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each named call, the calls taking turns in each round,
    each round a block of ~0.2 s of the first call's length."""
    for call in calls.values():  # compiled, warm
        call()
    repeats = max(1, int(0.2 / block_time(next(iter(calls.values())), 1)))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(block_time(call, repeats))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    threads = torch.get_num_threads()
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']} ({cpu['vector_isa']}), {threads} threads; forward, "
          f"{Q_HEADS}/{KV_HEADS} heads, E = {HEAD_DIM}, L = S = {args.length}; medians of "
          f"{args.rounds} rounds")  # fmt: skip
    for name in args.dtypes:
        dtype = getattr(torch, name)
        peak = peak_rate(name, threads)
        print(f"{name}: peak ({peak_kind(name)}) {peak / 1e9:.0f} GFLOP/s")
        for label, mask in masks(args.length, dtype).items():
            batch = 1 if mask is None or mask.dim() == 2 else mask.shape[0]
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, Q_HEADS, args.length, HEAD_DIM, generator=gen).to(dtype)
            k, v = (torch.randn(batch, KV_HEADS, args.length, HEAD_DIM, generator=gen).to(dtype)
                    for _ in range(2))  # fmt: skip
            kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
            times = race({
                "sdpa": lambda kw=kw, q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, enable_gqa=True, **kw),
                "numba": lambda kw=kw, q=q, k=k, v=v: attnperf.attention(
                    q, k, v, enable_gqa=True, backend="numba", **kw),
            }, args.rounds)  # fmt: skip
            pairs = batch * args.length * (args.length + 1) / 2
            if mask is not None:
                seen = mask if mask.dtype == torch.bool else mask == 0
                pairs = float(seen.expand(batch, 1, args.length, args.length).sum())
            flops = 4 * Q_HEADS * HEAD_DIM * pairs
            print(f"  {label:19s} sdpa {1e3 * times['sdpa']:8.2f} ms  numba "
                  f"{1e3 * times['numba']:8.2f} ms  numba / sdpa "
                  f"{times['sdpa'] / times['numba']:5.2f}x  numba of peak "
                  f"{100 * flops / times['numba'] / peak:4.1f}%")  # fmt: skip
        bert_padding(dtype, args.rounds)


def bert_padding(dtype: torch.dtype, rounds: int) -> None:
    """BERT-base's padding masks, every call taking turns."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(32, 12, 128, 64, generator=gen).to(dtype) for _ in range(3))
    keep = torch.arange(128)[None, :] < torch.randint(64, 129, (32,), generator=gen)[:, None]
    floor = (1.0 - keep.to(dtype)) * torch.finfo(dtype).min
    masks = {"bool": keep[:, None, None, :], "finfo.min": floor[:, None, None, :]}
    calls = {"numba unmasked": lambda: attnperf.attention(q, k, v, backend="numba")}
    for name, mask in masks.items():
        calls[f"sdpa {name}"] = lambda mask=mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask)  # fmt: skip
        calls[f"numba {name}"] = lambda mask=mask: attnperf.attention(
            q, k, v, attn_mask=mask, backend="numba")  # fmt: skip
    times = race(calls, rounds)
    ratios = ", ".join(f"{name} {times[f'sdpa {name}'] / times[f'numba {name}']:.2f}x"
                       for name in masks)  # fmt: skip
    medians = ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in times.items())
    print(f"  BERT-base padding: {medians}; numba / sdpa: {ratios}")


if __name__ == "__main__":
    main()
