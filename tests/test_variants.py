"""The variants (window, alignment, softcap, ALiBi, block layouts, the LSE) on every backend
that declares them, forward, LSE and gradients, against the float64 reference."""

import pytest
import torch
from cases import VARIANT_CASES, Case, backend_params, device_for, results_and_gradients

import attnperf
from attnperf import dispatch
from attnperf.backend import FEATURES
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

VARIANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("backend, case, dtype", backend_params(VARIANT_CASES, VARIANT_DTYPES))
def test_variant_forward_and_lse_agree_with_float64_reference(backend, case, dtype):
    args = case.build(dtype, device_for(backend))
    result = attnperf.attention(**args, backend=backend.name)
    exact, baseline = float64_reference(**args), same_precision_reference(**args)
    names = ("output", "lse")
    if not case.variant.get("return_lse"):
        names, result, exact, baseline = names[:1], (result,), (exact,), (baseline,)
    for what, actual, expected, base in zip(names, result, exact, baseline, strict=True):
        assert actual.shape == base.shape, what
        assert actual.dtype == (dtype if what == "output" else torch.float32), what
        assert_agrees(actual, expected, base, what=what)


@pytest.mark.parametrize(
    "backend, case, dtype",
    backend_params(VARIANT_CASES, VARIANT_DTYPES, need_backward=True),
)
def test_variant_gradients_agree_with_float64_reference(backend, case, dtype):
    args = case.build(dtype, device_for(backend))
    if "attn_mask" in args and args["attn_mask"].is_floating_point():
        args["attn_mask"] = args["attn_mask"].float()  # its gradient goes through the softcap
    run = lambda **call: attnperf.attention(**call, backend=backend.name)  # noqa: E731
    *_, actual = results_and_gradients(run, args)
    *_, exact = results_and_gradients(float64_reference, args, cast=torch.float64)
    *_, baseline = results_and_gradients(same_precision_reference, args)
    assert actual.keys() == baseline.keys()
    for name in actual:
        assert actual[name] is not None, f"no gradient reached {name}"
        assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")


# One call per feature that needs exactly it (on top of what every backend serves).
FEATURE_CALLS = {
    "bool_mask": Case("f", mask="bool"),
    "float_mask": Case("f", mask="float_broadcast"),
    "causal": Case("f", is_causal=True),
    "window": Case("f", variant={"window": (4, 4)}),
    "bottom_right": Case("f", is_causal=True, q_len=9, variant={"align": "bottom_right"}),
    "softcap": Case("f", logit_gain=5.0, variant={"softcap": 1.0}),
    "alibi": Case("f", variant={"alibi_slopes": lambda case, gen: torch.rand(case.q_heads)}),
    "block_mask": next(case for case in VARIANT_CASES if case.id == "block_causal"),
    "lse": Case("f", variant={"return_lse": True}),
    "sinks": Case("f", variant={"sinks": lambda case, gen: torch.randn(case.q_heads) * 2}),
    "gqa": Case("f", q_heads=4, kv_heads=2),
    "dropout": Case("f", kwargs={"dropout_p": 0.5}),
    "backward": Case("f"),
}


# The serving calls' and linear attention's features are walked where those calls are
# tested (test_varlen.py, test_kvcache.py, test_linear.py): `attention` cannot ask for them;
# nor for torch.func's transforms (func_grad: test_fused_autograd.py), which wrap a call.
OTHER_CALLS = {"varlen", "kvcache", "kvcache_backward", "kvcache_int8", "linear", "linear_backward",
               "func_grad"}  # fmt: skip
ATTENTION_FEATURES = [f for f in FEATURES if f not in OTHER_CALLS]


def test_every_feature_has_a_call():
    assert FEATURE_CALLS.keys() == set(ATTENTION_FEATURES)


@pytest.mark.parametrize("feature", ATTENTION_FEATURES)
@pytest.mark.parametrize(
    "backend", [b for b in dispatch.registry().values() if b.unavailable_reason() is None],
    ids=lambda b: b.name,
)  # fmt: skip
def test_backend_serves_a_feature_or_refuses_it_with_a_reason(backend, feature):
    """Nothing is ignored silently: a declared feature agrees with the reference, any other
    is refused, naming it."""
    case = FEATURE_CALLS[feature]
    args = case.build(torch.float32, device_for(backend)) | case.kwargs
    if feature == "backward":
        args["query"] = args["query"].detach().requires_grad_()
    if feature not in backend.capabilities.features:
        with pytest.raises(attnperf.BackendNotSupportedError, match=FEATURES[feature]):
            attnperf.attention(**args, backend=backend.name)
        return
    if feature == "dropout":  # random: applied (not the plain output), and seeded
        torch.manual_seed(0)
        out = attnperf.attention(**args, backend=backend.name)
        torch.manual_seed(0)
        assert torch.equal(out, attnperf.attention(**args, backend=backend.name))
        plain = attnperf.attention(**(args | {"dropout_p": 0.0}), backend=backend.name)
        assert not torch.allclose(out, plain)
        return
    result = attnperf.attention(**args, backend=backend.name)
    exact, baseline = float64_reference(**args), same_precision_reference(**args)
    if feature == "lse":
        assert_agrees(result[1], exact[1], baseline[1], what="lse")
        result, exact, baseline = result[0], exact[0], baseline[0]
    assert_agrees(result, exact, baseline)
