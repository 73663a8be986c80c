"""Bad input gets a clear error naming the argument and what was expected."""

import pytest
import torch

import attnperf


def qkv(q_shape=(2, 4, 8, 16), k_shape=None, v_shape=None, dtype=torch.float32):
    k_shape = k_shape or q_shape
    v_shape = v_shape or k_shape
    return (
        torch.randn(q_shape, dtype=dtype),
        torch.randn(k_shape, dtype=dtype),
        torch.randn(v_shape, dtype=dtype),
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
    "dropout_negative": (lambda: call(dropout_p=-0.1), ValueError, r"must be in \[0, 1\)"),
    "dropout_one": (lambda: call(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    "dropout_not_number": (lambda: call(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    "causal_not_bool": (lambda: call(is_causal=1), TypeError, "is_causal must be a bool"),
    "scale_not_number": (lambda: call(scale="2"), TypeError, "scale must be a float"),
    "gqa_not_bool": (lambda: call(enable_gqa="yes"), TypeError, "enable_gqa must be a bool"),
    "unknown_backend": (lambda: call(backend="flash9"), ValueError, "known: auto, reference, sdpa"),
    "backend_not_str": (lambda: call(backend=3), TypeError, "backend must be a str"),
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
