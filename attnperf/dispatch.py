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
from attnperf.linear_inputs import LinearAttentionInputs
from attnperf.serving import KVCacheInputs


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
    """The order in which "auto" tries the backends for this call: those that lead it
    (`Backend.leads`), then the others by their rank on its device (`Backend.rank`); a
    linear-attention call only on the backends that declare it."""
    device = inputs.device.type
    ranked = sorted((b for b in registry().values() if device in b.rank),
                    key=lambda b: b.rank[device])  # fmt: skip
    if isinstance(inputs, LinearAttentionInputs):
        ranked = [b for b in ranked if "linear" in b.capabilities.features]
    leading = [b for b in ranked if b.leads(inputs)]
    return tuple(b.name for b in leading + [b for b in ranked if b not in leading])


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
    environment, a visible part of a decoding step). A choice kept under other ones is stale
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
    bytes of K and V (the CPU table's decode rule, `cpu_table.decode_numba_leads`)."""
    length, q_len = inputs.sequences.max_kv_len, inputs.q_len
    lengths = ANY_LENGTH
    if inputs.band is not None:
        shifted = range(q_len + 1, sys.maxsize) if length > q_len else range(q_len)
        lengths = range(q_len, q_len + 1) if length == q_len else shifted
    if backend == "auto" and inputs.device.type == "cpu" and inputs.sees_whole_cache:
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
