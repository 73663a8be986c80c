"""torch.compile(fullgraph=True) traces attnperf.attention on every backend (a custom op)."""

import pytest
import torch

import attnperf
import attnperf.inputs
from attnperf import dispatch

BACKENDS = [
    name
    for name, backend in dispatch.registry().items()
    if backend.unavailable_reason() is None and "cpu" in backend.capabilities.devices
]


def block(q, k, v, mask, backend):
    return torch.tanh(attnperf.attention(q, k, v, attn_mask=mask, backend=backend)) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "float-mask"])
def test_compiled_matches_eager_forward_and_backward(backend, with_mask):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.randn(16, 16, generator=gen).requires_grad_() if with_mask else None
    leaves = [t for t in (q, k, v, mask) if t is not None]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, mask, backend)
    expected = block(q, k, v, mask, backend)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.sum(), leaves)
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_inductor_compiles_a_module_using_attnperf():
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = attnperf.nn.SelfAttention(32, 4, num_kv_heads=2, causal=True, backend="reference")
    x = torch.randn(2, 8, 32)
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x), rtol=1e-4, atol=1e-5)


def test_the_custom_op_has_a_fake_implementation():
    q = torch.empty(2, 3, 5, 8, device="meta")
    v = torch.empty(2, 3, 7, 6, device="meta")
    k = torch.empty(2, 3, 7, 8, device="meta")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnperf.ops import flatten_variant

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        plain = flatten_variant({})
        out, lse, _ = torch.ops.attnperf.attention(fq, fk, fv, None, 0.0, False, None, False,
                                                   "auto", *plain)  # fmt: skip
        assert out.shape == (2, 3, 5, 6) and lse.numel() == 0
        with_lse = flatten_variant({"return_lse": True, "window": (2, None)})
        out, lse, _ = torch.ops.attnperf.attention(fq, fk, fv, None, 0.0, False, None, False,
                                                   "auto", *with_lse)  # fmt: skip
    assert out.shape == (2, 3, 5, 6) and lse.shape == (2, 3, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "backend", [b for b in BACKENDS if "dropout" in dispatch.registry()[b].capabilities.features]
)
def test_compiled_dropout_gradients_match_eager_under_the_same_seed(backend):
    """The backward recomputes the forward: it must draw the forward's dropout mask again."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen).requires_grad_() for _ in range(3))

    def dropped(q, k, v):
        return attnperf.attention(q, k, v, dropout_p=0.5, backend=backend)

    compiled = torch.compile(dropped, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    out = compiled(q, k, v)
    torch.manual_seed(1)
    expected = dropped(q, k, v)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


COMPILED_VARIANTS = {
    "window_bottom_right": {"window": (3, None), "align": "bottom_right", "is_causal": True},
    "sinks_lse": {"sinks": torch.randn(4), "is_causal": True, "return_lse": True},
    "softcap_alibi_lse": {"softcap": 2.0, "alibi_slopes": torch.rand(4), "return_lse": True},
    "block_mask": {
        "block_mask": attnperf.block_mask(
            attnperf.layouts.sliding_window(5), None, None, 16, 20, block_size=16
        ),
        "window": (None, 2),
    },
}


def declared(backend: str, variant: dict) -> bool:
    shapes = ((2, 4, 16, 8), (2, 4, 20, 8), (2, 4, 20, 8))
    features = attnperf.inputs.prepare(*map(torch.zeros, shapes), **variant).features()
    return features <= dispatch.registry()[backend].capabilities.features


@pytest.mark.parametrize(
    "backend, name",
    [pytest.param(backend, name, id=f"{backend}-{name}") for backend in BACKENDS
     for name, variant in COMPILED_VARIANTS.items() if declared(backend, variant)],
)  # fmt: skip
def test_compiled_variants_match_eager(backend, name):
    """The variants pass through the custom op: forward, LSE and gradients (through the LSE
    too; the sinks' own) as in eager mode, without graph breaks."""
    variant = dict(COMPILED_VARIANTS[name])
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(2, 4, 20, 8, generator=gen).requires_grad_() for _ in range(2))
    leaves = [q, k, v]
    if "sinks" in variant:
        variant["sinks"] = variant["sinks"].clone().requires_grad_()
        leaves.append(variant["sinks"])

    def call(q, k, v):
        result = attnperf.attention(q, k, v, backend=backend, **variant)
        out, lse = result if isinstance(result, tuple) else (result, None)
        return out.sum() + (0 if lse is None else lse.sin().sum()), out

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    (loss, out), (expected_loss, expected) = compiled(q, k, v), call(q, k, v)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(
        torch.autograd.grad(loss, leaves),
        torch.autograd.grad(expected_loss, leaves),
        strict=True,
    ):
        torch.testing.assert_close(grad, expected_grad)  # fmt: skip
