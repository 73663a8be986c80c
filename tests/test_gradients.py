"""Gradients of every backend that declares backward, against the float64 reference."""

import pytest
import torch
from cases import backend_params, device_for

import attnperf
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

DIFFERENTIABLE = ("query", "key", "value", "attn_mask")


def gradients(fn, args, grad_out, cast=None):
    """d(sum(out * grad_out))/d(each differentiable input), optionally cast first."""
    leaves = {}
    call = dict(args)
    for name in DIFFERENTIABLE:
        tensor = args.get(name)
        if tensor is None or not tensor.is_floating_point():
            continue
        leaf = (tensor if cast is None else tensor.to(cast)).detach().requires_grad_()
        leaves[name] = call[name] = leaf
    out = fn(**call)
    out.backward(grad_out.to(out.dtype))
    return {name: leaf.grad for name, leaf in leaves.items()}


@pytest.mark.parametrize("backend, case, dtype", backend_params(need_backward=True))
def test_gradients_agree_with_float64_reference(backend, case, dtype):
    args = case.build(dtype, device_for(backend))
    expected_shape = same_precision_reference(**args).shape
    grad_out = torch.randn(expected_shape, generator=torch.Generator().manual_seed(1))
    grad_out = grad_out.to(device=args["query"].device, dtype=dtype)

    def run(**call):
        return attnperf.attention(**call, backend=backend.name)

    actual = gradients(run, args, grad_out)
    exact = gradients(float64_reference, args, grad_out, cast=torch.float64)
    baseline = gradients(same_precision_reference, args, grad_out)
    assert actual.keys() == baseline.keys()
    for name in actual:
        assert actual[name] is not None, f"no gradient reached {name}"
        assert actual[name].shape == args[name].shape
        assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")
