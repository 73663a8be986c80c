"""Ring attention over N local processes (gloo, one thread each) against one process doing
the whole sequence with N threads, forward + backward, fp32, B = 1, H = 8, E = 64.

    python benches/ring.py --ranks 2 --lengths 4096 8192 16384 32768 --rounds 3

Per point and layout: each rank's median time, its share of that time spent waiting on a
receive that the computation did not hide, its peak extra memory, the balance (the busiest
rank's busy time / the least busy one's, busy = time - waiting: the ranks finish together,
the less loaded one waiting on the other) and the efficiency (one process's time / the
ring's time).
The ranks and the single process take turns round by round (all stay alive, idle while the
other runs), so the ratios come from the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HEADS, HEAD_DIM = 8, 64
LAYOUTS = ("contiguous", "zigzag")


def whole_sequence(length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, length, HEAD_DIM, generator=gen) for _ in range(4)]


def peak_extra_bytes(fn) -> int:
    """Peak resident memory added while fn runs (VmHWM reset through clear_refs)."""
    from attnperf.bench.sweep import cpu_peak_extra_bytes

    return cpu_peak_extra_bytes(fn) or 0


def ring_step(leaves, grad, causal, layout):
    from attnperf import distributed

    out = distributed.ring_attention(*leaves, is_causal=causal, layout=layout, backend="numba")
    out.backward(grad)
    return out


def whole_step(leaves, grad, causal):
    import attnperf

    out = attnperf.attention(*leaves, is_causal=causal, backend="numba")
    out.backward(grad)
    return out


def rank_main(rank: int, world: int, init: str, commands, answers) -> None:
    """A ring rank: runs the points it is told to, answers (time, wait, memory)."""
    import torch.distributed as dist

    from attnperf import distributed

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        while (command := commands.get()) is not None:
            length, causal, layout, measure_memory = command
            q, k, v, grad = (distributed.shard_sequence(t, 2, layout=layout)
                             for t in whole_sequence(length))  # fmt: skip
            call = functools.partial(ring_step, [t.requires_grad_() for t in (q, k, v)], grad,
                                     causal, layout)  # fmt: skip
            dist.barrier()
            if measure_memory:
                answers.put((rank, peak_extra_bytes(call)))
                continue
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            times = distributed.LAST_TIMES
            wait = times["forward"].wait_s + times["backward"].wait_s
            answers.put((rank, (seconds, wait)))
    except BaseException:
        answers.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def single_main(threads: int, commands, answers) -> None:
    """One process, the whole sequence, `threads` threads."""
    torch.set_num_threads(threads)
    try:
        while (command := commands.get()) is not None:
            length, causal, measure_memory = command
            q, k, v, grad = whole_sequence(length)
            call = functools.partial(whole_step, [t.requires_grad_() for t in (q, k, v)], grad,
                                     causal)  # fmt: skip
            if measure_memory:
                answers.put(peak_extra_bytes(call))
                continue
            start = time.perf_counter()
            call()
            answers.put(time.perf_counter() - start)
    except BaseException:
        answers.put(traceback.format_exc())


def collect(answers, count: int) -> list:
    results = [answers.get(timeout=1800) for _ in range(count)]
    for result in results:
        payload = result[1] if isinstance(result, tuple) else result
        if isinstance(payload, str):
            raise RuntimeError(payload)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="ring-report.json")
    args = parser.parse_args()
    world = args.ranks
    context = multiprocessing.get_context("spawn")
    init = f"file://{tempfile.mkdtemp()}/rendezvous"
    rank_commands = [context.Queue() for _ in range(world)]
    rank_answers, single_commands, single_answers = (context.Queue() for _ in range(3))
    ranks = [context.Process(target=rank_main,
                             args=(r, world, init, rank_commands[r], rank_answers))
             for r in range(world)]  # fmt: skip
    single = context.Process(target=single_main, args=(world, single_commands, single_answers))
    processes = [*ranks, single]
    for process in processes:
        process.start()
    causal_values = {"yes": (True,), "no": (False,), "both": (True, False)}[args.causal]
    report = []
    try:
        for causal in causal_values:
            for length in args.lengths:
                point = run_point(args, length, causal, rank_commands, rank_answers,
                                  single_commands, single_answers)  # fmt: skip
                report.append(point)
                show(point, world)
    finally:
        for queue in (*rank_commands, single_commands):
            queue.put(None)
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    return 0


def run_point(args, length, causal, rank_commands, rank_answers, single_commands,
              single_answers) -> dict:  # fmt: skip
    world = len(rank_commands)

    def ring(layout, memory=False):
        for commands in rank_commands:
            commands.put((length, causal, layout, memory))
        return dict(collect(rank_answers, world))

    def one(memory=False):
        single_commands.put((length, causal, memory))
        return collect(single_answers, 1)[0]

    one(), ring(LAYOUTS[0]), ring(LAYOUTS[1])  # warm-up: JIT caches, thread pools
    single_times, ring_times = [], {layout: [] for layout in LAYOUTS}
    for round_ in range(args.rounds):
        order = ["single", *LAYOUTS] if round_ % 2 == 0 else [*LAYOUTS[::-1], "single"]
        for contender in order:
            if contender == "single":
                single_times.append(one())
            else:
                ring_times[contender].append(ring(contender))
    single_s = statistics.median(single_times)
    point = {"length": length, "causal": causal, "ranks": world, "single_s": single_s,
             "single_peak_bytes": one(memory=True), "layouts": {}}  # fmt: skip
    for layout in LAYOUTS:
        memory = ring(layout, memory=True)
        per_rank = []
        for rank in range(world):
            seconds = statistics.median(r[rank][0] for r in ring_times[layout])
            wait = statistics.median(r[rank][1] for r in ring_times[layout])
            per_rank.append({"rank": rank, "median_s": seconds, "wait_share": wait / seconds,
                             "peak_extra_bytes": memory[rank]})  # fmt: skip
        point["layouts"][layout] = summary(per_rank, single_s)
    return point


def summary(per_rank: list[dict], single_s: float) -> dict:
    busy = [r["median_s"] * (1 - r["wait_share"]) for r in per_rank]
    slowest = max(r["median_s"] for r in per_rank)
    return {"ranks": per_rank, "balance": max(busy) / min(busy),
            "efficiency": single_s / slowest}  # fmt: skip


def show(point: dict, world: int) -> None:
    kind = "causal" if point["causal"] else "full"
    peak = point["single_peak_bytes"] / 2**20
    print(f"L={point['length']} {kind}: one process x {world} threads "
          f"{point['single_s']:.2f} s, peak +{peak:.0f} MiB")  # fmt: skip
    for layout, result in point["layouts"].items():
        ranks = "; ".join(
            f"rank {r['rank']} {r['median_s']:.2f} s, waiting {r['wait_share']:.0%}, "
            f"+{r['peak_extra_bytes'] / 2**20:.0f} MiB"
            for r in result["ranks"]
        )
        print(f"  {layout:10s} balance {result['balance']:.2f}, efficiency "
              f"{result['efficiency']:.2f} ({ranks})")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
