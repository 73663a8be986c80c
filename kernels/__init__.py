"""Attention backends; installed as `attnperf.kernels`.

`reference` and `sdpa` are one module each; `numba` and `triton` are packages with one
module per concern (see their docstrings). Each module of BACKEND_MODULES defines `BACKEND`,
an `attnperf.backend.Backend`. Importing a module never imports an optional dependency's
compiled code paths, compiles, or probes a device.
"""

BACKEND_MODULES = ("reference", "sdpa", "numba.backend", "triton.backend")
