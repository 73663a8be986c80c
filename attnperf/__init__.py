"""attnperf: exact, fast attention kernels behind one SDPA-compatible call."""

from attnperf import nn
from attnperf.api import attention, backends, choose_backend
from attnperf.dispatch import BackendNotSupportedError

__all__ = ["BackendNotSupportedError", "attention", "backends", "choose_backend", "nn"]
__version__ = "0.1.0"
