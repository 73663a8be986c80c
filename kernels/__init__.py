"""Attention backends, one module each; installed as `attnperf.kernels`.

Each module defines `BACKEND`, an `attnperf.backend.Backend`. Importing a module never
imports an optional dependency's compiled code paths, compiles, or probes a device.
"""

BACKEND_MODULES = ("reference", "sdpa", "numba_cpu", "triton_gpu")
