"""attention_varlen on every backend that declares it, against a per-sequence loop of the
reference (float64 and same precision): forward, LSE, gradients; and its bad inputs."""

import pytest
import torch
from cases import device_for, preset_params

import attnperf
from attnperf import dispatch
from attnperf.kernels import sdpa as sdpa_kernel
from attnperf.kernels.numba import attention as numba_attention
from attnperf.serving import prepare_varlen
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

# Query and key lengths per sequence: an empty sequence, one without keys, a single token,
# L != S both ways, and sequences longer than a tile (numba's 8 x 16 here, triton's 32 x 32
# under the interpreter), so that tiles start at sequence boundaries mid-array.
Q_LENS = (5, 0, 1, 37, 20, 3)
K_LENS = (7, 3, 1, 37, 50, 0)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

# Each preset reaches a distinct path: plain, bottom-right causal (per-sequence offsets),
# top-left causal, and window + softcap + per-sequence ALiBi (bands cut tiles both sides).
PRESETS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal_top_left": {"is_causal": True, "align": "top_left"},
    "window_softcap_alibi": {
        "window": (6, 2),
        "softcap": 2.0,
        "alibi_slopes": torch.rand(len(Q_LENS), HEADS, generator=torch.Generator().manual_seed(3)),
    },
    "causal_sinks": {"is_causal": True,
                     "sinks": torch.randn(HEADS, generator=torch.Generator().manual_seed(4)) * 2},
}  # fmt: skip


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """numba's tiles of 8 x 16: every sequence spans several."""
    monkeypatch.setattr(numba_attention, "BLOCK_M", 8)
    monkeypatch.setattr(numba_attention, "BANDED_BLOCK_M", 8)
    monkeypatch.setattr(numba_attention, "BLOCK_N", 16)


def packed_call(dtype, device="cpu", seed=0, q_lens=Q_LENS, k_lens=K_LENS, **variant) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def tensor(rows, heads):
        return (torch.randn(rows, heads, HEAD_DIM, generator=gen) * 2).to(device, dtype)

    def cumulative(lengths):
        return torch.tensor((0, *lengths), dtype=torch.int32).cumsum(0).int().to(device)

    return {
        "q": tensor(sum(q_lens), HEADS),
        "k": tensor(sum(k_lens), KV_HEADS),
        "v": tensor(sum(k_lens), KV_HEADS),
        "cu_seqlens_q": cumulative(q_lens),
        "cu_seqlens_k": cumulative(k_lens),
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(k_lens),
        **{name: value.to(device) if torch.is_tensor(value) else value
           for name, value in variant.items()},
    }  # fmt: skip


def per_sequence(fn, call: dict):
    """(out (total_q, Hq, Ev), lse (Hq, total_q)) of `fn`, an SDPA-style reference, run on
    each sequence alone: what attention_varlen must equal."""
    cq, ck = call["cu_seqlens_q"].tolist(), call["cu_seqlens_k"].tolist()
    slopes = call.get("alibi_slopes")
    outs, lses = [], []
    for b in range(len(cq) - 1):
        q, k, v = (call[n][lo:hi].transpose(0, 1) for n, lo, hi in (
            ("q", cq[b], cq[b + 1]), ("k", ck[b], ck[b + 1]), ("v", ck[b], ck[b + 1])))  # fmt: skip
        variant = {n: call[n] for n in ("window", "softcap", "sinks") if n in call}
        out, lse = fn(
            q, k, v, is_causal=call.get("is_causal", False), enable_gqa=True,
            align=call.get("align", "bottom_right"), return_lse=True,
            alibi_slopes=None if slopes is None else slopes[b], **variant,
        )  # fmt: skip
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def varlen_params(dtypes):
    return preset_params(PRESETS, dtypes, lambda *a, **k: prepare_varlen(**packed_call(*a, **k)))


@pytest.mark.parametrize("backend, preset, dtype", varlen_params((torch.float32, torch.bfloat16)))
def test_varlen_forward_and_lse_equal_a_loop_over_sequences(backend, preset, dtype):
    call = packed_call(dtype, device_for(backend), **PRESETS[preset])
    with_lse = "lse" in backend.capabilities.features
    result = attnperf.attention_varlen(**call, backend=backend.name, return_lse=with_lse)
    out, lse = result if with_lse else (result, None)
    exact = per_sequence(float64_reference, call)
    baseline = per_sequence(same_precision_reference, call)
    assert out.shape == (sum(Q_LENS), HEADS, HEAD_DIM) and out.dtype == dtype
    assert_agrees(out, exact[0], baseline[0])
    if with_lse:
        assert lse.shape == (HEADS, sum(Q_LENS)) and lse.dtype == torch.float32
        assert_agrees(lse, exact[1], baseline[1], what="lse")


def _gradients(fn, call: dict, cast=None):
    call = dict(call)
    leaves = {}
    for name in ("q", "k", "v", "sinks"):
        if name not in call:
            continue
        tensor = call[name].detach()
        call[name] = leaves[name] = (tensor.to(cast) if cast else tensor).requires_grad_()
    out, lse = fn(call)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    grad_lse = torch.randn(lse.shape, generator=gen).to(lse.device, lse.dtype)
    total = (out * grad_out).sum() + (torch.where(lse.isinf(), 0, lse) * grad_lse).sum()
    return dict(zip(leaves, torch.autograd.grad(total, list(leaves.values())), strict=True))


@pytest.mark.parametrize(
    "backend, preset, dtype",
    [p for p in varlen_params((torch.float32, torch.bfloat16))
     if p.values[0] is None or "lse" in p.values[0].capabilities.features],
)  # fmt: skip
def test_varlen_gradients_equal_a_loop_over_sequences(backend, preset, dtype):
    """dq, dk, dv (and dsinks) through the output and the LSE."""
    call = packed_call(dtype, device_for(backend), **PRESETS[preset])
    run = lambda c: attnperf.attention_varlen(**c, backend=backend.name, return_lse=True)  # noqa: E731
    actual = _gradients(run, call)
    exact = _gradients(lambda c: per_sequence(float64_reference, c), call, cast=torch.float64)
    baseline = _gradients(lambda c: per_sequence(same_precision_reference, c), call)
    for name in actual:
        assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")


def test_varlen_serves_packed_calls_without_padding_work():
    """'auto' on CPU takes the fused kernel, not sdpa's padded batch."""
    call = packed_call(torch.float32)
    inputs = prepare_varlen(**call)
    assert dispatch.select(inputs).name == "numba"


BAD_CALLS = [
    (
        "cu_seqlens_q",
        lambda c: c["cu_seqlens_q"].float(),
        TypeError,
        "cu_seqlens_q must be an int32",
    ),
    ("cu_seqlens_k", lambda c: c["cu_seqlens_k"][None], ValueError, "cu_seqlens_k must be 1-D"),
    ("cu_seqlens_q", lambda c: c["cu_seqlens_q"] + 1, ValueError, "must start at 0"),
    ("cu_seqlens_k", lambda c: c["cu_seqlens_k"][[0, 1, 3, 2, 4, 5, 6]], ValueError, "non-decr"),
    ("cu_seqlens_q", lambda c: c["cu_seqlens_q"][:-1], ValueError, "last entry"),
    ("max_seqlen_q", lambda c: 36, ValueError, r"max_seqlen_q \(36\) is smaller than sequence 3"),
    ("max_seqlen_k", lambda c: 4.0, TypeError, "max_seqlen_k must be an int"),
    ("k", lambda c: c["k"][:, :, :8], ValueError, "head dim"),
    ("v", lambda c: c["v"][:, :1], ValueError, "v's"),
    ("q", lambda c: c["q"][:, :3], ValueError, "must divide the query heads"),
    ("k", lambda c: c["k"].double(), TypeError, "k dtype"),
    ("q", lambda c: c["q"][None], ValueError, r"q must be \(total, heads, head dim\)"),
    ("align", lambda c: "center", ValueError, "align must be one of"),
    ("window", lambda c: (-1, 0), ValueError, "window sides must be >= 0"),
    ("alibi_slopes", lambda c: torch.ones(2, HEADS), ValueError, "alibi_slopes must have shape"),
]


@pytest.mark.parametrize("name, change, error, match", BAD_CALLS,
                         ids=[f"{b[0]}-{b[3][:24]}" for b in BAD_CALLS])  # fmt: skip
def test_varlen_refuses_bad_input_naming_the_argument(name, change, error, match):
    call = packed_call(torch.float32)
    call[name] = change(call)
    with pytest.raises(error, match=match):
        attnperf.attention_varlen(**call)


@pytest.mark.parametrize("preset", ["plain", "causal_top_left", "causal"])
def test_sdpa_loops_over_sequences_where_padding_would_waste_work(preset, monkeypatch):
    """sdpa's careful ragged form, one SDPA call per sequence (forced here: the sizes are
    small), forward and gradients; a shifted causal diagonal keeps the padded batch."""
    monkeypatch.setattr(sdpa_kernel, "LOOP_FLOPS_PER_CALL", 0.0)
    call = packed_call(torch.float32, **PRESETS[preset])
    assert sdpa_kernel._loop_pays(prepare_varlen(**call)) == (preset != "causal")

    def output_only(fn):  # sdpa has no LSE: gradients through the output alone
        return lambda c: (fn(c), torch.zeros(1))

    actual = output_only(lambda c: attnperf.attention_varlen(**c, backend="sdpa"))
    exact, baseline = (output_only(lambda c, f=f: per_sequence(f, c)[0])
                       for f in (float64_reference, same_precision_reference))  # fmt: skip
    assert_agrees(actual(call)[0], exact(call)[0], baseline(call)[0])
    grads = _gradients(actual, call)
    exact_grads = _gradients(exact, call, cast=torch.float64)
    baseline_grads = _gradients(baseline, call)
    for name in grads:
        assert_agrees(grads[name], exact_grads[name], baseline_grads[name], what=f"grad of {name}")
