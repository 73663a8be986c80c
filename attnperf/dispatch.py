"""Backend registry and the "auto" priority walk. Nothing ever falls back silently."""

from __future__ import annotations

import functools
import importlib

from torch import Tensor

from attnperf.backend import Backend
from attnperf.inputs import AttentionInputs
from attnperf.kernels import BACKEND_MODULES

# Fastest first, per device, from measurements. CPU: fp32, B=1, H=8, E=64 on a 2-core
# AVX-512 machine, `attnperf bench --backends sdpa numba --lengths 512 1024 2048 4096
# --causal both`: numba reaches 0.41-0.67x of sdpa's throughput forward (full), 0.75-0.93x
# causal for L >= 1024, 0.53-0.88x forward+backward; numba serves nothing that sdpa refuses,
# so sdpa leads for every CPU call.
PRIORITY = {
    "cuda": ("triton", "sdpa", "reference"),
    "cpu": ("sdpa", "numba", "reference"),
}


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
