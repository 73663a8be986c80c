"""Linear-attention benchmarks (`attnperf bench --linear`): numba's chunked kernels over T
against transformers' torch fallback and causal softmax attention at the same heads, and a
decoding step on a carried state against the machine's read bandwidth.

As in attnperf.bench.serving, each contender runs in its own spawned worker and the workers
take turns round by round, so that every ratio is measured in the same run. Heads are
Qwen3-Next's linear-attention ones: 16 key heads, 32 value heads, K = V = 128, fp32, B = 1.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import attnperf
from attnperf.bench import serving
from attnperf.bench.sweep import (
    BACKWARD_FLOP_FACTOR,
    cpu_peak_extra_bytes,
    fit_exponent,
    start_worker,
)

KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 32, 128
CHUNK = 64  # fla's FLOP count's chunk: 2 T HV (2 K V + C (K + V)) per forward
RULES = ("additive", "scalar gate", "gated delta")
PASSES = ("forward", "forward+backward")
# Where the peers stop: transformers' fallback and softmax attention grow too slow past these.
FALLBACK_LONGEST = {"forward": 4096, "forward+backward": 2048}
SOFTMAX_LONGEST = {"forward": 8192, "forward+backward": 4096}
# A decoding step takes ~2 ms: a turn times this many in a row (a decode loop's steady
# state; one step alone after another worker's turn measured 2 to 26 ms).
STEPS_PER_TURN = 10


@dataclass(frozen=True)
class LinearConfig:
    """The --linear sweep."""

    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    decode_batch: int = 8
    rounds: int = 3
    threads: int = field(default_factory=torch.get_num_threads)


def transformers_fallbacks() -> tuple[Callable, Callable] | None:
    """transformers' (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), or
    None where transformers (with Qwen3-Next) is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    def unwrapped(function):  # patch_linear_attention's wrapper, if one is installed
        return getattr(function, "attnperf_original", function)

    return (unwrapped(modeling.torch_chunk_gated_delta_rule),
            unwrapped(modeling.torch_recurrent_gated_delta_rule))  # fmt: skip


def linear_inputs(rule: str, batch: int, steps: int, backward: bool, seed: int = 0) -> dict:
    """Qwen3-Next-shaped tensors for `rule` (g = logsigmoid, beta = sigmoid, as its layers
    make them)."""
    gen = torch.Generator().manual_seed(seed)
    call = {
        "q": torch.randn(batch, steps, KEY_HEADS, HEAD_DIM, generator=gen),
        "k": torch.randn(batch, steps, KEY_HEADS, HEAD_DIM, generator=gen),
        "v": torch.randn(batch, steps, VALUE_HEADS, HEAD_DIM, generator=gen),
    }
    if rule != "additive":
        call["g"] = F.logsigmoid(torch.randn(batch, steps, VALUE_HEADS, generator=gen))
    if rule == "gated delta":
        call["beta"] = torch.rand(batch, steps, VALUE_HEADS, generator=gen).sigmoid()
    for tensor in call.values():
        tensor.requires_grad_(backward)
    return call


def with_backward(run: Callable[[], torch.Tensor], leaves: list, backward: bool):
    """The call, its output's backward too when asked (gradients cleared each time)."""

    def call():
        out = run()
        if backward:
            for leaf in leaves:
                leaf.grad = None
            out.sum().backward()
        return out

    return call


class LinearCall:
    """One prefill: numba's linear_attention of a rule, or transformers' chunked fallback
    (the gated delta rule), with l2-normalised q and k as Qwen3-Next's layers ask."""

    def __init__(self, implementation: str, rule: str, steps: int, backward: bool):
        self.args = (implementation, rule, steps, backward)

    def __call__(self) -> Callable[[], object]:
        implementation, rule, steps, backward = self.args
        call = linear_inputs(rule, 1, steps, backward)
        leaves = list(call.values())
        if implementation == "transformers":
            chunked = transformers_fallbacks()[0]
            q, k, v = call.pop("q"), call.pop("k"), call.pop("v")

            def run():
                return chunked(q, k, v, **call, use_qk_l2norm_in_kernel=True)[0]
        else:

            def run():
                return attnperf.linear_attention(**call, use_qk_l2norm=True,
                                                 backend=implementation)[0]  # fmt: skip

        return with_backward(run, leaves, backward)


class SoftmaxCall:
    """Causal softmax attention at the same heads: 32 query heads over 16 key/value heads,
    head dim 128, on `backend` (numba, or sdpa with enable_gqa)."""

    def __init__(self, backend: str, steps: int, backward: bool):
        self.args = (backend, steps, backward)

    def __call__(self) -> Callable[[], object]:
        backend, steps, backward = self.args
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, VALUE_HEADS, steps, HEAD_DIM, generator=gen)
        k, v = (torch.randn(1, KEY_HEADS, steps, HEAD_DIM, generator=gen) for _ in range(2))
        for tensor in (q, k, v):
            tensor.requires_grad_(backward)

        def run():
            return attnperf.attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

        return with_backward(run, [q, k, v], backward)


class DecodeStep:
    """STEPS_PER_TURN tokens, one at a time, on a carried state (B, 32, 128, 128) fp32, the
    gated delta rule: numba's linear_attention, or transformers' recurrent fallback. The
    state is replaced by the new one each step, as a decoding loop does."""

    def __init__(self, implementation: str, batch: int):
        self.args = (implementation, batch)

    def __call__(self) -> Callable[[], object]:
        implementation, batch = self.args
        call = linear_inputs("gated delta", batch, 1, False)
        gen = torch.Generator().manual_seed(1)
        state = [torch.randn(batch, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen) / 8]
        q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
        if implementation == "transformers":
            recurrent = transformers_fallbacks()[1]

            def step():
                out, state[0] = recurrent(
                    q, k, v, **call, initial_state=state[0], output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )  # fmt: skip
                return out
        else:

            def step():
                out, state[0] = attnperf.linear_attention(
                    q, k, v, **call, initial_state=state[0], output_final_state=True,
                    use_qk_l2norm=True, backend=implementation,
                )  # fmt: skip
                return out

        def steps():
            for _ in range(STEPS_PER_TURN):
                step()

        return steps


def linear_flops(steps: int, pass_: str) -> float:
    """fla's count, 2 T HV (2 K V + C (K + V)), x3.5 with the backward (as attention's)."""
    forward = 2 * steps * VALUE_HEADS * (2 * HEAD_DIM**2 + CHUNK * 2 * HEAD_DIM)
    return forward * (1 + BACKWARD_FLOP_FACTOR) if pass_ == "forward+backward" else forward


def softmax_flops(steps: int, pass_: str) -> float:
    """Causal attention's useful work: 4 Hq E per (query, key) pair, half of L^2."""
    forward = 4 * VALUE_HEADS * HEAD_DIM * steps * steps / 2
    return forward * (1 + BACKWARD_FLOP_FACTOR) if pass_ == "forward+backward" else forward


def prefill_sweep(config: LinearConfig, on_progress: Callable[[str], None]) -> dict:
    """Every rule on numba per T and pass, with the peers where they finish in reasonable
    time; the fp32 FMA peak and sgemm rate of the same run; growth fits in T."""
    peak_rate = serving.peak_rate("float32", config.threads)
    sgemm_rate = serving.sgemm_rate(config)
    on_progress(f"sgemm: {sgemm_rate / 1e9:.0f} GFLOP/s")
    fallback = transformers_fallbacks() is not None
    rows = []
    for pass_ in PASSES:
        backward = pass_ == "forward+backward"
        for steps in config.lengths:
            calls = {rule: LinearCall("numba", rule, steps, backward) for rule in RULES}
            if fallback and steps <= FALLBACK_LONGEST[pass_]:
                calls["transformers"] = LinearCall("transformers", "gated delta", steps, backward)
            if steps <= SOFTMAX_LONGEST[pass_]:
                calls |= {
                    f"softmax {b}": SoftmaxCall(b, steps, backward) for b in ("numba", "sdpa")
                }
            timed = serving.race(config, calls)
            for label, result in timed.items():
                work = (softmax_flops if label.startswith("softmax") else linear_flops)(
                    steps, pass_
                )
                rows.append({
                    "pass": pass_, "length": steps, "call": label, "median_s": result.median_s,
                    "gflops": work / result.median_s / 1e9,
                    "of_peak": work / result.median_s / peak_rate if peak_rate else None,
                    "of_sgemm": work / result.median_s / sgemm_rate,
                })  # fmt: skip
            on_progress(f"{pass_} T={steps} done")
    return {"peak_gflops": peak_rate / 1e9 if peak_rate else None,
            "sgemm_gflops": sgemm_rate / 1e9, "rows": rows, "fits": fits(rows, config),
            "memory": memory_sweep(config)}  # fmt: skip


def _peak_extra_bytes(make_call: Callable[[], Callable[[], object]]) -> int | None:
    """In a memory worker: the call's peak extra memory, once warm (inputs excluded)."""
    call = make_call()
    call()
    return cpu_peak_extra_bytes(call)


def memory_sweep(config: LinearConfig) -> list[dict]:
    """numba's gated delta rule: peak extra memory per T and pass, each in a fresh worker
    whose allocator returns freed blocks (attnperf.bench.sweep.WORKER_ENV)."""
    rows = []
    for pass_ in PASSES:
        for steps in config.lengths:
            worker = start_worker(config, memory=True)
            try:
                call = LinearCall("numba", "gated delta", steps, pass_ == "forward+backward")
                peak = worker.submit(_peak_extra_bytes, call).result()
            finally:
                worker.shutdown()
            rows.append({"pass": pass_, "length": steps, "peak_extra_bytes": peak})
    return rows


def fits(rows: list[dict], config: LinearConfig) -> list[dict]:
    """Each numba rule's growth in T (time ~ T^k): over every length and the last two."""
    result = []
    for pass_ in PASSES:
        for rule in RULES:
            points = sorted((r["length"], r["median_s"]) for r in rows
                            if r["pass"] == pass_ and r["call"] == rule)  # fmt: skip
            lengths, times = [p[0] for p in points], [p[1] for p in points]
            whole, last = fit_exponent(lengths, times), fit_exponent(lengths[-2:], times[-2:])
            result.append({"pass": pass_, "rule": rule, "k_all": whole and whole[0],
                           "k_last_two": last and last[0],
                           "last_two": lengths[-2:]})  # fmt: skip
    return result


def crossover(rows: list[dict], pass_: str) -> int | None:
    """The shortest T from which the gated delta rule beat numba's softmax attention at
    every longer T measured (None: never, where both ran)."""
    times = {(r["length"], r["call"]): r["median_s"] for r in rows if r["pass"] == pass_}
    shared = sorted(t for t, call in times if call == "softmax numba")
    start = None
    for steps in reversed(shared):
        if times[(steps, "gated delta")] >= times[(steps, "softmax numba")]:
            break
        start = steps
    return start


def decode_sweep(config: LinearConfig, on_progress: Callable[[str], None]) -> dict:
    """A one-token step on a carried (B, 32, 128, 128) state: numba against transformers'
    recurrent fallback and the read bandwidth, in one run; the state's bytes read and
    written once each per step."""
    calls = {"read": serving.ReadCall(), "numba": DecodeStep("numba", config.decode_batch)}
    if transformers_fallbacks() is not None:
        calls["transformers"] = DecodeStep("transformers", config.decode_batch)
    timed = serving.race(config, calls)
    bandwidth = serving.COPY_BYTES / timed["read"].median_s
    state_bytes = 2 * config.decode_batch * VALUE_HEADS * HEAD_DIM * HEAD_DIM * 4
    rows = []
    for label in ("numba", "transformers"):
        if label in timed:
            seconds = timed[label].median_s / STEPS_PER_TURN
            rows.append({"call": label, "median_s": seconds,
                         "state_gbps": state_bytes / seconds / 1e9,
                         "bandwidth_share": state_bytes / seconds / bandwidth})  # fmt: skip
    on_progress("decode done")
    return {"batch": config.decode_batch, "bandwidth_gbps": bandwidth / 1e9,
            "state_bytes": state_bytes, "rows": rows}  # fmt: skip
