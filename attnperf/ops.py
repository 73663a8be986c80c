"""`attention` as a torch.library custom op, so that torch.compile traces it without breaks.

Inside a compiled region `attnperf.attention` calls `torch.ops.attnperf.attention`: dynamo
sees one opaque op with a fake (shape-only) implementation, and autograd through a second op
that recomputes the forward under autograd and returns the input gradients.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.inputs import prepare


def _eager_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                     backend):  # fmt: skip
    inputs = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return dispatch.attend(inputs, backend)


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
) -> Tensor:
    """Attention output (..., Hq, L, Ev), computed eagerly by `backend`."""
    with torch.no_grad():
        return _eager_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
        ).clone()


@attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


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
    mask_needs_grad: bool,
) -> list[Tensor]:
    """[dq, dk, dv, dmask]: the forward recomputed under autograd, then differentiated.

    dmask is an empty tensor unless `mask_needs_grad`.
    """
    with _autograd_inside_op():
        leaves = [t.detach().requires_grad_() for t in (query, key, value)]
        mask = attn_mask
        if mask_needs_grad:
            mask = attn_mask.detach().requires_grad_()
            leaves.append(mask)
        out = _eager_attention(*leaves[:3], mask, dropout_p, is_causal, scale, enable_gqa, backend)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]
    if not mask_needs_grad:
        grads.append(query.new_empty(0))
    return grads


@attention_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
      mask_needs_grad):  # fmt: skip
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else query.new_empty(0)
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dmask]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs[:4] if t is not None))
    ctx.has_mask = inputs[3] is not None
    ctx.arguments = inputs[4:]


def _backward(ctx, grad_out):
    saved = ctx.saved_tensors
    query, key, value = saved[:3]
    mask = saved[3] if ctx.has_mask else None
    mask_needs_grad = bool(ctx.has_mask and ctx.needs_input_grad[3])
    dq, dk, dv, dmask = attention_backward_op(
        grad_out, query, key, value, mask, *ctx.arguments, mask_needs_grad
    )
    return dq, dk, dv, dmask if mask_needs_grad else None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
