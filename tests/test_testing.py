"""The agreement helpers must be able to fail: they catch real errors and report them."""

import pytest
import torch

from attnperf.testing import (
    assert_agrees,
    compare,
    float64_reference,
    max_error,
    same_precision_reference,
)


def args(dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(1, 2, 16, 32, generator=gen).to(dtype) for name in "qkv"}


def test_baseline_passes_and_a_small_perturbation_fails():
    a = args()
    exact = float64_reference(a["q"], a["k"], a["v"])
    baseline = same_precision_reference(a["q"], a["k"], a["v"])
    assert_agrees(baseline, exact, baseline)
    broken = baseline.clone()
    broken[0, 1, 7, 3] += 0.05
    with pytest.raises(AssertionError, match=r"1 of 1024 elements differ.*worst at \(0, 1, 7, 3\)"):
        assert_agrees(broken, exact, baseline)


def test_a_kernel_that_drops_the_scale_fails():
    a = args(torch.float32)
    exact = float64_reference(a["q"], a["k"], a["v"])
    baseline = same_precision_reference(a["q"], a["k"], a["v"])
    wrong = same_precision_reference(a["q"], a["k"], a["v"], scale=1.0)
    assert not compare(wrong, exact, baseline).ok


def test_nan_on_one_side_only_is_an_infinite_error_and_reported():
    expected = torch.zeros(4)
    actual = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    assert max_error(actual, expected) == float("inf")
    assert max_error(actual, actual.clone()) == 0.0
    result = compare(actual, expected.double(), expected)
    assert not result.ok
    assert "1 NaN/inf disagreements" in result.report
