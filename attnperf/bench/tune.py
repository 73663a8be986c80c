"""`attnperf tune`: numba against sdpa measured on this machine, written as the table that
"auto" reads (attnperf.cpu_table).

`calibrate` times both on the call classes that matter (fp32 and bf16, causal or not,
forward or with backward, head dims 64 and 128, grouped-query or not, L = S from 1024 up)
in processes of their own (attnperf.bench.sweep), and `write_table` stores, per class, the
shortest length from which numba was at least as fast as sdpa at that length and every
longer one measured.
Decoding steps likewise (attnperf.bench.serving): the smallest cache, in bytes of K and V,
from which numba's step was at least as fast as sdpa's, which packs the group as rows.
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
# and grouped-query (4 query heads per kv head) at 64.
SHAPES = ((8, 8, 64), (4, 4, 128), (8, 2, 64))
LENGTHS = (1024, 2048, 4096)
DTYPES = ("float32", "bfloat16")  # bf16: numba's bf16 micro-kernels against SDPA's bf16
# Decoding: one token, B = 1, Llama-3-8B's heads; 8 to 512 MiB of K and V.
DECODE_LENGTHS = (1024, 4096, 16384, 65536)


def numba_from(ratios: dict[int, float]) -> int | None:
    """The shortest length from which numba was at least as fast at every longer length."""
    start = None
    for length in sorted(ratios, reverse=True):
        if ratios[length] < 1.0:
            break
        start = length
    return start


def calibrate_decode(
    lengths: tuple[int, ...], rounds: int, threads: int, on_progress: Callable[[str], None]
) -> DecodeRule:
    """Time numba's decoding step against sdpa's (attention_with_kvcache, B = 1) per cache
    length; the rule by bytes of K and V."""
    config = serving.ServingConfig(rounds=rounds, threads=threads)
    shape = (serving.DECODE_HEADS, serving.DECODE_KV_HEADS, serving.DECODE_HEAD_DIM)
    ratios = {}
    for length in lengths:
        calls = {b: serving.DecodeCall(b, 1, length, *shape) for b in ("sdpa", "numba")}
        timed = serving.race(config, calls)
        read = serving.kv_bytes(1, length, *shape[1:])
        ratios[read] = round(timed["sdpa"].median_s / timed["numba"].median_s, 3)
        on_progress(f"decode S={length}")
    return DecodeRule(numba_from(ratios), ratios)


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
    decode = calibrate_decode(decode_lengths, rounds, threads, on_progress or (lambda _: None))
    return {
        "schema": SCHEMA,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "fingerprint": fingerprint(threads),
        "lengths": list(lengths),
        "rounds": rounds,
        "rules": rules,
        "decode": asdict(decode),
    }


def write_table(table: dict, path: Path | None = None) -> Path:
    """Write the table where "auto" reads it (or to `path`); the next call reads it anew."""
    path = path or table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    load_table.cache_clear()
    return path
