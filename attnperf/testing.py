"""Agreement checks for attention kernels, usable on your own kernels too.

The rule is FlashAttention's: against a float64 reference, a kernel's max error may be at
most twice the error of PyTorch's own computation in the kernel's precision, plus a tiny
absolute floor for the dtype.

    initialize_mkl_vml()  # once, first: torch 2.13's CPU exp (see its docstring)
    exact = float64_reference(q, k, v, is_causal=True)
    baseline = same_precision_reference(q, k, v, is_causal=True)
    assert_agrees(my_kernel(q, k, v), exact, baseline)

Linear attention's rule is the same in relative RMS terms (an error's RMS over the exact
result's RMS, which suits a recurrence's long sums): at most twice that of the reference
recurrence in the kernel's precision, plus a floor for the dtype.

    exact = linear_reference(q.double(), k.double(), v.double(), g=g.double())
    baseline = linear_reference(q, k, v, g=g)
    assert_linear_agrees(my_kernel(q, k, v, g), exact[0], baseline[0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnperf.inputs import prepare
from attnperf.kernels.reference import reference_attention, reference_linear_attention
from attnperf.linear_inputs import prepare_linear

# Absolute floor added to the tolerance: torch.testing.assert_close's default atol per dtype.
# It covers results whose baseline is exact by construction (one key: dq is exactly 0 in
# autograd's softmax backward, rounding noise in FlashAttention's rowsum(dO * O) form).
ABSOLUTE_FLOOR = {
    torch.float64: 1e-7,
    torch.float32: 1e-5,
    torch.float16: 1e-5,
    torch.bfloat16: 1e-5,
}


# Linear attention: relative RMS floors per dtype (the output's rounding in fp16 and bf16).
RELATIVE_FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.float16: 1e-4,
    torch.bfloat16: 1e-3,
}


def initialize_mkl_vml() -> None:
    """Make torch's first call into MKL's vector math (VML) a one-thread call; returns None.

    torch 2.13's CPU `exp` (and `log`, ...) runs MKL's VML, which sets itself up on its
    first call in a process. When that first call comes from two threads at once (a tensor
    of 32k elements or more, right after another parallel op such as SDPA, on a busy
    machine), one thread can run VML's low-accuracy AVX2 kernel (`sExp_L9EP`): float32
    `torch.exp` off by up to 1.5e-4 relative over that thread's share, and a reference so
    computed failing the agreement rule at random. Call this once, before the first check.
    """
    torch.exp(torch.zeros(16))


def same_precision_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **variants: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """PyTorch's textbook attention in the inputs' own dtype (the baseline's precision);
    `attention`'s variant keywords too (with return_lse: (out, lse))."""
    inputs = prepare(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **variants
    )
    out, _, lse = reference_attention(inputs)
    return inputs.restore(out, lse)


def float64_reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **variants: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """The same computation in float64 (a float mask too): the ground truth, as float64."""
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return same_precision_reference(
        query.double(), key.double(), value.double(), attn_mask, dropout_p, is_causal, scale,
        enable_gqa, **variants,
    )  # fmt: skip


def elementwise_error(actual: Tensor, expected: Tensor) -> Tensor:
    """|actual - expected| in float64; equal NaN/inf count as 0, a one-sided NaN/inf as inf."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    diff = (actual - expected).abs().masked_fill(same, 0.0)
    return diff.nan_to_num(nan=float("inf"))


def max_error(actual: Tensor, expected: Tensor) -> float:
    """Max elementwise_error; 0 for empty tensors."""
    diff = elementwise_error(actual, expected)
    return float(diff.max()) if diff.numel() else 0.0


@dataclass(frozen=True)
class Agreement:
    """Outcome of one comparison under the rule."""

    what: str
    error: float
    baseline_error: float
    tolerance: float
    report: str

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def compare(actual: Tensor, exact: Tensor, baseline: Tensor, *, what: str = "output") -> Agreement:
    """Judge `actual` against the float64 `exact` result, allowing twice `baseline`'s error."""
    if actual.dtype != baseline.dtype:
        raise ValueError(f"{what}: dtype {actual.dtype} differs from baseline's {baseline.dtype}")
    baseline_error = max_error(baseline, exact)
    tolerance = 2 * baseline_error + ABSOLUTE_FLOOR[baseline.dtype]
    error = max_error(actual, exact)
    return Agreement(
        what, error, baseline_error, tolerance, mismatch_report(actual, exact, tolerance)
    )


def assert_agrees(actual: Tensor, exact: Tensor, baseline: Tensor, *, what: str = "output") -> None:
    """Raise AssertionError, with a mismatch report, unless `actual` passes the rule."""
    result = compare(actual, exact, baseline, what=what)
    if not result.ok:
        raise AssertionError(
            f"{what}: max error {result.error:.3e} > tolerance {result.tolerance:.3e} "
            f"(2 x baseline {result.baseline_error:.3e} + floor)\n{result.report}"
        )


def mismatch_report(actual: Tensor, expected: Tensor, tolerance: float) -> str:
    """How many elements differ by more than `tolerance`, the worst one, NaN/inf disagreement."""
    diff = elementwise_error(actual, expected)
    if diff.numel() == 0:
        return "empty tensors: nothing differs"
    actual, expected = actual.detach().double(), expected.detach().double()
    bad = diff > tolerance
    nonfinite_mismatch = int((actual.isfinite() != expected.isfinite()).sum())
    worst = int(diff.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
    return (
        f"{int(bad.sum())} of {actual.numel()} elements differ by more than {tolerance:.3e}; "
        f"worst at {index}: actual {actual.flatten()[worst].item():.6g}, "
        f"expected {expected.flatten()[worst].item():.6g}; "
        f"{nonfinite_mismatch} NaN/inf disagreements"
    )


def linear_reference(q: Tensor, k: Tensor, v: Tensor, **call: object) -> tuple[Tensor, Tensor]:
    """The linear-attention recurrence token by token (`linear_attention`'s arguments), in
    float32 for fp16/bf16/fp32 inputs and in float64 for float64 ones: (out, final state)."""
    return reference_linear_attention(prepare_linear(q, k, v, **call))


def relative_rms_error(actual: Tensor, exact: Tensor) -> float:
    """RMS(actual - exact) / RMS(exact), in float64; 0 when both are 0 or empty, inf on a
    one-sided NaN/inf."""
    diff = elementwise_error(actual, exact)
    if diff.numel() == 0:
        return 0.0
    scale = float(exact.detach().double().square().mean().sqrt())
    error = float(diff.square().mean().sqrt())
    return error / scale if scale else (0.0 if error == 0 else float("inf"))


def assert_linear_agrees(
    actual: Tensor, exact: Tensor, baseline: Tensor, *, what: str = "output"
) -> None:
    """Raise AssertionError unless `actual`'s relative RMS error against the float64 `exact`
    is at most twice `baseline`'s (the reference in the same precision) plus the floor."""
    if actual.dtype != baseline.dtype:
        raise ValueError(f"{what}: dtype {actual.dtype} differs from baseline's {baseline.dtype}")
    error, baseline_error = relative_rms_error(actual, exact), relative_rms_error(baseline, exact)
    tolerance = 2 * baseline_error + RELATIVE_FLOOR[baseline.dtype]
    if not error <= tolerance:
        raise AssertionError(
            f"{what}: relative RMS error {error:.3e} > tolerance {tolerance:.3e} (2 x baseline "
            f"{baseline_error:.3e} + floor)\n"
            + mismatch_report(
                actual, exact, tolerance * float(exact.double().square().mean().sqrt())
            )
        )
