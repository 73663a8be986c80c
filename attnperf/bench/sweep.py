"""Measurement: time, throughput and peak extra memory of each backend, each in its own process.

Every backend runs in fresh worker processes (spawned), so that one backend's thread pools,
JIT caches or allocator state cannot slow another. Timing and memory use separate workers:
timing runs with the default allocator, memory with one that maps every large block apart
(see WORKER_ENV), which would slow the timings. A timing is one first call (JIT / compile
time, reported apart), one more warm-up call, then `rounds` timed calls (median, min, max).
The backends take turns at each point, round by round (the order reversed every other
round), so that a machine whose speed drifts (shared cores, turbo) shifts every backend
alike and the same-run ratios stay honest; each turn is untimed calls for at least WARM_S,
which wake the worker's thread pools after the others' turns, then the timed one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context

import torch

import attnperf
from attnperf import dispatch, layouts
from attnperf.inputs import prepare
from attnperf.kernels.numba.launch import spare_bytes
from attnperf.kernels.sdpa import sdpa_mask

# glibc's adaptive mmap threshold would serve a repeated large allocation from the already
# resident heap, hiding it from the RSS high-water mark: a fixed threshold keeps every
# block >= 64 KiB in its own mapping, which is returned to the system when freed.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# A turn's untimed calls last at least this long: after an idle spell this VM's scheduler
# woke a worker's two threads onto one vCPU and parted them only a time slice (~3 ms)
# later (seen as involuntary context switches of both, found on one CPU). On the 2-core
# AMD EPYC VM, in serving's race (B = 1, S = 16k, bf16, 9 rounds), one untimed call left
# numba's step at 2.7-8.4 ms (medians 3.5, 3.7) and SDPA's rows at 7.0-10.1 (8.4, 8.6);
# 20 ms of calls, 2.2-2.6 (2.3, 2.3) and 6.7-8.7 (6.9, 6.9).
WARM_S = 0.02

PASSES = ("forward", "forward+backward")
BACKWARD_FLOP_FACTOR = 2.5  # backward = 2.5x forward (FlashAttention's accounting)
BLOCK_MASKS = ("causal", "sliding", "document", "prefix")
DOCUMENT_LENGTH = 1024  # --block-mask document: packed documents of this many tokens
# Peers measured beside the backends, not backends themselves ("auto" never picks them):
# FlexAttention compiled by torch.compile; on CPU inference only.
PEERS = ("flex",)


@dataclass(frozen=True)
class BenchConfig:
    """One sweep: lengths (L = S) crossed with passes and causal, for each backend."""

    lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None  # key/value heads (GQA when fewer than heads); None: heads
    head_dim: int = 64
    dtype: str = "float32"
    causal: tuple[bool, ...] = (False,)
    passes: tuple[str, ...] = PASSES
    backends: tuple[str, ...] = ()  # empty: every backend known to the registry
    device: str = "cpu"
    rounds: int = 5
    threads: int = field(default_factory=torch.get_num_threads)
    memory: bool = True  # also measure each point's peak extra memory
    # The variant of every call: a sliding window of `window` keys, (window - 1, 0); a
    # softcap; ALiBi with the standard slopes; a block layout from BLOCK_MASKS.
    window: int | None = None
    softcap: float | None = None
    alibi: bool = False
    block_mask: str | None = None

    def describe_variant(self) -> str:
        parts = [f"window {self.window}" if self.window else "",
                 f"softcap {self.softcap:g}" if self.softcap else "",
                 "ALiBi" if self.alibi else "",
                 f"block mask {self.block_mask}" if self.block_mask else ""]  # fmt: skip
        return ", ".join(part for part in parts if part)


@dataclass
class Measurement:
    """One (backend, length, causal, pass) point; `status` is "ok" or why it is absent."""

    backend: str
    length: int
    causal: bool
    pass_: str
    status: str = "ok"
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    first_call_s: float | None = None
    peak_extra_bytes: int | None = None
    note: str = ""
    flops: float = 0.0
    times_s: list[float] = field(default_factory=list)

    @property
    def gflops(self) -> float | None:
        return self.flops / self.median_s / 1e9 if self.median_s else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        data["gflops"] = self.gflops
        return data


def attention_flops(config: BenchConfig, length: int, causal: bool, pass_: str) -> float:
    """The useful work: 4 B H E per (query, key) pair that the call lets take part (L S,
    half of it when causal, fewer with a window or a block layout), x3.5 with the backward."""
    pairs = length * length / (2 if causal else 1)
    if config.window is not None:  # rows see min(i + 1, W) keys (and fewer if causal)
        width = min(config.window, length)
        pairs = min(pairs, width * length - width * (width - 1) / 2)
    if config.block_mask is not None:
        pairs = min(pairs, block_layout(config, length).allowed_pairs())
    forward = 4.0 * config.batch * config.heads * pairs * config.head_dim
    return forward * (1 + BACKWARD_FLOP_FACTOR) if pass_ == "forward+backward" else forward


def mask_fn(config: BenchConfig, length: int):
    """The `mask_fn` of the sweep's --block-mask at this length."""
    if config.block_mask == "causal":
        return layouts.causal()
    if config.block_mask == "sliding":
        return layouts.sliding_window(config.window or 256)
    if config.block_mask == "document":
        offsets = torch.arange(0, length + DOCUMENT_LENGTH, DOCUMENT_LENGTH).clamp(max=length)
        return layouts.document(offsets.unique(), is_causal=True)
    return layouts.prefix_lm(length // 4)


@functools.lru_cache(maxsize=4)
def block_layout(config: BenchConfig, length: int):
    """The sweep's BlockMask at this length (same for every batch and head), built once per
    process: the FLOP count and the call both need it."""
    return attnperf.block_mask(mask_fn(config, length), None, None, length, length)


def variant_kwargs(config: BenchConfig, length: int) -> dict:
    """`attention`'s variant keywords for this sweep and length."""
    kwargs = {}
    if config.window is not None:
        kwargs["window"] = (config.window - 1, 0)
    if config.softcap is not None:
        kwargs["softcap"] = config.softcap
    if config.alibi:
        kwargs["alibi_slopes"] = torch.tensor(
            layouts.alibi_slopes(config.heads), device=config.device
        )
    if config.block_mask is not None:
        kwargs["block_mask"] = block_layout(config, length).to(config.device)
    return kwargs


# ---------------------------------------------------------------------------- memory
def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} missing from /proc/self/status")


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak resident memory added while `fn` runs, from the kernel's high-water mark, plus
    the memory numba's recycled outputs held spare before it (`spare_bytes`: what a warm
    call left resident for the next one, such as linear attention's kept chunks).

    Resetting VmHWM (write "5" to /proc/self/clear_refs) makes it see every allocation that
    touches memory, torch's, numpy's and numba's alike. None where /proc is not Linux's.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _proc_status_kib("VmRSS")
    except OSError:
        return None
    spare = spare_bytes()
    result = fn()
    peak = _proc_status_kib("VmHWM")
    del result
    return max(peak - before, 0) * 1024 + spare


def cuda_peak_extra_bytes(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak - before


# ---------------------------------------------------------------------------- one point
def make_timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device.startswith("cuda"):

        def cuda_time(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_time

    def cpu_time(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_time


def measure_point(
    config: BenchConfig, backend: str, length: int, causal: bool, pass_: str, memory: bool
) -> Measurement:
    """Set up one point in this process: its first call and a warm-up call, then with
    `memory` its peak extra memory; else it stays ready for `time_turn`."""
    set_ready(None)
    point = Measurement(backend, length, causal, pass_)
    point.flops = attention_flops(config, length, causal, pass_)
    if backend == "triton" and not config.device.startswith("cuda"):
        point.status = "not supported: on CPU Triton runs only its test interpreter (no timings)"
        return point
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(0)
    shape = (config.batch, config.heads, length, config.head_dim)
    kv_shape = (config.batch, config.kv_heads or config.heads, length, config.head_dim)
    q, k, v = (
        torch.randn(s, generator=gen).to(config.device, dtype) for s in (shape, kv_shape, kv_shape)
    )
    gqa = kv_shape[1] != shape[1]
    backward = pass_ == "forward+backward"
    for tensor in (q, k, v):
        tensor.requires_grad_(backward)
    variant = variant_kwargs(config, length)
    if backend in PEERS:
        attend, reason = flex_peer(config, length, causal, backward, variant, gqa)
    else:
        attend, reason = backend_call(backend, q, k, v, causal, gqa, variant)
    if reason:
        point.status = "not supported: " + reason
        return point
    point.note = getattr(attend, "note", "")
    grad_out = torch.randn(shape, generator=gen).to(config.device, dtype)

    def call():
        out = attend(q, k, v)
        if backward:
            q.grad = k.grad = v.grad = None
            out.backward(grad_out)
        return out

    timer = make_timer(config.device)
    try:
        point.first_call_s = timer(call)
    except Exception as error:  # a peer's failure is reported; a backend's is a bug: raised
        if backend not in PEERS:
            raise
        point.status = f"failed: {backend}: {type(error).__name__}: {str(error)[:200]}"
        return point
    timer(call)  # warm caches and pools
    if memory:
        peak = cuda_peak_extra_bytes if config.device.startswith("cuda") else cpu_peak_extra_bytes
        point.peak_extra_bytes = peak(call)
    else:
        set_ready(timer, call)
    return point


def backend_call(backend: str, q, k, v, causal: bool, gqa: bool, variant: dict):
    """(attend(q, k, v), None) running `backend`, or (None, why it cannot).

    sdpa's peer call gets the variant as a user of SDPA would pass it: a mask materialised
    once, before the timed calls (its build is not timed; its memory is reported apart).
    """
    inputs = prepare(q, k, v, is_causal=causal, enable_gqa=gqa, **variant)
    reasons = dispatch.registry()[backend].not_supported_reasons(inputs)
    if reasons:
        return None, "; ".join(reasons)
    if backend == "sdpa":
        mask, is_causal = sdpa_mask(inputs)  # built here, once, not in the timed calls
        attend = lambda q, k, v: attnperf.attention(  # noqa: E731
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, backend="sdpa"
        )  # fmt: skip
        if mask is not None:
            attend.note = f"+{mask.numel() * mask.element_size() / 2**20:.1f} MiB mask built once"
        return attend, None
    return lambda q, k, v: attnperf.attention(
        q, k, v, is_causal=causal, enable_gqa=gqa, backend=backend, **variant
    ), None  # fmt: skip


def documents_by_arithmetic(b, h, q_idx, kv_idx):
    """The sweep's causal documents of DOCUMENT_LENGTH tokens for FlexAttention: inductor's
    CPU code for flex failed to compile (torch 2.13) with attnperf.layouts.document's id
    lookup."""
    same = q_idx // DOCUMENT_LENGTH == kv_idx // DOCUMENT_LENGTH
    return same & (kv_idx <= q_idx)


def flex_peer(config: BenchConfig, length: int, causal: bool, backward: bool, variant: dict,
              gqa: bool):  # fmt: skip
    """(attend(q, k, v), None) with torch's FlexAttention compiled, the call's variant as its
    block mask and score_mod, or (None, why it cannot)."""
    if backward and not config.device.startswith("cuda"):
        return None, "flex: FlexAttention on CPU is inference only (no backward)"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as error:
        return None, f"flex: torch has no FlexAttention ({error})"
    window = config.window
    layout_fn = mask_fn(config, length) if config.block_mask else None
    if config.block_mask == "document":
        layout_fn = documents_by_arithmetic

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx >= 0  # all True, as a tensor
        if causal or window is not None:
            allowed = allowed & (kv_idx <= q_idx)
        if window is not None:
            allowed = allowed & (q_idx - kv_idx < window)
        if layout_fn is not None:
            allowed = allowed & layout_fn(b, h, q_idx, kv_idx)
        return allowed

    softcap = config.softcap
    slopes = variant.get("alibi_slopes")

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx - kv_idx).abs()
        return score

    structured = causal or window is not None or layout_fn is not None
    block_mask = None
    if structured:
        block_mask = create_block_mask(mask_mod, None, None, length, length,
                                       device=config.device)  # fmt: skip
    compiled = torch.compile(flex_attention)
    modify = score_mod if softcap is not None or slopes is not None else None

    def attend(q, k, v):
        with contextlib.nullcontext() if backward else torch.no_grad():
            return compiled(q, k, v, score_mod=modify, block_mask=block_mask, enable_gqa=gqa)

    return attend, None


_READY: tuple[Callable, Callable] | None = None  # the worker's point set up for timing


def set_ready(timer: Callable | None, call: Callable | None = None) -> None:
    """Leave `call` (timed by `timer`) ready for time_turn in this worker; None: nothing."""
    global _READY
    _READY = None if timer is None else (timer, call)


def time_turn() -> float:
    """One turn at the point that measure_point set up in this worker: calls for at least
    WARM_S (one at least) to wake this process's thread pools and caches after the other
    backends' turns, then the timed call (back to back, as a caller's repeated calls run)."""
    timer, call = _READY
    warmed = timer(call)
    while warmed < WARM_S:
        warmed += timer(call)
    return timer(call)


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def start_worker(config: BenchConfig, memory: bool) -> ProcessPoolExecutor:
    """A fresh spawned process (WORKER_ENV set in it when it measures memory)."""
    return start_workers(config, 1, memory)[0]


def start_workers(
    config: BenchConfig, count: int, memory: bool = False
) -> list[ProcessPoolExecutor]:
    """`count` fresh spawned processes, started together (each one's imports took ~1.4 s);
    WORKER_ENV set in them when they measure memory."""
    saved = {name: os.environ.get(name) for name in WORKER_ENV}
    if memory:
        os.environ.update(WORKER_ENV)  # inherited by the spawned workers
    try:
        pools = [
            ProcessPoolExecutor(
                max_workers=1,
                mp_context=get_context("spawn"),
                initializer=_init_worker,
                initargs=(config.threads,),
            )
            for _ in range(count)
        ]
        started = [pool.submit(os.getpid) for pool in pools]  # each starts now, in this environment
        for pid in started:
            pid.result()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return pools


def stop_workers(workers: Iterable[ProcessPoolExecutor]) -> None:
    """Shut the workers down together, each waited for (a process's exit took ~0.7 s)."""
    workers = list(workers)
    with ThreadPoolExecutor(max(len(workers), 1)) as stopping:
        list(stopping.map(ProcessPoolExecutor.shutdown, workers))


def run_sweep(
    config: BenchConfig, on_progress: Callable[[str], None] | None = None
) -> list[Measurement]:
    """Every point of the sweep; `on_progress` hears of each finished job (2 per point)."""
    backends = config.backends or tuple(dispatch.registry())
    points = [
        (length, causal, pass_)
        for causal in config.causal
        for pass_ in config.passes
        for length in config.lengths
    ]

    def progress(point, phase):
        if on_progress:
            on_progress(f"{point.backend} L={point.length} {point.pass_} ({phase})")

    timers = dict(zip(backends, start_workers(config, len(backends)), strict=True))
    timed = {}
    try:
        for spec in points:
            ready = []
            for backend, worker in timers.items():
                point = worker.submit(measure_point, config, backend, *spec, False).result()
                timed[backend, spec] = point
                if point.status == "ok":
                    ready.append(backend)
                else:
                    progress(point, "time")
            for round_ in range(config.rounds):
                for backend in ready if round_ % 2 == 0 else ready[::-1]:
                    seconds = timers[backend].submit(time_turn).result()
                    timed[backend, spec].times_s.append(seconds)
            for backend in ready:
                point = timed[backend, spec]
                point.median_s = statistics.median(point.times_s)
                point.min_s, point.max_s = min(point.times_s), max(point.times_s)
                progress(point, "time")
    finally:
        stop_workers(timers.values())
    if not config.memory:
        return [timed[backend, spec] for backend in backends for spec in points]
    results = []
    for backend in backends:
        watcher = start_worker(config, memory=True)
        try:
            for spec in points:
                memory_point = watcher.submit(measure_point, config, backend, *spec, True).result()
                progress(memory_point, "memory")
                point = timed[backend, spec]
                point.peak_extra_bytes = memory_point.peak_extra_bytes
                point.note = point.note or memory_point.note
                results.append(point)
        finally:
            watcher.shutdown()
    return results


def fit_exponent(lengths: list[int], values: list[float]) -> tuple[float, float] | None:
    """Least-squares slope of log(value) against log(L), and the fit's R^2."""
    points = [(math.log(x), math.log(y)) for x, y in zip(lengths, values, strict=True) if y > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)
    total = sum((y - mean_y) ** 2 for _, y in points)
    return slope, 1.0 - residual / total if total else 1.0
