"""Gradients of every backend that declares backward, against the float64 reference."""

import pytest
import torch
from cases import backend_params, device_for, output_and_gradients, torch_may_deviate

import attnperf
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference


@pytest.mark.parametrize("backend, case, dtype", backend_params(need_backward=True))
def test_gradients_agree_with_float64_reference(backend, case, dtype):
    args = case.build(dtype, device_for(backend))
    expected_shape = same_precision_reference(**args).shape
    grad_out = torch.randn(expected_shape, generator=torch.Generator().manual_seed(1))
    grad_out = grad_out.to(device=args["query"].device, dtype=dtype)

    def run(**call):
        return attnperf.attention(**call, backend=backend.name)

    _, actual = output_and_gradients(run, args, grad_out)
    _, exact = output_and_gradients(float64_reference, args, grad_out, cast=torch.float64)
    _, baseline = output_and_gradients(same_precision_reference, args, grad_out)
    assert actual.keys() == baseline.keys()
    for name in actual:
        assert actual[name] is not None, f"no gradient reached {name}"
        assert actual[name].shape == args[name].shape
        with torch_may_deviate(backend, case, dtype, "backward"):
            assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")
