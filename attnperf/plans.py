"""Call plans: a call shape's validation and backend choice, kept for its next call.

Checking an `attention` call and walking "auto" read only the call's metadata (shapes,
dtypes, devices, the scalar arguments, whether a gradient is wanted), never a tensor's
values, wherever no variant is a tensor (no attn_mask, alibi_slopes, block_mask or sinks).
A model makes the same call layer after layer, step after step, and for short calls those
steps cost as much as the kernel: 45 us of a 167 us call at B = 1, H = 8, L = 64 (Intel
Xeon, 2 threads; SDPA's whole call 55 us). A plan keeps what they found under the call's
metadata; the next call with that metadata binds its own tensors to it and runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.backend import Backend
from attnperf.inputs import AttentionInputs, Variant

# Plans kept at most; past it they are dropped all at once (a model uses a handful).
MAX_PLANS = 256
_PLANS: dict[tuple, DensePlan] = {}

# The scalar arguments' types that a plan's key may hold: each value of these types checks
# alike (is_causal=1 is refused where True is not, so a key never mixes them).
_NUMBER = (float, int)


@dataclass(frozen=True)
class DensePlan:
    """What `prepare` and `dispatch.select` found for a call's metadata: the 4-D shapes to
    view q, k, v as (None: they are 4-D already), the checked arguments and the backend.
    `selection_state`: what the choice read besides the call (dispatch.selection_state)."""

    shapes: tuple[torch.Size, torch.Size, torch.Size] | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    out_shape: tuple[int, ...]
    variant: Variant
    backend: Backend
    selection_state: tuple

    def bind(self, query: Tensor, key: Tensor, value: Tensor) -> AttentionInputs:
        """The inputs of a call with this plan's metadata."""
        if self.shapes is not None:
            q_shape, k_shape, v_shape = self.shapes
            query, key, value = query.reshape(q_shape), key.reshape(k_shape), value.reshape(v_shape)
        return AttentionInputs(
            query, key, value, None, self.dropout_p, self.is_causal, self.scale, self.enable_gqa,
            self.out_shape, self.variant,
        )  # fmt: skip


def _tensor_key(tensor: object) -> tuple | None:
    if type(tensor) is not Tensor:  # subclasses (fake, functional, DTensor) plan nothing
        return None
    return (tensor.shape, tensor.dtype, tensor.device, tensor.layout, tensor.is_nested,
            tensor.requires_grad)  # fmt: skip


def _plain_window(window: object) -> bool:
    return window is None or (
        type(window) is tuple
        and len(window) == 2
        and all(side is None or type(side) is int for side in window)
    )


def dense_key(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, variants
) -> tuple | None:
    """The metadata an `attention` call's checks and backend choice depend on, or None
    where a plan cannot stand for them (a tensor variant, an argument of another type)."""
    tensor_variants = (variants["alibi_slopes"], variants["block_mask"], variants["sinks"])
    if attn_mask is not None or any(v is not None for v in tensor_variants):
        return None
    window, softcap = variants["window"], variants["softcap"]
    plain = (
        type(is_causal) is bool
        and type(enable_gqa) is bool
        and type(variants["return_lse"]) is bool
        and type(dropout_p) in _NUMBER
        and (scale is None or type(scale) in _NUMBER)
        and (softcap is None or type(softcap) in _NUMBER)
        and _plain_window(window)
        and type(variants["align"]) is str
        and type(backend) is str
    )
    tensors = (_tensor_key(query), _tensor_key(key), _tensor_key(value))
    if not plain or None in tensors:
        return None
    return (
        *tensors, dropout_p, is_causal, scale, enable_gqa, backend, window, softcap,
        variants["align"], variants["return_lse"], torch.is_grad_enabled(),
        torch.get_num_threads(),
    )  # fmt: skip


def dense_plan(key: tuple) -> DensePlan | None:
    """The plan kept for `key`, if the backend's choice would still read what it read."""
    plan = _PLANS.get(key)
    if plan is None:
        return None
    kept, now = plan.selection_state, dispatch.selection_state()
    if any(a is not b for a, b in zip(kept, now, strict=True)):
        return None
    return plan


def keep_dense_plan(key: tuple, inputs: AttentionInputs, chosen: Backend) -> None:
    """Keep what a checked call found, for the next call with its metadata (`key`)."""
    shapes = (inputs.query.shape, inputs.key.shape, inputs.value.shape)
    given = tuple(tensor_key[0] for tensor_key in key[:3])
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = DensePlan(
        shapes=None if given == shapes else shapes,
        dropout_p=inputs.dropout_p,
        is_causal=inputs.is_causal,
        scale=inputs.scale,
        enable_gqa=inputs.enable_gqa,
        out_shape=inputs.out_shape,
        variant=inputs.variant,
        backend=chosen,
        selection_state=dispatch.selection_state(),
    )


def clear() -> None:
    """Drop every plan (the next call of each shape is checked in full again)."""
    _PLANS.clear()
