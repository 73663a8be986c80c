"""pytest-benchmark suites: every available backend x L x causal x pass, grouped per length.

    pytest benches/ --benchmark-columns=median,iqr,rounds
    ATTNPERF_BENCH_LENGTHS=512,1024,2048,4096 pytest benches/ -k "numba or sdpa"

Backends share this process (pytest-benchmark's way); `attnperf bench` measures each in a
process of its own and is the report of record. Benchmarks never assert a time.
"""

import os

import pytest
import torch

import attnperf
from attnperf import dispatch
from attnperf.bench.sweep import BenchConfig, attention_flops
from attnperf.inputs import prepare

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [int(n) for n in os.environ.get("ATTNPERF_BENCH_LENGTHS", "256,512,1024,2048").split(",")]
CONFIG = BenchConfig(lengths=tuple(LENGTHS), device=DEVICE)
# Triton on CPU is its test interpreter: no timings there.
BACKENDS = [
    name
    for name, backend in dispatch.registry().items()
    if backend.unavailable_reason() is None and DEVICE in backend.capabilities.devices
    and not (name == "triton" and DEVICE == "cpu")
]  # fmt: skip


@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("length", LENGTHS, ids=lambda n: f"L{n}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention(benchmark, backend, length, causal, pass_):
    shape = (CONFIG.batch, CONFIG.heads, length, CONFIG.head_dim)
    backward = pass_ == "forward+backward"
    q, k, v = (torch.randn(shape, device=DEVICE, requires_grad=backward) for _ in range(3))
    reasons = dispatch.registry()[backend].not_supported_reasons(prepare(q, k, v, is_causal=causal))
    if reasons:
        pytest.skip("not supported: " + "; ".join(reasons))
    grad_out = torch.randn(shape, device=DEVICE)

    def call():
        out = attnperf.attention(q, k, v, is_causal=causal, backend=backend)
        if backward:
            q.grad = k.grad = v.grad = None
            out.backward(grad_out)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"{pass_} {'causal' if causal else 'full'} L={length}"
    benchmark.pedantic(call, rounds=5, warmup_rounds=1)
    flops = attention_flops(CONFIG, length, causal, pass_)
    benchmark.extra_info.update(
        backend=backend, length=length, causal=causal, pass_=pass_, dtype="float32",
        shape=list(shape), flops=flops, gflops=flops / benchmark.stats.stats.median / 1e9,
    )  # fmt: skip
