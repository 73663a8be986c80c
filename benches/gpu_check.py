"""GPU check of the triton backend: agreement on a reduced grid, then speed against SDPA.

On a machine with an NVIDIA GPU:

    python benches/gpu_check.py --csv gpu_check.csv [--stages agreement dense ...]

Warm-up processes (`--jobs`, `--warm-up-limit` seconds) first compile the kernels every
stage calls, in parallel (one process took ~17 s per agreement case on an H200: Triton
compiling, then tuning, each kernel variant's autotune configs one at a time), and check
the agreement cases among them; the timed run then times the other stages.

For every dtype (bf16, fp16), head dim (64, 128), L = S in 1k..16k, causal or not, and pass
(forward, forward+backward) with B x H = 32, it times `triton` and each SDPA kernel that
accepts the call (flash, efficient, cudnn) with triton.testing.do_bench, and prints TFLOP/s
and triton's speed relative to each kernel (> 1: triton is faster). Variant rows (bf16,
E = 128, causal sliding window of 256 keys, alone and with softcap 50) time `triton`
against SDPA with the mask materialised once and FlexAttention compiled. Serving rows (bf16):
decode steps (one query token, Hq = 32 over H = 8, E = 128, B = 1 and 8, caches of 4k to
64k keys) of attention_with_kvcache against SDPA on the cache with the GQA group packed as
rows, with the bandwidth achieved;
a packed causal batch of 16 sequences (512..8192 tokens, seeded) through attention_varlen
against SDPA and triton on the padded batch under a padding mask. Linear-attention rows
(fp32, the gated delta rule with Qwen3-Next's heads, 16 key and 32 value heads of 128, B = 1,
T = 4k and 16k, forward and forward+backward): `linear_attention` on triton against fla's
`chunk_gated_delta_rule` where fla is installed and transformers' torch fallback where
transformers is, after an agreement check against the float64 recurrence; and scalar gates
with the additive rule (simple GLA, q and k at all 32 heads) against fla's
`chunk_simple_gla`. The calls stage says where a short call's time goes (host, GPU kernels,
synchronisations). Without a GPU, `TRITON_INTERPRET=1 python benches/gpu_check.py --tiny`
runs the same script end to end on CPU at tiny sizes (its timings mean nothing there).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import importlib.metadata
import itertools
import multiprocessing
import os
import pstats
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import attnperf
import attnperf.kernels.triton.linear as triton_linear
import attnperf.kernels.triton.variant as triton_variant
from attnperf.testing import (
    assert_agrees,
    assert_linear_agrees,
    float64_reference,
    linear_reference,
    same_precision_reference,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (index, count) in a warm-up process, which runs every count-th item of the stages untimed,
# filling Triton's and Inductor's on-disk caches; None in the timed run, which runs them all.
SHARD: tuple[int, int] | None = None
ITEMS = itertools.count()


def my_item() -> bool:
    """Whether this process runs the next agreement case or measurement."""
    item = next(ITEMS)
    return SHARD is None or item % SHARD[1] == SHARD[0]


def sdpa_kernels() -> dict:
    """SDPA restricted to one kernel each, by name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def only(kind):
        def run(q, k, v, is_causal):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

        return run

    return {
        "sdpa_flash": only(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": only(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_cudnn": only(SDPBackend.CUDNN_ATTENTION),
    }


def check_agreement(device: str, tiny: bool) -> int:
    """Forward and gradients of triton under the testing rule on a reduced grid."""
    failures = 0
    length, batch = (48, 1) if tiny else (1000, 2)  # ragged lengths on purpose
    layout = attnperf.block_mask(lambda b, h, i, j: (i // 64 + j // 48) % 3 != 0, None, None,
                                 length, length + 7, block_size=32)  # fmt: skip
    cases = [
        {"is_causal": False},
        {"is_causal": True},
        {"mask": True},
        {"gqa": True, "is_causal": True},
        {"is_causal": True, "variant": {"window": (100, 0), "align": "bottom_right"}},
        {"variant": {"softcap": 5.0, "alibi_slopes": torch.rand(4) / 4}},
        {"gqa": True, "variant": {"block_mask": layout, "window": (300, 40)}},
    ]
    for dtype_name, dtype in DTYPES.items():
        for head_dim in (64, 128):
            for case in cases:
                gen = torch.Generator().manual_seed(0)
                heads_kv = 2 if case.get("gqa") else 4
                q = torch.randn(batch, 4, length, head_dim, generator=gen)
                k = torch.randn(batch, heads_kv, length + 7, head_dim, generator=gen)
                v = torch.randn(batch, heads_kv, length + 7, head_dim, generator=gen)
                args = {
                    "query": q.to(device, dtype).requires_grad_(),
                    "key": k.to(device, dtype).requires_grad_(),
                    "value": v.to(device, dtype).requires_grad_(),
                    "is_causal": case.get("is_causal", False),
                    "enable_gqa": bool(case.get("gqa")),
                }
                if case.get("mask"):
                    args["attn_mask"] = torch.randn(length, length + 7, generator=gen).to(
                        device, dtype
                    )
                for name, value in case.get("variant", {}).items():
                    args[name] = value.to(device) if hasattr(value, "to") else value
                label = f"{dtype_name} E={head_dim} {', '.join(case)}"
                if not my_item():
                    continue
                try:
                    compare_all(args)
                    print(f"agree  {label}")
                except Exception as error:  # a launch that breaks fails its case alone
                    failures += 1
                    lines = str(error).splitlines() or [""]
                    print(f"FAIL   {label}: {type(error).__name__}: {lines[0][:300]}")
    return failures


def compare_all(args: dict) -> None:
    grad_out = torch.randn_like(args["query"]).detach()
    results = []
    for fn, cast in (
        (lambda **a: attnperf.attention(**a, backend="triton"), None),
        (float64_reference, torch.float64),
        (same_precision_reference, None),
    ):
        leaves = {
            n: args[n].detach().to(cast or args[n].dtype).requires_grad_()
            for n in ("query", "key", "value")
        }
        out = fn(**{**args, **leaves})
        out.backward(grad_out.to(out.dtype))
        results.append((out, *(leaves[n].grad for n in ("query", "key", "value"))))
    for what, actual, exact, baseline in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert_agrees(actual, exact, baseline, what=what)


def time_ms(fn, device: str) -> float | None:
    if SHARD is not None:  # warming up: compile and run once, time nothing
        fn()
        if device == "cuda":  # many processes share the GPU: keep to what each one holds
            torch.cuda.empty_cache()
        return None
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def benchmark(device: str, tiny: bool, rows: list[dict]) -> None:
    lengths = (64,) if tiny else (1024, 2048, 4096, 8192, 16384)
    contenders = {"triton": lambda q, k, v, is_causal: attnperf.attention(
        q, k, v, is_causal=is_causal, backend="triton")}  # fmt: skip
    if device == "cuda":
        contenders.update(sdpa_kernels())
    for dtype_name, dtype in DTYPES.items():
        for head_dim in (64, 128):
            batch, heads = (1, 2) if tiny else (2, 16)  # B x H = 32 on a GPU
            for length in lengths:
                for causal in (False, True):
                    shape = (batch, heads, length, head_dim)
                    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
                    grad_out = torch.randn_like(q)
                    flops = 4 * batch * heads * length * length * head_dim / (2 if causal else 1)
                    for pass_ in ("forward", "forward+backward"):
                        timings = {}
                        for name, fn in contenders.items():
                            timings[name] = measure(fn, q, k, v, causal, pass_, grad_out, device)
                        total_flops = flops * (3.5 if pass_ == "forward+backward" else 1)
                        report(rows, dtype_name, head_dim, length, causal, pass_, timings,
                               total_flops)  # fmt: skip


def variant_contenders(q, window: int, softcap: float | None, flex) -> dict:
    """Callables (q, k, v, causal) for a causal sliding window of `window` keys: triton,
    SDPA with the mask materialised once (what a user of SDPA does; SDPA has no softcap)
    and FlexAttention compiled (`flex`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attnperf.inputs import prepare
    from attnperf.kernels.sdpa import sdpa_mask

    variant = {"window": (window - 1, 0), "softcap": softcap}
    length = q.shape[-2]

    def sliding(b, h, i, j):
        return (j <= i) & (i - j < window)

    def cap(score, b, h, i, j):
        return softcap * torch.tanh(score / softcap)

    layout = create_block_mask(sliding, None, None, length, length, device=q.device)
    contenders = {
        "triton": lambda q, k, v, _: attnperf.attention(
            q, k, v, is_causal=True, backend="triton", **variant),
        "flex": lambda q, k, v, _: flex(
            q, k, v, score_mod=cap if softcap else None, block_mask=layout),
    }  # fmt: skip
    if softcap is None:
        inputs = prepare(q, q, q, is_causal=True, **variant)
        mask, _ = sdpa_mask(inputs)
        contenders["sdpa_mask"] = lambda q, k, v, _: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask
        )
    return contenders


def benchmark_variants(device: str, tiny: bool, rows: list[dict]) -> None:
    """triton against SDPA with the mask materialised and FlexAttention compiled: bf16,
    E = 128, a causal sliding window of 256 keys, alone and with softcap 50."""
    from torch.nn.attention.flex_attention import flex_attention

    window = 16 if tiny else 256
    lengths = (64,) if tiny else (1024, 4096, 16384)
    batch, heads, head_dim = (1, 2, 16) if tiny else (2, 16, 128)
    flex = torch.compile(flex_attention)
    for softcap in (None, 50.0):
        label = f"bf16-window{window}" + (f"-softcap{softcap:g}" if softcap else "")
        for length in lengths:
            shape = (batch, heads, length, head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
            grad_out = torch.randn_like(q)
            contenders = variant_contenders(q, window, softcap, flex)
            pairs = length * window - window * (window - 1) / 2
            flops = 4 * batch * heads * pairs * head_dim
            for pass_ in ("forward", "forward+backward"):
                timings = {name: measure(fn, q, k, v, True, pass_, grad_out, device)
                           for name, fn in contenders.items()}  # fmt: skip
                total = flops * (3.5 if pass_ == "forward+backward" else 1)
                report(rows, label, head_dim, length, True, pass_, timings, total)


def sdpa_decode(q, k_cache, v_cache):
    """A decoding step by SDPA as a careful user calls it: q (B, 1, Hq, E) with each kv head's
    group packed as its rows, (B, H, group, E), against the cache (B, S, H, E) seen as (B,
    H, S, E), no mask."""
    batch, dim = q.shape[0], q.shape[3]
    return F.scaled_dot_product_attention(
        q.reshape(batch, k_cache.shape[2], -1, dim), k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
    )  # fmt: skip


# num_splits tried beside the default at the serving stage's longest cache.
SPLIT_SWEEP = (8, 16, 32, 64)


def benchmark_serving(device: str, tiny: bool, rows: list[dict]) -> None:
    """Decode steps over a KV cache and a packed batch of variable lengths, bf16."""
    dtype = torch.bfloat16
    heads, kv_heads, head_dim = (4, 2, 16) if tiny else (32, 8, 128)
    for batch in (1,) if tiny else (1, 8):
        for length in (64,) if tiny else (4096, 16384, 65536):
            q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
            cache = [torch.randn(batch, length, kv_heads, head_dim, device=device, dtype=dtype)
                     for _ in range(2)]  # fmt: skip
            contenders = {
                "triton": lambda q, k, v, _, length=length: attnperf.attention_with_kvcache(
                    q, k, v, length, backend="triton"),
                "sdpa": lambda q, k, v, _: sdpa_decode(q, k, v),
            }  # fmt: skip
            # The longest cache also with more splits than the default's (enough programs
            # to fill the SMs twice: 320 at B = 8, which read at half SDPA's rate).
            for splits in SPLIT_SWEEP if length == (64 if tiny else 65536) else ():
                contenders[f"triton-splits{splits}"] = (
                    lambda q, k, v, _, length=length, splits=splits:
                    attnperf.attention_with_kvcache(q, k, v, length, num_splits=splits,
                                                    backend="triton")
                )  # fmt: skip
            timings = {name: measure(fn, q, *cache, False, "forward", None, device)
                       for name, fn in contenders.items()}  # fmt: skip
            read = 2 * cache[0].numel() * cache[0].element_size()
            label = f"bf16-decode-B{batch}"
            report(rows, label, head_dim, length, False, "forward", timings,
                   4 * batch * heads * length * head_dim)  # fmt: skip
            for name, ms in timings.items():
                if name.startswith("triton") and ms:
                    print(f"  {name} reads K and V at {read / ms / 1e6:.0f} GB/s")
    count, shortest, longest = (3, 16, 64) if tiny else (16, 512, 8192)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int().to(device)
    total, most = int(lengths.sum()), int(lengths.max())
    packed = [torch.randn(total, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
    padded = [torch.zeros(count, heads, most, head_dim, device=device, dtype=dtype)
              for _ in range(3)]  # fmt: skip
    positions = torch.arange(most, device=device)
    real = positions[None] < lengths.to(device)[:, None]
    mask = real[:, None, None, :] & (positions[None, :] <= positions[:, None])
    flops = 4 * heads * head_dim * float((lengths * lengths).sum()) / 2
    for pass_ in ("forward", "forward+backward"):
        timings = {"triton": measure(
            lambda q, k, v, _: attnperf.attention_varlen(q, k, v, cu, cu, most, most,
                                                         is_causal=True, backend="triton"),
            *packed, True, pass_, torch.randn_like(packed[0]), device)}  # fmt: skip
        for name in ("sdpa", "triton"):
            timings[f"{name}-padded"] = measure(
                lambda q, k, v, _, name=name: attnperf.attention(q, k, v, attn_mask=mask,
                                                                 backend=name),
                *padded, True, pass_, torch.randn_like(padded[0]), device,
            )  # fmt: skip
        report(rows, f"bf16-varlen{count}", head_dim, most, True, pass_, timings,
               flops * (3.5 if pass_ == "forward+backward" else 1))  # fmt: skip


def measure(fn, q, k, v, causal, pass_, grad_out, device) -> float | None:
    if not my_item():
        return None
    backward = pass_ == "forward+backward"
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))

    def call():
        out = fn(q, k, v, causal)
        if backward:
            out.backward(grad_out)

    try:
        return time_ms(call, device)
    except Exception as error:  # an SDPA kernel (or flex) that refuses this call
        if SHARD is None:  # the timed run says it once
            print(f"  skipped: {str(error).splitlines()[0][:100]}", file=sys.stderr)
        return None


def report(rows, dtype_name, head_dim, length, causal, pass_, timings, flops) -> None:
    if SHARD is not None:  # warming up: nothing was timed
        return
    triton_ms = timings["triton"]
    cells = []
    for name, ms in timings.items():
        tflops = flops / (ms * 1e-3) / 1e12 if ms else None
        ratio = ms / triton_ms if ms and triton_ms else None
        rows.append({
            "dtype": dtype_name, "head_dim": head_dim, "L": length, "causal": causal,
            "pass": pass_, "kernel": name, "ms": ms, "tflops": tflops,
            "triton_speedup": ratio,
        })  # fmt: skip
        cells.append(
            f"{name} {'n/a' if ms is None else f'{tflops:7.1f} TF/s'}"
            + (f" (triton x{ratio:.2f})" if ratio and name != "triton" else "")
        )
    mask = "causal" if causal else "full"
    print(f"{dtype_name} E={head_dim} L={length:5d} {mask:6s} {pass_:16s} " + " | ".join(cells))


def linear_contenders() -> dict[str, dict]:
    """Per rule, fn(q, k, v, g, beta) -> out: triton and its peers where installed. The gated
    delta rule (l2-normalised q and k) against fla's chunk_gated_delta_rule and transformers'
    fallback; simple GLA (scalar gates, the additive rule, no beta) against fla's
    chunk_simple_gla."""
    gated_delta = {"triton": lambda q, k, v, g, beta: attnperf.linear_attention(
        q, k, v, g=g, beta=beta, use_qk_l2norm=True, backend="triton")[0]}  # fmt: skip
    simple_gla = {"triton": lambda q, k, v, g, beta: attnperf.linear_attention(
        q, k, v, g=g, backend="triton")[0]}  # fmt: skip
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla

        gated_delta["fla"] = lambda q, k, v, g, beta: chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]  # fmt: skip
        simple_gla["fla"] = lambda q, k, v, g, beta: chunk_simple_gla(q, k, v, g)[0]
    except ImportError:
        print("  fla not installed: no fla rows", file=sys.stderr)
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule,
        )

        gated_delta["transformers"] = lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]  # fmt: skip
    except ImportError:
        print("  transformers not installed: no transformers row", file=sys.stderr)
    return {"fp32-gated-delta": gated_delta, "fp32-simple-gla": simple_gla}


def check_linear_agreement(q, k, v, g, beta) -> int:
    """The gated delta rule on triton against the float64 recurrence: 1 if it disagrees."""
    call = {"g": g, "beta": beta, "use_qk_l2norm": True, "output_final_state": True}
    try:
        actual = attnperf.linear_attention(q, k, v, **call, backend="triton")
        exact = linear_reference(q.double(), k.double(), v.double(), **{**call, "g": g.double(),
                                 "beta": beta.double()})  # fmt: skip
        baseline = linear_reference(q, k, v, **call)
        for part, what in zip(range(2), ("linear out", "linear final state"), strict=True):
            assert_linear_agrees(actual[part], exact[part].to(actual[part].device),
                                 baseline[part], what=what)  # fmt: skip
    except Exception as error:
        print(f"FAIL linear attention: {type(error).__name__}: {str(error)[:500]}")
        return 1
    print("linear attention agrees (gated delta, l2norm, T = 100)")
    return 0


def benchmark_linear(device: str, tiny: bool, rows: list[dict]) -> int:
    """The gated delta rule on triton: agreement with the float64 recurrence (the count of
    failures), then its speed against fla's and transformers' chunked kernels."""
    key_heads, heads, dim = (1, 2, 16) if tiny else (16, 32, 128)
    gen = torch.Generator(device=device).manual_seed(0)

    def inputs(steps):
        q, k = (torch.randn(1, steps, key_heads, dim, device=device, generator=gen)
                for _ in range(2))  # fmt: skip
        v = torch.randn(1, steps, heads, dim, device=device, generator=gen)
        g = F.logsigmoid(torch.randn(1, steps, heads, device=device, generator=gen))
        return q, k, v, g, torch.rand(1, steps, heads, device=device, generator=gen)

    checked = inputs(100)
    failures = check_linear_agreement(*checked) if my_item() else 0
    contenders = linear_contenders()
    for steps in (32,) if tiny else (4096, 16384):
        q, k, v, g, beta = inputs(steps)
        flops = 2 * steps * heads * (2 * dim * dim + 64 * 2 * dim)
        # simple GLA: q and k at every value head (fla's simple_gla has no grouped heads)
        wide = [t.repeat_interleave(heads // key_heads, 2) for t in (q, k)]
        keys = {"fp32-gated-delta": (q, k), "fp32-simple-gla": wide}
        for label, fns in contenders.items():
            q_in, k_in = keys[label]
            for pass_ in ("forward", "forward+backward"):
                timings = {}
                for name, fn in fns.items():
                    leaves = [t.detach().requires_grad_(pass_ != "forward") for t in (g, beta)]
                    timings[name] = measure(
                        lambda q, k, v, _, fn=fn, leaves=leaves: fn(q, k, v, *leaves),
                        q_in, k_in, v, False, pass_, torch.randn_like(v), device,
                    )  # fmt: skip
                report(rows, label, dim, steps, True, pass_, timings,
                       flops * (3.5 if pass_ == "forward+backward" else 1))  # fmt: skip
    return failures


@contextlib.contextmanager
def pageable_tables():
    """The launchers' sequence tables copied from the host at every call, as before
    on_device kept them on the device: each copy waits for the stream to drain."""
    modules = (triton_variant, triton_linear)
    kept = [module.on_device for module in modules]
    for module in modules:
        module.on_device = lambda table, device: table.to(device)
    try:
        yield
    finally:
        for module, function in zip(modules, kept, strict=True):
            module.on_device = function


def call_cases(device: str, tiny: bool) -> dict:
    """name -> {contender: fn()}: short calls, where the host's cost per call shows."""
    length, steps, cached = (64, 32, 64) if tiny else (1024, 4096, 4096)
    batch, heads, dim = (1, 2, 16) if tiny else (2, 16, 64)
    q, k, v = (torch.randn(batch, heads, length, dim, device=device, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)

    def dense(backend, backward):
        def call():
            if backend == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = attnperf.attention(q, k, v, is_causal=True, backend=backend)
            if backward:
                out.backward(grad)

        return call

    q_heads, kv_heads, e = (4, 2, 16) if tiny else (32, 8, 128)
    step_q = torch.randn(1, 1, q_heads, e, device=device, dtype=torch.bfloat16)
    cache = [torch.randn(1, cached, kv_heads, e, device=device, dtype=torch.bfloat16)
             for _ in range(2)]  # fmt: skip
    lq, lk = (torch.randn(1, steps, 2, 16 if tiny else 128, device=device) for _ in range(2))
    lv = torch.randn(1, steps, 4, 16 if tiny else 128, device=device)
    g = F.logsigmoid(torch.randn(1, steps, 4, device=device))
    beta = torch.rand(1, steps, 4, device=device)
    return {
        f"dense causal forward L={length}": {
            "triton": dense("triton", False), "sdpa": dense("sdpa", False)},
        f"dense causal forward+backward L={length}": {
            "triton": dense("triton", True), "sdpa": dense("sdpa", True)},
        f"decode B=1 S={cached}": {
            "triton": lambda: attnperf.attention_with_kvcache(step_q, *cache, cached,
                                                              backend="triton"),
            "sdpa": lambda: sdpa_decode(step_q, *cache)},
        f"linear gated delta forward T={steps}": {
            "triton": lambda: attnperf.linear_attention(lq, lk, lv, g=g, beta=beta,
                                                        backend="triton")},
    }  # fmt: skip


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def call_figures(fn, device: str, calls: int, activities) -> tuple[float, float, float, float]:
    """(us a call with calls queued back to back, the host's us a call, the GPU kernels' us
    a call, synchronisations a call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ms = time_ms(fn, device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    sync()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.time_range.elapsed_us() for e in kernels) / calls
    syncs = sum(e.name.startswith(SYNCS) and "Async" not in e.name for e in events) / calls
    return ms * 1e3, host_us, gpu_us, syncs


def profile_calls(device: str, tiny: bool) -> None:
    """Where a short call's time goes, triton against SDPA (printed, not in the CSV): the
    time per call with calls queued back to back (do_bench), the host's own time per call
    (calls queued without a sync), the GPU's kernel time and the host-device
    synchronisations per call (torch.profiler); for triton, the same with the tables copied
    at every call (triton-pageable), and the host's hottest functions (cProfile). Each
    contender is measured twice, in order then in reverse, so that an order effect shows
    (at tiny sizes once, on one call: the interpreter's check of the script)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    calls = 1 if tiny else 20
    for case, contenders in call_cases(device, tiny).items():
        if "triton" in contenders:
            contenders["triton-pageable"] = contenders["triton"]
        names = list(contenders)
        if SHARD is None and not tiny:  # tiny: the script's check, where no order shows
            names += names[::-1]
        for turn, name in enumerate(names):
            if not my_item():
                continue
            fn = contenders[name]
            with pageable_tables() if name == "triton-pageable" else contextlib.nullcontext():
                fn()
                if SHARD is not None:  # warming up: compiled, nothing to time
                    continue
                ms, host_us, gpu_us, syncs = call_figures(fn, device, calls, activities)
            print(f"{case:36s} {name:16s} {ms:8.1f} us a call, host {host_us:7.1f} us, "
                  f"GPU kernels {gpu_us:7.1f} us, {syncs:.1f} syncs", flush=True)  # fmt: skip
            if name == "triton" and turn < len(contenders):
                profiler = cProfile.Profile()
                for _ in range(calls):
                    profiler.runcall(fn)
                stats = pstats.Stats(profiler, stream=sys.stdout).strip_dirs()
                stats.sort_stats("cumulative").print_stats(r"attnperf|kernels|triton", 25)
                stats.sort_stats("tottime").print_stats(12)


STAGES = ("agreement", "dense", "variants", "serving", "linear", "calls")


def run_stages(names, device: str, tiny: bool, rows: list[dict], csv_path=None) -> int:
    """Runs the stages `names`, writing `rows` to `csv_path` after each and when cut short;
    returns the count of failures."""
    stages = {
        "agreement": lambda: check_agreement(device, tiny),
        "dense": lambda: benchmark(device, tiny, rows),
        "variants": lambda: benchmark_variants(device, tiny, rows),
        "serving": lambda: benchmark_serving(device, tiny, rows),
        "linear": lambda: benchmark_linear(device, tiny, rows),
        "calls": lambda: profile_calls(device, tiny),
    }
    failures = 0
    for name in names:
        # A stage that breaks (a kernel that fails to launch on this GPU, say) is a failure
        # to report, not a reason to lose the stages after it: on a lent GPU every minute counts.
        start = time.perf_counter()
        try:
            failures += stages[name]() or 0
        except Exception:
            failures += 1
            print(f"FAIL   stage {name} broke:\n{traceback.format_exc()}")
        finally:  # a run cut short (timeout -s INT) keeps what it measured
            write_csv(rows, csv_path)
        if SHARD is None:
            print(f"stage {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return failures


def write_csv(rows: list[dict], path) -> None:
    if rows and path:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def warm_up(index: int, count: int, names, device: str, tiny: bool) -> int:
    """A warm-up process: its share of the stages' items, untimed; the agreement cases among
    them are checked and printed. Returns the count of failures."""
    global SHARD
    SHARD = (index, count)
    return run_stages(names, device, tiny, [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (CPU interpreter)")
    parser.add_argument("--csv", default="gpu_check.csv", help="where to write the figures")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES,
                        help="which parts to run, in this order (all by default)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=None,
                        help="warm-up processes compiling the kernels first (default: "
                             "the CPU count up to 8 on a GPU, none on CPU)")  # fmt: skip
    parser.add_argument(
        "--warm-up-limit",
        type=float,
        default=240.0,
        help="seconds after which the warm-up is stopped (default 240)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run with TRITON_INTERPRET=1 and --tiny to check the script on CPU")
        return 2
    if args.jobs is None:
        args.jobs = min(8, os.cpu_count() or 1) if device == "cuda" else 1
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; torch {torch.__version__}; "
          f"triton {importlib.metadata.version('triton')}", flush=True)  # fmt: skip
    failures, stages = 0, list(args.stages)
    if args.jobs > 1:
        # Triton compiles each kernel variant and autotune config on first use, one at a
        # time: the first H200 run took ~17 s per agreement case (compiles and tuning).
        # Warm-up processes compile the stages' kernels in parallel and check the agreement
        # cases (untimed work); the timed run then loads the kernels from the cache.
        start = time.perf_counter()
        spawn = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        pool = spawn.Pool(args.jobs)
        shares = pool.starmap_async(warm_up, [(i, args.jobs, stages, device, args.tiny)
                                              for i in range(args.jobs)])  # fmt: skip
        try:
            failures += sum(shares.get(timeout=args.warm_up_limit))
            if "agreement" in stages:
                stages.remove("agreement")  # checked in full by the warm-up
        except multiprocessing.TimeoutError:  # the timed run compiles what is left
            print(f"warm-up stopped at its limit of {args.warm_up_limit:.0f} s")
        except Exception:
            print(f"warm-up broke:\n{traceback.format_exc()}")
        pool.terminate()
        pool.join()
        print(f"warm-up in {args.jobs} processes: {time.perf_counter() - start:.0f} s",
              flush=True)  # fmt: skip
    failures += run_stages(stages, device, args.tiny, [], args.csv)
    print(f"wrote {args.csv}; failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
