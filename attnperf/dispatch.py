"""Backend registry and the "auto" priority walk. Nothing ever falls back silently."""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from attnperf.backend import Backend
from attnperf.inputs import AttentionInputs
from attnperf.kernels import BACKEND_MODULES

# Fastest first, per device, from measurements; CPU calls of the class below put numba first.
PRIORITY = {
    "cuda": ("triton", "sdpa", "reference"),
    "cpu": ("sdpa", "numba", "reference"),
}
CPU_NUMBA_FIRST = ("numba", "sdpa", "reference")


def numba_leads_on_cpu(inputs: AttentionInputs) -> bool:
    """Whether the call is of the CPU class in which numba measured faster than sdpa.

    numba/sdpa throughput, same run, 2-core AVX-512 machine, fp32, no mask, B=1; five runs of
    `attnperf bench --backends sdpa numba --lengths 512 1024 2048 4096 --causal both
    --rounds 9` (H=8, E=64) and one with `--heads 4 --head-dim 128 --lengths 2048 4096`:
      L = S = 2048 / 4096, forward, full:             0.84-0.95x / 0.91-0.98x  (sdpa)
      L = S = 2048 / 4096, forward, causal:           1.01-1.08x / 1.00-1.10x  (numba)
      L = S = 2048 / 4096, forward+backward, full:    0.96-1.08x / 0.97-1.09x  (numba, mostly)
      L = S = 2048 / 4096, forward+backward, causal:  0.88-1.05x / 1.00-1.14x  (numba, mostly)
      L = S <= 1024, any:                             0.54-1.17x, mostly < 0.95x (sdpa)
    GQA, 8 query / 2 kv heads (two runs, `--heads 8 --kv-heads 2 --lengths 1024 2048 4096`):
      L = S = 2048 / 4096: forward full 0.96-1.06x / 1.01-1.02x; forward causal 1.06-1.09x /
      1.04-1.21x; forward+backward full 0.98-1.05x / 1.05-1.16x, causal 1.01-1.02x /
      1.07-1.15x; numba's backward shares its work out by (batch, kv head), so GQA counts only
      with at least one such pair per thread.
    Masks, other dtypes and head dims above 128 were not measured: sdpa stays first.
    """
    return (
        inputs.dtype == torch.float32
        and inputs.attn_mask is None
        and (
            inputs.q_heads == inputs.kv_heads
            or inputs.batch * inputs.kv_heads >= torch.get_num_threads()
        )
        and min(inputs.q_len, inputs.kv_len) >= 2048
        and max(inputs.head_dim, inputs.value_dim) <= 128
        and (inputs.is_causal or inputs.needs_grad)
    )


class BackendNotSupportedError(RuntimeError):
    """No backend (or not the one asked for) can serve the call; the message lists why."""


@functools.cache
def registry() -> dict[str, Backend]:
    """Every known backend by name, whether available on this machine or not."""
    backends = (importlib.import_module(f"attnperf.kernels.{m}").BACKEND for m in BACKEND_MODULES)
    return {backend.name: backend for backend in backends}


def priority(inputs: AttentionInputs) -> tuple[str, ...]:
    """The order in which "auto" tries the backends for this call."""
    order = PRIORITY.get(inputs.device.type, ("reference",))
    if inputs.device.type == "cpu" and numba_leads_on_cpu(inputs):
        order = CPU_NUMBA_FIRST
    known = registry()
    return tuple(name for name in order if name in known)


def select(inputs: AttentionInputs, backend: str = "auto") -> Backend:
    """The backend that serves `inputs`: the named one, or the first fitting one for "auto"."""
    known = registry()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        if backend not in known:
            raise ValueError(f"unknown backend {backend!r}; known: auto, {', '.join(known)}")
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


def attend(inputs: AttentionInputs, backend: str = "auto") -> Tensor:
    """Run `inputs` on the selected backend; the output in the caller's layout."""
    return inputs.restore(select(inputs, backend).run(inputs))
