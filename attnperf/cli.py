"""`attnperf` command line: `info` (the capability table), `warmup`, `smoke`, `bench` and
`tune`."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

import attnperf
from attnperf import cpu_table, dispatch, warmup
from attnperf.bench import linear, serving, summary, tune
from attnperf.bench.beyond import beyond_sdpa
from attnperf.bench.report import (
    FIT_NOTE,
    beyond_title,
    build_report,
    compare_to_baseline,
    decode_table,
    decode_title,
    dtypes_plot,
    fit_rows,
    left_out_note,
    peak_text,
    sgemm_text,
    table_rows,
    verdict,
    write_report,
)
from attnperf.bench.sweep import (
    BLOCK_MASKS,
    DOCUMENT_LENGTH,
    PASSES,
    PEERS,
    BenchConfig,
    run_sweep,
)
from attnperf.kernels.numba.jit import MISSING as NUMBA_MISSING
from attnperf.kernels.numba.microkernels import tile_route
from attnperf.machine import cpu_description
from attnperf.testing import initialize_mkl_vml


def info_table() -> str:
    rows = [("backend", "status", "devices", "dtypes", "max head dim", "features")]
    for entry in attnperf.backends():
        status = (
            "available" if entry["available"] else f"unavailable: {entry['unavailable_reason']}"
        )
        rows.append(
            (
                str(entry["name"]),
                status,
                ",".join(entry["devices"]),
                ",".join(entry["dtypes"]),
                str(entry["max_head_dim"] or "any"),
                ",".join(entry["features"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def numba_tile_routes() -> list[str]:
    """numba's tile-product route per dtype, and why."""
    if NUMBA_MISSING:
        return [f"numba tiles: none ({NUMBA_MISSING})"]
    lines = []
    for dtypes, kind in (("fp32, fp16", "fp32"), ("bf16", "bf16")):
        route, why = tile_route(kind)
        lines.append(f"numba tiles, {dtypes}: {route} ({why})")
    return lines


def warmup_command(args: argparse.Namespace) -> int:
    """Compile numba's kernels for this CPU, the jobs in parallel, a line as each ends."""
    if NUMBA_MISSING:
        print(f"attnperf warmup: nothing to compile, numba backend unavailable: {NUMBA_MISSING}",
              file=sys.stderr)  # fmt: skip
        return 1
    names = tuple(warmup.JOBS) if args.all else warmup.DEFAULT_JOBS
    workers = min(args.workers, len(names))
    cpu = cpu_description()
    print(f"attnperf warmup: compiling numba's kernels for {cpu['cpu_model']} "
          f"({cpu['vector_isa']}) into {warmup.cache_folder()}: {len(names)} jobs on "
          f"{workers} processes; once per machine, ~1 min a job on its first run",
          flush=True)  # fmt: skip
    seconds = warmup.warmup(names, workers, lambda line: print(line, flush=True))
    print(f"done in {seconds:.0f} s; a process loads a compiled kernel in about a second")
    return 0


def smoke(device: str) -> int:
    """Run one small call on every available backend and compare it with sdpa."""
    initialize_mkl_vml()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device=device) for _ in range(3))
    expected = attnperf.attention(q, k, v, is_causal=True, backend="sdpa")
    failures = 0
    for entry in attnperf.backends():
        name = str(entry["name"])
        try:
            out = attnperf.attention(q, k, v, is_causal=True, backend=name)
        except attnperf.BackendNotSupportedError as error:
            print(f"{name:10s} skipped: {error}")
            continue
        err = (out - expected).abs().max().item()
        ok = err < 1e-4
        failures += not ok
        print(f"{name:10s} max |out - sdpa| = {err:.2e}  {'ok' if ok else 'MISMATCH'}")
    return 1 if failures else 0


QUICK_LENGTHS = (256, 512, 1024)


def decode_first(numba_from_bytes: int | None) -> str:
    """Which backend a decode rule puts first, and from what size of K and V."""
    if numba_from_bytes is None:
        return "sdpa"
    return f"numba from {numba_from_bytes / 2**20:g} MiB of K and V"


def tune_command(args: argparse.Namespace) -> int:
    """Measure numba against sdpa here and write the table that "auto" reads on CPU."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=None if sys.stdout.isatty() else 160)
    lengths = tuple(args.lengths or tune.LENGTHS)
    decode_lengths = tuple(args.decode_lengths or tune.DECODE_LENGTHS)
    jobs = len(tune.DTYPES) * (len(tune.SHAPES) * len(lengths) * 2 * 2 * 2 + len(decode_lengths))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("tuning", total=jobs)
        table = tune.calibrate(
            lengths, args.rounds, args.threads,
            lambda done: progress.update(task, advance=1, description=done), decode_lengths,
        )  # fmt: skip
    path = tune.write_table(table)
    for rule in table["rules"]:
        kind = (f"{rule['dtype']} E={rule['head_dim']}{' GQA' if rule['gqa'] else ''} "
                f"{'causal' if rule['causal'] else 'full'} "
                f"{'forward+backward' if rule['backward'] else 'forward'}")  # fmt: skip
        ratios = ", ".join(f"L={length}: {ratio:.2f}x" for length, ratio in rule["ratios"].items())
        first = f"numba from L={rule['numba_from']}" if rule["numba_from"] else "sdpa"
        console.print(f"{kind:42s} {first:22s} numba/sdpa {ratios}", highlight=False)
    for decode in table["decode"]:
        first = decode_first(decode["numba_from_bytes"])
        ratios = ", ".join(f"{int(size) / 2**20:g} MiB: {ratio:.2f}x"
                           for size, ratio in decode["ratios"].items())  # fmt: skip
        kind = f"{decode['dtype']} decoding steps"
        console.print(f"{kind:42s} {first:22s} numba/sdpa {ratios}", highlight=False)
    console.print(f"written: {path}", highlight=False)
    return 0


def bench_dtypes(args: argparse.Namespace) -> tuple[str, ...]:
    """The dtypes a sweep measures: --dtype's, else fp32 and bf16 (fp32 alone for --quick,
    CI's sweep against a fp32 baseline)."""
    if args.dtype:
        return tuple(dict.fromkeys(args.dtype))
    return ("float32",) if args.quick else ("float32", "bfloat16")


def bench(args: argparse.Namespace, baseline: dict | None) -> int:
    """Sweep each dtype, print its table and growth fits, write its report folder (the
    first dtype's in --out, the others' in --out/<dtype>)."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    dtypes = bench_dtypes(args)
    config = BenchConfig(
        lengths=tuple(args.lengths or (QUICK_LENGTHS if args.quick else BenchConfig.lengths)),
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dtypes[0],
        causal={"no": (False,), "yes": (True,), "both": (False, True)}[args.causal],
        passes=PASSES if args.pass_ == "both" else (args.pass_,),
        backends=tuple(args.backends or (n for n in dispatch.registry() if n != "reference")),
        device=args.device,
        rounds=args.rounds if args.rounds is not None else (7 if args.quick else 3),
        threads=args.threads or torch.get_num_threads(),
        window=args.window,
        softcap=args.softcap,
        alibi=args.alibi,
        block_mask=args.block_mask,
    )
    console = Console(width=None if sys.stdout.isatty() else 160)  # CI logs: no wrapping
    sgemm = serving.sgemm_rate(config) / 1e9 if config.device == "cpu" else None

    def show(rows, title):
        table = Table(title=title)
        for column in rows[0]:
            table.add_column(column, overflow="fold")
        for row in rows[1:]:
            table.add_row(*row)
        console.print(table)

    with_beyond = args.beyond and not (args.quick or config.describe_variant()
                                       or config.device != "cpu")  # fmt: skip
    jobs = warmup.jobs_for(dtypes, decoding=with_beyond)
    if "numba" in config.backends and not NUMBA_MISSING and config.device == "cpu":
        console.print(f"numba's kernels for {', '.join(dtypes)} on this CPU (compiled once per "
                      "machine, ~1.5 min on 2 cores; `attnperf warmup` does it ahead):",
                      highlight=False)  # fmt: skip
        warmup.warmup(jobs, min(len(jobs), os.cpu_count() or 1),
                      lambda line: console.print(line, style="dim", highlight=False))  # fmt: skip
    points_per_dtype = (len(config.lengths) * len(config.causal) * len(config.passes)
                        * 2 * len(config.backends))  # fmt: skip
    total = points_per_dtype * len(dtypes)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("benchmarking", total=total)
        steps = itertools.count(1)

        def on_progress(dtype):
            def step(what):
                if console.is_terminal:
                    progress.update(task, advance=1, description=f"{dtype} {what}")
                else:  # a log: a line a step
                    console.print(f"[{next(steps)}/{total}] {dtype} {what}", highlight=False)

            return step

        sweeps = [run_sweep(replace(config, dtype=dtype), on_progress(dtype)) for dtype in dtypes]
    reports = []
    for dtype, points in zip(dtypes, sweeps, strict=True):
        dtype_config = replace(config, dtype=dtype)
        peak = serving.peak_rate(dtype, config.threads) if config.device == "cpu" else None
        report = build_report(dtype_config, points, sgemm, peak and peak / 1e9,
                              serving.peak_kind(dtype))  # fmt: skip
        show(table_rows(report), bench_title(dtype_config, report))
        if left_out_note(report):
            console.print(left_out_note(report), highlight=False)
        show(fit_rows(report), f"growth in L ({dtype}): value ~ L^k")
        reports.append(report)
    console.print(FIT_NOTE, highlight=False)
    if with_beyond:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("beyond SDPA", total=None)
            beyond = beyond_sdpa(
                config, sgemm, lambda done: progress.update(task, description=done)
            )
        reports[0]["beyond_sdpa"] = beyond
        show(table_rows(beyond["window"]), f"beyond SDPA: {beyond_title(beyond)}")
        header, rows = decode_table([beyond["decode"]])
        show([header, *rows], f"beyond SDPA: {decode_title(beyond)}")
    for index, (dtype, report) in enumerate(zip(dtypes, reports, strict=True)):
        folder = Path(args.out) if index == 0 else Path(args.out) / dtype
        written = write_report(report, folder)
        console.print("report: " + ", ".join(str(path) for path in written), highlight=False)
    if len(reports) > 1:
        path = dtypes_plot(reports, Path(args.out) / "time_vs_length_dtypes.png")
        console.print(f"plot of the dtypes side by side: {path}", highlight=False)
    if baseline is not None:
        compared = baseline["config"].get("dtype", "float32")
        report = next((r for r in reports if r["config"]["dtype"] == compared), None)
        warnings = (compare_to_baseline(report, baseline) if report is not None
                    else [f"baseline not compared: it measured {compared}"])  # fmt: skip
        for warning in warnings:
            console.print(f"WARNING {warning}", style="yellow", highlight=False)
        if not warnings:
            console.print(f"no regression against {args.baseline} beyond measured noise")
    lines = verdict(reports)
    if lines:
        console.print("\nverdict:", style="bold", highlight=False)
        for line in lines:
            console.print("  " + line, highlight=False)
    return 0


def bench_title(config: BenchConfig, report: dict) -> str:
    """A sweep table's title: dtype, shape, threads, device, variant, sgemm and peak."""
    kv = f"/{config.kv_heads}" if config.kv_heads and config.kv_heads != config.heads else ""
    shape = f"B={config.batch}, H={config.heads}{kv}, E={config.head_dim}"
    cpu = report["machine_info"]
    device = (
        config.device
        if config.device != "cpu"
        else (f"cpu {cpu['cpu_model']} ({cpu['vector_isa']})")
    )
    title = f"attnperf bench: {config.dtype}, {shape}, {config.threads} threads, {device}"
    if config.describe_variant():
        title += f"; {config.describe_variant()}"
    return title + f"; sgemm {sgemm_text(report)}; peak {peak_text(report)}"


def table_printers():
    """(show(title, header, rows), progress(text)): rich tables and dim progress lines on one
    console (160 columns when not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)

    def show(title, header, rows):
        table = Table(title=title)
        for column in header:
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)

    def progress(text):
        console.print(text, style="dim", highlight=False)

    return show, progress


def bench_summary(args: argparse.Namespace) -> int:
    """The verdict table: one short point per case, on this CPU (a few minutes)."""
    cpu, threads = cpu_description(), args.threads or torch.get_num_threads()
    where = f"{cpu['cpu_model']} ({cpu['vector_isa']}), {threads} threads"
    rows = summary.summary_rows(
        args.rounds or summary.ROUNDS, threads, lambda text: print(text, file=sys.stderr)
    )
    print(summary.summary_markdown(rows, where))
    return 0


def bench_serving(args: argparse.Namespace) -> int:
    """--decode and --varlen: the serving sweeps, printed and written to serving.json."""
    defaults = serving.ServingConfig()
    config = serving.ServingConfig(
        decode_lengths=tuple(args.lengths or defaults.decode_lengths),
        batches=tuple(args.decode_batches or defaults.batches),
        draft_tokens=args.draft_tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype[0] if args.dtype else defaults.dtype,
        rounds=args.rounds or defaults.rounds,
        threads=args.threads or torch.get_num_threads(),
    )
    show, progress = table_printers()
    cpu = cpu_description()
    where = (
        f"{config.threads} threads, cpu {cpu['cpu_model']} ({cpu['vector_isa']}), {config.dtype}"
    )

    report = {"config": vars(config) | {"machine": cpu}}
    if args.decode:
        result = serving.decode_sweep(config, progress)
        report["decode"] = result
        heads = (f"Hq={serving.DECODE_HEADS}, H={serving.DECODE_KV_HEADS}, "
                 f"E={serving.DECODE_HEAD_DIM}")  # fmt: skip
        show(f"decode, one query token: {heads}; {where}; memory bandwidth (same run): read "
             f"{result['bandwidth_gbps']:.1f} GB/s (a sum), copy {result['copy_gbps']:.1f} "
             "GB/s (read + write)", *decode_table(result["decode"]))  # fmt: skip
        if result["speculative"]:
            show(f"speculative step, {config.draft_tokens} query tokens, bottom-right causal: "
                 f"{heads}; {where}; SDPA under the causal mask (rows: tiled per query head of "
                 "the group)", *decode_table(result["speculative"]))  # fmt: skip
        show(f"split-K, numba, B=1 (below the threads), {heads}; {where}",
             ["cache S", "one pass ms", "split-K ms", "gain"],
             [(str(r["length"]), f"{r['one_pass_s'] * 1e3:.2f}", f"{r['split_s'] * 1e3:.2f}",
               f"{r['gain']:.2f}x") for r in result["split_k"]])  # fmt: skip
    if args.varlen:
        result = serving.varlen_sweep(config, progress)
        report["varlen"] = result
        ratio = result["padded_squares"] / result["sum_squares"]
        show(f"varlen, causal, {config.sequences} sequences of {result['lengths']} tokens, "
             f"H={config.heads}, E={config.head_dim}; {where}; B x max(L)^2 / sum(L^2) = "
             f"{ratio:.2f}",
             ["pass", "call", "median ms", "time / numba packed (> 1: numba faster)"],
             [(r["pass"], r["call"], f"{r['median_s'] * 1e3:.1f}", f"{r['vs_packed']:.2f}x")
              for r in result["rows"]])  # fmt: skip
    path = Path(args.out) / "serving.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    progress(f"report: {path}")
    return 0


def bench_linear(args: argparse.Namespace) -> int:
    """--linear: the linear-attention sweep, printed and written to linear.json."""
    defaults = linear.LinearConfig()
    config = linear.LinearConfig(
        lengths=tuple(args.lengths or defaults.lengths),
        decode_batch=(args.decode_batches or [defaults.decode_batch])[0],
        rounds=args.rounds or defaults.rounds,
        threads=args.threads or torch.get_num_threads(),
    )
    show, progress = table_printers()
    cpu = cpu_description()
    where = (f"{config.threads} threads, cpu {cpu['cpu_model']} ({cpu['vector_isa']}), fp32, "
             f"H={linear.KEY_HEADS}, HV={linear.VALUE_HEADS}, K=V={linear.HEAD_DIM}")  # fmt: skip

    report = {"config": vars(config) | {"machine": cpu}}
    prefill = linear.prefill_sweep(config, progress)
    decode = linear.decode_sweep(config, progress)
    report |= {"prefill": prefill, "decode": decode}
    for pass_ in linear.PASSES:
        rows = [r for r in prefill["rows"] if r["pass"] == pass_]
        times = {(r["length"], r["call"]): r["median_s"] for r in rows}
        table = []
        for r in rows:
            fallback = times.get((r["length"], "transformers"))
            vs = ""
            if r["call"] == "gated delta" and fallback:
                vs = f"{fallback / r['median_s']:.2f}x transformers"
            of_peak = f"{r['of_peak']:.0%}" if r["of_peak"] is not None else "-"
            table.append((str(r["length"]), r["call"], f"{r['median_s'] * 1e3:.1f}",
                          f"{r['gflops']:.0f}", of_peak, f"{r['of_sgemm']:.0%}", vs))  # fmt: skip
        cross = linear.crossover(prefill["rows"], pass_)
        peak = prefill["peak_gflops"]
        show(f"linear attention, {pass_}, B=1; {where}; fp32 FMA peak "
             f"{f'{peak:.0f}' if peak else '-'} GFLOP/s, sgemm {prefill['sgemm_gflops']:.0f} "
             f"GFLOP/s (same run); gated delta faster than numba's causal softmax attention "
             f"from T = {cross} on",
             ["T", "call", "median ms", "GFLOP/s", "of peak", "of sgemm", "speed"],
             table)  # fmt: skip
    show("growth in T: time ~ T^k (numba)", ["pass", "rule", "k, all T", "k, last two T"],
         [(f["pass"], f["rule"], f"{f['k_all']:.2f}" if f["k_all"] is not None else "-",
           f"{f['k_last_two']:.2f} ({f['last_two']})" if f["k_last_two"] is not None else "-")
          for f in prefill["fits"]])  # fmt: skip
    show("peak extra memory, numba gated delta", ["pass", "T", "MiB"],
         [(r["pass"], str(r["length"]),
           f"{r['peak_extra_bytes'] / 2**20:.0f}" if r["peak_extra_bytes"] is not None else "-")
          for r in prefill["memory"]])  # fmt: skip
    numba_step = next(r for r in decode["rows"] if r["call"] == "numba")
    show(f"decode: one token on a carried state, B={decode['batch']} (state "
         f"{decode['state_bytes'] / 2 / 2**20:.0f} MiB read + as much written); {where}; read "
         f"bandwidth (same run) {decode['bandwidth_gbps']:.1f} GB/s",
         ["call", "median ms", "state GB/s", "of read bandwidth", "numba's speed"],
         [(r["call"], f"{r['median_s'] * 1e3:.2f}", f"{r['state_gbps']:.1f}",
           f"{r['bandwidth_share']:.0%}", f"{r['median_s'] / numba_step['median_s']:.2f}x")
          for r in decode["rows"]])  # fmt: skip
    path = Path(args.out) / "linear.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    progress(f"report: {path}")
    return 0


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, with a one-line message otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0, with a one-line message otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def device_name(text: str) -> str:
    """argparse type: "cpu", or "cuda[:i]" where torch sees a CUDA device."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("cuda: no CUDA GPU is visible to torch here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: torch sees {torch.cuda.device_count()}")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}")
    return text


def check_output_folder(parser: argparse.ArgumentParser, out: str) -> None:
    """Fail before the sweep, not after it, when the report cannot be written."""
    folder = Path(out)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".attnperf-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        parser.error(f"--out {out}: cannot write a report there ({error.strerror or error})")


def load_baseline(parser: argparse.ArgumentParser, path: str) -> dict:
    """A previous report.json, checked for the layout compare_to_baseline reads."""
    try:
        baseline = json.loads(Path(path).read_text())
        for entry in (b["extra_info"] for b in baseline["benchmarks"]):
            missing = {"backend", "length", "causal", "pass", "status"} - entry.keys()
            if missing:
                raise KeyError(f"a benchmark without {', '.join(sorted(missing))}")
    except OSError as error:
        parser.error(f"--baseline {path}: cannot read it ({error.strerror or error})")
    except (ValueError, KeyError, TypeError) as error:
        parser.error(
            f"--baseline {path}: not an attnperf bench report.json ({type(error).__name__}: "
            f"{error})"
        )
    return baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnperf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="print every backend's capabilities and availability")
    w = commands.add_parser(
        "warmup", help="compile numba's kernels for this CPU once, ahead of the first calls "
        "(float32 and bfloat16: ~2 min on 2 cores)")  # fmt: skip
    w.add_argument(
        "--all",
        action="store_true",
        help="also float16, masks, int8 caches, varlen and linear attention",
    )
    w.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="processes compiling at once (default: the CPU's cores)")  # fmt: skip
    smoke_parser = commands.add_parser("smoke", help="one small call on every available backend")
    smoke_parser.add_argument("--device", type=device_name, default="cpu")
    b = commands.add_parser(
        "bench", help="time and memory vs sequence length, every backend against sdpa"
    )
    b.add_argument(
        "--summary",
        action="store_true",
        help="the README's verdict on this CPU: one short point per case (dense "
        "fp32 and bf16, short, window, decode, varlen), a few minutes",
    )
    b.add_argument("--quick", action="store_true",
                   help="L in 256..1024, 7 rounds, no 'beyond SDPA' section (for CI)")  # fmt: skip
    b.add_argument("--beyond", action="store_true",
                   help="add the 'beyond SDPA' section (~1 min): a sliding window against "
                        "FlexAttention, a decode step against SDPA's two forms")  # fmt: skip
    b.add_argument("--no-beyond", action="store_true", help=argparse.SUPPRESS)  # the default
    b.add_argument("--decode", action="store_true",
                   help="KV-cache decoding, one query token, Llama-3-8B heads: numba vs SDPA "
                        "(group packed as rows, and enable_gqa) per cache length (--lengths, "
                        "default 1k..64k), a speculative step (--draft-tokens), split-K "
                        "on/off, against the read bandwidth measured in the same run")  # fmt: skip
    b.add_argument("--draft-tokens", type=int, default=4,
                   help="--decode's speculative step: query tokens (0 or 1: none)")  # fmt: skip
    b.add_argument("--decode-batches", type=positive_int, nargs="+",
                   help="--decode's batch sizes (default 1 4); --linear's (8)")  # fmt: skip
    b.add_argument("--linear", action="store_true",
                   help="linear attention (Qwen3-Next's heads): numba over T against transformers' "
                        "fallback and causal softmax attention; a decode step")  # fmt: skip
    b.add_argument("--varlen", action="store_true",
                   help="a packed causal batch of 8 sequences of 128..4096 tokens: numba "
                        "varlen vs SDPA looped over the sequences, and sdpa and numba on the "
                        "padded batch")  # fmt: skip
    b.add_argument("--lengths", type=positive_int, nargs="+",
                   help="L = S values (default 256..2048)")  # fmt: skip
    b.add_argument("--batch", type=positive_int, default=1)
    b.add_argument("--heads", type=positive_int, default=8)
    b.add_argument("--kv-heads", type=positive_int, help="key/value heads, GQA (default: --heads)")
    b.add_argument("--head-dim", type=positive_int, default=64)
    b.add_argument("--dtype", nargs="+", choices=["float32", "float16", "bfloat16"],
                   help="the sweep's dtypes, a report each (default float32 bfloat16; "
                        "--quick float32); --decode and --varlen take the first")  # fmt: skip
    b.add_argument("--causal", default="no", choices=["no", "yes", "both"])
    b.add_argument("--pass", dest="pass_", default="both",
                   choices=["forward", "forward+backward", "both"])  # fmt: skip
    b.add_argument("--backends", nargs="+", choices=[*dispatch.registry(), *PEERS],
                   help="default: every registered backend but the reference (its L x S "
                        "scores: minutes at L = 2048); 'flex': torch's FlexAttention "
                        "compiled, as a peer")  # fmt: skip
    b.add_argument(
        "--window",
        type=positive_int,
        help="a sliding window of W keys, the query's own included: (W - 1, 0)",
    )
    b.add_argument("--softcap", type=positive_float, help="softcap every call at this value")
    b.add_argument("--alibi", action="store_true", help="ALiBi with the standard slopes")
    b.add_argument(
        "--block-mask",
        choices=BLOCK_MASKS,
        help="a block-sparse layout: causal, sliding (--window or 256 keys), "
        f"document ({DOCUMENT_LENGTH}-token documents), prefix (L/4 prefix LM)",
    )
    b.add_argument("--device", type=device_name, default="cpu")
    b.add_argument("--rounds", type=positive_int,
                   help="timed rounds per point (default 3, quick and summary 7)")  # fmt: skip
    b.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    b.add_argument("--out", default="bench-report", help="report folder")
    b.add_argument("--baseline", help="a report.json to compare with (warns, never fails)")
    t = commands.add_parser(
        "tune", help="measure numba against sdpa here; write the table that 'auto' reads"
    )
    t.add_argument("--lengths", type=positive_int, nargs="+",
                   help="L = S values (default 1024 2048 4096)")  # fmt: skip
    t.add_argument("--decode-lengths", type=positive_int, nargs="+",
                   help="decoding's cache lengths, B = 1, Llama-3-8B heads, fp32 and bf16 "
                        "(default 64 256 1024 4096 16384 65536)")  # fmt: skip
    t.add_argument("--rounds", type=positive_int, default=5, help="timed rounds per point")
    t.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.command == "info":
        cpu = cpu_description()
        print(f"attnperf {attnperf.__version__}, torch {torch.__version__}")
        print(f"CPU: {cpu['cpu_model']}, {cpu['vector_isa']} (torch's kernels: "
              f"{cpu['torch_cpu_capability']}), {torch.get_num_threads()} threads")  # fmt: skip
        print(info_table())
        print(f"auto on CPU: {cpu_table.active_rules()[1]}")
        for dtype, name in cpu_table.MEASURED_DTYPES.items():
            rule = cpu_table.active_decode_rule(dtype)
            if rule is not None:
                print(f"  {name} decoding steps: {decode_first(rule.numba_from_bytes)}")
        for line in numba_tile_routes():
            print(line)
        return 0
    if args.command == "warmup":
        return warmup_command(args)
    if args.command == "tune":
        if args.threads:
            torch.set_num_threads(args.threads)
        return tune_command(args)
    if args.command == "bench":
        if args.kv_heads is not None and args.heads % args.kv_heads:
            parser.error(f"--kv-heads must divide --heads ({args.heads}), got {args.kv_heads}")
        baseline = load_baseline(parser, args.baseline) if args.baseline else None
        check_output_folder(parser, args.out)
        if args.summary:
            return bench_summary(args)
        if args.linear:
            return bench_linear(args)
        if args.decode or args.varlen:
            return bench_serving(args)
        return bench(args, baseline)
    return smoke(args.device)


if __name__ == "__main__":
    sys.exit(main())
