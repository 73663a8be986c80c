"""The triton backend's declaration: what it serves, and its launchers."""

from __future__ import annotations

import torch

from attnperf.backend import Capabilities, FusedBackend, built_mask
from attnperf.inputs import AttentionInputs
from attnperf.kernels.triton.attention import (
    triton_attention_backward,
    triton_attention_forward,
    triton_forward_for,
)
from attnperf.kernels.triton.jit import INTERPRET, MAX_HEAD_DIM, MISSING
from attnperf.kernels.triton.kvcache import triton_kvcache_forward
from attnperf.kernels.triton.linear import triton_linear_backward, triton_linear_forward
from attnperf.linear_inputs import LinearAttentionInputs
from attnperf.serving import KVCacheInputs


class TritonBackend(FusedBackend):
    name = "triton"
    description = "fused FlashAttention-2-style GPU kernel (Triton), online softmax in base 2"
    capabilities = Capabilities(
        devices=("cuda", "cpu") if INTERPRET else ("cuda",),
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        max_head_dim=MAX_HEAD_DIM,
        features=frozenset({
            "bool_mask", "float_mask", "causal", "window", "softcap", "alibi", "block_mask",
            "lse", "sinks", "bottom_right", "gqa", "backward", "varlen", "kvcache",
            "kvcache_int8", "linear", "linear_backward",
        }),
    )  # fmt: skip
    # After sdpa on CUDA: SDPA's own kernels beat it on the calls they serve as they are
    # (benches/README.md, "GPU"). Never tried by "auto" on the CPU (the interpreter).
    rank = {"cuda": 1}  # noqa: RUF012

    forward = staticmethod(triton_attention_forward)
    backward = staticmethod(triton_attention_backward)
    forward_for = staticmethod(triton_forward_for)
    kvcache_forward = staticmethod(triton_kvcache_forward)
    linear_forward = staticmethod(triton_linear_forward)
    linear_backward = staticmethod(triton_linear_backward)

    def unavailable_reason(self) -> str | None:
        if MISSING:
            return MISSING
        if not INTERPRET and not torch.cuda.is_available():
            return (
                "no CUDA GPU (TRITON_INTERPRET=1, set before attnperf's kernels are first "
                "used, runs them on CPU through Triton's interpreter)"
            )
        return None

    def leads(self, inputs: AttentionInputs | KVCacheInputs | LinearAttentionInputs) -> bool:
        """First on CUDA for linear attention and for calls that sdpa would serve under a
        mask built for them (a packed batch of causal sequences ran many times faster
        than SDPA's padded batch)."""
        if inputs.device.type != "cuda":
            return False
        return isinstance(inputs, LinearAttentionInputs) or built_mask(inputs)


BACKEND = TritonBackend()
