"""Call plans: what a call shape's checks (and backend choice) found, kept for its next
call.

Checking an `attention` call and walking "auto" read only the call's metadata (shapes,
dtypes, devices, the scalar arguments, whether a gradient is wanted), never a tensor's
values, wherever no variant is a tensor (no attn_mask, alibi_slopes, block_mask or sinks).
A model makes the same call layer after layer, step after step, and for short calls those
steps cost as much as the kernel: 45 us of a 167 us call at B = 1, H = 8, L = 64 (Intel
Xeon, 2 threads; SDPA's whole call 55 us). A plan keeps what they found under the call's
metadata; the next call with that metadata binds its own tensors to it and runs.

An attention_with_kvcache call keeps the checks of its metadata alone: its lengths are
values, checked per call, and so is the backend's choice, which may read them. Where the
call is a plain step (a contiguous cache, one int length, no new keys, left padding or
sinks: transformers' decoding), the chosen backend's own launcher for such steps is kept
too (`Backend.kvcache_step`), with the lengths over which the choice stands
(`dispatch.step_lengths`), and the next step of such a length runs on it after its
values' checks alone.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.backend import Backend
from attnperf.inputs import AttentionInputs, Variant
from attnperf.serving import KVCacheCall

# Plans kept at most; past it they are dropped all at once (a model uses a handful).
MAX_PLANS = 256
_PLANS: dict[tuple, DensePlan | KVCacheCall | KVCacheStep] = {}

# The scalar arguments' types that a plan's key may hold: each value of these types checks
# alike (is_causal=1 is refused where True is not, so a key never mixes them).
_NUMBER = (float, int)


@dataclass(frozen=True)
class DensePlan:
    """What `prepare` and `dispatch.select` found for a call's metadata: the 4-D shapes to
    view q, k, v as (None: they are 4-D already), the checked arguments and the backend.
    `selection_state`: what the choice of `requested` ("auto" or a backend's name) read
    besides the call (dispatch.selection_state)."""

    shapes: tuple[torch.Size, torch.Size, torch.Size] | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    out_shape: tuple[int, ...]
    variant: Variant
    backend: Backend
    requested: str
    selection_state: tuple
    forward: Callable[..., object] | None  # the backend's `forward_for`: None, none kept

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
        """The backend's `run` of a call bound to this plan, on the kept forward if any."""
        if self.forward is None:
            return self.backend.run(inputs)
        return self.backend.run(inputs, self.forward)

    def bind(self, query: Tensor, key: Tensor, value: Tensor) -> AttentionInputs:
        """The inputs of a call with this plan's metadata."""
        if self.shapes is not None:
            q_shape, k_shape, v_shape = self.shapes
            query, key, value = query.reshape(q_shape), key.reshape(k_shape), value.reshape(v_shape)
        return AttentionInputs(
            query, key, value, None, self.dropout_p, self.is_causal, self.scale, self.enable_gqa,
            self.out_shape, self.variant,
        )  # fmt: skip


def _tensor_key(tensor: object, shape: tuple | None = None) -> tuple | None:
    """A tensor's metadata (`shape` standing for its own where given), or None for what is
    not a plain tensor: subclasses (fake, functional, DTensor) plan nothing."""
    if type(tensor) is not Tensor:
        return None
    return (tensor.shape if shape is None else shape, tensor.dtype, tensor.device,
            tensor.layout, tensor.is_nested, tensor.requires_grad)  # fmt: skip


_ABSENT = ("absent",)


def _optional_key(tensor: object) -> tuple | None:
    return _ABSENT if tensor is None else _tensor_key(tensor)


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
    return plan if plan is not None and _current(plan.requested, plan.selection_state) else None


def _current(requested: str, selection_state: tuple) -> bool:
    """Whether what the choice of `requested` read (the registry, for "auto" the CPU table
    in force) is what a plan's choice read."""
    now = dispatch.selection_state(requested)
    return len(now) == len(selection_state) and all(map(operator.is_, selection_state, now))


def keep_dense_plan(key: tuple, inputs: AttentionInputs, requested: str, chosen: Backend) -> None:
    """Keep what a checked call found, for the next call with its metadata (`key`), where
    `chosen` served `requested` ("auto" or its name)."""
    shapes = (inputs.query.shape, inputs.key.shape, inputs.value.shape)
    given = tuple(tensor_key[0] for tensor_key in key[:3])
    plan = DensePlan(
        shapes=None if given == shapes else shapes,
        dropout_p=inputs.dropout_p,
        is_causal=inputs.is_causal,
        scale=inputs.scale,
        enable_gqa=inputs.enable_gqa,
        out_shape=inputs.out_shape,
        variant=inputs.variant,
        backend=chosen,
        requested=requested,
        selection_state=dispatch.selection_state(requested),
        forward=chosen.forward_for(inputs),
    )
    _keep(key, plan)


def kvcache_key(
    q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_leftpad, is_causal,
    scale, window, softcap, alibi_slopes, num_splits, return_lse, sinks, k_scale, v_scale,
    heads_first=False,
) -> tuple | None:  # fmt: skip
    """The metadata an attention_with_kvcache call's checks of metadata read
    (`serving.check_kvcache_call`), or None where a plan cannot stand for them (ALiBi
    slopes, an int8 cache's scales, an argument of another type). A contiguous cache's
    length is left out: a cache that grows by a row each step keeps its plan (its lengths
    are checked against it per call). heads_first: q, k_cache and v_cache are given in
    SDPA's (B, H, L, E) layout, a contiguous cache's; the key is their (B, L, H, E) views'."""
    if alibi_slopes is not None or k_scale is not None or v_scale is not None:
        return None
    if heads_first and (block_table is not None or type(q) is not Tensor or q.dim() != 4):
        return None
    plain = (
        type(is_causal) is bool
        and type(return_lse) is bool
        and type(num_splits) is int
        and (scale is None or type(scale) in _NUMBER)
        and (softcap is None or type(softcap) in _NUMBER)
        and _plain_window(window)
    )
    if not plain:
        return None
    k_rows = v_rows = None  # a contiguous cache's metadata without its length (dim 1)
    if block_table is None:
        if type(k_cache) is not Tensor or type(v_cache) is not Tensor:
            return None
        k_shape, v_shape = k_cache.shape, v_cache.shape  # each read makes a torch.Size
        if len(k_shape) != 4 or len(v_shape) != 4:
            return None
        heads = 1 if heads_first else 2
        k_rows = (k_shape[0], k_shape[heads], k_shape[3])
        v_rows = (v_shape[0], v_shape[heads], v_shape[3])
    q_shape = None
    if heads_first:
        batch, q_heads, q_len, head_dim = q.shape
        q_shape = torch.Size((batch, q_len, q_heads, head_dim))
    lengths = "int" if type(cache_seqlens) is int else _tensor_key(cache_seqlens)
    tensors = (
        _tensor_key(q, q_shape), _tensor_key(k_cache, k_rows), _tensor_key(v_cache, v_rows),
        _optional_key(k_new), _optional_key(v_new), _optional_key(block_table), lengths,
        _optional_key(cache_leftpad), _optional_key(sinks),
    )  # fmt: skip
    if None in tensors:
        return None
    return ("kvcache", *tensors, is_causal, scale, window, softcap, num_splits, return_lse)


def kept_kvcache_call(key: tuple) -> KVCacheCall | None:
    """The checked metadata kept for `key`, if any."""
    return _PLANS.get(key)


def keep_kvcache_call(key: tuple, call: KVCacheCall) -> None:
    """Keep a checked call's metadata for the next call with its `key`."""
    _keep(key, call)


@dataclass(frozen=True)
class KVCacheStep:
    """A named backend's launcher for a plain KV-cache step's metadata
    (`Backend.kvcache_step`), and what the backend's choice read (as DensePlan's)."""

    launch: Callable[..., object]
    requested: str
    selection_state: tuple
    lengths: range  # the cache lengths it serves (`dispatch.step_lengths`)


def kvcache_step_key(
    metadata: tuple | None, backend: object, cache_seqlens, k_new, block_table, cache_leftpad,
    sinks,
) -> tuple | None:  # fmt: skip
    """The key of a backend's step launcher for calls with this metadata (`kvcache_key`),
    or None where the call is no plain step: lengths not one int, new keys, a paged cache,
    left padding, sinks. The launcher's work depends on the grad mode and the thread count
    too."""
    plain = (
        type(backend) is str and type(cache_seqlens) is int and k_new is None
        and block_table is None and cache_leftpad is None and sinks is None
    )  # fmt: skip
    if metadata is None or not plain:
        return None
    return ("step", metadata, backend, torch.is_grad_enabled(), torch.get_num_threads())


def kept_kvcache_step(key: tuple, cache_seqlens: int) -> Callable[..., object] | None:
    """The step launcher kept for `key`, if the backend's choice for a cache of
    `cache_seqlens` keys would still read what it read."""
    step = _PLANS.get(key)
    current = (
        step is not None
        and cache_seqlens in step.lengths
        and _current(step.requested, step.selection_state)
    )
    return step.launch if current else None


def keep_kvcache_step(
    key: tuple, backend: str, launch: Callable[..., object], lengths: range
) -> None:
    """Keep the step launcher of the backend chosen for `backend` ("auto" or its name) for
    the next call with its key (`kvcache_step_key`) and a length in `lengths`
    (`dispatch.step_lengths`)."""
    _keep(key, KVCacheStep(launch, backend, dispatch.selection_state(backend), lengths))


def _keep(key: tuple, plan: object) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def clear() -> None:
    """Drop every plan (the next call of each shape is checked in full again)."""
    _PLANS.clear()
