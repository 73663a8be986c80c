"""Backend registry and the "auto" priority walk. Nothing ever falls back silently."""

from __future__ import annotations

import functools
import importlib
import sys

from torch import Tensor

from attnperf import cpu_table
from attnperf.backend import Backend
from attnperf.inputs import AttentionInputs
from attnperf.kernels import BACKEND_MODULES
from attnperf.kernels.sdpa import sees_whole_cache
from attnperf.linear_inputs import LinearAttentionInputs
from attnperf.serving import KVCacheInputs

# Fastest first, per device; on CPU, numba goes first where this machine's measured table
# (`attnperf tune`, attnperf.cpu_table) says it is faster, sdpa first everywhere else. On
# CUDA, SDPA's own kernels beat triton on the calls they serve as they are: on an H200
# (`python benches/gpu_check.py`, bf16 and fp16, B x H = 32, 2026-12-04) triton's forward
# ran at 0.12-0.81x FlashAttention's speed at L <= 4096 and 0.78-1.32x at 8192-16384, its
# forward+backward at 0.10-0.94x, a decoding step at 0.05-0.51x SDPA with the group packed
# as rows; a packed batch of 16 causal sequences ran at 10.3x SDPA's padded batch. So sdpa
# goes first there, and triton first for the calls SDPA could serve only under a mask.
PRIORITY = {
    "cuda": ("sdpa", "triton", "reference"),
    "cpu": ("sdpa", "numba", "reference"),
}
CPU_NUMBA_FIRST = ("numba", "sdpa", "reference")
CUDA_TRITON_FIRST = ("triton", "sdpa", "reference")
# Linear attention: the fused kernels first, the reference recurrence as the last resort.
LINEAR_PRIORITY = {"cuda": ("triton", "reference"), "cpu": ("numba", "reference")}
# Variants that sdpa serves only through an L x S mask built per call, where numba skips
# what is masked: numba first whatever the table says. `attnperf bench --backends sdpa numba
# --lengths 1024 2048 4096 8192 16384 --window 256 --causal yes`: numba 2.2x / 6.0x / 16.5x /
# 41x / 89x sdpa's speed forward, 2.6x to 53x forward+backward (2-core AVX-512 machine).
# Packed and KV-cache calls likewise: sdpa pads them to a batch under a mask, except where
# it calls SDPA the careful way (below). Sinks too: sdpa takes them as an extra key column
# under a materialised mask (`python benches/sinks.py`: numba 4.3x its speed at gpt-oss's
# full causal layer, L = 4096, 2-core AMD EPYC).
MASKED_BY_SDPA = frozenset({"window", "alibi", "block_mask", "varlen", "kvcache", "sinks"})


def numba_leads_on_cpu(inputs: AttentionInputs | KVCacheInputs) -> bool:
    """Whether numba goes first for this CPU call: for the variants in MASKED_BY_SDPA, and
    where this machine's measured table (`attnperf tune`) puts it first. Decoding steps that
    sdpa serves with the group packed as rows, no mask (sdpa.sees_whole_cache), follow the
    table's decode rule for their dtype (fp32 or bf16; others: sdpa first): numba from a
    measured cache size on (for reference, 128 MiB of fp32 K and V on the 2-core AVX-512
    machine, where both leave its L3: 1.3-1.8x there, 0.4-0.9x on 8-32 MiB); sdpa first
    without a table.

    Without a valid table, dense calls go to sdpa first. For reference, on the 2-core
    AVX-512 machine this package was developed on (`attnperf bench --backends sdpa numba
    --lengths 2048 4096 --causal both --rounds 9`, five runs), numba/sdpa was 0.84-0.98x on full
    forward-only calls, 1.00-1.10x causal, 0.96-1.14x with the backward, and mostly below
    0.95x at L <= 1024; other machines differ, which is why it is measured where it runs.
    """
    if isinstance(inputs, KVCacheInputs) and sees_whole_cache(inputs):
        rule = cpu_table.active_decode_rule(inputs.dtype)
        return rule is not None and cpu_table.decode_numba_leads(inputs, rule)
    if inputs.features() & MASKED_BY_SDPA:
        return True
    rules, _ = cpu_table.active_rules()
    return bool(rules) and cpu_table.numba_leads(inputs, rules)


def triton_leads_on_cuda(inputs: AttentionInputs | KVCacheInputs) -> bool:
    """Whether triton goes first for this CUDA call: for the variants in MASKED_BY_SDPA,
    except decoding steps that sdpa serves with the group packed as rows, no mask
    (sdpa.sees_whole_cache)."""
    if isinstance(inputs, KVCacheInputs) and sees_whole_cache(inputs):
        return False
    return bool(inputs.features() & MASKED_BY_SDPA)


class BackendNotSupportedError(RuntimeError):
    """No backend (or not the one asked for) can serve the call; the message lists why."""


@functools.cache
def registry() -> dict[str, Backend]:
    """Every known backend by name, whether available on this machine or not."""
    backends = (importlib.import_module(f"attnperf.kernels.{m}").BACKEND for m in BACKEND_MODULES)
    return {backend.name: backend for backend in backends}


def priority(
    inputs: AttentionInputs | KVCacheInputs | LinearAttentionInputs,
) -> tuple[str, ...]:
    """The order in which "auto" tries the backends for this call."""
    order = PRIORITY.get(inputs.device.type, ("reference",))
    if isinstance(inputs, LinearAttentionInputs):
        order = LINEAR_PRIORITY.get(inputs.device.type, ("reference",))
    elif inputs.device.type == "cpu" and numba_leads_on_cpu(inputs):
        order = CPU_NUMBA_FIRST
    elif inputs.device.type == "cuda" and triton_leads_on_cuda(inputs):
        order = CUDA_TRITON_FIRST
    known = registry()
    return tuple(name for name in order if name in known)


def check_name(backend: object) -> None:
    """Raise unless `backend` is "auto" or a registered backend's name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    known = registry()
    if backend != "auto" and backend not in known:
        raise ValueError(f"unknown backend {backend!r}; known: auto, {', '.join(known)}")


def select(
    inputs: AttentionInputs | KVCacheInputs | LinearAttentionInputs, backend: str = "auto"
) -> Backend:
    """The backend that serves `inputs`: the named one, or the first fitting one for "auto"."""
    check_name(backend)
    known = registry()
    if backend != "auto":
        reasons = known[backend].not_supported_reasons(inputs)
        if reasons:
            raise BackendNotSupportedError(
                f"backend {backend!r} cannot serve this call: {'; '.join(reasons)}"
            )
        return known[backend]
    refusals = []
    for name in priority(inputs):
        reasons = known[name].not_supported_reasons(inputs)
        if not reasons:
            return known[name]
        refusals.append(f"  {name}: {'; '.join(reasons)}")
    raise BackendNotSupportedError("no backend can serve this call:\n" + "\n".join(refusals))


def selection_state(backend: str) -> tuple:
    """What `select(inputs, backend)` reads besides the call and the thread count, each made
    once: the registry, and for "auto" the CPU table in force (`attnperf tune` reloads it;
    a named backend's choice never reads it, and finding the table's path reads the
    environment, ~5 us of a decoding step). A choice kept under other ones is stale
    (attnperf.plans)."""
    if backend != "auto":
        return (registry(),)
    return registry(), cpu_table.load_table(cpu_table.table_path())


# Every cache length: a step's lengths where nothing select reads depends on them.
ANY_LENGTH = range(sys.maxsize)


def step_lengths(inputs: KVCacheInputs, backend: str) -> range:
    """The cache lengths at which `select` chooses as it chose for `inputs`, a plain step
    (one int length for every sequence, no new keys; `Backend.kvcache_step`), for steps
    that differ from it in their length alone. What select reads of a step's length: where
    causality or a window bands the keys, whether the band is shifted (the "bottom_right"
    feature: a length other than the query count); for "auto" on a CPU, the decode rule's
    bytes of K and V (`numba_leads_on_cpu`)."""
    length, q_len = inputs.sequences.max_kv_len, inputs.q_len
    lengths = ANY_LENGTH
    if inputs.band is not None:
        shifted = range(q_len + 1, sys.maxsize) if length > q_len else range(q_len)
        lengths = range(q_len, q_len + 1) if length == q_len else shifted
    if backend == "auto" and inputs.device.type == "cpu" and sees_whole_cache(inputs):
        rule = cpu_table.active_decode_rule(inputs.dtype)
        first_keys = None
        if rule is not None:
            first_keys = cpu_table.decode_numba_from_keys(rule, inputs.key_bytes)
        if first_keys is not None and inputs.batch > 0:
            first = -(-first_keys // inputs.batch)  # the first length numba leads at
            side = range(first, sys.maxsize) if length >= first else range(first)
            lengths = range(max(lengths.start, side.start), min(lengths.stop, side.stop))
    return lengths


def attend(inputs: AttentionInputs, backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Run `inputs` on the selected backend; the output (and the LSE when the call asked for
    it) in the caller's layout."""
    return inputs.restore(*select(inputs, backend).run(inputs))


def linear(inputs: LinearAttentionInputs, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """Run a linear-attention call on the selected backend: (out, final state or None)."""
    out, state = select(inputs, backend).run_linear(inputs)
    return out, state if inputs.output_final_state else None
