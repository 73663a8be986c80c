"""The numba backend's declaration: what it serves, and its launchers."""

from __future__ import annotations

import torch

from attnperf import cpu_table
from attnperf.backend import Capabilities, FusedBackend, built_mask
from attnperf.inputs import AttentionInputs
from attnperf.kernels.numba.attention import (
    numba_attention_backward,
    numba_attention_forward,
    numba_forward_for,
)
from attnperf.kernels.numba.jit import MISSING
from attnperf.kernels.numba.kvcache import numba_kvcache_forward, numba_kvcache_step
from attnperf.kernels.numba.linear import numba_linear_backward, numba_linear_forward
from attnperf.linear_inputs import LinearAttentionInputs
from attnperf.serving import KVCacheInputs


class NumbaBackend(FusedBackend):
    name = "numba"
    description = "fused tiled online-softmax CPU kernel (Numba, BLAS tiles), O(tile) memory"
    capabilities = Capabilities(
        devices=("cpu",),
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        max_head_dim=None,
        features=frozenset({
            "bool_mask", "float_mask", "causal", "window", "softcap", "alibi", "block_mask",
            "lse", "sinks", "bottom_right", "gqa", "backward", "varlen", "kvcache",
            "kvcache_int8", "linear", "linear_backward",
        }),
    )  # fmt: skip
    rank = {"cpu": 1}  # noqa: RUF012 (after sdpa, where it does not lead)

    forward = staticmethod(numba_attention_forward)
    backward = staticmethod(numba_attention_backward)
    forward_for = staticmethod(numba_forward_for)
    kvcache_forward = staticmethod(numba_kvcache_forward)
    kvcache_step = staticmethod(numba_kvcache_step)
    linear_forward = staticmethod(numba_linear_forward)
    linear_backward = staticmethod(numba_linear_backward)

    def unavailable_reason(self) -> str | None:
        return MISSING

    def leads(self, inputs: AttentionInputs | KVCacheInputs | LinearAttentionInputs) -> bool:
        """First on the CPU for linear attention, for calls that sdpa would serve under a
        mask built for them (it skips what is masked), and where this machine's measured
        table (`attnperf tune`, attnperf.cpu_table) says it is faster; elsewhere sdpa goes
        first (without a table: dense calls, and decoding steps that sdpa serves with the
        group packed as rows, which follow the table's decode rule for their dtype)."""
        if inputs.device.type != "cpu":
            return False
        if isinstance(inputs, LinearAttentionInputs) or built_mask(inputs):
            return True
        if isinstance(inputs, KVCacheInputs):
            rule = cpu_table.active_decode_rule(inputs.dtype)
            return rule is not None and cpu_table.decode_numba_leads(inputs, rule)
        rules, _ = cpu_table.active_rules()
        return bool(rules) and cpu_table.numba_leads(inputs, rules)


BACKEND = NumbaBackend()
