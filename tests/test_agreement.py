"""Forward agreement of every backend with the float64 reference, under the FlashAttention rule."""

import pytest
import torch
import torch.nn.functional as F
from cases import CASES, backend_params, device_for, torch_may_deviate

import attnperf
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference


@pytest.mark.parametrize("backend, case, dtype", backend_params())
def test_forward_agrees_with_float64_reference(backend, case, dtype):
    args = case.build(dtype, device_for(backend))
    out = attnperf.attention(**args, backend=backend.name)
    baseline = same_precision_reference(**args)
    assert out.shape == baseline.shape
    assert out.dtype == dtype
    with torch_may_deviate(backend, case, dtype, "forward"):
        assert_agrees(out, float64_reference(**args), baseline)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_reference_has_sdpa_semantics(case):
    """In float64 the reference and torch's SDPA (on the caller's own layout) agree closely."""
    args = case.build(torch.float64)
    expected = F.scaled_dot_product_attention(**args)
    actual = float64_reference(**args)
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)
