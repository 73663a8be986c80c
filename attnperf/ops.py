"""`attention` as a torch.library custom op, so that torch.compile traces it without breaks.

Inside a compiled region `attnperf.attention` calls `torch.ops.attnperf.attention`: dynamo
sees one opaque op with a fake (shape-only) implementation, and autograd through a second op
that recomputes the forward under autograd and returns the input gradients. With dropout the
forward op also returns the random generator's state from before it ran (as activation
checkpointing does), and the backward recomputes under that state: the same dropout mask.
The call's variant travels as typed arguments (`flatten_variant`); the op returns the LSE
(empty unless asked for), whose gradient the backward op takes too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.inputs import prepare
from attnperf.layouts import BlockMask

NO_SIDE = -1  # a window side that is None (unbounded), as the op's int arguments carry it


def flatten_variant(variants: dict) -> list:
    """`attention`'s variant keywords as the custom op's typed arguments: window given,
    left, right (NO_SIDE: None), softcap, alibi_slopes, align, return_lse, the block
    layout's tensors and its ints (shape and block size; empty without one), sinks."""
    window = variants.get("window")
    layout = variants.get("block_mask")
    left, right = window if isinstance(window, (tuple, list)) and len(window) == 2 else (0, 0)
    return [
        window is not None,
        NO_SIDE if left is None else left,
        NO_SIDE if right is None else right,
        variants.get("softcap"),
        variants.get("alibi_slopes"),
        variants.get("align", "top_left"),
        variants.get("return_lse", False),
        [] if layout is None else [layout.kinds, layout.partial_index, layout.partial],
        [] if layout is None else [*layout.shape, *layout.block_size],
        variants.get("sinks"),
    ]


def unflatten_variant(has_window, left, right, softcap, alibi_slopes, align, return_lse,
                      layout, layout_ints, sinks) -> dict:  # fmt: skip
    """The inverse of flatten_variant: keywords for `prepare`."""
    block_mask = None
    if layout:
        block_mask = BlockMask(tuple(layout_ints[:4]), tuple(layout_ints[4:]), *layout)
    window = None
    if has_window:
        window = (None if left == NO_SIDE else left, None if right == NO_SIDE else right)
    return {
        "window": window, "softcap": softcap, "alibi_slopes": alibi_slopes,
        "block_mask": block_mask, "align": align, "return_lse": return_lse, "sinks": sinks,
    }  # fmt: skip


def _eager_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     backend, variant) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse: empty unless the variant asks for it)."""
    variants = unflatten_variant(*variant)
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
    has_window: bool,
    window_left: int,
    window_right: int,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    align: str,
    return_lse: bool,
    layout: list[Tensor],
    layout_ints: list[int],
    sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(attention output (..., Hq, L, Ev) computed eagerly by `backend`, its LSE (empty
    unless return_lse), the random state the dropout drew from: empty without dropout)."""
    state = _rng_state(query.device) if dropout_p > 0 else query.new_empty(0, dtype=torch.uint8)
    variant = (has_window, window_left, window_right, softcap, alibi_slopes, align, return_lse,
               layout, layout_ints, sinks)  # fmt: skip
    with torch.no_grad():
        out, lse = _eager_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
            variant,
        )  # fmt: skip
    return out.clone(), lse.clone(), state.clone()


@attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, *variant):
    state_size = _rng_state(query.device).numel() if dropout_p > 0 else 0
    return_lse = variant[6]
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
    has_window: bool,
    window_left: int,
    window_right: int,
    softcap: float | None,
    alibi_slopes: Tensor | None,
    align: str,
    return_lse: bool,
    layout: list[Tensor],
    layout_ints: list[int],
    sinks: Tensor | None,
    grad_lse: Tensor,
    mask_needs_grad: bool,
    rng_state: Tensor,
) -> list[Tensor]:
    """[dq, dk, dv, dmask, dsinks]: the forward recomputed under autograd (with dropout,
    from the forward's `rng_state`), then differentiated (through the LSE too, where
    `grad_lse` is not empty). dmask is empty unless `mask_needs_grad`, dsinks without
    sinks."""
    replay = _replayed_rng(query.device, rng_state) if dropout_p > 0 else contextlib.nullcontext()
    with _autograd_inside_op(), replay:
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        if sinks is not None:
            sinks = sinks.detach().requires_grad_()
        variant = (has_window, window_left, window_right, softcap, alibi_slopes, align,
                   return_lse, layout, layout_ints, sinks)  # fmt: skip
        mask = attn_mask
        if mask_needs_grad:
            mask = attn_mask.detach().requires_grad_()
            leaves.append(mask)
        out, lse = _eager_attention(*leaves[:3], mask, dropout_p, is_causal, scale, enable_gqa,
                                    backend, variant)  # fmt: skip
        if sinks is not None:
            leaves.append(sinks)
        outputs, grads_in = [out], [grad_out]
        if grad_lse.numel():
            outputs.append(lse)
            grads_in.append(grad_lse)
        grads = torch.autograd.grad(outputs, leaves, grads_in, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]
    if not mask_needs_grad:
        grads.insert(3, query.new_empty(0))
    if sinks is None:
        grads.append(query.new_empty(0))
    return grads


@attention_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, *arguments):
    sinks, mask_needs_grad = arguments[-4], arguments[-2]
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else query.new_empty(0)
    dsinks = query.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dmask,
            dsinks]  # fmt: skip


ARGUMENTS_AFTER_MASK = 15  # dropout_p .. sinks: passed through to the backward op


def _setup_context(ctx, inputs, output):
    alibi_slopes, layout, sinks = inputs[13], inputs[16], inputs[18]
    ctx.save_for_backward(*inputs[:4], output[2], alibi_slopes, sinks, *layout)
    ctx.arguments = inputs[4:]
    ctx.layout_count = len(layout)
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_out, grad_lse, _grad_rng_state):
    query, key, value, mask, rng_state, alibi_slopes, sinks, *layout = ctx.saved_tensors
    mask_needs_grad = bool(mask is not None and ctx.needs_input_grad[3])
    arguments = list(ctx.arguments)
    # Saved, not held as plain references:
    arguments[9], arguments[12], arguments[14] = alibi_slopes, layout, sinks
    return_lse = arguments[11]
    grad_lse = grad_lse if return_lse and grad_lse is not None else query.new_empty(0)
    dq, dk, dv, dmask, dsinks = attention_backward_op(
        grad_out, query, key, value, mask, *arguments, grad_lse, mask_needs_grad, rng_state
    )
    # No gradient for the other arguments, in their structure: a list per tensor list; the
    # int list is one leaf (an empty one is an empty list).
    others = [None] * ARGUMENTS_AFTER_MASK
    others[12] = [None] * ctx.layout_count
    others[13] = None if ctx.arguments[13] else []
    others[14] = dsinks if sinks is not None else None
    return dq, dk, dv, dmask if mask_needs_grad else None, *others


attention_op.register_autograd(_backward, setup_context=_setup_context)
