"""The contract every backend implements: declared capabilities and reasons for refusing a call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnperf.inputs import AttentionInputs

DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve, as data: dispatch, `attnperf info` and the tests read it."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None  # None: any head dim
    bool_mask: bool
    float_mask: bool
    causal: bool
    gqa: bool
    dropout: bool
    backward: bool

    def features(self) -> list[str]:
        flags = ("bool_mask", "float_mask", "causal", "gqa", "dropout", "backward")
        return [flag for flag in flags if getattr(self, flag)]


class Backend:
    """A named attention implementation; subclasses set `name`, `capabilities`, `run`."""

    name: str
    description: str
    capabilities: Capabilities

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all on this machine (missing package, no GPU), or None."""
        return None

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Every reason this backend cannot serve `inputs`; empty when it can."""
        unavailable = self.unavailable_reason()
        if unavailable:
            return [unavailable]
        return self.capability_reasons(inputs)

    def capability_reasons(self, inputs: AttentionInputs) -> list[str]:
        """The reasons that follow from the declarations alone, available or not."""
        caps = self.capabilities
        reasons = []
        if inputs.device.type not in caps.devices:
            reasons.append(f"device {inputs.device.type} not in {caps.devices}")
        if inputs.dtype not in caps.dtypes:
            supported = ", ".join(DTYPE_NAMES[d] for d in caps.dtypes)
            reasons.append(f"dtype {DTYPE_NAMES[inputs.dtype]} not in ({supported})")
        largest = max(inputs.head_dim, inputs.value_dim)
        if caps.max_head_dim is not None and largest > caps.max_head_dim:
            reasons.append(f"head dim {largest} > {caps.max_head_dim}")
        if inputs.mask_kind == "bool" and not caps.bool_mask:
            reasons.append("bool attn_mask not supported")
        if inputs.mask_kind == "float" and not caps.float_mask:
            reasons.append("float attn_mask not supported")
        if inputs.is_causal and not caps.causal:
            reasons.append("is_causal not supported")
        if inputs.q_heads != inputs.kv_heads and not caps.gqa:
            reasons.append("grouped-query attention not supported")
        if inputs.dropout_p > 0 and not caps.dropout:
            reasons.append("dropout_p > 0 not supported")
        if inputs.needs_grad and not caps.backward:
            reasons.append("backward (inputs require grad) not supported")
        return reasons + self.extra_reasons(inputs)

    def extra_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Limits that the declared capabilities cannot express."""
        return []

    def run(self, inputs: AttentionInputs) -> Tensor:
        """Attention output (B, Hq, L, Ev) for inputs this backend has accepted."""
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        caps = self.capabilities
        return {
            "name": self.name,
            "available": self.unavailable_reason() is None,
            "unavailable_reason": self.unavailable_reason(),
            "description": self.description,
            "devices": list(caps.devices),
            "dtypes": [DTYPE_NAMES[d] for d in caps.dtypes],
            "max_head_dim": caps.max_head_dim,
            "features": caps.features(),
        }


class FusedAttention(torch.autograd.Function):
    """Autograd over a fused kernel's two launchers; saves (out, lse), never L x S.

    apply((forward, backward), inputs, query, key, value, attn_mask), where
    forward(inputs) -> (out, lse) and backward(inputs, out, lse, grad_out) ->
    (dq, dk, dv, dmask or None). The tensors are passed so autograd sees them.
    """

    @staticmethod
    def forward(ctx, launchers, inputs: AttentionInputs, query, key, value, attn_mask):
        forward, ctx.launch_backward = launchers
        out, lse = forward(inputs)
        ctx.inputs = inputs
        ctx.save_for_backward(out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out, lse = ctx.saved_tensors
        dq, dk, dv, dmask = ctx.launch_backward(ctx.inputs, out, lse, grad_out)
        return None, None, dq, dk, dv, dmask
