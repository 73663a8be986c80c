"""`attention` as a torch.library custom op, so that torch.compile traces it without breaks.

Inside a compiled region `attnperf.attention` calls `torch.ops.attnperf.attention`: dynamo
sees one opaque op with a fake (shape-only) implementation, and autograd through a second op
that recomputes the forward under autograd and returns the input gradients. With dropout the
forward op also returns the random generator's state from before it ran (as activation
checkpointing does), and the backward recomputes under that state: the same dropout mask.
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


def attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              backend) -> Tensor:  # fmt: skip
    """`attnperf.attention` as traced under torch.compile: the custom op's output."""
    return attention_op(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
    )[0]


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
) -> tuple[Tensor, Tensor]:
    """(attention output (..., Hq, L, Ev) computed eagerly by `backend`, the random state
    the dropout drew from: empty without dropout)."""
    state = _rng_state(query.device) if dropout_p > 0 else query.new_empty(0, dtype=torch.uint8)
    with torch.no_grad():
        out = _eager_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
        )
    return out.clone(), state.clone()


@attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend):
    state_size = _rng_state(query.device).numel() if dropout_p > 0 else 0
    return (
        query.new_empty((*query.shape[:-1], value.shape[-1])),
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
    mask_needs_grad: bool,
    rng_state: Tensor,
) -> list[Tensor]:
    """[dq, dk, dv, dmask]: the forward recomputed under autograd (with dropout, from the
    forward's `rng_state`), then differentiated. dmask is empty unless `mask_needs_grad`."""
    replay = _replayed_rng(query.device, rng_state) if dropout_p > 0 else contextlib.nullcontext()
    with _autograd_inside_op(), replay:
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
      mask_needs_grad, rng_state):  # fmt: skip
    dmask = torch.empty_like(attn_mask) if mask_needs_grad else query.new_empty(0)
    return [torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dmask]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], output[1])
    ctx.arguments = inputs[4:]
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_rng_state):
    query, key, value, mask, rng_state = ctx.saved_tensors
    mask_needs_grad = bool(mask is not None and ctx.needs_input_grad[3])
    dq, dk, dv, dmask = attention_backward_op(
        grad_out, query, key, value, mask, *ctx.arguments, mask_needs_grad, rng_state
    )
    return dq, dk, dv, dmask if mask_needs_grad else None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
