"""Call plans: what a call shape's checks (and backend choice) found, kept for its next
call; the one route from `api` to a backend's launcher.

Checking an `attention` call and walking "auto" read only the call's metadata (shapes,
dtypes, devices, the scalar arguments, whether a gradient is wanted), never a tensor's
values, wherever no variant is a tensor (no attn_mask, alibi_slopes, block_mask or sinks).
A model makes the same call layer after layer, step after step, and for short calls those
steps cost as much as the kernel (benches/README.md, "Short sequences"). Every call runs
on a `DensePlan`: a fresh one made of its checked inputs (`plan_dense`), kept under its
metadata where it has no tensor variant; the next call with that metadata runs on it, its
tensors alone bound.

An attention_with_kvcache call keeps the checks of its metadata alone: its lengths are
values, checked per call, and so is the backend's choice, which may read them. Where the
call is a plain step (a contiguous cache, one int length, no new keys, left padding, ALiBi,
sinks or int8 scales: transformers' decoding), the chosen backend's own launcher for such
steps runs it (`Backend.kvcache_step`), kept with the lengths over which the choice stands
(`dispatch.step_lengths`): the next step of such a length runs on it after its values'
checks alone.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.backend import Backend
from attnperf.inputs import (
    PLAIN_KINDS,
    PLAIN_NUMBERS,
    TENSOR_KEYWORDS,
    VARIANT_KEYWORDS,
    AttentionInputs,
    Variant,
    plain_window,
    restore_dense,
)
from attnperf.serving import KVCacheCall

# Plans kept at most; past it they are dropped all at once (a model uses a handful).
MAX_PLANS = 256
_PLANS: dict[tuple, DensePlan | KVCacheCall | KVCacheStep] = {}


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
    needs_grad: bool  # whether the calls of its metadata have a gradient to come

    def __call__(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """`attention` of a call with this plan's metadata: without a gradient to come, its
        q, k, v on the kept forward alone (`Backend.run_kept`: no inputs record, a fifth
        of a short call's Python), else its tensors bound, then run."""
        if self.shapes is not None:
            q_shape, k_shape, v_shape = self.shapes
            query, key, value = query.reshape(q_shape), key.reshape(k_shape), value.reshape(v_shape)
        if (
            not self.needs_grad
            and self.forward is not None
            and not torch._C._are_functorch_transforms_active()  # vmap: `FusedBackend.run`
        ):
            return_lse = self.variant.return_lse
            out, lse = self.backend.run_kept(self.forward, query, key, value, return_lse)
            return restore_dense(out, lse, self.out_shape, return_lse)
        return self.run(self.bind(query, key, value))

    def run(self, inputs: AttentionInputs) -> Tensor | tuple[Tensor, Tensor]:
        """`attention`'s result of a call this plan was made for, or bound to it: the
        backend's `run`, on the kept forward if any, in the caller's layout."""
        if self.forward is None:
            return inputs.restore(*self.backend.run(inputs))
        return inputs.restore(*self.backend.run(inputs, self.forward))

    def bind(self, query: Tensor, key: Tensor, value: Tensor) -> AttentionInputs:
        """The inputs of a call with this plan's metadata, its q, k, v 4-D."""
        return AttentionInputs(
            query, key, value, None, self.dropout_p, self.is_causal, self.scale, self.enable_gqa,
            self.out_shape, self.variant,
        )  # fmt: skip


def plan_dense(inputs: AttentionInputs, requested: str) -> DensePlan:
    """The plan of a checked call (`prepare`'s inputs): the backend that serves `requested`
    ("auto" or its name; `dispatch.select`) and, where the call has no tensor variant, its
    forward for the next calls with its metadata (`Backend.forward_for`)."""
    chosen = dispatch.select(inputs, requested)
    given = (inputs.query.shape, inputs.key.shape, inputs.value.shape)
    return DensePlan(
        shapes=given,
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
        needs_grad=inputs.needs_grad,
    )


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


# The variant keywords whose values a plan's key holds (with their test), and those whose
# tensors no plan stands for (attnperf.inputs.VARIANT_KEYWORDS).
# (Read by itemgetter, and tested only where not `attention`'s defaults: tested one by one,
# they cost a short call a tenth of its Python.)
_PLAIN = tuple(k for k in VARIANT_KEYWORDS if k.kind in PLAIN_KINDS)
_PLAIN_VALUES = operator.itemgetter(*(k.name for k in _PLAIN))
_PLAIN_DEFAULTS = tuple(k.default for k in _PLAIN)
_PLAIN_TESTS = tuple(PLAIN_KINDS[k.kind] for k in _PLAIN)
_TENSOR_VALUES = operator.itemgetter(*TENSOR_KEYWORDS)


def dense_key(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, variants
) -> tuple | None:
    """The metadata an `attention` call's checks and backend choice depend on, or None
    where a plan cannot stand for them (a tensor variant, an argument of another type)."""
    if attn_mask is not None or _TENSOR_VALUES(variants).count(None) != len(TENSOR_KEYWORDS):
        return None
    scalars = _PLAIN_VALUES(variants)
    defaults = all(map(operator.is_, scalars, _PLAIN_DEFAULTS))  # by identity: 0 == False
    if not defaults and not all(map(operator.call, _PLAIN_TESTS, scalars)):
        return None
    plain = (
        type(is_causal) is bool
        and type(enable_gqa) is bool
        and type(dropout_p) in PLAIN_NUMBERS
        and (scale is None or type(scale) in PLAIN_NUMBERS)
        and type(backend) is str
        and type(query) is Tensor
        and type(key) is Tensor
        and type(value) is Tensor
    )
    if not plain:
        return None
    return (
        (
            query.shape,
            query.dtype,
            query.device,
            query.layout,
            query.is_nested,
            query.requires_grad,
        ),
        (key.shape, key.dtype, key.device, key.layout, key.is_nested, key.requires_grad),
        (
            value.shape,
            value.dtype,
            value.device,
            value.layout,
            value.is_nested,
            value.requires_grad,
        ),
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        backend,
        *scalars,
        torch.is_grad_enabled(),
        torch.get_num_threads(),
    )  # each tensor's metadata as _tensor_key's, made in place: no call each


def dense_plan(key: tuple) -> DensePlan | None:
    """The plan kept for `key`, if the backend's choice would still read what it read."""
    plan = _PLANS.get(key)
    return plan if plan is not None and _current(plan.requested, plan.selection_state) else None


def _current(requested: str, selection_state: tuple) -> bool:
    """Whether what the choice of `requested` read (the registry, for "auto" the CPU table
    in force) is what a plan's choice read."""
    now = dispatch.selection_state(requested)
    return len(now) == len(selection_state) and all(map(operator.is_, selection_state, now))


def keep_dense_plan(key: tuple, plan: DensePlan) -> None:
    """Keep a checked call's plan for the next call with its metadata (`key`): its 4-D
    views made only where the key's shapes are not theirs."""
    given = tuple(tensor_key[0] for tensor_key in key[:3])
    _keep(key, replace(plan, shapes=None) if given == plan.shapes else plan)


def kvcache_key(
    q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_leftpad, is_causal,
    scale, window, softcap, alibi_slopes, num_splits, return_lse, sinks, k_scale, v_scale,
) -> tuple | None:  # fmt: skip
    """The metadata an attention_with_kvcache call's checks of metadata read
    (`serving.check_kvcache_call`), or None where a plan cannot stand for them (ALiBi
    slopes, an int8 cache's scales, an argument of another type). A contiguous cache's
    length is left out: a cache that grows by a row each step keeps its plan (its lengths
    are checked against it per call)."""
    if alibi_slopes is not None or k_scale is not None or v_scale is not None:
        return None
    plain = (
        type(is_causal) is bool
        and type(return_lse) is bool
        and type(num_splits) is int
        and (scale is None or type(scale) in PLAIN_NUMBERS)
        and (softcap is None or type(softcap) in PLAIN_NUMBERS)
        and plain_window(window)
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
        k_rows = (k_shape[0], k_shape[2], k_shape[3])
        v_rows = (v_shape[0], v_shape[2], v_shape[3])
    lengths = "int" if type(cache_seqlens) is int else _tensor_key(cache_seqlens)
    tensors = (
        _tensor_key(q), _tensor_key(k_cache, k_rows), _tensor_key(v_cache, v_rows),
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
    q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_leftpad, is_causal,
    scale, window, softcap, alibi_slopes, num_splits, return_lse, sinks, k_scale, v_scale,
    backend, heads_first=False,
) -> tuple | None:  # fmt: skip
    """The key of a backend's step launcher (`Backend.kvcache_step`) for an
    attention_with_kvcache call's metadata, or None where the call is no plain step: lengths
    not one int, new keys, a paged cache, left padding, ALiBi, sinks, an int8 cache's
    scales, an argument of another type. Each cache's length (dim 1) is left out, as in
    `kvcache_key`; the grad mode and the thread count are in (the launcher's work depends
    on them). heads_first: q, k_cache and v_cache given in SDPA's (B, H, L, E) layout; the
    key is their (B, L, H, E) views'. Written out, not looped: a step's whole Python is a
    few microseconds."""
    if (
        type(cache_seqlens) is not int
        or k_new is not None
        or v_new is not None
        or block_table is not None
        or cache_leftpad is not None
        or alibi_slopes is not None
        or sinks is not None
        or k_scale is not None
        or v_scale is not None
    ):
        return None
    plain = (
        type(backend) is str
        and type(is_causal) is bool
        and type(return_lse) is bool
        and type(num_splits) is int
        and (scale is None or type(scale) in PLAIN_NUMBERS)
        and (softcap is None or type(softcap) in PLAIN_NUMBERS)
        and plain_window(window)
        and type(q) is Tensor
        and type(k_cache) is Tensor
        and type(v_cache) is Tensor
    )
    if not plain:
        return None
    q_shape, k_shape, v_shape = q.shape, k_cache.shape, v_cache.shape
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        return None
    heads = 1 if heads_first else 2
    if heads_first:
        q_shape = (q_shape[0], q_shape[2], q_shape[1], q_shape[3])
    return (
        (q_shape, q.dtype, q.device, q.layout, q.is_nested, q.requires_grad),
        (k_shape[0], k_shape[heads], k_shape[3], k_cache.dtype, k_cache.device, k_cache.layout,
         k_cache.is_nested, k_cache.requires_grad),
        (v_shape[0], v_shape[heads], v_shape[3], v_cache.dtype, v_cache.device, v_cache.layout,
         v_cache.is_nested, v_cache.requires_grad),
        is_causal, scale, window, softcap, num_splits, return_lse, backend,
        torch.is_grad_enabled(), torch.get_num_threads(),
    )  # fmt: skip


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
