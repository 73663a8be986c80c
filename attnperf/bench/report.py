"""Benchmark reports: table, JSON (pytest-benchmark's layout), Markdown, PNG plots, fits."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from attnperf.bench.sweep import BenchConfig, Measurement, fit_exponent
from attnperf.machine import cpu_description

PEER = "sdpa"
MIB = 2**20


def machine_info(config: BenchConfig) -> dict:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for module in ("numba", "triton", "numpy"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    device = config.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device = torch.cuda.get_device_name(device)
    return {
        "node": platform.node(),
        "processor": platform.processor() or platform.machine(),
        **cpu_description(),
        "cpu_count": os.cpu_count(),
        "threads": config.threads,
        "device": device,
        "versions": versions,
    }


def speed_vs_peer(points: list[Measurement]) -> dict[tuple, float]:
    """sdpa's median time / the backend's, per point (> 1: faster than sdpa)."""
    peer = {(p.length, p.causal, p.pass_): p.median_s for p in points if p.backend == PEER}
    ratios = {}
    for p in points:
        peer_time = peer.get((p.length, p.causal, p.pass_))
        if p.median_s and peer_time:
            ratios[(p.backend, p.length, p.causal, p.pass_)] = peer_time / p.median_s
    return ratios


def local_exponent(lengths: list[int], values: list[float]) -> float | None:
    """The slope of log(value) on log(L) between the two largest lengths: where per-call
    overhead no longer bends the whole-range fit below the kernel's true growth."""
    pairs = sorted((x, y) for x, y in zip(lengths, values, strict=True) if y and y > 0)
    if len(pairs) < 2 or pairs[-1][0] == pairs[-2][0]:
        return None
    (x0, y0), (x1, y1) = pairs[-2:]
    return math.log(y1 / y0) / math.log(x1 / x0)


def growth_fits(points: list[Measurement]) -> list[dict]:
    """Per backend, pass and causal: the exponent of time and of peak memory in L, fitted
    over every length and between the two largest."""
    series: dict[tuple, list[Measurement]] = {}
    for p in points:
        if p.status == "ok":
            series.setdefault((p.backend, p.pass_, p.causal), []).append(p)
    fits = []
    for (backend, pass_, causal), measured in series.items():
        lengths = [p.length for p in measured]
        row = {"backend": backend, "pass": pass_, "causal": causal}
        for name, values in (
            ("time", [p.median_s for p in measured]),
            ("memory", [p.peak_extra_bytes or 0 for p in measured]),
        ):
            fit = fit_exponent(lengths, values)
            row[f"{name}_exponent"], row[f"{name}_r2"] = fit if fit else (None, None)
            row[f"{name}_local_exponent"] = local_exponent(lengths, values)
        row["upper_lengths"] = sorted(lengths)[-2:]
        fits.append(row)
    return fits


def build_report(
    config: BenchConfig,
    points: list[Measurement],
    sgemm_gflops: float | None = None,
    peak_gflops: float | None = None,
    peak_kind: str = "fp32 FMA",
) -> dict:
    """The machine-readable report; `benchmarks` follows pytest-benchmark's layout.
    `sgemm_gflops` and `peak_gflops` (the chip's peak for the call's dtype: `peak_kind`),
    measured in the same run, give each point's GFLOP/s as a fraction of each (None: not
    measured, e.g. on a GPU)."""
    ratios = speed_vs_peer(points)
    benchmarks = []
    for p in points:
        causal = "causal" if p.causal else "full"
        extra = p.to_dict()
        extra["speed_vs_sdpa"] = ratios.get((p.backend, p.length, p.causal, p.pass_))
        extra["of_sgemm"] = p.gflops / sgemm_gflops if p.gflops and sgemm_gflops else None
        extra["of_peak"] = p.gflops / peak_gflops if p.gflops and peak_gflops else None
        benchmarks.append(
            {
                "name": f"{p.backend}[L={p.length},{p.pass_},{causal}]",
                "group": f"{p.pass_} {causal} L={p.length}",
                "stats": {
                    "min": p.min_s,
                    "max": p.max_s,
                    "median": p.median_s,
                    "rounds": len(p.times_s),
                    "data": p.times_s,
                },
                "extra_info": extra,
            }
        )
    return {
        "attnperf_version": __import__("attnperf").__version__,
        "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine_info": machine_info(config),
        "sgemm_gflops": sgemm_gflops,
        "peak_gflops": peak_gflops,
        "peak_kind": peak_kind,
        "config": asdict(config),
        "benchmarks": benchmarks,
        "fits": growth_fits(points),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def left_out(report: dict) -> dict[str, str]:
    """Backends with no measured point (unavailable here), each with why."""
    reasons: dict[str, str] = {}
    measured = set()
    for e in (b["extra_info"] for b in report["benchmarks"]):
        if e["status"] == "ok":
            measured.add(e["backend"])
        else:
            reasons.setdefault(e["backend"], e["status"])
    return {backend: why for backend, why in reasons.items() if backend not in measured}


def left_out_note(report: dict) -> str:
    """One line under the table naming what it leaves out, or ''."""
    absent = left_out(report)
    return "; ".join(f"{b} left out ({why})" for b, why in absent.items())


def table_rows(report: dict) -> list[list[str]]:
    """Header and rows: each length's backends side by side; backends without any measured
    point are left out (`left_out_note` says why)."""
    rows = [
        [
            "pass",
            "mask",
            "L",
            "backend",
            "median ms",
            "spread",
            "GFLOP/s",
            "of sgemm",
            "of peak",
            "peak extra MiB",
            "vs sdpa",
            "first call s",
            "note",
        ]
    ]
    absent = left_out(report)
    entries = sorted(
        (b["extra_info"] for b in report["benchmarks"] if b["extra_info"]["backend"] not in absent),
        key=lambda e: (e["pass"], e["causal"], e["length"]),
    )
    for e in entries:
        ok = e["status"] == "ok"
        rows.append(
            [
                e["pass"],
                "causal" if e["causal"] else "full",
                str(e["length"]),
                e["backend"],
                _fmt(e["median_s"] and e["median_s"] * 1e3, ".2f"),
                _fmt((e["max_s"] - e["min_s"]) / e["median_s"] * 100 if ok else None, ".0f")
                + "%" * ok,
                _fmt(e["gflops"], ".1f"),
                _fmt(e.get("of_sgemm") and e["of_sgemm"] * 100, ".0f")
                + "%" * bool(e.get("of_sgemm")),
                _fmt(e.get("of_peak") and e["of_peak"] * 100, ".0f") + "%" * bool(e.get("of_peak")),
                _fmt(e["peak_extra_bytes"] and e["peak_extra_bytes"] / MIB, ".1f") if ok else "-",
                _fmt(e["speed_vs_sdpa"], ".2f") + ("x" if e["speed_vs_sdpa"] else ""),
                _fmt(e["first_call_s"], ".2f"),
                e.get("note", "") if ok else e["status"],
            ]
        )
    return rows


FIT_NOTE = (
    "k over all lengths is bent low by per-call overhead at short L; k between the two "
    "largest lengths is the kernel's growth. Ideal: time k = 2 for dense attention (causal "
    "too), 1 with a sliding window or a layout whose blocks per row stay fixed, for kernels "
    "that skip what is masked; memory k = 1 for fused kernels, 2 for ones that hold the "
    "L x S scores."
)


def fit_rows(report: dict) -> list[list[str]]:
    rows = [["backend", "pass", "mask", "time k (all L)", "R^2", "time k (top 2)",
             "memory k (all L)", "memory k (top 2)", "top 2 lengths"]]  # fmt: skip
    for f in report["fits"]:
        rows.append(
            [
                f["backend"],
                f["pass"],
                "causal" if f["causal"] else "full",
                _fmt(f["time_exponent"], ".2f"),
                _fmt(f["time_r2"], ".3f"),
                _fmt(f.get("time_local_exponent"), ".2f"),
                _fmt(f["memory_exponent"], ".2f"),
                _fmt(f.get("memory_local_exponent"), ".2f"),
                ", ".join(str(x) for x in f.get("upper_lengths", [])),
            ]
        )
    return rows


def sgemm_text(report: dict) -> str:
    """The run's sgemm anchor in words."""
    rate = report.get("sgemm_gflops")
    if rate is None:
        return "not measured in this run"
    return f"{rate:.0f} GFLOP/s (torch.mm of 2048^2 fp32 matrices, same run and threads)"


def peak_text(report: dict) -> str:
    """The run's peak anchor in words."""
    rate = report.get("peak_gflops")
    if rate is None:
        return "not measured in this run"
    kind = report.get("peak_kind", "fp32 FMA")
    return f"{rate:.0f} GFLOP/s ({kind}, a register-only loop, one thread x threads)"


def decode_table(rows: list[dict]) -> tuple[list[str], list[tuple[str, ...]]]:
    """(header, rows) of decode points: numba against SDPA with the group packed as rows (the
    careful form) and with enable_gqa; each one's share of the read bandwidth."""
    header = ["B", "cache S", "numba ms", "sdpa rows ms", "sdpa gqa ms", "numba vs sdpa rows",
              "numba vs sdpa gqa", "numba of read bw", "sdpa rows of read bw"]  # fmt: skip
    return header, [
        (str(r["batch"]), str(r["length"]), f"{r['numba_s'] * 1e3:.2f}",
         f"{r['sdpa_rows_s'] * 1e3:.2f}", f"{r['sdpa_gqa_s'] * 1e3:.2f}",
         f"{r['vs_sdpa_rows']:.2f}x", f"{r['vs_sdpa_gqa']:.2f}x",
         f"{r['numba_bandwidth_share']:.0%}", f"{r['sdpa_rows_bandwidth_share']:.0%}")
        for r in rows
    ]  # fmt: skip


def beyond_title(beyond: dict) -> str:
    config = beyond["window"]["config"]
    return (f"causal sliding window of {config['window']} keys, forward, against "
            "FlexAttention compiled ('first call': its compile) and sdpa under the "
            "materialised mask")  # fmt: skip


def decode_title(beyond: dict) -> str:
    return (f"one decode step, Llama-3-8B heads (32/8, E = 128), fp32; read bandwidth (same "
            f"run) {beyond['bandwidth_gbps']:.1f} GB/s")  # fmt: skip


def beyond_markdown(beyond: dict) -> list[str]:
    """The "beyond SDPA" section of report.md."""
    header, rows = decode_table([beyond["decode"]])
    return ["## Beyond SDPA", beyond_title(beyond), md_table(table_rows(beyond["window"])),
            decode_title(beyond), md_table([header, *rows])]  # fmt: skip


def md_table(rows) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    info = report["machine_info"]
    config = report["config"]
    return "\n\n".join(
        [
            "# attnperf benchmark",
            f"{report['datetime']} on {info.get('cpu_model', info['processor'])} "
            f"({info.get('vector_isa', '?')}, torch's CPU kernels "
            f"{info.get('torch_cpu_capability', '?')}; {info['cpu_count']} CPUs, "
            f"{info['threads']} threads), device {info['device']}; versions "
            + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v),
            f"B={config['batch']}, H={config['heads']}, "
            f"kv heads {config.get('kv_heads') or config['heads']}, E={config['head_dim']}, "
            f"{config['dtype']}, L=S; median of {config['rounds']} rounds after warm-up. "
            "GFLOP/s counts 4·B·H·L·S·E forward (half when causal), x3.5 with backward; "
            f"'of sgemm' is its fraction of this machine's sgemm rate, {sgemm_text(report)}; "
            f"'of peak' of the chip's peak, {peak_text(report)}. "
            "'vs sdpa' is sdpa's median time over the backend's (> 1: faster); spread is "
            "(max - min) / median; 'first call' includes JIT compilation or cache loading.",
            md_table(table_rows(report)),
            left_out_note(report),
            "## Growth in L (value ~ L^k: least-squares fit of log value on log L)",
            FIT_NOTE,
            md_table(fit_rows(report)),
            "![time](time_vs_length.png)\n\n![memory](memory_vs_length.png)",
            *(beyond_markdown(report["beyond_sdpa"]) if "beyond_sdpa" in report else []),
        ]
    )


def _pyplot():
    """matplotlib's pyplot on its file backend (no screen), imported when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axes(ax, ylabel: str, title: str) -> None:
    """A panel against L on log-log axes, gridded, with its legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L = S")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def plot(report: dict, out_dir: Path) -> list[Path]:
    """Log-log time and peak-memory plots against L, one line per backend."""
    plt = _pyplot()
    entries = [b["extra_info"] for b in report["benchmarks"] if b["extra_info"]["status"] == "ok"]
    panels = sorted({(e["pass"], e["causal"]) for e in entries})
    fits = {(f["backend"], f["pass"], f["causal"]): f for f in report["fits"]}
    paths = []
    for metric, label, scale in (
        ("median_s", "time per call (ms)", 1e3),
        ("peak_extra_bytes", "peak extra memory (MiB)", 1 / MIB),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
        for ax, (pass_, causal) in zip(axes[0], panels, strict=True):
            for backend in sorted({e["backend"] for e in entries}):
                series = sorted(
                    (e["length"], e[metric] * scale)
                    for e in entries
                    if e["backend"] == backend
                    and e["pass"] == pass_
                    and e["causal"] == causal
                    and e[metric]
                )
                if not series:
                    continue
                fit = fits.get((backend, pass_, causal), {})
                exponent = fit.get("time_exponent" if metric == "median_s" else "memory_exponent")
                name = f"{backend} (~L^{exponent:.2f})" if exponent is not None else backend
                ax.plot(*zip(*series, strict=True), marker="o", label=name)
            _log_axes(ax, label, f"{pass_}, {'causal' if causal else 'full'}")
        fig.suptitle(f"attnperf on {report['machine_info']['device']}")
        fig.tight_layout()
        path = out_dir / ("time_vs_length.png" if metric == "median_s" else "memory_vs_length.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _span(values: list[float], spec: str) -> str:
    low, high = min(values), max(values)
    return f"{low:{spec}}" if f"{low:{spec}}" == f"{high:{spec}}" else f"{low:{spec}}-{high:{spec}}"


def verdict(reports: list[dict], backend: str = "numba") -> list[str]:
    """A few lines that end the sweep: per dtype, pass and mask, the range over L of
    `backend`'s speed against SDPA, and of its share of the chip's peak, on this machine."""
    lines = []
    for report in reports:
        cases = {}
        for entry in (b["extra_info"] for b in report["benchmarks"]):
            if entry["backend"] == backend and entry["speed_vs_sdpa"]:
                cases.setdefault((entry["pass"], entry["causal"]), []).append(entry)
        dtype = report["config"]["dtype"]
        for (pass_, causal), entries in sorted(cases.items()):
            speeds = [e["speed_vs_sdpa"] for e in entries]
            lengths = sorted(e["length"] for e in entries)
            case = f"{dtype} {pass_}{', causal' if causal else ''}"
            text = (f"{backend} vs SDPA, {case}: {_span(speeds, '.2f')}x SDPA's speed "
                    f"(L {lengths[0]}-{lengths[-1]})")  # fmt: skip
            peaks = [e["of_peak"] for e in entries if e.get("of_peak")]
            if peaks:
                text += (f", {_span([100 * p for p in peaks], '.0f')}% of the "
                         f"{report.get('peak_kind', 'fp32 FMA')} peak")  # fmt: skip
            lines.append(text)
    if lines:
        machine = reports[0]["machine_info"]
        where = (f"{machine['cpu_model']} ({machine['vector_isa']}), {machine['threads']} threads"
                 if machine["device"] == "cpu" else machine["device"])  # fmt: skip
        lines.append(f"(> 1x: faster than SDPA; measured here: {where})")
    return lines


def dtypes_plot(reports: list[dict], path: Path, backend: str = "numba") -> Path:
    """One figure of time against L: `backend` and SDPA in each dtype, a panel per pass
    (the README's plot)."""
    plt = _pyplot()
    passes = sorted({b["extra_info"]["pass"] for r in reports for b in r["benchmarks"]},
                    key=lambda p: p != "forward")  # fmt: skip
    fig, axes = plt.subplots(1, len(passes), figsize=(6 * len(passes), 4.5), squeeze=False)
    colors = {"float32": "tab:blue", "bfloat16": "tab:green", "float16": "tab:purple"}
    for ax, pass_ in zip(axes[0], passes, strict=True):
        for report in reports:
            dtype = report["config"]["dtype"]
            for name, style in ((backend, "-"), (PEER, "--")):
                series = sorted((e["length"], e["median_s"] * 1e3)
                                for e in (b["extra_info"] for b in report["benchmarks"])
                                if e["backend"] == name and e["pass"] == pass_
                                and not e["causal"] and e["median_s"])  # fmt: skip
                if series:
                    ax.plot(*zip(*series, strict=True), style, marker="o", color=colors.get(dtype),
                            label=f"{name} {dtype}")  # fmt: skip
        _log_axes(ax, "time per call (ms)", pass_)
    config, machine = reports[0]["config"], reports[0]["machine_info"]
    fig.suptitle(f"attnperf bench: B={config['batch']}, H={config['heads']}, "
                 f"E={config['head_dim']}; {machine['cpu_model']} ({machine['vector_isa']}), "
                 f"{machine['threads']} threads")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """report.json, report.md and the two PNG plots under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2))
    md_path = out_dir / "report.md"
    md_path.write_text(markdown(report) + "\n")
    return [json_path, md_path, *plot(report, out_dir)]


def compare_to_baseline(report: dict, baseline: dict, min_loss: float = 0.25) -> list[str]:
    """Warnings for points that lost speed against the baseline beyond the measured noise.

    A backend's speed is taken relative to sdpa in the same run, which cancels the machine
    getting faster or slower between runs; sdpa itself is the yardstick, never flagged.
    Noise is the runs' spreads, (max - min) / median, of the backend and of sdpa, both runs
    added; a point warns when the fraction of speed it lost exceeds max(min_loss, noise).
    min_loss is 25%: between two quiet runs on a 2-core machine, same-run ratios of unchanged
    code moved by up to ~40% at L <= 512. Never an error.
    """

    def by_key(rep):
        return {
            (e["backend"], e["length"], e["causal"], e["pass"]): e
            for e in (b["extra_info"] for b in rep["benchmarks"])
            if e["status"] == "ok"
        }

    def spread(entry):
        return (entry["max_s"] - entry["min_s"]) / entry["median_s"]

    # A report from before the variants has none of their fields: the defaults, a dense run.
    variant = {f: BenchConfig.__dataclass_fields__[f].default
               for f in ("window", "softcap", "alibi", "block_mask")}  # fmt: skip
    if any(baseline["config"].get(f, d) != report["config"].get(f, d) for f, d in variant.items()):
        return ["baseline not compared: it measured another variant (window, softcap, alibi "
                "or block mask)"]  # fmt: skip
    old, new = by_key(baseline), by_key(report)
    warnings = []
    for key in sorted(old.keys() & new.keys(), key=str):
        backend, length, causal, pass_ = key
        peer_key = (PEER, length, causal, pass_)
        if backend == PEER or peer_key not in old.keys() & new.keys():
            continue
        entries = (old[key], new[key], old[peer_key], new[peer_key])
        noise = sum(spread(e) for e in entries)
        before = old[peer_key]["median_s"] / old[key]["median_s"]
        after = new[peer_key]["median_s"] / new[key]["median_s"]
        loss = 1 - after / before
        if loss > max(min_loss, noise):
            warnings.append(
                f"regression: {backend} L={length} {pass_} {'causal' if causal else 'full'}: "
                f"{before:.2f}x -> {after:.2f}x sdpa's speed (-{loss:.0%}, noise {noise:.0%})"
            )
    return warnings
