"""`attnperf tune`: numba against sdpa measured on this machine, written as the table that
"auto" reads (attnperf.cpu_table).

`calibrate` times both on the call classes that matter (fp32 and bf16, causal or not,
forward or with backward, head dims 64 and 128, grouped-query or not, L = S from 1024 up)
in processes of their own (attnperf.bench.sweep), and `write_table` stores, per class, the
shortest length from which numba was at least as fast as sdpa at that length and every
longer one measured.
Decoding steps likewise, per dtype (attnperf.bench.serving): the smallest cache, in bytes
of K and V, from which numba's step was at least as fast as sdpa's, which packs the group
as rows.
"""

from __future__ import annotations

import datetime
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from attnperf.bench import serving
from attnperf.bench.sweep import PASSES, BenchConfig, run_sweep
from attnperf.cpu_table import SCHEMA, DecodeRule, Rule, fingerprint, load_table, table_path

# (heads, kv heads, head dim) of the measured classes: multi-head at head dims 64 and 128,
# and grouped-query (4 query heads per kv head) at both: Llama-like models' prefill is
# grouped at 128, which a table without that class sent to sdpa.
SHAPES = ((8, 8, 64), (4, 4, 128), (8, 2, 64), (8, 2, 128))
LENGTHS = (1024, 2048, 4096)
DTYPES = ("float32", "bfloat16")  # bf16: numba's bf16 micro-kernels against SDPA's bf16
# Decoding: one token, B = 1, Llama-3-8B's heads (32/8, E = 128, a (B, S, H, E) cache); 0.5
# to 512 MiB of fp32 K and V. Where a step's fixed costs weigh, the same bytes ran at other
# ratios with other heads and layouts (2-core Zen 4, numba's speed over sdpa's: 0.5 MiB of
# fp32 K and V 1.79x at 32/8 heads, 1.01x at 8/2 in transformers' layout; 8 MiB 2.53x and
# 1.83x), so up to SMALL_DECODE_BYTES a small model's step, 8/2 heads of a (B, H, S, E)
# cache, is timed at the same bytes too, and the lower of the two ratios stands for them.
DECODE_LENGTHS = (64, 256, 1024, 4096, 16384, 65536)
SMALL_DECODE_HEADS = (8, 2, 128)
SMALL_DECODE_BYTES = 8 << 20


def numba_from(ratios: dict[int, float]) -> int | None:
    """The shortest length from which numba was at least as fast at every longer length."""
    start = None
    for length in sorted(ratios, reverse=True):
        if ratios[length] < 1.0:
            break
        start = length
    return start


def calibrate_decode(
    lengths: tuple[int, ...],
    rounds: int,
    threads: int,
    on_progress: Callable[[str], None],
    dtype: str = "float32",
) -> DecodeRule:
    """Time numba's decoding step against sdpa's (attention_with_kvcache, B = 1, a cache in
    `dtype`) per cache length, and a small model's at the same bytes up to
    SMALL_DECODE_BYTES; the rule by bytes of K and V."""
    config = serving.ServingConfig(rounds=rounds, threads=threads)
    shape = (serving.DECODE_HEADS, serving.DECODE_KV_HEADS, serving.DECODE_HEAD_DIM)
    torch_dtype, ratios = getattr(torch, dtype), {}
    small_key_bytes = serving.kv_bytes(1, 1, *SMALL_DECODE_HEADS[1:], torch_dtype.itemsize)

    def ratio(length, heads, kv_heads, head_dim, head_major=False):
        calls = {b: serving.DecodeCall(b, 1, length, heads, kv_heads, head_dim,
                                       dtype=torch_dtype, head_major=head_major)
                 for b in ("sdpa", "numba")}  # fmt: skip
        timed = serving.race(config, calls)
        return round(timed["sdpa"].median_s / timed["numba"].median_s, 3)

    for length in lengths:
        read = serving.kv_bytes(1, length, *shape[1:], torch_dtype.itemsize)
        ratios[read] = ratio(length, *shape)
        if read <= SMALL_DECODE_BYTES:  # the same bytes in a small model's step
            small = ratio(read // small_key_bytes, *SMALL_DECODE_HEADS, head_major=True)
            ratios[read] = min(ratios[read], small)
        on_progress(f"decode {dtype} S={length}")
    return DecodeRule(numba_from(ratios), ratios, dtype)


def calibrate(
    lengths: tuple[int, ...] = LENGTHS,
    rounds: int = 5,
    threads: int | None = None,
    on_progress: Callable[[str], None] | None = None,
    decode_lengths: tuple[int, ...] = DECODE_LENGTHS,
) -> dict:
    """Time numba and sdpa over the classes; the table (not yet written)."""
    threads = threads or torch.get_num_threads()
    rules = []
    for dtype, (heads, kv_heads, head_dim) in itertools.product(DTYPES, SHAPES):
        config = BenchConfig(
            lengths=tuple(lengths), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            dtype=dtype, causal=(False, True), passes=PASSES, backends=("sdpa", "numba"),
            rounds=rounds, threads=threads, memory=False,
        )  # fmt: skip
        points = run_sweep(config, on_progress)
        medians = {(p.backend, p.length, p.causal, p.pass_): p.median_s for p in points}
        for causal in (False, True):
            for pass_ in PASSES:
                ratios = {}
                for length in lengths:
                    sdpa = medians.get(("sdpa", length, causal, pass_))
                    numba = medians.get(("numba", length, causal, pass_))
                    if sdpa and numba:
                        ratios[length] = round(sdpa / numba, 3)
                rule = Rule(head_dim, kv_heads != heads, causal, pass_ != "forward",
                            numba_from(ratios), ratios, dtype)  # fmt: skip
                rules.append(asdict(rule))
    decode = [calibrate_decode(decode_lengths, rounds, threads, on_progress or (lambda _: None),
                               dtype) for dtype in DTYPES]  # fmt: skip
    return {
        "schema": SCHEMA,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "fingerprint": fingerprint(threads),
        "lengths": list(lengths),
        "rounds": rounds,
        "rules": rules,
        "decode": [asdict(rule) for rule in decode],
    }


def write_table(table: dict, path: Path | None = None) -> Path:
    """Write the table where "auto" reads it (or to `path`); the next call reads it anew."""
    path = path or table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    load_table.cache_clear()
    return path
