"""Serving benchmarks: KV-cache decoding (`attnperf bench --decode`) and packed batches of
variable-length sequences (`attnperf bench --varlen`).

As in attnperf.bench.sweep, each contender runs in its own spawned worker process and the workers
take turns round by round (the order reversed every other round), so that the ratios are
measured in the same run; a time is the median of the rounds. Each turn first pauses
SETTLE_S, so that the previous contender's OpenMP threads, which spin for a while after
torch's parallel ops, are asleep before it starts (they took a millisecond-scale decode
step's cores: numba's step at B = 1, S = 16k measured 12.3 ms after sdpa's turns, 6.5 ms
with OMP_WAIT_POLICY=PASSIVE), then makes untimed calls (`sweep.time_turn`), then the
timed one.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import attnperf
from attnperf.bench import sweep
from attnperf.kernels.numba.jit import MISSING as NUMBA_MISSING
from attnperf.kernels.numba.microkernels import target_features, tile_route
from attnperf.kernels.numba.peaks import peak_flops

# Llama-3-8B's attention: 32 query heads over 8 key/value heads of 128 dims.
DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM = 32, 8, 128
COPY_BYTES = 1 << 30  # the bandwidth probe's tensor: far larger than any cache level
SGEMM_SIZE = 2048  # the sgemm probe's square matrices
SETTLE_S = 0.3


@dataclass(frozen=True)
class ServingConfig:
    """The --decode and --varlen sweeps."""

    decode_lengths: tuple[int, ...] = (1024, 4096, 16384, 65536)
    batches: tuple[int, ...] = (1, 4)
    draft_tokens: int = 4  # --decode's speculative steps: query tokens per step (0 or 1: none)
    sequences: int = 8  # --varlen: a packed batch of this many sequences
    shortest: int = 128
    longest: int = 4096
    seed: int = 0
    heads: int = 8  # --varlen's heads and head dim
    head_dim: int = 64
    dtype: str = "float32"  # --decode's query and cache (float32 or bfloat16)
    rounds: int = 5
    threads: int = field(default_factory=torch.get_num_threads)


@dataclass
class Contender:
    """One timed call: its label, median and every round's time."""

    label: str
    median_s: float | None = None
    first_call_s: float | None = None
    times_s: list[float] = field(default_factory=list)


def _set_up(make_call: Callable[[], Callable[[], object]]) -> float:
    """In a worker: build the call, run it once (returns that time) and once more, and
    leave it ready for sweep.time_turn."""
    call = make_call()
    timer = sweep.make_timer("cpu")
    first = timer(call)
    timer(call)
    sweep.set_ready(timer, call)
    return first


def race(config: ServingConfig, calls: dict[str, Callable]) -> dict[str, Contender]:
    """Time each call (a picklable factory of the call) in its own worker, in turns."""
    workers = dict(zip(calls, sweep.start_workers(config, len(calls)), strict=True))
    results = {label: Contender(label) for label in calls}
    try:
        for label, make_call in calls.items():
            results[label].first_call_s = workers[label].submit(_set_up, make_call).result()
        labels = list(calls)
        for round_ in range(config.rounds):
            for label in labels if round_ % 2 == 0 else labels[::-1]:
                time.sleep(SETTLE_S)
                results[label].times_s.append(workers[label].submit(sweep.time_turn).result())
    finally:
        sweep.stop_workers(workers.values())
    for result in results.values():
        result.median_s = statistics.median(result.times_s)
    return results


# ---------------------------------------------------------------------------- decode
class DecodeCall:
    """attention_with_kvcache of `tokens` query tokens (bottom-right causal when more than
    one: a speculative step) over a full contiguous cache in `dtype`; head_major: the cache
    a (B, S, H, E) view of (B, H, S, E) memory, as transformers' decoding passes it."""

    def __init__(self, backend, batch, length, heads, kv_heads, head_dim, num_splits=0,
                 tokens=1, dtype=torch.float32, head_major=False):  # fmt: skip
        self.args = (backend, batch, length, heads, kv_heads, head_dim, num_splits, tokens,
                     dtype, head_major)  # fmt: skip

    def __call__(self) -> Callable[[], object]:
        (backend, batch, length, heads, kv_heads, head_dim, num_splits, tokens, dtype,
         head_major) = self.args  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, tokens, heads, head_dim, generator=gen).to(dtype)
        if head_major:
            k_cache, v_cache = (torch.randn(batch, kv_heads, length, head_dim, generator=gen)
                                .to(dtype).transpose(1, 2) for _ in range(2))  # fmt: skip
        else:
            k_cache, v_cache = (torch.randn(batch, length, kv_heads, head_dim, generator=gen)
                                .to(dtype) for _ in range(2))  # fmt: skip
        return lambda: attnperf.attention_with_kvcache(
            q, k_cache, v_cache, length, is_causal=tokens > 1, backend=backend,
            num_splits=num_splits,
        )  # fmt: skip


class Int8DecodeCall:
    """attention_with_kvcache of one fp32 query token over a full contiguous int8 cache:
    quantize_kv's codes and scales of DecodeCall's keys, groups of `group_size` values
    (None: one scale per row)."""

    def __init__(self, batch, length, heads, kv_heads, head_dim, group_size=None):
        self.args = (batch, length, heads, kv_heads, head_dim, group_size)

    def __call__(self) -> Callable[[], object]:
        batch, length, heads, kv_heads, head_dim, group_size = self.args
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, 1, heads, head_dim, generator=gen)
        (k_cache, k_scale), (v_cache, v_scale) = (
            attnperf.quantize_kv(torch.randn(batch, length, kv_heads, head_dim, generator=gen),
                                 group_size=group_size)
            for _ in range(2)
        )  # fmt: skip
        return lambda: attnperf.attention_with_kvcache(
            q, k_cache, v_cache, length, k_scale=k_scale, v_scale=v_scale, backend="numba"
        )


class SdpaDecodeCall:
    """torch's SDPA on DecodeCall's inputs (in `dtype`), its cache moved to (B, H, S, E)
    (transformers' layout), as its users call it: "rows", the query heads of each group
    packed as the rows of their key/value head (exact: no mask for one token; for a
    speculative step the bottom-right causal mask, tiled once per query head of the group),
    or "gqa", enable_gqa=True (with the mask for a speculative step)."""

    def __init__(self, form, batch, length, heads, kv_heads, head_dim, tokens=1,
                 dtype=torch.float32):  # fmt: skip
        self.args = (form, batch, length, heads, kv_heads, head_dim, tokens, dtype)

    def __call__(self) -> Callable[[], object]:
        form, batch, length, heads, kv_heads, head_dim, tokens, dtype = self.args
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, tokens, heads, head_dim, generator=gen).transpose(1, 2).to(dtype)
        k_cache, v_cache = (torch.randn(batch, length, kv_heads, head_dim, generator=gen)
                            .transpose(1, 2).contiguous().to(dtype) for _ in range(2))  # fmt: skip
        group = heads // kv_heads
        mask = None  # query token i sees the keys up to length - tokens + i
        if tokens > 1:
            mask = torch.ones(tokens, length, dtype=torch.bool).tril(length - tokens)
        if form == "rows":
            rows = q.reshape(batch, kv_heads, group * tokens, head_dim)
            if mask is not None:
                mask = mask.repeat(group, 1)
            return lambda: F.scaled_dot_product_attention(rows, k_cache, v_cache, mask)
        return lambda: F.scaled_dot_product_attention(q, k_cache, v_cache, mask, enable_gqa=True)


class CopyCall:
    """A copy of COPY_BYTES: the memory bandwidth this machine gives these threads."""

    def __call__(self) -> Callable[[], object]:
        source = torch.ones(COPY_BYTES // 4)
        target = torch.empty_like(source)
        return lambda: target.copy_(source)


class ReadCall:
    """A sum over COPY_BYTES: the read bandwidth this machine gives these threads."""

    def __call__(self) -> Callable[[], object]:
        source = torch.ones(COPY_BYTES // 4)
        return source.sum


class SgemmCall:
    """torch.mm of two SGEMM_SIZE^2 fp32 matrices: the machine's sgemm rate."""

    def __call__(self) -> Callable[[], object]:
        a, b = torch.randn(SGEMM_SIZE, SGEMM_SIZE), torch.randn(SGEMM_SIZE, SGEMM_SIZE)
        return lambda: torch.mm(a, b)


def sgemm_rate(config) -> float:
    """The machine's fp32 sgemm rate in FLOP/s (torch.mm, `config.threads` threads; the
    median of `config.rounds`): the anchor of every GFLOP/s figure of a run."""
    return 2 * SGEMM_SIZE**3 / race(config, {"sgemm": SgemmCall()})["sgemm"].median_s


PEAK_KINDS = {"AMX bf16": "amx", "bf16 dot": "bf16", "fp32 FMA": "fp32"}


def peak_rate(dtype: str, threads: int) -> float | None:
    """The chip's peak in FLOP/s for a call of `dtype` (`peak_kind`); a register-only loop
    on one thread times `threads` (one per core). None without numba, which emits it."""
    if NUMBA_MISSING:
        return None
    return peak_flops(PEAK_KINDS[peak_kind(dtype)]) * threads


def peak_kind(dtype: str) -> str:
    """What `peak_rate` times for a call of `dtype`, in words: for "bfloat16" AMX's tiles
    where bf16 runs on them ("AMX bf16"), else the bf16 dot product where the CPU has one
    ("bf16 dot"); otherwise "fp32 FMA"."""
    if dtype == "bfloat16" and tile_route("bf16")[0] == "amx":
        return "AMX bf16"
    has_dot = dtype == "bfloat16" and "avx512bf16" in target_features()
    return "bf16 dot" if has_dot else "fp32 FMA"


def kv_bytes(batch: int, length: int, kv_heads: int, head_dim: int, element_size: int = 4) -> int:
    """Bytes of K and V that one decode step must read (fp32: 4 bytes an element)."""
    return 2 * batch * length * kv_heads * head_dim * element_size


def decode_calls(batch: int, length: int, tokens: int = 1,
                 dtype: torch.dtype = torch.float32) -> dict[str, Callable]:  # fmt: skip
    """numba's step and SDPA's two forms at one point (Llama-3-8B's heads), in `dtype`."""
    shape = (DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM)
    return {"numba": DecodeCall("numba", batch, length, *shape, tokens=tokens, dtype=dtype),
            "sdpa rows": SdpaDecodeCall("rows", batch, length, *shape, tokens, dtype),
            "sdpa gqa": SdpaDecodeCall("gqa", batch, length, *shape, tokens, dtype)}  # fmt: skip


def decode_row(batch: int, length: int, timed: dict[str, Contender], bandwidth: float,
               tokens: int = 1, element_size: int = 4) -> dict:  # fmt: skip
    """One decode point: each call's time, K and V read per second and its share of the
    read bandwidth; numba's speed against each SDPA form (> 1: numba faster)."""
    read = kv_bytes(batch, length, DECODE_KV_HEADS, DECODE_HEAD_DIM, element_size)
    row = {"batch": batch, "length": length, "tokens": tokens}
    for label, result in timed.items():
        key = label.replace(" ", "_")
        row[f"{key}_s"] = result.median_s
        row[f"{key}_bandwidth_share"] = read / result.median_s / bandwidth
    numba = timed["numba"].median_s
    row["numba_gbps"] = read / numba / 1e9
    row["vs_sdpa_rows"] = timed["sdpa rows"].median_s / numba
    row["vs_sdpa_gqa"] = timed["sdpa gqa"].median_s / numba
    return row


def read_bandwidth(config) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a copy counted read + write, as STREAM does, and a
    read-only sum, which is what a decode step does."""
    probes = race(config, {"copy": CopyCall(), "read": ReadCall()})
    return 2 * COPY_BYTES / probes["copy"].median_s, COPY_BYTES / probes["read"].median_s


def decode_sweep(config: ServingConfig, on_progress: Callable[[str], None]) -> dict:
    """numba against SDPA's two forms per (batch, cache length), for one token and for a
    speculative step of `draft_tokens`; split-K on and off at B = 1; the memory bandwidth,
    all in one run."""
    copy, bandwidth = read_bandwidth(config)
    on_progress(f"bandwidth: copy {copy / 1e9:.1f} GB/s, read {bandwidth / 1e9:.1f} GB/s")
    dtype = getattr(torch, config.dtype)
    size = dtype.itemsize
    rows = []
    for batch in config.batches:
        for length in config.decode_lengths:
            timed = race(config, decode_calls(batch, length, dtype=dtype))
            rows.append(decode_row(batch, length, timed, bandwidth, element_size=size))
            on_progress(f"decode B={batch} S={length}: numba {rows[-1]['vs_sdpa_rows']:.2f}x "
                        "sdpa rows")  # fmt: skip
    speculative = []  # SDPA has no exact maskless packing for these: reported apart
    for batch in config.batches if config.draft_tokens > 1 else ():
        for length in config.decode_lengths:
            timed = race(config, decode_calls(batch, length, config.draft_tokens, dtype))
            speculative.append(decode_row(batch, length, timed, bandwidth, config.draft_tokens,
                                          size))  # fmt: skip
            on_progress(f"speculative B={batch} S={length}: numba "
                        f"{speculative[-1]['vs_sdpa_rows']:.2f}x sdpa rows")  # fmt: skip
    shape = (DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM)
    splits = []  # B = 1, below the thread count: split-K is what keeps the threads busy
    for length in config.decode_lengths:
        calls = {n: DecodeCall("numba", 1, length, *shape, num_splits=s, dtype=dtype)
                 for n, s in (("one pass", 1), ("split-K", 0))}  # fmt: skip
        timed = race(config, calls)
        single, split = timed["one pass"].median_s, timed["split-K"].median_s
        splits.append({"length": length, "one_pass_s": single, "split_s": split,
                       "gain": single / split})  # fmt: skip
        on_progress(f"split-K S={length}: {single / split:.2f}x")
    return {"copy_gbps": copy / 1e9, "bandwidth_gbps": bandwidth / 1e9, "decode": rows,
            "speculative": speculative, "split_k": splits}  # fmt: skip


# ---------------------------------------------------------------------------- varlen
def varlen_lengths(config: ServingConfig) -> list[int]:
    gen = torch.Generator().manual_seed(config.seed)
    return torch.randint(config.shortest, config.longest + 1, (config.sequences,),
                         generator=gen).tolist()  # fmt: skip


class VarlenCall:
    """A causal packed batch: attention_varlen ("packed"); attention on the batch padded to
    its longest sequence under a padding mask ("padded"); or torch's SDPA called on each
    sequence in turn, causal, no mask, on views of the packed tensors ("looped", the careful
    SDPA user's form; `backend` unused); with or without the backward."""

    def __init__(self, backend, layout, lengths, heads, head_dim, backward):
        self.args = (backend, layout, lengths, heads, head_dim, backward)

    def __call__(self) -> Callable[[], object]:
        backend, layout, lengths, heads, head_dim, backward = self.args
        gen = torch.Generator().manual_seed(0)
        total, longest, count = sum(lengths), max(lengths), len(lengths)
        if layout == "packed":
            q, k, v = (torch.randn(total, heads, head_dim, generator=gen) for _ in range(3))
            cu = torch.tensor([0, *lengths]).cumsum(0).int()

            def attend(q, k, v):
                return attnperf.attention_varlen(q, k, v, cu, cu, longest, longest,
                                                 is_causal=True, backend=backend)  # fmt: skip
        elif layout == "looped":
            q, k, v = (torch.randn(total, heads, head_dim, generator=gen) for _ in range(3))
            bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

            def attend(q, k, v):
                outs = [F.scaled_dot_product_attention(*(t[lo:hi].transpose(0, 1)[None]
                                                         for t in (q, k, v)), is_causal=True)
                        for lo, hi in itertools.pairwise(bounds)]  # fmt: skip
                return torch.cat([out[0].transpose(0, 1) for out in outs])
        else:
            shape = (count, heads, longest, head_dim)
            q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
            positions = torch.arange(longest)
            real = positions[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
            mask = real[:, None, None, :] & (positions[None, :] <= positions[:, None])

            def attend(q, k, v):
                return attnperf.attention(q, k, v, attn_mask=mask, backend=backend)

        for tensor in (q, k, v):
            tensor.requires_grad_(backward)

        def call():
            out = attend(q, k, v)
            if backward:
                q.grad = k.grad = v.grad = None
                out.sum().backward()
            return out

        return call


def varlen_sweep(config: ServingConfig, on_progress: Callable[[str], None]) -> dict:
    """numba on the packed batch vs SDPA looped over the sequences (the careful peer), sdpa
    and numba on the padded batch, forward and forward+backward; the work each layout
    implies."""
    lengths = varlen_lengths(config)
    squares, padded_squares = sum(n * n for n in lengths), len(lengths) * max(lengths) ** 2
    rows = []
    for backward in (False, True):
        contenders = (("numba", "packed"), ("sdpa", "looped"), ("sdpa", "padded"),
                      ("numba", "padded"))  # fmt: skip
        calls = {
            f"{backend} {layout}": VarlenCall(
                backend, layout, lengths, config.heads, config.head_dim, backward
            )
            for backend, layout in contenders
        }
        timed = race(config, calls)
        packed = timed["numba packed"].median_s
        for label, result in timed.items():
            pass_ = "forward+backward" if backward else "forward"
            rows.append({"pass": pass_, "call": label, "median_s": result.median_s,
                         "vs_packed": result.median_s / packed})  # fmt: skip
        on_progress(f"varlen {'forward+backward' if backward else 'forward'} done")
    return {"lengths": lengths, "sum_squares": squares, "padded_squares": padded_squares,
            "rows": rows}  # fmt: skip
