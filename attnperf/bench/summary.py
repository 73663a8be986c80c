"""`attnperf bench --summary`: the README's verdict, measured on this CPU in a few minutes.

One short point per case, each contender in worker processes of its own, turns alternated
(the machinery of `sweep` and `serving`); each ratio is the peer's median time over
attnperf's (> 1: attnperf faster), the peer called as a careful user calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnperf.bench import serving
from attnperf.bench.report import speed_vs_peer
from attnperf.bench.sweep import BenchConfig, run_sweep

# (case, peer's form, BenchConfig fields): dense and short calls, numba against sdpa.
SWEEP_CASES = (
    ("dense fp32, L = 2048, causal, forward", "SDPA",
     {"lengths": (2048,), "causal": (True,), "passes": ("forward",)}),
    ("dense fp32, L = 2048, causal, forward+backward", "SDPA",
     {"lengths": (2048,), "causal": (True,), "passes": ("forward+backward",)}),
    ("dense bf16, L = 2048, causal, forward", "SDPA bf16",
     {"lengths": (2048,), "causal": (True,), "passes": ("forward",), "dtype": "bfloat16"}),
    ("dense bf16, L = 2048, causal, forward+backward", "SDPA bf16",
     {"lengths": (2048,), "causal": (True,), "passes": ("forward+backward",),
      "dtype": "bfloat16"}),
    ("short: B = 32, H = 12, L = 128, forward", "SDPA",
     {"lengths": (128,), "batch": 32, "heads": 12, "passes": ("forward",)}),
    ("causal window of 256 keys, L = 4096, forward", "SDPA under the materialised mask",
     {"lengths": (4096,), "causal": (True,), "passes": ("forward",), "window": 256}),
)  # fmt: skip
DECODE_LENGTH = 16384
# Timed rounds per case unless asked otherwise: each is one call after 20 ms of untimed ones,
# and this VM's slow spells last seconds. Zen 4, 2026-12-07: the short point read 0.71x and
# 1.07x in two runs of 3 rounds (numba 21-25 ms over 5 rounds alone, spreads 80-87%; 11.5
# ms over 27, its time back to back) and 1.33x in one of 7, as in one process with SDPA in
# turns (1.32-1.33x); the whole summary 1.6 -> 2.7 min.
ROUNDS = 7


def summary_rows(rounds: int, threads: int, on_progress: Callable[[str], None]) -> list[dict]:
    """[{case, ratio, peer}] for the dense, short, window, decode and varlen cases."""
    rows = []
    for case, peer, fields in SWEEP_CASES:
        config = BenchConfig(backends=("sdpa", "numba"), rounds=rounds, threads=threads,
                             memory=False, **fields)  # fmt: skip
        ratios = speed_vs_peer(run_sweep(config, lambda _: None))
        ratio = next((r for key, r in ratios.items() if key[0] == "numba"), None)
        rows.append({"case": case, "ratio": ratio, "peer": peer})
        on_progress(f"{case}: {ratio or 0:.2f}x")
    serving_config = serving.ServingConfig(rounds=rounds, threads=threads)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        timed = serving.race(serving_config, serving.decode_calls(1, DECODE_LENGTH, dtype=dtype))
        ratio = timed["sdpa rows"].median_s / timed["numba"].median_s
        case = f"decode, {name} cache, B = 1, S = {DECODE_LENGTH}, 32/8 heads"
        rows.append({"case": case, "ratio": ratio, "peer": f"SDPA {name}, group packed as rows"})
        on_progress(f"{case}: {ratio:.2f}x")
    lengths = serving.varlen_lengths(serving_config)
    for backward in (False, True):
        calls = {layout: serving.VarlenCall(backend, layout, lengths, serving_config.heads,
                                            serving_config.head_dim, backward)
                 for backend, layout in (("numba", "packed"), ("sdpa", "looped"))}  # fmt: skip
        timed = serving.race(serving_config, calls)
        ratio = timed["looped"].median_s / timed["packed"].median_s
        case = (f"packed causal batch of {len(lengths)} sequences (varlen), "
                f"{'forward+backward' if backward else 'forward'}")  # fmt: skip
        rows.append({"case": case, "ratio": ratio, "peer": "SDPA looped over the sequences"})
        on_progress(f"{case}: {ratio:.2f}x")
    return rows


def summary_markdown(rows: list[dict], cpu: str) -> str:
    lines = [f"attnperf vs its peer on {cpu} (> 1: attnperf faster)", "",
             "| case | attnperf vs peer | peer's form |", "|---|---|---|"]  # fmt: skip
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        lines.append(f"| {row['case']} | {ratio} | {row['peer']} |")
    return "\n".join(lines)
