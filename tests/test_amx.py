"""AMX tile products and the bf16 forward on them: every block shape of the 2 x 2 walk, the
operands' padding, and the forward's variants against the float64 reference."""

import numpy as np
import pytest
import torch
from cases import softmax_score_tile

import attnperf
from attnperf import dispatch
from attnperf.inputs import prepare
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

pytest.importorskip("numba")
from attnperf.kernels.numba import attention, microkernels, vector_ops
from attnperf.kernels.numba.amx import amx_product
from attnperf.kernels.numba.jit import njit
from attnperf.kernels.numba.packing import pack_key_panels, pack_vnni
from attnperf.kernels.numba.vector_ops import column_maxima, exp2_pairs_to_bf16

if dispatch.registry()["numba"].unavailable_reason():
    pytest.skip(dispatch.registry()["numba"].unavailable_reason(), allow_module_level=True)
if microkernels.tile_route("bf16")[0] != "amx":
    pytest.skip(f"no AMX route here: {microkernels.tile_route('bf16')[1]}", allow_module_level=True)


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("accumulate", [False, True])
def test_amx_product_matches_float64_for_every_block_shape(accumulate):
    """1-3 tiles of rows and columns (blocks of 2 x 2, 2 x 1, 1 x 2, 1 x 1), 1-3 steps of
    depth, B in panels (keys) and in pairs of rows (values), C inside a wider buffer."""
    gen = torch.Generator().manual_seed(0)
    for row_tiles in (1, 2, 3):
        for col_tiles in (1, 2, 3):
            for steps in (1, 2, 3):
                rows, cols, depth = 16 * row_tiles, 16 * col_tiles, 32 * steps
                a = torch.randn(rows, depth, generator=gen).bfloat16()
                b = torch.randn(depth, cols, generator=gen).bfloat16()
                c = torch.randn(rows, cols + 5, generator=gen)
                exact = a.double() @ b.double() + (c[:, :cols].double() if accumulate else 0)
                panels = np.empty((col_tiles, depth // 2, 32), np.uint16)
                pack_key_panels(bits(b.T), panels)
                pairs = np.empty((depth // 2, 2 * cols), np.uint16)
                pack_vnni(bits(b), pairs)
                a_view = (bits(a), 0, depth)
                for b_view in ((panels, 0, 32, depth // 2 * 32), (pairs, 0, 2 * cols, 32)):
                    out = c.numpy().copy()
                    amx_product(a_view, b_view, (out, 0, cols + 5), row_tiles, col_tiles, steps,
                                accumulate)  # fmt: skip
                    error = (torch.from_numpy(out[:, :cols]).double() - exact).abs()
                    bound = 1e-6 * (depth + 2) * (a.double().abs() @ b.double().abs() + 2)
                    assert bool((error <= bound).all()), (row_tiles, col_tiles, steps)
                    assert np.array_equal(out[:, cols:], c.numpy()[:, cols:])


def forward_agrees(call, on_amx, monkeypatch):
    """numba's bf16 output and LSE against float64, by the 2x rule, with the forward on AMX
    tiles or not (`attention.amx_tiles`); the call qualifies for them."""
    inputs = prepare(call["query"], call["key"], call["value"], enable_gqa=True)
    assert attention.amx_tiles(inputs)
    call = {**call, "return_lse": True}
    with monkeypatch.context() as patch:
        patch.setattr(attention, "amx_tiles", lambda inputs: on_amx)
        out, lse = attnperf.attention(**call, backend="numba")
    exact_out, exact_lse = float64_reference(**call)
    base_out, base_lse = same_precision_reference(**call)
    assert_agrees(out, exact_out, base_out, what="output")
    assert_agrees(lse, exact_lse, base_lse, what="lse")
    return out


CASES = {
    "full, odd lengths": {"shape": (2, 4, 301, 64), "keys": 299},
    "causal, GQA": {"shape": (1, 4, 1000, 128), "keys": 1000, "is_causal": True, "groups": 2},
    "window and softcap": {
        "shape": (1, 2, 700, 64),
        "keys": 700,
        "window": (100, 0),
        "softcap": 30.0,
    },
    "float mask": {"shape": (1, 2, 97, 32), "keys": 530, "mask": True},
    "short": {"shape": (3, 2, 17, 64), "keys": 33},
    # Keys and values whose E is not of unit stride: every key tile copied, 16 keys a time,
    # the values transposed element by element.
    "strided keys and values": {"shape": (1, 2, 40, 32), "keys": 70, "strided": True},
    # A last key tile ending at 16 keys past a step of 32, with keys after it: P's padded
    # columns must be zeros, not the wider tile's probabilities before them.
    "causal bottom-right": {
        "shape": (1, 2, 600, 64),
        "keys": 616,
        "is_causal": True,
        "align": "bottom_right",
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_forward_on_amx_keeps_the_2x_rule(case, monkeypatch):
    """Rows not in sixteens, keys not in steps of 32 (P's padded columns), the scale folded
    into the softmax (plain tiles) or not (masks, windows, softcaps), several key tiles."""
    spec = CASES[case]
    gen = torch.Generator().manual_seed(4)
    batch, heads, length, dim = spec["shape"]
    kv_heads = heads // spec.get("groups", 1)
    q = torch.randn(batch, heads, length, dim, generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, spec["keys"], dim, generator=gen).bfloat16() * 2
            for _ in range(2))  # fmt: skip
    if spec.get("strided"):
        k, v = (torch.stack((x, torch.zeros_like(x)), dim=-1).flatten(-2)[..., ::2]
                for x in (k, v))  # fmt: skip
        assert k.stride(-1) == 2
    call = {"query": q, "key": k, "value": v, "is_causal": spec.get("is_causal", False),
            "enable_gqa": kv_heads != heads}  # fmt: skip
    if "align" in spec:
        call["align"] = spec["align"]
    if "window" in spec:
        call.update(window=spec["window"], softcap=spec["softcap"])
    if spec.get("mask"):
        call["attn_mask"] = torch.randn(length, spec["keys"], generator=gen)
    on_amx = forward_agrees(call, True, monkeypatch)
    off_amx = forward_agrees(call, False, monkeypatch)
    # The two routes round the same P to bf16: they differ by the products' order alone.
    assert (on_amx.float() - off_amx.float()).abs().max() <= 0.02


@njit()
def _exp2_pairs(s_t, shift, factor, p_t, total):
    for d in range(s_t.shape[0] // 2):
        for r in range(0, s_t.shape[1], 16):
            exp2_pairs_to_bf16(s_t, 2 * d * s_t.shape[1] + r, s_t.shape[1], shift, r, factor, p_t,
                               2 * d * s_t.shape[1] + 2 * r, total)  # fmt: skip


def test_exp2_pairs_round_to_bf16_pairs_and_sum_in_fp32():
    """p = 2 ** (factor s - shift) within bf16's rounding of float64's, interleaved by key
    pairs; the sums near fp32's; -inf and scores far below the shift exactly 0 (no subnormal
    results: each cost a microcode assist); NaN stays."""
    s_t, shift, factor = softmax_score_tile(6, seed=6)
    p_t, total = np.zeros((3, 64), np.uint16), np.full(32, 0.5, np.float32)
    _exp2_pairs(s_t, shift, factor, p_t, total)
    exact = np.exp2(np.float64(factor) * s_t.astype(np.float64) - shift.astype(np.float64))
    got = torch.from_numpy(p_t.astype(np.int32) << 16).view(torch.float32).numpy()
    got = got.reshape(3, 32, 2).transpose(0, 2, 1).reshape(6, 32)  # pairs back to keys
    assert got[0, 0] == 0 and np.isnan(got[0, 1]) and got[0, 2] == 0 and got[0, 3] == 1
    finite = np.isfinite(exact)
    finite[0, :4] = False
    floor = 2.0**vector_ops.EXP2_FLOOR  # below it, 0
    assert np.all(np.abs(got[finite] - exact[finite]) <= 2.0**-8 * exact[finite] + floor)
    sums = 0.5 + np.nansum(exact, axis=0)
    assert np.isnan(total[1]) and total[8] == 0.5
    rest = [r for r in range(32) if r != 1]
    assert np.allclose(total[rest], sums[rest], rtol=1e-5, atol=0)


@njit()
def _column_maxima(s_t, cols, largest):
    for r in range(0, s_t.shape[1], 16):
        column_maxima(s_t, cols, r, largest)


@pytest.mark.parametrize("cols", [0, 1, 7, 8, 9, 23])
def test_column_maxima_pass_over_nan_and_keep_earlier_maxima(cols):
    gen = torch.Generator().manual_seed(7)
    s_t = (torch.randn(25, 48, generator=gen) * 10).numpy()
    s_t[:, 5] = np.nan
    s_t[: cols // 2, 6] = np.nan
    s_t[:, 7] = -np.inf
    largest = np.full(48, -np.inf, np.float32)
    largest[9] = 100.0  # a maximum from an earlier key tile stays
    _column_maxima(s_t, cols, largest)
    expected = np.fmax(np.nanmax(np.vstack([s_t[:cols], np.full((1, 48), -np.inf)]), axis=0),
                       np.where(np.arange(48) == 9, 100.0, -np.inf)).astype(np.float32)  # fmt: skip
    assert np.array_equal(largest, expected)


def results_and_gradients(run, call):
    """run(**call)'s output and the gradients of sum(out * g) for its tensor arguments."""
    args = {key: value.clone().requires_grad_() for key, value in call.items()
            if isinstance(value, torch.Tensor)}  # fmt: skip
    out = run(**{**call, **args})
    gen = torch.Generator().manual_seed(1)
    (out * torch.randn(out.shape, generator=gen).to(out)).sum().backward()
    return {"output": out, **{f"grad of {key}": value.grad for key, value in args.items()}}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", ["full, odd lengths", "causal, GQA", "window and softcap",
                                  "float mask", "causal bottom-right"])  # fmt: skip
def test_bf16_gradients_on_amx_keep_the_2x_rule(case, fused, monkeypatch):
    """All five backward products on AMX tiles (S, dP against panels; dQ against key pairs;
    dK^T, dV^T over the query rows in pairs), both schedules, a float mask's gradient too."""
    spec = CASES[case]
    gen = torch.Generator().manual_seed(5)
    batch, heads, length, dim = spec["shape"]
    kv_heads = heads // spec.get("groups", 1)
    q = torch.randn(batch, heads, length, dim, generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, spec["keys"], dim, generator=gen).bfloat16()
            for _ in range(2))  # fmt: skip
    call = {"query": q, "key": k, "value": v, "is_causal": spec.get("is_causal", False),
            "enable_gqa": kv_heads != heads}  # fmt: skip
    for key in ("align", "window", "softcap"):
        if key in spec:
            call[key] = spec[key]
    if spec.get("mask"):
        call["attn_mask"] = torch.randn(length, spec["keys"], generator=gen)
    assert attention.amx_tiles(prepare(q, k, v, enable_gqa=True))
    monkeypatch.setattr(attention, "fused_backward_pays", lambda items, threads: fused)
    ours = results_and_gradients(lambda **c: attnperf.attention(**c, backend="numba"), call)
    exact = results_and_gradients(float64_reference, {
        key: value.double() if isinstance(value, torch.Tensor) else value
        for key, value in call.items()
    })  # fmt: skip
    baseline = results_and_gradients(same_precision_reference, call)
    for what, actual in ours.items():
        assert_agrees(actual, exact[what], baseline[what], what=what)


def test_amx_needs_head_dims_in_whole_tiles():
    def inputs(dim, value_dim):
        return prepare(torch.ones(1, 1, 4, dim).bfloat16(), torch.ones(1, 1, 4, dim).bfloat16(),
                       torch.ones(1, 1, 4, value_dim).bfloat16())  # fmt: skip

    assert attention.amx_tiles(inputs(64, 64)) and attention.amx_tiles(inputs(96, 32))
    assert not attention.amx_tiles(inputs(40, 64)) and not attention.amx_tiles(inputs(64, 48))
