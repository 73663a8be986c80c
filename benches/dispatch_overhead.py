"""What `attnperf.attention` adds to the call it dispatches to: the drop-in against torch's
own SDPA, turns interleaved in one process.

Forward, no mask, fp32, E = 64, at short calls (where per-call costs show): B = 1, H = 8,
L = 64 and 256, and B = 32, H = 12, L = 128. Each round times a block of ~20 ms of calls
of each form; prints the median time of each and what attnperf adds to SDPA's call, for
backend="auto" (validation, the "auto" walk, the backend's own steps) and backend="sdpa".
Then the call's validation (`prepare`) alone: back to back, and right after an SDPA call
(whose data then fills the caches, and whose OpenMP workers may still be spinning).

Then the Python of a repeated numba call, B = 1, H = 8, L = 64, fp32 and bf16, and of a
repeated decoding step (one token, 8/2 heads over 256 keys, E = 128, transformers' (B, H,
S, E) cache): the call's median time less that of its kernel launched alone with the
arguments the call gave it (`run_parallel`, or the serial kernel, as the launcher calls
it), turns interleaved.

    python benches/dispatch_overhead.py [--rounds 11]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from short_calls import take_turns  # benches/, the script's own folder

import attnperf
from attnperf.inputs import prepare
from attnperf.kernels.numba import attention, kvcache
from attnperf.machine import cpu_description

SHAPES = ((1, 8, 64, 64), (1, 8, 256, 64), (32, 12, 128, 64))


def medians(q, k, v, rounds: int) -> dict[str, float]:
    """Median seconds a call of SDPA itself, of attnperf "auto" and of backend="sdpa"."""
    calls = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "auto": lambda: attnperf.attention(q, k, v),
        "sdpa": lambda: attnperf.attention(q, k, v, backend="sdpa"),
    }
    return {name: statistics.median(t) for name, t in take_turns(calls, rounds).items()}


def validation_times(q, k, v, rounds: int) -> tuple[float, float]:
    """Median seconds of `prepare` back to back, and right after an SDPA call."""
    warm, after = [], []
    for _ in range(rounds * 20):
        start = time.perf_counter()
        prepare(q, k, v)
        warm.append(time.perf_counter() - start)
        F.scaled_dot_product_attention(q, k, v)
        start = time.perf_counter()
        prepare(q, k, v)
        after.append(time.perf_counter() - start)
    return statistics.median(warm), statistics.median(after)


def recorded_launch(call):
    """(the result of a repeated `call`, its kernel's launch again with the arguments the
    call gave it). The result is kept by the caller: the arguments hold its memory's
    address (and a repeated call's other memory is kept by the launcher between calls)."""
    call()
    launches = []
    patched = {attention: ("run_parallel",), kvcache: ("run_parallel", "serial")}
    originals = {(m, name): getattr(m, name) for m, names in patched.items() for name in names}

    def recording(module, name):
        def run_parallel(kernel, *args):
            launches.append(lambda: originals[(module, name)](kernel, *args))
            return originals[(module, name)](kernel, *args)

        def serial(kernel):
            twin = originals[(module, name)](kernel)
            return lambda *args: launches.append(lambda: twin(*args)) or twin(*args)

        return run_parallel if name == "run_parallel" else serial

    for module, name in originals:
        setattr(module, name, recording(module, name))
    try:
        result = call()
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
    (launch,) = launches
    return result, launch


def python_per_call(call, rounds: int) -> tuple[float, float]:
    """(median seconds of a repeated `call`, of its kernel's launch alone)."""
    result, launch = recorded_launch(call)
    times = take_turns({"call": call, "kernel": launch}, rounds)
    del result
    return statistics.median(times["call"]), statistics.median(times["kernel"])


def numba_python(rounds: int) -> None:
    """Print the Python of a repeated numba call and of a repeated decoding step."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, 8, 64, 64, dtype=dtype) for _ in range(3))
        call, kernel = python_per_call(
            lambda q=q, k=k, v=v: attnperf.attention(q, k, v, backend="numba"), rounds
        )
        print(f"numba, B=1 H=8 L=64 {str(dtype)[6:]}: call {1e6 * call:.1f} us, its kernel "
              f"{1e6 * kernel:.1f} us: Python {1e6 * (call - kernel):.1f} us")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        k_cache, v_cache = (torch.randn(1, 2, 256, 128, dtype=dtype).transpose(1, 2)
                            for _ in range(2))  # fmt: skip
        q = torch.randn(1, 1, 8, 128, dtype=dtype)
        call, kernel = python_per_call(
            lambda q=q, k=k_cache, v=v_cache: attnperf.attention_with_kvcache(
                q, k, v, 256, backend="numba"
            ),
            rounds,
        )
        print(f"numba decoding step, 8/2 heads, S = 256, {str(dtype)[6:]}: call "
              f"{1e6 * call:.1f} us, its kernel {1e6 * kernel:.1f} us: Python "
              f"{1e6 * (call - kernel):.1f} us")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"cpu {cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads; "
          f"forward, fp32, E = 64; medians of {args.rounds} rounds")  # fmt: skip
    torch.manual_seed(0)
    for shape in SHAPES:
        q, k, v = (torch.randn(shape) for _ in range(3))
        median = medians(q, k, v, args.rounds)
        sdpa, chosen = median["F.sdpa"], attnperf.choose_backend(q, k, v)
        print(f"B={shape[0]:2d} H={shape[1]:2d} L={shape[2]:3d}: F.sdpa {1e6 * sdpa:8.1f} us; "
              f"attnperf auto ({chosen}) {1e6 * (median['auto'] - sdpa):+7.1f} us, "
              f"backend='sdpa' {1e6 * (median['sdpa'] - sdpa):+7.1f} us")  # fmt: skip
        warm, after = validation_times(q, k, v, args.rounds)
        print(f"  its validation alone: {1e6 * warm:.1f} us back to back, {1e6 * after:.1f} us "
              "right after an SDPA call")  # fmt: skip
    numba_python(args.rounds)


if __name__ == "__main__":
    main()
