"""The default bench's "beyond SDPA" section: what attnperf does that SDPA cannot do in its
own kernel, each against the peer a careful user would write. A causal sliding window,
against FlexAttention compiled (its compile time is the "first call") and SDPA under the
materialised mask; one decode step, against SDPA with the group packed as rows and with
enable_gqa. About a minute on 2 cores."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from attnperf.bench import serving
from attnperf.bench.report import build_report
from attnperf.bench.sweep import BenchConfig, run_sweep

WINDOW = 256
# Two lengths: SDPA under the materialised mask takes 1.6 s a call at 8192 (Zen 5).
WINDOW_LENGTHS = (2048, 4096)
DECODE_BATCH, DECODE_LENGTH = 1, 16384


def window_config(config: BenchConfig) -> BenchConfig:
    """The window points: the sweep's heads and dtype, forward, 3 rounds."""
    return replace(config, lengths=WINDOW_LENGTHS, causal=(True,), passes=("forward",),
                   backends=("sdpa", "numba", "flex"), rounds=3, window=WINDOW)  # fmt: skip


def beyond_sdpa(
    config: BenchConfig, sgemm_gflops: float | None, on_progress: Callable[[str], None]
) -> dict:
    """{"window": a bench report of the window points, "decode": one decode row (see
    serving.decode_row), "bandwidth_gbps": the read bandwidth of the same run}."""
    window = window_config(config)
    window_report = build_report(window, run_sweep(window, on_progress), sgemm_gflops)
    probes = serving.ServingConfig(threads=config.threads)
    _, bandwidth = serving.read_bandwidth(probes)
    timed = serving.race(probes, serving.decode_calls(DECODE_BATCH, DECODE_LENGTH))
    on_progress("decode done")
    decode = serving.decode_row(DECODE_BATCH, DECODE_LENGTH, timed, bandwidth)
    return {"window": window_report, "bandwidth_gbps": bandwidth / 1e9, "decode": decode}
