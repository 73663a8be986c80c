"""What softcap and ALiBi cost on top of plain causal attention, same process, turns
interleaved.

fp32, B=1, H=8, E=64, L = S = 4096 (`--length`), causal; forward and forward+backward; for
each backend given (default numba) prints each variant's time relative to plain causal
(median of `--rounds` rounds; > 1: slower).

    python benches/variant_overhead.py [--backends numba triton] [--length 4096] [--rounds 7]
"""

import argparse
import statistics
import time

import torch

import attnperf
from attnperf.layouts import alibi_slopes

VARIANTS = {
    "causal": {},
    "causal + softcap 50": {"softcap": 50.0},
    "causal + ALiBi": {"alibi_slopes": torch.tensor(alibi_slopes(8))},
    "causal + softcap + ALiBi": {"softcap": 50.0, "alibi_slopes": torch.tensor(alibi_slopes(8))},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["numba"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    shape = (1, 8, args.length, 64)
    q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device)
    variants = {name: {k: t.to(device) if torch.is_tensor(t) else t for k, t in kw.items()}
                for name, kw in VARIANTS.items()}  # fmt: skip

    def timed(backend, variant, backward):
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        start = time.perf_counter()
        with torch.enable_grad() if backward else torch.no_grad():
            out = attnperf.attention(q, k, v, is_causal=True, backend=backend, **variant)
            if backward:
                out.backward(grad_out)
        sync()
        return time.perf_counter() - start

    for backend in args.backends:
        for backward in (False, True):
            times = {name: [] for name in variants}
            for variant in variants.values():
                timed(backend, variant, backward)  # warm-up (and JIT)
            for _ in range(args.rounds):
                for name, variant in variants.items():
                    times[name].append(timed(backend, variant, backward))
            base = statistics.median(times["causal"])
            print(f"{backend} {'forward+backward' if backward else 'forward'}, L={args.length}: "
                  f"causal {base * 1e3:.1f} ms; " + ", ".join(
                      f"{name[8:]} {statistics.median(t) / base:.2f}x"
                      for name, t in times.items() if name != "causal"))  # fmt: skip


if __name__ == "__main__":
    main()
