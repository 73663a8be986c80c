"""`attnperf warmup`: compile numba's kernels for this CPU once, ahead of the first calls.

numba compiles a kernel at its first call in an environment (tens of seconds for each of the
dense forwards and backwards) and caches it on disk; later processes load it in about a
second. Each job here is a small call through the public API, so it compiles exactly what a
user's call of that kind will run (the variant, the shape and the layout are read at run
time: one job covers them all). The jobs run in parallel worker processes, one a core.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import NamedTuple

import torch

import attnperf
from attnperf.kernels.numba import fastmath, jit


def _dense(dtype: torch.dtype, backward: bool) -> None:
    q, k, v = (torch.randn(1, 2, 256, 64, dtype=dtype, requires_grad=backward) for _ in range(3))
    out = attnperf.attention(q, k, v, backend="numba")
    if backward:
        out.sum().backward()


def _masked() -> None:
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    allowed = torch.ones(256, 256, dtype=torch.bool).tril()
    for attn_mask in (allowed, torch.zeros(256, 256).masked_fill(~allowed, -1.0)):
        attnperf.attention(q, k, v, attn_mask=attn_mask, backend="numba")


def _decoding(dtype: torch.dtype) -> None:
    query_dtype = torch.float32 if dtype == torch.int8 else dtype
    q = torch.randn(1, 1, 8, 128, dtype=query_dtype)
    k_new, v_new = (torch.randn(1, 1, 2, 128, dtype=query_dtype) for _ in range(2))
    if dtype == torch.int8:
        k_cache, v_cache = (torch.zeros(1, 4096, 2, 128, dtype=torch.int8) for _ in range(2))
        k_scale, v_scale = (torch.ones(1, 4096, 2, 4) for _ in range(2))
    else:
        k_cache, v_cache = (torch.randn(1, 4096, 2, 128, dtype=dtype) for _ in range(2))
        k_scale = v_scale = None
    attnperf.attention_with_kvcache(
        q, k_cache, v_cache, 4000, k_new, v_new, k_scale=k_scale, v_scale=v_scale,
        backend="numba",
    )  # fmt: skip


def _varlen() -> None:
    q, k, v = (torch.randn(300, 2, 64, requires_grad=True) for _ in range(3))
    bounds = torch.tensor([0, 100, 300], dtype=torch.int32)
    attnperf.attention_varlen(
        q, k, v, bounds, bounds, 200, 200, is_causal=True, backend="numba"
    ).sum().backward()


def _linear() -> None:
    q, k = (torch.nn.functional.normalize(torch.randn(1, 128, 2, 64), dim=-1) for _ in range(2))
    v = torch.randn(1, 128, 2, 64)
    g = -torch.rand(1, 128, 2)
    beta = torch.rand(1, 128, 2)
    for tensor in (q, k, v, g, beta):
        tensor.requires_grad_()
    out, state = attnperf.linear_attention(
        q, k, v, g=g, beta=beta, output_final_state=True, backend="numba"
    )
    out.sum().backward()
    step = [x[:, :1].detach() for x in (q, k, v, g, beta)]
    attnperf.linear_attention(*step[:3], g=step[3], beta=step[4], initial_state=state.detach(),
                              backend="numba")  # fmt: skip


# name -> the call that compiles it. A dtype's forward and backward are one job, since its
# backward runs its forward (two workers would both compile it). The first four are what
# most users run; jobs that share no kernel run in parallel.
JOBS: dict[str, Callable[[], None]] = {
    "float32: forward, backward": lambda: _dense(torch.float32, backward=True),
    "bfloat16: forward, backward": lambda: _dense(torch.bfloat16, backward=True),
    "float32: decoding step": lambda: _decoding(torch.float32),
    "bfloat16: decoding step": lambda: _decoding(torch.bfloat16),
    "float16: forward, backward": lambda: _dense(torch.float16, backward=True),
    "float32 under a mask (bool, float)": _masked,
    "int8 cache: decoding step": lambda: _decoding(torch.int8),
    "varlen: forward, backward": _varlen,
    "linear attention: forward, backward, decoding step": _linear,
}
DEFAULT_JOBS = tuple(JOBS)[:4]


def jobs_for(dtypes: tuple[str, ...], decoding: bool) -> tuple[str, ...]:
    """The jobs of these dtypes' dense calls ("float32", ...), forward and backward, and
    with `decoding` the float32 decoding step."""
    names = [f"{dtype}: forward, backward" for dtype in dtypes]
    if decoding:
        names.append("float32: decoding step")
    return tuple(name for name in JOBS if name in names)


class JobResult(NamedTuple):
    seconds: float
    compiled: bool  # numba compiled something (else every kernel came from the disk cache)


def run_job(name: str) -> JobResult:
    """In a worker: one job on one thread."""
    torch.set_num_threads(1)
    jit.COMPILE_NOTE_AFTER_S = float("inf")  # the warmup's own lines say it
    start = time.perf_counter()
    with jit.event.install_recorder("numba:compile") as compiles:  # none on a cache hit
        JOBS[name]()
    return JobResult(time.perf_counter() - start, bool(compiles.buffer))


def warmup(names: tuple[str, ...], workers: int, say: Callable[[str], None]) -> float:
    """Run the jobs `names` in `workers` spawned processes; `say` gets a line as each ends
    (and, on a terminal, the running ones each second). Returns the seconds taken."""
    if jit.MISSING:
        raise RuntimeError(f"numba backend unavailable: {jit.MISSING}")
    start = time.perf_counter()
    context = get_context("spawn")  # a fresh interpreter: no threads or OpenMP state forked
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        running = {pool.submit(run_job, name): name for name in names}
        done_count = 0
        while running:
            finished, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                if sys.stderr.isatty():
                    print("\r\033[K", end="", file=sys.stderr)  # the running line's place
                done_count += 1
                result = future.result()
                how = f"compiled in {result.seconds:.0f} s" if result.compiled else "cached already"
                say(f"[{done_count}/{len(names)}] {name}: {how}")
            if running and not finished and sys.stderr.isatty():
                elapsed = time.perf_counter() - start
                print(f"\r  {elapsed:4.0f} s: {', '.join(running.values())} ...", end="",
                      file=sys.stderr, flush=True)  # fmt: skip
    return time.perf_counter() - start


def cache_folder() -> str:
    """Where numba keeps the compiled kernels, as its cache locator chose for one of them
    (NUMBA_CACHE_DIR, beside the sources, or the user-wide folder where those are read-only)."""
    return fastmath.exp2_shifted._cache._cache_path
