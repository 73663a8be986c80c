"""merge_attention: attention over disjoint key sets, merged by their LSEs, is attention
over their union, forward and gradients, with -inf parts."""

import pytest
import torch
from cases import device_for

import attnperf
from attnperf import dispatch
from attnperf.backend import FusedBackend, lse_from_stats, stats_from_lse
from attnperf.inputs import prepare

LSE_BACKENDS = [
    b.name
    for b in dispatch.registry().values()
    if "lse" in b.capabilities.features and b.unavailable_reason() is None
]


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("split", [(41,), (10, 31), (5, 16, 20)], ids=["whole", "two", "three"])
def test_chunks_merged_equal_attention_over_all_keys(backend, split):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 23, 16, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, 2, 41, 16, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in range(2))  # fmt: skip
    mask = torch.rand(23, 41, generator=gen) > 0.3
    mask[3] = False  # a row that sees no key in any chunk: out 0, lse -inf
    mask[5, :10] = False  # a row that sees none of the first chunk: that part's lse is -inf
    dtype = torch.float64 if backend == "reference" else torch.float32
    device = device_for(backend)
    q_, k_, v_ = (t.to(device, dtype) for t in (q, k, v))
    mask = mask.to(device)

    def run(keys, values, m):
        return attnperf.attention(q_, keys, values, attn_mask=m, enable_gqa=True,
                                  backend=backend, return_lse=True)  # fmt: skip

    parts, start = [], 0
    for size in split:
        cut = slice(start, start + size)
        parts.append(run(k_[:, :, cut], v_[:, :, cut], mask[:, cut]))
        start += size
    out, lse = attnperf.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    whole_out, whole_lse = run(k_, v_, mask)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, whole_out, **tolerance)
    torch.testing.assert_close(lse, whole_lse.to(lse.dtype), **tolerance)
    assert lse[:, :, 3].eq(float("-inf")).all() and out[:, :, 3].eq(0).all()

    weights = torch.randn(out.shape, generator=gen, dtype=dtype).to(device)
    merged = torch.autograd.grad((out * weights).sum(), (q, k, v))
    whole = torch.autograd.grad((whole_out * weights).sum(), (q, k, v))
    for name, a, b in zip("qkv", merged, whole, strict=True):
        assert a.isfinite().all(), name
        torch.testing.assert_close(a, b, **tolerance, msg=name)


def test_sinks_applied_at_the_merge_equal_attention_with_sinks():
    """Parts computed without the sinks, merged with them: the sinks counted once; a row no
    part sees gives out 0 and lse = sink; the sinks' gradient as the reference's."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 20, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(9, 20, generator=gen) > 0.4
    mask[2] = False
    sinks = (torch.randn(4, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    parts = [attnperf.attention(q, k[:, :, keys], v[:, :, keys], attn_mask=mask[:, keys],
                                backend="reference", return_lse=True)
             for keys in (slice(0, 7), slice(7, 20))]  # fmt: skip
    out, lse = attnperf.merge_attention(*zip(*parts, strict=True), sinks=sinks)
    whole = attnperf.attention(q, k, v, attn_mask=mask, backend="reference", return_lse=True,
                               sinks=sinks)  # fmt: skip
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(lse, whole[1])
    assert out[:, :, 2].eq(0).all() and torch.equal(lse[:, :, 2], sinks.detach().expand(2, 4))
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    merged = torch.autograd.grad((out * weights).sum() + lse.sum(), sinks)[0]
    expected = torch.autograd.grad((whole[0] * weights).sum() + whole[1].sum(), sinks)[0]
    torch.testing.assert_close(merged, expected)
    with pytest.raises(ValueError, match="sinks must have shape"):
        attnperf.merge_attention([out], [lse], sinks=sinks[:3])


def test_merge_of_only_empty_parts_is_zero_with_finite_gradients():
    outs = [torch.randn(3, 5, requires_grad=True) for _ in range(2)]
    lses = [torch.full((3,), float("-inf"), requires_grad=True) for _ in range(2)]
    out, lse = attnperf.merge_attention(outs, lses)
    assert out.eq(0).all() and lse.eq(float("-inf")).all()
    out.sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in outs + lses)


@pytest.mark.parametrize(
    "outs, lses, message",
    [
        ([], [], "non-empty"),
        ([torch.zeros(3, 4)], [torch.zeros(3), torch.zeros(3)], "of one length"),
        ([torch.zeros(3, 4)], [torch.zeros(4)], r"lses\[0\] must have shape \(3,\)"),
        ([torch.zeros(3, 4), torch.zeros(3, 5)], [torch.zeros(3)] * 2, r"outs\[1\] has shape"),
        (torch.zeros(3, 4), [torch.zeros(3)], "must be lists of tensors"),
    ],
    ids=["empty", "lengths", "lse_shape", "out_shapes", "not_lists"],
)
def test_merge_refuses_bad_input(outs, lses, message):
    with pytest.raises((ValueError, TypeError), match=message):
        attnperf.merge_attention(outs, lses)


FUSED = [
    b
    for b in dispatch.registry().values()
    if isinstance(b, FusedBackend) and b.unavailable_reason() is None
]


@pytest.mark.parametrize("backend", FUSED, ids=lambda b: b.name)
def test_fused_launchers_take_stats_rebuilt_from_the_lse(backend):
    """The launchers' interface for split-K and ring attention: a backward run against
    stats rebuilt from natural-log LSEs (`stats_from_lse`) gives the gradients of the
    kernel's own stats; rows that see no key stay empty both ways."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(device_for(backend))
               for n in (40, 33, 33))  # fmt: skip
    inputs = prepare(q, k, v, is_causal=True, align="bottom_right", window=(9, 0))
    inputs_empty_rows = prepare(q[:, :, :20], k[:, :, :5], v[:, :, :5], is_causal=True,
                                align="bottom_right")  # fmt: skip
    for call in (inputs, inputs_empty_rows):
        out, stats, _ = backend.forward(call)
        lse = lse_from_stats(stats)
        rebuilt = stats_from_lse(lse)
        torch.testing.assert_close(lse_from_stats(rebuilt), lse)
        grad_out = torch.randn(out.shape, generator=gen).to(out.device)
        own = backend.backward(call, out, stats, grad_out, None)
        from_lse = backend.backward(call, out, rebuilt, grad_out, None)
        for name, a, b in zip(("dq", "dk", "dv"), own[:3], from_lse[:3], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
