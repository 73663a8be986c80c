"""SDPA semantics that the agreement grid cannot express: dropout, NaN/inf, weights."""

import pytest
import torch
from cases import device_for, output_and_gradients

import attnperf
from attnperf import dispatch
from attnperf.kernels.reference import attention_with_weights
from attnperf.testing import (
    assert_agrees,
    float64_reference,
    max_error,
    same_precision_reference,
)

AVAILABLE = [b for b in dispatch.registry().values() if b.unavailable_reason() is None]
DROPOUT = [b for b in AVAILABLE if "dropout" in b.capabilities.features]


def test_weights_are_a_softmax_over_allowed_keys():
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(3))
    out, weights = attention_with_weights(q, k, v, is_causal=True)
    assert weights.shape == (2, 3, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 6, dtype=torch.float64))
    assert torch.all(weights.triu(1) == 0)
    torch.testing.assert_close(out, weights @ v)


def test_reference_dropout_zeroes_weights_and_rescales_the_rest():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 16, dtype=torch.float64) for _ in range(3))
    _, clean = attention_with_weights(q, k, v)
    out, dropped = attention_with_weights(q, k, v, dropout_p=0.25)
    kept = dropped != 0
    fraction_dropped = 1 - kept.double().mean().item()
    assert abs(fraction_dropped - 0.25) < 0.03  # 16k draws: 5 sigma is about 0.017
    torch.testing.assert_close(dropped[kept], clean[kept] / 0.75)
    torch.testing.assert_close(out, dropped @ v)


@pytest.mark.parametrize("backend", DROPOUT, ids=lambda b: b.name)
def test_dropout_keeps_the_expected_output(backend):
    """Averaged over many draws, dropout's output converges to the output without it."""
    device = device_for(backend)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, device=device) for _ in range(3))
    clean = attnperf.attention(q, k, v, backend=backend.name)
    draws = torch.stack(
        [attnperf.attention(q, k, v, dropout_p=0.3, backend=backend.name) for _ in range(4000)]
    )
    assert not torch.equal(draws[0], draws[1])
    standard_error = draws.std(0) / 4000**0.5
    assert torch.all((draws.mean(0) - clean).abs() < 6 * standard_error + 1e-6)


@pytest.mark.parametrize("backend", AVAILABLE, ids=lambda b: b.name)
def test_nan_and_inf_propagate_as_in_sdpa(backend):
    """NaN/inf follow SDPA's definition (its math path): a NaN query row gives a NaN row.

    The sdpa backend is held to torch's own kernel on this machine: whether that kernel
    turns a NaN row into finite output depends on the CPU path torch takes (AVX-512's flash
    kernel does, AVX2's does not)."""
    device = device_for(backend)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    q[0, 0, 3, 5] = float("nan")  # poisons query row 3 of head 0 only
    v[0, 1, 2, 0] = float("inf")  # every row of head 1 attends to key 2
    out = attnperf.attention(q, k, v, backend=backend.name)
    expected = torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
    if backend.name == "sdpa":
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-4, atol=1e-5)


FINFO_MIN = torch.finfo(torch.float32).min


@pytest.mark.parametrize("backend", AVAILABLE, ids=lambda b: b.name)
def test_float_mask_of_finfo_min_masks_like_sdpa(backend):
    """finfo.min is transformers' "masked": a row of it averages V (its scores stay finite)."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen).to(device) for _ in range(3))
    mask = torch.randn(1, 2, 24, 24, generator=gen)
    mask[..., 5, :] = FINFO_MIN  # a row that sees only finfo.min
    mask[..., 9, 3:] = FINFO_MIN  # a row that sees three keys
    mask = mask.to(device)
    args = {"query": q, "key": k, "value": v, "attn_mask": mask}
    grad_out = torch.randn(1, 2, 24, 16, generator=gen).to(device)

    def run(**call):
        return attnperf.attention(**call, backend=backend.name)

    out, grads = output_and_gradients(run, args, grad_out)
    exact, exact_grads = output_and_gradients(float64_reference, args, grad_out, torch.float64)
    baseline, baseline_grads = output_and_gradients(same_precision_reference, args, grad_out)
    torch.testing.assert_close(out[..., 5, :], v.mean(-2), rtol=1e-5, atol=1e-6)
    assert_agrees(out, exact, baseline)
    for name in ("query", "key", "value"):
        assert_agrees(grads[name], exact_grads[name], baseline_grads[name], what=name)


def test_reference_computes_half_precision_in_float32_as_sdpa():
    """fp16 scores of q, k ~ 100 * randn overflow; the ground truth must not."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=gen) for _ in range(3))
    q, k = (q * 100).half(), (k * 100).half()
    out = attnperf.attention(q, k, v.half(), backend="reference")
    assert out.isfinite().all()
    exact = float64_reference(q, k, v.half())
    sdpa = torch.ops.aten._scaled_dot_product_attention_math(q, k, v.half())[0]
    assert max_error(out, exact) <= max_error(sdpa, exact) + 1e-3


@pytest.mark.parametrize("backend", [*(b.name for b in AVAILABLE), "auto"])
def test_autocast_casts_as_sdpa_does(backend):
    """Under autocast SDPA casts q, k, v (mixed dtypes too) to the autocast dtype."""
    device = device_for(backend)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen).to(device) for _ in range(3))
    with torch.autocast(device, dtype=torch.bfloat16):
        out = attnperf.attention(q.bfloat16(), k, v, backend=backend)
        expected = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k, v)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", AVAILABLE, ids=lambda b: b.name)
def test_outputs_own_torch_storage(backend):
    """Resizable like any torch result: no numpy-owned memory behind the output."""
    q = torch.randn(1, 2, 8, 16, device=device_for(backend))
    out = attnperf.attention(q, q, q, backend=backend.name)
    out.resize_(4, 16, 16)
    assert out.shape == (4, 16, 16)
