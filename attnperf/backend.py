"""The contract every backend implements: declared capabilities and reasons for refusing a call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

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


class FusedBackend(Backend):
    """A fused kernel served through FusedAttention: subclasses set `forward` and
    `backward`, its two launchers (staticmethods)."""

    forward: Callable[[AttentionInputs], tuple[Tensor, Tensor]]  # -> (out, stats)
    backward: Callable[..., tuple[Tensor | None, ...]]

    def run(self, inputs: AttentionInputs) -> Tensor:
        launchers = (self.forward, self.backward)
        return FusedAttention.apply(
            launchers, inputs, inputs.query, inputs.key, inputs.value, inputs.attn_mask
        )[0]


class FusedAttention(torch.autograd.Function):
    """Autograd over a fused kernel's two launchers: (out, stats) from
    apply((forward, backward), inputs, query, key, value, attn_mask), where
    forward(inputs) -> (out, stats) and backward(inputs, out, stats, grad_out) ->
    (dq, dk, dv, dmask or None); stats are the kernel's per-row softmax statistics.

    Saves the inputs and (out, stats), never L x S, through save_for_backward, so that an
    in-place edit after the forward raises in backward as it does for SDPA. Double backward
    raises a clear error when reached; torch.vmap folds its dim into the batch.
    """

    @staticmethod
    def forward(launchers, inputs: AttentionInputs, query, key, value, attn_mask):
        return launchers[0](inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        launchers, call, query, key, value, attn_mask = inputs
        ctx.launch_backward, ctx.call = launchers[1], call
        ctx.save_for_backward(query, key, value, attn_mask, *output)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_out, _grad_stats):
        query, key, value, attn_mask, out, stats = ctx.saved_tensors  # checks in-place edits
        inputs = replace(ctx.call, query=query, key=key, value=value, attn_mask=attn_mask)
        with torch.no_grad():
            grads = ctx.launch_backward(inputs, out, stats, grad_out)
        saved = (grad_out, query, key, value, attn_mask)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in saved):
            grads = _refuse_double_backward(grads)
        return None, None, *grads

    @staticmethod
    def vmap(info, in_dims, launchers, inputs: AttentionInputs, query, key, value, attn_mask):
        size, batch = info.batch_size, inputs.batch

        def fold(tensor, dim):  # (size, B, ...) -> (size * B, ...)
            if tensor is None:
                return None
            tensor = tensor.expand(size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)
            return tensor.reshape(size * batch, *tensor.shape[2:])

        tensors = (query, key, value, attn_mask)
        q, k, v, m = (fold(t, d) for t, d in zip(tensors, in_dims[2:], strict=True))
        folded = replace(inputs, query=q, key=k, value=v, attn_mask=m)
        out, stats = FusedAttention.apply(launchers, folded, q, k, v, m)
        return (out.unflatten(0, (size, batch)), stats.unflatten(0, (size, batch))), (0, 0)


def _refuse_double_backward(grads):
    """The gradients, wired so that differentiating them again raises a clear error."""
    error = torch._C._functions.DelayedError(
        b"attnperf's fused kernels have no double backward (second derivatives); "
        b"use backend='reference' or 'sdpa' for them",
        sum(g is not None for g in grads),
    )
    present = [g.detach().requires_grad_() for g in grads if g is not None]
    wired = iter(error(*present) if len(present) > 1 else (error(*present),))
    return tuple(None if g is None else next(wired) for g in grads)
