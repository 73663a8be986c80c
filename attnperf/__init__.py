"""attnperf: exact, fast attention kernels behind one SDPA-compatible call."""

import torch

from attnperf import layouts, nn
from attnperf.api import (
    attention,
    attention_varlen,
    attention_with_kvcache,
    backends,
    choose_backend,
    linear_attention,
    merge_attention,
)
from attnperf.dispatch import BackendNotSupportedError
from attnperf.layouts import BlockMask, block_mask
from attnperf.serving import dequantize_kv, quantize_kv
from attnperf.version import __version__, warn_on_untested_torch

warn_on_untested_torch(torch.__version__)

__all__ = [
    "BackendNotSupportedError",
    "BlockMask",
    "__version__",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "backends",
    "block_mask",
    "choose_backend",
    "dequantize_kv",
    "layouts",
    "linear_attention",
    "merge_attention",
    "nn",
    "quantize_kv",
]
