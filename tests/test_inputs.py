"""Bad input gets a clear error naming the argument and what was expected."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cases import device_for
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnperf
from attnperf import dispatch
from attnperf.inputs import prepare


def qkv(q_shape=(2, 4, 8, 16), k_shape=None, v_shape=None, dtype=torch.float32, device="cpu"):
    k_shape = k_shape or q_shape
    v_shape = v_shape or k_shape
    return (
        torch.randn(q_shape, dtype=dtype, device=device),
        torch.randn(k_shape, dtype=dtype, device=device),
        torch.randn(v_shape, dtype=dtype, device=device),
    )


def call(q_shape=(2, 4, 8, 16), k_shape=None, v_shape=None, **kwargs):
    q, k, v = qkv(q_shape, k_shape, v_shape)
    return attnperf.attention(q, k, v, **kwargs)


BAD_CALLS = {
    "query_not_tensor": (
        lambda: attnperf.attention([[1.0]], *qkv()[1:]), TypeError, "query must be a torch.Tensor"
    ),
    "integer_query": (
        lambda: attnperf.attention(*(torch.ones(1, 2, 3, dtype=torch.int64) for _ in range(3))),
        TypeError, "query must be a floating-point",
    ),
    "rank_1": (lambda: call((8,), (8,), (8,)), ValueError, "at least 2"),
    "rank_mismatch": (lambda: call((2, 4, 8, 16), (4, 8, 16)), ValueError, "same number of dims"),
    "batch_mismatch": (lambda: call((2, 4, 8, 16), (3, 4, 8, 16)), ValueError, "batch dims of key"),
    "head_mismatch": (lambda: call((2, 4, 8, 16), (2, 2, 8, 16)), ValueError, "enable_gqa=True"),
    "gqa_not_dividing": (
        lambda: call((2, 4, 8, 16), (2, 3, 8, 16), enable_gqa=True), ValueError, "divide"
    ),
    "key_value_heads": (
        lambda: call((2, 4, 8, 16), (2, 4, 8, 16), (2, 2, 8, 16)), ValueError, "value has 2"
    ),
    "embedding_mismatch": (lambda: call((2, 4, 8, 16), (2, 4, 8, 12)), ValueError, "key embedding"),
    "key_value_lengths": (
        lambda: call((2, 4, 8, 16), (2, 4, 9, 16), (2, 4, 10, 16)), ValueError, "sequence length"
    ),
    "mask_not_broadcastable": (
        lambda: call(attn_mask=torch.ones(8, 7, dtype=torch.bool)), ValueError, "not broadcastable"
    ),
    "mask_too_many_dims": (
        lambda: call(attn_mask=torch.ones(1, 2, 4, 8, 8, dtype=torch.bool)),
        ValueError, "not broadcastable",
    ),
    "mask_integer": (
        lambda: call(attn_mask=torch.ones(8, 8, dtype=torch.int32)), TypeError, "attn_mask must be"
    ),
    "mask_float64_for_fp32": (
        lambda: call(attn_mask=torch.zeros(8, 8, dtype=torch.float64)), TypeError, "attn_mask must"
    ),
    "mask_not_tensor": (lambda: call(attn_mask=[[True]]), TypeError, "attn_mask must be"),
    "mask_and_causal": (
        lambda: call(attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=True),
        ValueError, "cannot be given together",
    ),
    "mixed_dtypes": (
        lambda: attnperf.attention(*qkv()[:2], qkv()[2].double()), TypeError, "value dtype"
    ),
    "mixed_devices": (
        lambda: attnperf.attention(*qkv()[:2], qkv()[2].to("meta")), ValueError, "value is on meta"
    ),
    "dropout_negative": (lambda: call(dropout_p=-0.1), ValueError, r"must be in \[0, 1\]"),
    "dropout_above_one": (lambda: call(dropout_p=1.5), ValueError, r"dropout_p must be in \["),
    "dropout_bool": (lambda: call(dropout_p=True), TypeError, "dropout_p must be a float, got"),
    "scale_nan": (lambda: call(scale=float("nan")), ValueError, "scale must be finite"),
    "scale_inf": (lambda: call(scale=np.float32("inf")), ValueError, "scale must be finite"),
    "causal_numpy_int": (lambda: call(is_causal=np.int64(1)), TypeError, "got int64"),
    "nested_query": (
        lambda: attnperf.attention(*(torch.nested.nested_tensor(
            [torch.randn(2, 3, 8), torch.randn(2, 5, 8)], layout=torch.jagged) for _ in range(3))),
        TypeError, "query must be a dense",
    ),
    "sparse_key": (
        lambda: attnperf.attention(qkv()[0], qkv()[1].to_sparse(), qkv()[2]),
        TypeError, "key must be a dense",
    ),
    "causal_bias_wrong_lengths": (
        lambda: call(attn_mask=causal_upper_left(8, 9)), ValueError, r"CausalBias for \(L, S\)"
    ),
    "causal_bias_and_is_causal": (
        lambda: call(attn_mask=causal_lower_right(8, 8), is_causal=True),
        ValueError, "cannot be given together",
    ),
    "dropout_not_number": (lambda: call(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    "causal_not_bool": (lambda: call(is_causal=1), TypeError, "is_causal must be a bool"),
    "scale_not_number": (lambda: call(scale="2"), TypeError, "scale must be a float"),
    "gqa_not_bool": (lambda: call(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
    "unknown_backend": (lambda: call(backend="flash9"), ValueError, "known: auto, reference, sdpa"),
    "backend_not_str": (lambda: call(backend=3), TypeError, "backend must be a str"),
    # The variants' arguments.
    "window_negative": (lambda: call(window=(-1, 0)), ValueError, "window sides must be >= 0"),
    "window_not_pair": (lambda: call(window=5), TypeError, r"window must be None or a \(left"),
    "window_three": (lambda: call(window=(1, 2, 3)), TypeError, "window must be None or a"),
    "window_float": (lambda: call(window=(1.5, 0)), TypeError, "window sides must be ints"),
    "window_bool": (lambda: call(window=(True, 0)), TypeError, "window sides must be ints"),
    "softcap_zero": (lambda: call(softcap=0.0), ValueError, "softcap must be a finite float > 0"),
    "softcap_negative": (lambda: call(softcap=-2), ValueError, "softcap must be a finite"),
    "softcap_nan": (lambda: call(softcap=float("nan")), ValueError, "softcap must be a finite"),
    "softcap_inf": (lambda: call(softcap=float("inf")), ValueError, "softcap must be a finite"),
    "softcap_str": (lambda: call(softcap="50"), TypeError, "softcap must be a float > 0 or None"),
    "slopes_wrong_shape": (
        lambda: call(alibi_slopes=torch.rand(3)), ValueError, r"alibi_slopes must have shape \(Hq"
    ),
    "slopes_wrong_batch": (
        lambda: call(alibi_slopes=torch.rand(3, 4)), ValueError, "alibi_slopes must have shape"
    ),
    "slopes_float64": (
        lambda: call(alibi_slopes=torch.rand(4, dtype=torch.float64)),
        TypeError, "alibi_slopes must be a float32 tensor, got a torch.float64",
    ),
    "slopes_list": (lambda: call(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a"),
    "slopes_require_grad": (
        lambda: call(alibi_slopes=torch.rand(4, requires_grad=True)),
        ValueError, "alibi_slopes must not require grad",
    ),
    "slopes_other_device": (
        lambda: call(alibi_slopes=torch.rand(4, device="meta")), ValueError, "alibi_slopes is on"
    ),
    "sinks_wrong_shape": (
        lambda: call(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(Hq,\)"
    ),
    "sinks_per_batch": (lambda: call(sinks=torch.zeros(2, 4)), ValueError, "sinks must have shape"),
    "sinks_integer": (
        lambda: call(sinks=torch.zeros(4, dtype=torch.int64)),
        TypeError, "sinks must be a floating-point tensor, got a torch.int64",
    ),
    "sinks_list": (lambda: call(sinks=[0.0] * 4), TypeError, "sinks must be a floating-point"),
    "sinks_other_device": (
        lambda: call(sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"
    ),
    "align_unknown": (lambda: call(align="center"), ValueError, "align must be one of"),
    "return_lse_not_bool": (lambda: call(return_lse=1), TypeError, "return_lse must be a bool"),
    "block_mask_not_blockmask": (
        lambda: call(block_mask=torch.ones(8, 8, dtype=torch.bool)),
        TypeError, "block_mask must be an attnperf.BlockMask",
    ),
    "block_mask_wrong_lengths": (
        lambda: call(block_mask=attnperf.block_mask(attnperf.layouts.causal(), None, None, 8, 9)),
        ValueError, r"block_mask is for \(B, H, L, S\) = \(1, 1, 8, 9\)",
    ),
    "block_mask_wrong_heads": (
        lambda: call(block_mask=attnperf.block_mask(attnperf.layouts.causal(), None, 3, 8, 8)),
        ValueError, "does not fit the call",
    ),
    "causal_bias_against_align": (
        lambda: call((2, 4, 5, 16), (2, 4, 9, 16), attn_mask=causal_upper_left(5, 9),
                     align="bottom_right"),
        ValueError, "top_left CausalBias but align='bottom_right'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("make_call, error, message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_is_refused_clearly(make_call, error, message):
    with pytest.raises(error, match=message):
        make_call()


def test_float32_mask_is_accepted_for_half_inputs():
    q, k, v = qkv(dtype=torch.float16)
    mask = torch.zeros(8, 8)
    out = attnperf.attention(q, k, v, attn_mask=mask, backend="reference")
    assert out.dtype == torch.float16


def test_partially_broadcast_batch_mask_copies_no_more_than_its_batch():
    """A mask broadcast over one of two batch dims is copied over batch dims, not heads/L/S."""
    from attnperf.inputs import prepare

    q = torch.randn(2, 3, 4, 8, 16)
    mask = torch.rand(2, 1, 1, 8, 8) > 0.5
    inputs = prepare(q, q, q, attn_mask=mask)
    assert inputs.attn_mask.shape == (6, 4, 8, 8)
    assert inputs.attn_mask.stride(1) == 0  # heads stay broadcast
    assert inputs.attn_mask.untyped_storage().nbytes() <= 6 * 8 * 8
    expected = mask.expand(2, 3, 4, 8, 8).reshape(6, 4, 8, 8)
    assert torch.equal(inputs.attn_mask, expected)


AVAILABLE = [b.name for b in dispatch.registry().values() if b.unavailable_reason() is None]


def test_numpy_scalars_are_taken_as_sdpa_takes_python_numbers():
    q, k, v = qkv()
    out = attnperf.attention(
        q, k, v, is_causal=np.bool_(True), scale=np.float32(0.25), dropout_p=np.float64(0.0)
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [b for b in AVAILABLE if b in ("reference", "sdpa")])
def test_dropout_one_gives_zeros_as_sdpa(backend):
    q, k, v = (t.requires_grad_() for t in qkv())
    out = attnperf.attention(q, k, v, dropout_p=1.0, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")  # ours: zeros
@pytest.mark.parametrize("backend", [*AVAILABLE, "auto"])
@pytest.mark.parametrize("lengths", [(8, 8), (5, 9), (9, 5)], ids=["square", "L<S", "L>S"])
@pytest.mark.parametrize("bias", [causal_upper_left, causal_lower_right], ids=lambda f: f.__name__)
def test_torch_causal_bias_objects_mean_what_they_mean_in_sdpa(backend, lengths, bias):
    device = device_for(backend)
    q, k, v = qkv((2, 4, lengths[0], 16), (2, 4, lengths[1], 16), device=device)
    inputs = prepare(q, k, v, attn_mask=bias(*lengths))
    assert inputs.attn_mask is None and inputs.is_causal, "served in-kernel, not as a mask"
    out = attnperf.attention(q, k, v, attn_mask=bias(*lengths), backend=backend)
    # SDPA's own reading of them, from the band they stand for (rows that see no key: 0).
    offset = 0 if bias is causal_upper_left else lengths[1] - lengths[0]
    band = torch.ones(lengths, dtype=torch.bool, device=device).tril(offset)
    expected = attnperf.attention(q, k, v, attn_mask=band, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
