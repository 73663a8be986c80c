"""What this CPU is: its model and vector ISA, for bench reports and the tuning table."""

from __future__ import annotations

import functools
import platform

import torch

# The flags that decide which kernels run fast: torch's and Numba's code paths follow them.
ISA_FLAGS = (
    "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@functools.cache
def _cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(vendor, model name, flags) from /proc/cpuinfo; elsewhere no vendor ("") and no
    flags, and the platform's word for the model."""
    vendor, model, flags = "", platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return vendor, model, flags


def cpu_vendor() -> str:
    """The CPU's maker: AMD, Intel, or what /proc/cpuinfo's vendor_id says ("" if none)."""
    vendor = _cpuinfo()[0]
    return {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor, vendor)


def vector_isa(flags: frozenset[str] | set[str]) -> str:
    """The widest vector extension: "AMX", "AVX-512", "AVX2", "AVX" or "none/unknown"."""
    for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "AVX" if "avx" in flags else "none/unknown"


def cpu_description() -> dict:
    """Model, vector ISA, its flags, and the path torch's own CPU kernels take here (which
    ATEN_CPU_CAPABILITY can lower)."""
    _, model, flags = _cpuinfo()
    return {
        "cpu_model": model,
        "vector_isa": vector_isa(flags),
        "isa_flags": [flag for flag in ISA_FLAGS if flag in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
