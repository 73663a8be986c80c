"""attnperf.nn.SelfAttention: the textbook module, any backend, same parameters."""

import math

import pytest
import torch

from attnperf import dispatch
from attnperf.nn import SelfAttention, alibi_slopes

BACKENDS = [
    name
    for name, backend in dispatch.registry().items()
    if backend.unavailable_reason() is None and "cpu" in backend.capabilities.devices
]


def textbook(module, x, padding=None, allowed_pairs=None):
    """The module's computation written out with plain tensor ops; `padding` (batch, seq)
    is 1 for real tokens, `allowed_pairs` (seq, seq) True where a query sees a key."""
    batch, seq, _ = x.shape
    h, hk, d = module.num_heads, module.num_kv_heads, module.head_dim
    q = module.q_proj(x).view(batch, seq, h, d).transpose(1, 2)
    k = module.k_proj(x).view(batch, seq, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1)
    v = module.v_proj(x).view(batch, seq, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if module.causal:
        allowed = allowed.tril()
    allowed = allowed.expand(batch, 1, seq, seq)
    if padding is not None:
        allowed = allowed & padding[:, None, None, :].bool()
    if allowed_pairs is not None:
        allowed = allowed & allowed_pairs
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num()
    out = (weights @ v).transpose(1, 2).reshape(batch, seq, -1)
    return module.out_proj(out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_module_matches_the_textbook_steps(backend, kv_heads, causal):
    torch.manual_seed(0)
    module = SelfAttention(32, 4, num_kv_heads=kv_heads, causal=causal, backend=backend)
    x = torch.randn(2, 10, 32)
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, 7:] = 0
    with torch.no_grad():
        torch.testing.assert_close(module(x), textbook(module, x), rtol=1e-4, atol=1e-5)
        out = module(x, key_padding_mask=padding == 0)
        torch.testing.assert_close(out, textbook(module, x, padding), rtol=1e-4, atol=1e-5)


def test_padding_keys_do_not_change_real_tokens():
    torch.manual_seed(0)
    module = SelfAttention(16, 2, causal=True)
    x = torch.randn(1, 6, 16)
    padded = torch.cat([x, torch.randn(1, 3, 16) * 100], dim=1)
    pad = torch.tensor([[False] * 6 + [True] * 3])
    additive = torch.zeros(1, 9).masked_fill(pad, float("-inf"))
    with torch.no_grad():
        torch.testing.assert_close(module(padded, key_padding_mask=pad)[:, :6], module(x))
        # A float padding mask is added (0 keeps, -inf drops), never inverted.
        torch.testing.assert_close(module(padded, key_padding_mask=additive)[:, :6], module(x))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_square_attn_mask_is_a_pair_mask_even_when_batch_equals_seq(causal):
    """A (seq, seq) attn_mask is (query, key) pairs, never taken for padding."""
    torch.manual_seed(0)
    module = SelfAttention(16, 2, causal=causal)
    x = torch.randn(5, 5, 16)  # batch == seq
    pairs = torch.rand(5, 5) > 0.4
    pairs[:, 0] = True  # every query sees a key
    padding = torch.ones(5, 5, dtype=torch.long)
    padding[2, 3:] = 0
    with torch.no_grad():
        expected = textbook(module, x, allowed_pairs=pairs)
        torch.testing.assert_close(module(x, attn_mask=pairs), expected, rtol=1e-4, atol=1e-5)
        both = module(x, attn_mask=pairs, key_padding_mask=padding == 0)
        expected = textbook(module, x, padding, allowed_pairs=pairs)
        torch.testing.assert_close(both, expected, rtol=1e-4, atol=1e-5)


def test_state_dict_is_the_same_whatever_the_backend():
    keys = {tuple(SelfAttention(16, 4, num_kv_heads=2, backend=b).state_dict()) for b in BACKENDS}
    assert len(keys) == 1
    a = SelfAttention(16, 4, backend="reference")
    b = SelfAttention(16, 4, backend=BACKENDS[-1])
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "backend", [b for b in BACKENDS if "backward" in dispatch.registry()[b].capabilities.features]
)
def test_the_module_trains(backend):
    torch.manual_seed(0)
    module = SelfAttention(16, 4, num_kv_heads=2, causal=True, backend=backend)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x, target = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), target)
        loss.backward()
        for name, parameter in module.named_parameters():
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"embed_dim": 30, "num_heads": 4}, "must divide embed_dim"),
        ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": 3}, "must divide num_heads"),
        ({"embed_dim": 32, "num_heads": 4, "dropout": 1.0}, "dropout must be in"),
    ],
)
def test_bad_configuration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SelfAttention(**kwargs)


def test_bad_masks_and_inputs_are_refused():
    module = SelfAttention(16, 2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(batch, seq\)"):
        module(x, key_padding_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attn_mask must be a torch\.Tensor"):
        module(x, attn_mask=[[True] * 5] * 5)
    with pytest.raises(ValueError, match="attn_mask must be"):
        module(x, attn_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must be a \(batch, seq, embed_dim\) tensor"):
        module(torch.randn(5, 16))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"embed_dim": 32, "num_heads": 4.0}, TypeError, "num_heads must be an int"),
        ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": "2"}, TypeError, "num_kv_heads"),
        ({"embed_dim": 32, "num_heads": 4, "backend": "nosuch"}, ValueError, "unknown backend"),
    ],
)
def test_bad_types_and_backends_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        SelfAttention(**kwargs)


OPTIONS = {  # option (named as the feature it needs): the module's keywords
    "window": {"window": (3, 0), "causal": True},
    "softcap": {"softcap": 2.0},
    "alibi": {"alibi": True, "causal": True},
}


@pytest.mark.parametrize(
    "backend, options",
    [pytest.param(backend, options, id=f"{feature}-{backend}")
     for feature, options in OPTIONS.items() for backend in BACKENDS
     if feature in dispatch.registry()[backend].capabilities.features],
)  # fmt: skip
def test_variant_options_reach_the_kernels(backend, options):
    """Each option changes the output (it is not ignored) and every backend that declares
    it agrees with the textbook attention of that variant (the reference backend's)."""
    torch.manual_seed(0)
    module = SelfAttention(32, 4, num_kv_heads=2, backend=backend, **options)
    plain = SelfAttention(32, 4, num_kv_heads=2, causal=options.get("causal", False))
    plain.load_state_dict(module.state_dict())  # the options add no parameters
    x = torch.randn(2, 12, 32) * 4
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    with torch.no_grad():
        out = module(x, key_padding_mask=padding)
        module.backend = "reference"
        torch.testing.assert_close(out, module(x, key_padding_mask=padding), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
        assert not torch.allclose(out, plain(x, key_padding_mask=padding), atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_sinks_reach_the_kernels_and_learn(backend):
    """sinks=True: a (num_heads,) parameter in the state_dict, zeros at first, that changes
    the output as the reference computes it and receives a gradient."""
    torch.manual_seed(0)
    module = SelfAttention(32, 4, num_kv_heads=2, causal=True, sinks=True, backend=backend)
    assert module.state_dict()["sinks"].equal(torch.zeros(4))
    x = torch.randn(2, 12, 32)
    plain = module(x).detach()
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4) * 2)
    out = module(x)
    assert not torch.allclose(out, plain, atol=1e-3)
    out.square().sum().backward()
    assert module.sinks.grad is not None and module.sinks.grad.abs().sum() > 0
    expected = module.sinks.grad.clone()
    module.zero_grad()
    module.backend = "reference"
    reference = module(x)
    reference.square().sum().backward()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(expected, module.sinks.grad, rtol=1e-4, atol=1e-4)


def test_alibi_slopes_are_the_standard_ones():
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]
    # 12 heads (BLOOM-style): the 8 of 8 heads, then every other one of 16 heads.
    assert alibi_slopes(12) == alibi_slopes(8) + [2.0 ** (-0.5 * i) for i in (1, 3, 5, 7)]
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        alibi_slopes(0)
