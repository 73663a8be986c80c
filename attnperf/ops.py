"""`attention` as a torch.library custom op, so that torch.compile traces it without breaks.

Inside a compiled region `attnperf.attention` calls `torch.ops.attnperf.attention`: dynamo
sees one opaque op with a fake (shape-only) implementation, and autograd through a second op
that recomputes the forward under autograd and returns the input gradients. With dropout the
forward op also returns the random generator's state from before it ran (as activation
checkpointing does), and the backward recomputes under that state: the same dropout mask.
The call's variant travels as three typed arguments, derived from the variant keywords'
declarations (attnperf.inputs.VARIANT_KEYWORDS, by kind: `flatten_variant`); the op
returns the LSE (empty unless asked for), whose gradient the backward op takes too.
"""

from __future__ import annotations

import contextlib
from numbers import Real

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.inputs import VARIANT_KEYWORDS, prepare
from attnperf.layouts import BlockMask

NO_SIDE = -1  # a window side that is None (unbounded), as the op's ints carry it
ABSENT = -1  # an optional tensor or layout not given, as the op's ints carry it


def flatten_variant(variants: dict) -> tuple[list[Tensor], list[int], list[float]]:
    """`attention`'s variant keywords (absent ones: their defaults) as the custom op's
    typed arguments (tensors, ints, floats), each keyword by its kind, in the declared
    order: a window as (given, left, right) ints (NO_SIDE: None); a number as (given) and a
    float; a flag as an int; a choice as its index; a tensor as its index in the tensors
    (ABSENT: None); a BlockMask as its first tensor's index, its shape and block size, its
    three tensors. Raises TypeError or ValueError naming a keyword whose value is none of
    its kind's (`prepare` checks the rest inside the op)."""
    tensors, ints, floats = [], [], []
    for keyword in VARIANT_KEYWORDS:
        name, kind = keyword.name, keyword.kind
        value = variants.get(name, keyword.default)
        if kind == "window":
            left, right = _window_sides(name, value)
            ints += [int(value is not None), left, right]
        elif kind == "number":
            if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
                raise TypeError(f"{name} must be a real number or None, got {type(value).__name__}")
            ints.append(int(value is not None))
            floats.append(0.0 if value is None else float(value))
        elif kind == "flag":
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            ints.append(int(value))
        elif kind == "choice":
            if value not in keyword.choices:
                raise ValueError(f"{name} must be one of {keyword.choices}, got {value!r}")
            ints.append(keyword.choices.index(value))
        elif value is None:  # an absent tensor or layout
            ints.append(ABSENT)
        elif kind == "tensor":
            ints.append(len(tensors))
            tensors.append(value)
        else:  # a layout
            ints += [len(tensors), *value.shape, *value.block_size]
            tensors += [value.kinds, value.partial_index, value.partial]
    return tensors, ints, floats


def _window_sides(name: str, window: object) -> tuple[int, int]:
    """A window's (left, right) as ints (NO_SIDE: None), (0, 0) for None."""
    if window is None:
        return 0, 0
    plain = (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(
            side is None or (isinstance(side, int) and not isinstance(side, bool))
            for side in window
        )
    )
    if not plain:
        raise TypeError(f"{name} must be a (left, right) pair of ints or None, got {window!r}")
    left, right = window
    return NO_SIDE if left is None else left, NO_SIDE if right is None else right


def unflatten_variant(tensors: list[Tensor], ints: list[int], floats: list[float]) -> dict:
    """The inverse of flatten_variant: keywords for `prepare`."""
    return _unflatten(tensors, ints, floats)[0]


def _unflatten(
    tensors: list[Tensor], ints: list[int], floats: list[float]
) -> tuple[dict, dict[str, int]]:
    """(unflatten_variant's keywords, the first tensor's index of each given tensor or
    layout keyword)."""
    variants, indices, at_int, at_float = {}, {}, 0, 0
    for keyword in VARIANT_KEYWORDS:
        kind = keyword.kind
        if kind == "window":
            given, left, right = ints[at_int : at_int + 3]
            at_int += 3
            sides = tuple(None if side == NO_SIDE else side for side in (left, right))
            value = sides if given else None
        elif kind == "number":
            value = floats[at_float] if ints[at_int] else None
            at_int, at_float = at_int + 1, at_float + 1
        elif kind == "flag":
            value, at_int = bool(ints[at_int]), at_int + 1
        elif kind == "choice":
            value, at_int = keyword.choices[ints[at_int]], at_int + 1
        else:
            first, at_int = ints[at_int], at_int + 1
            value = None if first == ABSENT else tensors[first]
            if first != ABSENT:
                indices[keyword.name] = first
            if kind == "layout" and first != ABSENT:
                shape, block_size = (
                    tuple(ints[at_int : at_int + 4]),
                    tuple(ints[at_int + 4 : at_int + 6]),
                )
                at_int += 6
                value = BlockMask(shape, block_size, *tensors[first : first + 3])
        variants[keyword.name] = value
    return variants, indices


def _differentiable_tensors(
    tensors: list[Tensor], ints: list[int], floats: list[float]
) -> list[int]:
    """The indices, among a flattened variant's tensors, of those that gradients reach
    (their keyword's `differentiable`), given."""
    indices = _unflatten(tensors, ints, floats)[1]
    return [indices[k.name] for k in VARIANT_KEYWORDS if k.differentiable and k.name in indices]


def _eager_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     backend, variants) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse: empty unless `variants` (keywords) ask for it)."""
    inputs = prepare(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **variants
    )
    result = dispatch.attend(inputs, backend)
    return result if variants["return_lse"] else (result, query.new_empty(0))


@contextlib.contextmanager
def _autograd_inside_op():
    """A custom op's body runs with autograd's dispatch keys excluded (private torch API):
    re-include them so the backward op can differentiate the eager backend."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        excluded = excluded.remove(key)
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


def attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              backend, variants: dict) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """`attnperf.attention` as traced under torch.compile: the custom op's output (and LSE
    when the variant asks for it)."""
    out, lse, _ = attention_op(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
        *flatten_variant(variants),
    )  # fmt: skip
    return (out, lse) if variants.get("return_lse") else out


def _rng_state(device: torch.device) -> Tensor:
    """The state of the generator that dropout draws from on `device`."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state: Tensor):
    """Draw from `state` inside, leave the caller's generator as it was."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


@torch.library.custom_op("attnperf::attention", mutates_args=())
def attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    variant_tensors: list[Tensor],
    variant_ints: list[int],
    variant_floats: list[float],
) -> tuple[Tensor, Tensor, Tensor]:
    """(attention output (..., Hq, L, Ev) computed eagerly by `backend`, its LSE (empty
    unless return_lse), the random state the dropout drew from: empty without dropout)."""
    state = _rng_state(query.device) if dropout_p > 0 else query.new_empty(0, dtype=torch.uint8)
    variants = unflatten_variant(variant_tensors, variant_ints, variant_floats)
    with torch.no_grad():
        out, lse = _eager_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
            variants,
        )  # fmt: skip
    return out.clone(), lse.clone(), state.clone()


@attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, *variant):
    state_size = _rng_state(query.device).numel() if dropout_p > 0 else 0
    return_lse = unflatten_variant(*variant)["return_lse"]
    return (
        query.new_empty((*query.shape[:-1], value.shape[-1])),
        query.new_empty(query.shape[:-1] if return_lse else 0, dtype=torch.float32),
        query.new_empty(state_size, dtype=torch.uint8, device="cpu"),
    )


@torch.library.custom_op("attnperf::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    backend: str,
    variant_tensors: list[Tensor],
    variant_ints: list[int],
    variant_floats: list[float],
    grad_lse: Tensor,
    mask_needs_grad: bool,
    rng_state: Tensor,
) -> list[Tensor]:
    """[dq, dk, dv, dmask, *one per variant tensor]: the forward recomputed under autograd
    (with dropout, from the forward's `rng_state`), then differentiated (through the LSE
    too, where `grad_lse` is not empty). dmask is empty unless `mask_needs_grad`; a variant
    tensor's gradient empty unless its keyword is differentiable (the sinks')."""
    replay = _replayed_rng(query.device, rng_state) if dropout_p > 0 else contextlib.nullcontext()
    with _autograd_inside_op(), replay:
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        mask = attn_mask
        if mask_needs_grad:
            mask = attn_mask.detach().requires_grad_()
            leaves.append(mask)
        variant_tensors = list(variant_tensors)
        differentiable = _differentiable_tensors(variant_tensors, variant_ints, variant_floats)
        for index in differentiable:
            variant_tensors[index] = variant_tensors[index].detach().requires_grad_()
            leaves.append(variant_tensors[index])
        variants = unflatten_variant(variant_tensors, variant_ints, variant_floats)
        out, lse = _eager_attention(*leaves[:3], mask, dropout_p, is_causal, scale, enable_gqa,
                                    backend, variants)  # fmt: skip
        outputs, grads_in = [out], [grad_out]
        if grad_lse.numel():
            outputs.append(lse)
            grads_in.append(grad_lse)
        grads = torch.autograd.grad(outputs, leaves, grads_in, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]
    if not mask_needs_grad:
        grads.insert(3, query.new_empty(0))
    tensor_grads = [query.new_empty(0) for _ in variant_tensors]  # no output aliases another
    for index, grad in zip(differentiable, grads[4:], strict=True):
        tensor_grads[index] = grad
    return grads[:4] + tensor_grads


@attention_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, *arguments):
    variant_tensors, mask_needs_grad = arguments[5], arguments[-2]
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else query.new_empty(0)
    differentiable = set(_differentiable_tensors(*arguments[5:8]))
    tensor_grads = [torch.empty_like(t) if i in differentiable else query.new_empty(0)
                    for i, t in enumerate(variant_tensors)]  # fmt: skip
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dmask,
            *tensor_grads]  # fmt: skip


def _setup_context(ctx, inputs, output):
    variant_tensors = inputs[9]
    ctx.save_for_backward(*inputs[:4], output[2], *variant_tensors)
    ctx.arguments = inputs[4:9]  # dropout_p .. backend
    ctx.variant = inputs[10:]  # its ints and floats
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_out, grad_lse, _grad_rng_state):
    query, key, value, mask, rng_state, *variant_tensors = ctx.saved_tensors
    mask_needs_grad = bool(mask is not None and ctx.needs_input_grad[3])
    ints, floats = ctx.variant
    return_lse = unflatten_variant(variant_tensors, ints, floats)["return_lse"]
    grad_lse = grad_lse if return_lse and grad_lse is not None else query.new_empty(0)
    dq, dk, dv, dmask, *tensor_grads = attention_backward_op(
        grad_out, query, key, value, mask, *ctx.arguments, variant_tensors, ints, floats,
        grad_lse, mask_needs_grad, rng_state,
    )  # fmt: skip
    differentiable = set(_differentiable_tensors(variant_tensors, ints, floats))
    tensor_grads = [g if i in differentiable else None for i, g in enumerate(tensor_grads)]
    # No gradient for the other arguments; an int or float list is one leaf (an empty one
    # an empty list).
    others = [None] * 5
    return (dq, dk, dv, dmask if mask_needs_grad else None, *others, tensor_grads,
            None if ints else [], None if floats else [])  # fmt: skip


attention_op.register_autograd(_backward, setup_context=_setup_context)
