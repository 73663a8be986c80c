"""Compile the triton backend's kernels for a real NVIDIA GPU target, on a machine without one.

    python benches/triton_compile_check.py              # sm_90 (H100/H200)
    python benches/triton_compile_check.py --arch 80    # sm_80 (A100)
    python benches/triton_compile_check.py --quick      # one call per kind of kernel

The CPU interpreter that CI tests the kernels with never runs Triton's GPU compiler. This
script does, down to ptxas and a cubin: it runs the backend's own launchers on CPU stand-in
tensors with a compile-only driver, every kernel launch (and every autotune config that the
pruning keeps) compiled instead of launched. It prints each kernel's shared memory against
the target's per-block limit and exits 1 if a kernel fails to compile or would not fit.
Covered: fp16, bf16 and fp32 at head dims 64, 128 and 256 (forward configs and backward
kernels), then masks, causal and ragged lengths at head dim 64, the variants (window,
bottom-right, softcap, ALiBi, block layouts, the LSE, sinks) at head dims 64 and 256, and the
serving calls: packed varlen forward and backward, KV-cache split-K and merge kernels
(contiguous and paged, GQA, with the variants, an int8 cache) in each dtype at head dims 64
to 256; linear attention's forward and backward (scalar and per-key gates, the delta rule)
at K = V = 64 to 256.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the GPU compiler, not the interpreter

import torch

# Largest shared memory one block may use (opt-in), in bytes, per compute capability.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class CompileOnlyDriver:
    """Just enough of a Triton driver to compile for `target`; it never launches."""

    def __init__(self, target, shared_limit: int):
        self.target = target
        self.utils = self  # the launchers ask driver.utils for the device's shared memory
        self.shared_limit = shared_limit

    def get_device_properties(self, device):
        return {"max_shared_mem": self.shared_limit}

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def install_compile_only(arch: int, compiled: list, every_config: bool) -> None:
    """Route every launch of the backend's kernels into a compile for sm_<arch>."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32), SHARED_LIMIT[arch]))
    run = JITFunction.run

    def compile_instead(self, *args, grid, warmup, **kwargs):
        start = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        flags = {k: v for k, v in kwargs.items() if k.isupper()}
        compiled.append((self.__name__, flags, kernel.metadata.shared, time.perf_counter() - start))
        return kernel

    def kept_configs(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        configs = self.prune_configs(kwargs)
        for config in configs if every_config else configs[:1]:
            self.fn.run(*args, **kwargs, **config.all_kwargs())
        self.nargs = None

    JITFunction.run = compile_instead
    Autotuner.run = kept_configs


def calls(quick: bool):
    """(label, prepare() arguments) for every call to compile, forward and backward."""
    gen = torch.Generator().manual_seed(0)

    def qkv(dtype, head_dim, length=256, kv_length=256):
        shapes = ((1, 2, length, head_dim), (1, 2, kv_length, head_dim))
        q = torch.randn(shapes[0], generator=gen).to(dtype)
        k, v = (torch.randn(shapes[1], generator=gen).to(dtype) for _ in range(2))
        return q, k, v

    dtypes = {"fp16": DTYPES["fp16"]} if quick else DTYPES
    head_dims = (64,) if quick else (64, 128, 256)
    import attnperf

    def all_variants(dtype, head_dim):
        q, k, v = qkv(dtype, head_dim)
        return {
            "q": q, "k": k, "v": v, "is_causal": True, "window": (100, 0), "softcap": 30.0,
            "alibi_slopes": torch.rand(2), "return_lse": True, "sinks": torch.randn(2),
            "block_mask": attnperf.block_mask(lambda b, h, i, j: j <= i, None, None, 256, 256),
        }  # fmt: skip

    for name, dtype in dtypes.items():
        for head_dim in head_dims:
            yield f"{name} E={head_dim}", dict(zip("qkv", qkv(dtype, head_dim), strict=True))
    if quick:
        yield "fp16 E=64 all variants", all_variants(torch.float16, 64)
        return
    q, k, v = qkv(torch.float16, 64, 200, 300)  # ragged: EVEN_N false
    bool_mask = torch.rand(200, 300, generator=gen) > 0.5
    float_mask = torch.randn(200, 300, generator=gen).to(torch.float16).requires_grad_()
    yield "fp16 ragged causal", {"q": q, "k": k, "v": v, "is_causal": True}
    yield "fp16 ragged bool mask", {"q": q, "k": k, "v": v, "attn_mask": bool_mask}
    yield "fp16 ragged float mask", {"q": q, "k": k, "v": v, "attn_mask": float_mask}
    # The variants: each constexpr path of the kernels' score modification and tile ranges.
    layout = attnperf.block_mask(lambda b, h, i, j: (i // 64 + j // 32) % 3 != 0, None, None,
                                 200, 300, block_size=(64, 32))  # fmt: skip
    yield (
        "fp16 window bottom-right",
        {"q": q, "k": k, "v": v, "is_causal": True, "window": (64, 0), "align": "bottom_right"},
    )
    yield (
        "fp16 softcap alibi",
        {
            "q": q,
            "k": k,
            "v": v,
            "softcap": 30.0,
            "alibi_slopes": torch.rand(2),
            "return_lse": True,
        },
    )
    yield (
        "fp16 block mask window",
        {"q": q, "k": k, "v": v, "block_mask": layout, "window": (100, 20)},
    )
    for name, dtype in DTYPES.items():  # the largest tiles, where shared memory is tightest
        yield f"{name} E=256 all variants", all_variants(dtype, 256)


def serving_calls(quick: bool):
    """(label, "varlen" or "kvcache", arguments) of the serving calls to compile."""
    import attnperf

    gen = torch.Generator().manual_seed(0)
    dtypes = {"fp16": DTYPES["fp16"]} if quick else DTYPES
    head_dims = (64,) if quick else (64, 128, 256)
    lengths = torch.tensor([0, 100, 0, 37, 300]).cumsum(0).int()
    for name, dtype in dtypes.items():
        for head_dim in head_dims:
            q, k, v = (torch.randn(437, heads, head_dim, generator=gen).to(dtype)
                       for heads in (8, 2, 2))  # fmt: skip
            yield f"{name} E={head_dim} varlen", "varlen", {
                "q": q, "k": k, "v": v, "cu_seqlens_q": lengths, "cu_seqlens_k": lengths,
                "max_seqlen_q": 300, "max_seqlen_k": 300, "is_causal": True,
                "window": (64, 0), "softcap": 30.0, "return_lse": True, "sinks": torch.randn(8),
            }  # fmt: skip
            query = torch.randn(3, 1, 8, head_dim, generator=gen).to(dtype)
            cache = torch.randn(3, 256, 2, head_dim, generator=gen).to(dtype)
            yield f"{name} E={head_dim} decode", "kvcache", {
                "q": query, "k_cache": cache, "v_cache": cache,
                "cache_seqlens": torch.tensor([5, 200, 256]).int(), "num_splits": 4,
            }  # fmt: skip
            pages = torch.randn(20, 64, 2, head_dim, generator=gen).to(dtype)
            yield f"{name} E={head_dim} paged spec.", "kvcache", {
                "q": torch.randn(3, 4, 8, head_dim, generator=gen).to(dtype), "k_cache": pages,
                "v_cache": pages, "cache_seqlens": torch.tensor([5, 100, 250]).int(),
                "block_table": torch.arange(12).view(3, 4).int(), "num_splits": 3,
                "window": (64, 0), "softcap": 30.0, "alibi_slopes": torch.rand(8),
                "sinks": torch.randn(8),
            }  # fmt: skip
            k_codes, k_scale = attnperf.quantize_kv(cache, group_size=32)
            v_codes, v_scale = attnperf.quantize_kv(cache)  # one scale per row
            yield f"{name} E={head_dim} int8 decode", "kvcache", {
                "q": query, "k_cache": k_codes, "v_cache": v_codes, "k_scale": k_scale,
                "v_scale": v_scale,
                "cache_seqlens": torch.tensor([5, 200, 256]).int(), "num_splits": 2,
            }  # fmt: skip


def linear_calls(quick: bool):
    """(label, "linear", linear_attention arguments) to compile, forward and backward: the
    kernels read fp32 (the launcher converts), so the head dims, gate kinds and rules vary
    (gated delta, per-key-dim gates and ungated additive: the chunk kernels' variants and
    the token-by-token ones)."""
    gen = torch.Generator().manual_seed(0)
    head_dims = (128,) if quick else (64, 128, 256)
    for head_dim in head_dims:
        q, k = (torch.randn(1, 100, 2, head_dim, generator=gen) for _ in range(2))
        v = torch.randn(1, 100, 4, head_dim, generator=gen)
        yield f"K=V={head_dim} gated delta", "linear", {
            "q": q, "k": k, "v": v, "g": -torch.rand(1, 100, 4, generator=gen),
            "beta": torch.rand(1, 100, 4, generator=gen),
            "initial_state": torch.zeros(1, 4, head_dim, head_dim), "use_qk_l2norm": True,
        }  # fmt: skip
        if not quick:
            yield f"K=V={head_dim} vector gate", "linear", {
                "q": q, "k": k, "v": v, "g": -torch.rand(1, 100, 4, head_dim, generator=gen),
            }  # fmt: skip
            yield f"K=V={head_dim} additive", "linear", {"q": q, "k": k, "v": v}


def compile_serving_call(kind: str, call: dict) -> None:
    from attnperf.kernels.triton.attention import (
        triton_attention_backward,
        triton_attention_forward,
    )
    from attnperf.kernels.triton.kvcache import triton_kvcache_forward
    from attnperf.kernels.triton.linear import triton_linear_backward, triton_linear_forward
    from attnperf.linear_inputs import prepare_linear
    from attnperf.serving import prepare_kvcache, prepare_varlen

    if kind == "linear":
        inputs = prepare_linear(**call)
        triton_linear_forward(inputs, False)  # inference: the forward keeps nothing
        out, state, kept = triton_linear_forward(inputs, True)
        triton_linear_backward(inputs, kept, torch.ones_like(out), torch.ones_like(state))
    elif kind == "varlen":
        inputs = prepare_varlen(**call)
        out, stats, _ = triton_attention_forward(inputs)
        triton_attention_backward(inputs, out, stats, torch.ones_like(out))
    else:
        triton_kvcache_forward(prepare_kvcache(**call))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT))
    parser.add_argument("--quick", action="store_true", help="fp16, E=64, first config only")
    args = parser.parse_args()

    compiled: list = []
    install_compile_only(args.arch, compiled, every_config=not args.quick)
    from attnperf.inputs import prepare
    from attnperf.kernels.triton.attention import (
        triton_attention_backward,
        triton_attention_forward,
    )

    limit = SHARED_LIMIT[args.arch]
    failures = 0
    every_call = [(label, "attention", call) for label, call in calls(args.quick)]
    for label, kind, call in [*every_call, *serving_calls(args.quick), *linear_calls(args.quick)]:
        before = len(compiled)
        try:
            if kind == "attention":
                variant = {k: v for k, v in call.items() if k not in ("q", "k", "v", "attn_mask")}
                inputs = prepare(call["q"], call["k"], call["v"], call.get("attn_mask"), **variant)
                out, stats, _ = triton_attention_forward(inputs)
                triton_attention_backward(inputs, out, stats, torch.ones_like(out))
            else:
                compile_serving_call(kind, call)
        except Exception as error:  # a compiler error: report it, go on with the next call
            failures += 1
            print(f"FAILED {label}: {type(error).__name__}: {str(error)[:2000]}")
            continue
        for name, flags, shared, seconds in compiled[before:]:
            fits = shared <= limit
            failures += not fits
            blocks = {k: v for k, v in flags.items() if k.startswith("BLOCK") or k == "IEEE"}
            print(
                f"{'ok ' if fits else 'TOO BIG'} {label:24} {name:34} shared {shared:>6} B "
                f"of {limit} ({seconds:.1f} s) {blocks}"
            )
    print(f"sm_{args.arch}: {len(compiled)} kernels compiled, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
