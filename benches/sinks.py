"""Attention with sinks at gpt-oss-20b's attention shape, one layer, in one process, the
contenders taking turns round by round.

    python benches/sinks.py                      # L = 4096, full causal and window 128
    python benches/sinks.py --length 2048 --rounds 5 --pass forward+backward
    python benches/sinks.py --no-peers --rounds 9      # numba with and without sinks only

64 query heads over 8 key/value heads, E = 64, fp32, batch 1, causal; the sinks (64,) as
gpt-oss has them. Contenders:
- eager: transformers' `eager_attention_forward` of gpt-oss (its only CPU path: the L x S
  scores in the model dtype, the sink as a concatenated column, the mask materialised);
- sdpa+column: SDPA given the sink as an extra key column (a zero key and value, the sink as
  that column's float mask, the causal or window mask materialised): attnperf's sdpa
  backend, the form a careful SDPA user writes;
- numba: attnperf's fused kernel with the sinks, and the same call without them (what the
  sinks cost).
Each time is the median of `--rounds` rounds after a warm-up; ratios are the peer's time over
numba's (> 1: numba faster); GFLOP/s counts 4 L S E per head (half of it causal, the band's
pairs with a window) as a share of the same run's sgemm (torch.mm 2048^3).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

import attnperf
from attnperf.machine import cpu_description

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64


def eager_call(q, k, v, sinks, mask):
    """transformers' gpt-oss eager attention, as the model calls it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    return lambda: eager_attention_forward(module, q, k, v, mask, scaling=HEAD_DIM**-0.5)[0]


def additive_mask(length: int, window: int | None) -> torch.Tensor:
    """transformers' eager mask: 0 where a query sees a key, -inf elsewhere (1, 1, L, L)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]


def contenders(q, k, v, sinks, window: int | None, backward: bool, peers: bool) -> dict:
    band = {"window": (window - 1, 0)} if window else {}
    calls = {
        "eager": eager_call(q, k, v, sinks, additive_mask(q.shape[2], window)),
        "sdpa+column": lambda: attnperf.attention(
            q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, backend="sdpa", **band
        ),
        "numba": lambda: attnperf.attention(
            q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, backend="numba", **band
        ),
        "numba, no sinks": lambda: attnperf.attention(
            q, k, v, is_causal=True, enable_gqa=True, backend="numba", **band
        ),
    }
    if not peers:
        calls = {name: call for name, call in calls.items() if name.startswith("numba")}
    if not backward:
        return {name: _no_grad(call) for name, call in calls.items()}
    grad = torch.randn(q.shape[0], HEADS, q.shape[2], HEAD_DIM)
    return {name: _with_backward(call, grad, (q, k, v, sinks)) for name, call in calls.items()}


def _no_grad(call):
    def run():
        with torch.no_grad():
            call()

    return run


def _with_backward(call, grad, leaves):
    def run():
        torch.autograd.grad(call(), leaves, grad)

    return run


def sgemm_gflops(rounds: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def attention_flops(length: int, window: int | None, backward: bool) -> float:
    """4 L S E per head, over the pairs causality and the window leave (x 3.5 with the
    backward)."""
    pairs = length * (length + 1) / 2
    if window:
        pairs = sum(min(i + 1, window) for i in range(length))
    return 4 * pairs * HEAD_DIM * HEADS * (3.5 if backward else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 128],
                        help="0: full causal; W: a sliding window of W keys")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pass", dest="which", choices=["forward", "forward+backward"],
                        default="forward")  # fmt: skip
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                        help="time eager and sdpa+column too (else numba alone)")  # fmt: skip
    args = parser.parse_args()
    backward = args.which == "forward+backward"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, args.length, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, args.length, HEAD_DIM, generator=gen) for _ in range(2))
    sinks = torch.randn(HEADS, generator=gen)
    if backward:
        q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    cpu = cpu_description()
    sgemm = sgemm_gflops(5)
    print(f"gpt-oss-20b attention ({HEADS}/{KV_HEADS} heads, E = {HEAD_DIM}), L = {args.length}, "
          f"fp32, {args.which}, {torch.get_num_threads()} threads, cpu {cpu['cpu_model']} "
          f"({cpu['vector_isa']}), sgemm {sgemm:.0f} GFLOP/s; medians of {args.rounds} "
          "rounds")  # fmt: skip
    for window in args.windows:
        calls = contenders(q, k, v, sinks, window or None, backward, args.peers)
        times = {name: [] for name in calls}
        for round_ in range(args.rounds + 1):  # round 0: warm-up (JIT, allocator)
            for name in calls if round_ % 2 else reversed(list(calls)):
                start = time.perf_counter()
                calls[name]()
                if round_:
                    times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        flops = attention_flops(args.length, window or None, backward)
        print(f"  {'full causal' if not window else f'window {window}'}:")
        numba = medians["numba"]
        for name, seconds in medians.items():
            rate = flops / seconds / 1e9
            print(f"    {name:16s} {seconds * 1e3:9.1f} ms  {rate:6.1f} GFLOP/s "
                  f"({rate / sgemm:4.0%} of sgemm)  {seconds / numba:6.2f}x numba's")  # fmt: skip
        print(f"    the sinks cost {numba / medians['numba, no sinks']:.3f}x the call without")


if __name__ == "__main__":
    main()
