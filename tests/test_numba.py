"""The numba backend's own choices: both backward schedules give the same gradients."""

import pytest
import torch

from attnperf import dispatch
from attnperf.inputs import prepare

numba_cpu = pytest.importorskip("attnperf.kernels.numba_cpu")
if dispatch.registry()["numba"].unavailable_reason():
    pytest.skip(dispatch.registry()["numba"].unavailable_reason(), allow_module_level=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fused_and_two_pass_backward_agree(causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 32, generator=gen)
    k, v = (torch.randn(2, 2, 280, 32, generator=gen) for _ in range(2))
    mask = None if causal else torch.randn(300, 280, generator=gen).requires_grad_()
    inputs = prepare(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    out, lse = numba_cpu.numba_attention_forward(inputs)
    grad_out = torch.randn(out.shape, generator=gen)
    fused = numba_cpu.numba_attention_backward(inputs, out, lse, grad_out, fused=True)
    two_pass = numba_cpu.numba_attention_backward(inputs, out, lse, grad_out, fused=False)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), fused, two_pass, strict=True):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
