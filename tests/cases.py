"""The agreement grid: call shapes and features, crossed with each backend's declarations."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import attnperf
from attnperf import dispatch, layouts
from attnperf.backend import DTYPE_NAMES, Backend
from attnperf.inputs import prepare
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

GRID_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Case:
    """One call: batch dims, heads, lengths, dims and features."""

    id: str
    batch: tuple[int, ...] = (2,)
    q_heads: int | None = 3  # None: no head dim (2-D inputs)
    kv_heads: int | None = None  # None: same as q_heads
    q_len: int = 37
    kv_len: int = 41
    head_dim: int = 32
    value_dim: int | None = None
    mask: str | None = None
    is_causal: bool = False
    scale: float | None = None
    logit_gain: float = 1.0
    transposed: bool = False  # q, k, v are (B, L, H, E) tensors viewed as (B, H, L, E)
    kwargs: dict = field(default_factory=dict)
    variant: dict = field(default_factory=dict)  # attention's variant keywords; see VARIANT_CASES

    def build(self, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict:
        """SDPA's arguments for this case, drawn in fp32 and rounded to `dtype`."""
        gen = torch.Generator().manual_seed(seed)
        kv_heads = self.kv_heads or self.q_heads
        heads_q = () if self.q_heads is None else (self.q_heads,)
        heads_kv = () if self.q_heads is None else (kv_heads,)
        value_dim = self.value_dim or self.head_dim

        def tensor(heads, length, dim, gain=1.0):
            if self.transposed:
                t = torch.randn(*self.batch, length, *heads, dim, generator=gen) * gain
                return t.to(dtype).to(device).transpose(-2, -3)
            return (torch.randn(*self.batch, *heads, length, dim, generator=gen) * gain).to(
                device=device, dtype=dtype
            )

        args = {
            "query": tensor(heads_q, self.q_len, self.head_dim, self.logit_gain),
            "key": tensor(heads_kv, self.kv_len, self.head_dim),
            "value": tensor(heads_kv, self.kv_len, value_dim),
            "is_causal": self.is_causal,
            "scale": self.scale,
            "enable_gqa": kv_heads != self.q_heads,
        }
        if self.mask is not None:
            args["attn_mask"] = MASKS[self.mask](self, gen, heads_q).to(device)
            if args["attn_mask"].is_floating_point():
                args["attn_mask"] = args["attn_mask"].to(dtype)
        for name, value in self.variant.items():
            args[name] = value(self, gen).to(device) if callable(value) else value
        return args


def _bool_full(case, gen, heads):
    mask = torch.rand(*case.batch, *heads, case.q_len, case.kv_len, generator=gen) > 0.3
    mask[..., 1, :] = False  # a fully masked row in every head
    return mask


def _padding(case, gen, heads):
    # Key padding, as tokenizers produce: (B, 1, 1, S), the later keys of batch 0 masked.
    mask = torch.ones(*case.batch, *(1 for _ in heads), 1, case.kv_len, dtype=torch.bool)
    mask[0, ..., case.kv_len // 2 :] = False
    return mask


def _float_broadcast(case, gen, heads):
    return torch.randn(case.q_len, case.kv_len, generator=gen)


def _float_neg_inf_rows(case, gen, heads):
    mask = torch.randn(*case.batch, *heads, case.q_len, case.kv_len, generator=gen)
    mask[..., 2, :] = float("-inf")
    mask[..., :, 3] = float("-inf")
    return mask


def _bool_batch_broadcast(case, gen, heads):
    # For 5-D inputs (N, M, H, L, S): broadcast over M and heads only.
    shape = (case.batch[0], 1, 1, case.q_len, case.kv_len)
    return torch.rand(*shape, generator=gen) > 0.5


MASKS = {
    "bool": _bool_full,
    "padding": _padding,
    "float_broadcast": _float_broadcast,
    "float_neg_inf_rows": _float_neg_inf_rows,
    "bool_batch_broadcast": _bool_batch_broadcast,
}

CASES = [
    Case("basic"),
    Case("head_dim_0", head_dim=0, value_dim=3, q_len=9, kv_len=11),
    Case("head_dim_1", head_dim=1, q_len=9, kv_len=11),
    Case("head_dim_59", head_dim=59, batch=(1,), q_len=17, kv_len=19),
    Case("head_dim_111", head_dim=111, batch=(1,), q_len=17, kv_len=19),
    Case("head_dim_256", head_dim=256, batch=(1,), q_heads=2, q_len=17, kv_len=19),
    Case("value_dim_differs", head_dim=32, value_dim=48),
    Case("L_lt_S", q_len=5, kv_len=67),
    Case("L_gt_S", q_len=67, kv_len=5),
    Case("L_1", q_len=1, kv_len=33),
    Case("S_1", q_len=33, kv_len=1),
    Case("bool_mask", mask="bool"),
    Case("padding_mask", mask="padding"),
    Case("float_mask_broadcast", mask="float_broadcast"),
    Case("float_mask_neg_inf_rows", mask="float_neg_inf_rows"),
    Case("causal", is_causal=True, q_len=40, kv_len=40),
    Case("causal_L_lt_S", is_causal=True, q_len=13, kv_len=45),
    Case("causal_L_gt_S", is_causal=True, q_len=45, kv_len=13),
    Case("gqa", q_heads=6, kv_heads=2),
    Case("gqa_causal_mask_free", q_heads=4, kv_heads=1, is_causal=True),
    Case("gqa_bool_mask", q_heads=4, kv_heads=2, mask="bool"),
    Case("3d", batch=(), q_len=21, kv_len=23),
    Case("2d", batch=(), q_heads=None, q_len=21, kv_len=23),
    Case("5d", batch=(2, 2), q_len=11, kv_len=13, mask="bool_batch_broadcast"),
    Case("non_contiguous", transposed=True),
    Case("large_logits", logit_gain=30.0),
    Case("scale_negative", scale=-0.3),
    Case("scale_one", scale=1.0),
    Case("empty_L", q_len=0),
    Case("empty_S", kv_len=0),
]


def _slopes(per_batch: bool):
    def make(case, gen):
        return torch.rand(*(case.batch if per_batch else ()), case.q_heads, generator=gen)

    return make


def _layout(mask_fn, block_size=16):
    """A maker of the BlockMask of `mask_fn` for the case (the same for every batch)."""

    def make(case, gen):
        return attnperf.block_mask(mask_fn, None, case.q_heads, case.q_len, case.kv_len,
                                   block_size=block_size)  # fmt: skip

    return make


def _per_batch_and_head(case, gen):
    """A layout that differs per batch and per head (B and H given, not None)."""
    fn = lambda b, h, q, k: ((k + 7 * b + 3 * h) % 11) < (5 + b)  # noqa: E731
    return attnperf.block_mask(fn, case.batch[0], case.q_heads, case.q_len, case.kv_len,
                               block_size=16)  # fmt: skip


def _random_tiles(case, gen):
    """Whole tiles on and off (and some partial ones): every layout kind in one call."""
    tiles = torch.rand(-(-case.q_len // 16), -(-case.kv_len // 16), generator=gen) > 0.5
    fine = torch.rand(case.q_len, case.kv_len, generator=gen) > 0.3
    fn = lambda b, h, q, k: tiles[q // 16, k // 16] & (fine[q, k] | (q % 3 != 0))  # noqa: E731
    return _layout(fn)(case, gen)


def _sinks(gain: float = 2.0):
    def make(case, gen):
        return torch.randn(case.q_heads, generator=gen) * gain

    return make


_DOCUMENTS = torch.tensor([0, 11, 12, 30, 50])  # a one-token document among them

# Variant presets, each aimed at a distinct code path of the fused kernels (band edges
# inside and outside tiles, empty rows, both alignments, the softcap's saturation, ALiBi's
# two slope shapes, every kind of block). At these lengths the kernels' tiles (numba 128 x
# 512, triton 32 x 32 under the interpreter) are cut by the band and the layout;
# tests/test_numba.py runs them again on 8 x 16 tiles to cross numba's tile boundaries.
VARIANT_CASES = [
    Case("window_small", variant={"window": (5, 3)}),
    Case("window_left_only", variant={"window": (7, None)}),
    Case("window_right_only", variant={"window": (None, 4)}),
    Case("window_0", variant={"window": (0, 0)}),
    Case("window_1_causal", is_causal=True, variant={"window": (1, 9)}),
    Case("window_ge_S", variant={"window": (100, 100)}),
    Case("causal_bottom_right_L_lt_S", is_causal=True, q_len=13, kv_len=45,
         variant={"align": "bottom_right"}),
    Case("causal_bottom_right_L_gt_S", is_causal=True, q_len=45, kv_len=13,
         variant={"align": "bottom_right", "return_lse": True}),  # empty rows: lse -inf
    Case("window_bottom_right_gqa", q_heads=4, kv_heads=2, q_len=20, kv_len=50,
         variant={"window": (8, 2), "align": "bottom_right"}),
    Case("softcap_past_cap", logit_gain=8.0, variant={"softcap": 2.0, "return_lse": True}),
    Case("softcap_gqa_float_mask", q_heads=4, kv_heads=1,
         mask="float_broadcast", variant={"softcap": 5.0}),
    Case("alibi_heads_causal", is_causal=True, variant={"alibi_slopes": _slopes(False)}),
    Case("alibi_batch_bottom_right", q_len=20, kv_len=45,
         variant={"alibi_slopes": _slopes(True), "align": "bottom_right", "window": (6, 6)}),
    Case("block_causal", variant={"block_mask": _layout(layouts.causal())}),
    Case("block_sliding", q_len=60, kv_len=60,
         variant={"block_mask": _layout(layouts.sliding_window(9))}),
    Case("block_document", q_len=50, kv_len=50,
         variant={"block_mask": _layout(layouts.document(_DOCUMENTS, is_causal=True))}),
    Case("block_prefix_lm", q_len=40, kv_len=40,
         variant={"block_mask": _layout(layouts.prefix_lm(10), (32, 16))}),
    Case("block_random_with_window", q_len=50, kv_len=70, variant={
        "block_mask": _random_tiles, "window": (20, 5), "return_lse": True}),
    Case("block_per_batch_and_head_gqa", q_heads=4, kv_heads=2, q_len=40, kv_len=50,
         variant={"block_mask": _per_batch_and_head, "return_lse": True}),
    Case("lse_bool_mask_empty_rows", mask="bool", variant={"return_lse": True}),
    Case("sinks_gqa_causal", q_heads=4, kv_heads=2, is_causal=True,
         variant={"sinks": _sinks(), "return_lse": True}),
    Case("sinks_dominant_bool_mask", mask="bool",  # rows of no key: out 0, lse = sink
         variant={"sinks": _sinks(20.0), "return_lse": True}),
    Case("sinks_window_softcap_bottom_right", q_heads=4, kv_heads=1, q_len=45, kv_len=13,
         is_causal=True, logit_gain=4.0, variant={
             "sinks": _sinks(), "window": (3, 0), "softcap": 2.0, "align": "bottom_right",
             "return_lse": True}),
    Case("everything_gqa", q_heads=4, kv_heads=2, is_causal=True, q_len=30, kv_len=60,
         logit_gain=4.0, variant={
             "window": (12, None), "align": "bottom_right", "softcap": 3.0,
             "alibi_slopes": _slopes(True), "return_lse": True,
             "block_mask": _random_tiles}),
]  # fmt: skip

# Where torch's own CPU kernels (the sdpa backend) were seen to miss the rule (on AVX-512,
# and on AVX2 with ATEN_CPU_CAPABILITY=avx2). Which kernel torch runs depends on the CPU, so
# these are judged at run time: see `torch_may_deviate`. Keyed by (backend, case id, dtype,
# pass).
PEER_DEVIATIONS = {
    ("sdpa", "S_1", torch.bfloat16, "backward"): "torch's CPU flash backward rounds dv to "
    "2 bf16 ulps where the bf16 math path has 1",
    ("sdpa", "large_logits", torch.float32, "backward"): "torch's CPU flash backward dq "
    "error is 3.1x the fp32 math path's at large logits",
}


DIFFERENTIABLE = ("query", "key", "value", "attn_mask", "sinks")


def _leaves(args, cast):
    """(the call's arguments, its differentiable inputs by name) with those inputs made
    leaves that require grad, cast to `cast` first when given."""
    leaves = {}
    call = dict(args)
    for name in DIFFERENTIABLE:
        tensor = args.get(name)
        if tensor is None or not tensor.is_floating_point():
            continue
        leaf = (tensor if cast is None else tensor.to(cast)).detach().requires_grad_()
        leaves[name] = call[name] = leaf
    return call, leaves


def output_and_gradients(fn, args, grad_out, cast=None):
    """fn's output and d(sum(out * grad_out))/d(each differentiable input), optionally cast
    first."""
    call, leaves = _leaves(args, cast)
    out = fn(**call)
    out.backward(grad_out.to(out.dtype))
    return out, {name: leaf.grad for name, leaf in leaves.items()}


def assert_gradients_agree(backend: str, args, grad_out):
    """The gradients of attention(**args, backend=backend) under grad_out, each by the
    agreement rule against float64 and PyTorch's own attention in the inputs' dtype."""

    def run(**call):
        return attnperf.attention(**call, backend=backend)

    _, actual = output_and_gradients(run, args, grad_out)
    _, exact = output_and_gradients(float64_reference, args, grad_out, cast=torch.float64)
    _, baseline = output_and_gradients(same_precision_reference, args, grad_out)
    for name in actual:
        assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")


def results_and_gradients(fn, args, cast=None, seed=1):
    """(out, lse or None, gradients of sum(out * g) + sum(finite lse * g') by name), the
    differentiable inputs optionally cast first."""
    call, leaves = _leaves(args, cast)
    result = fn(**call)
    out, lse = result if isinstance(result, tuple) else (result, None)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen).to(out)).sum()
    if lse is not None:
        weights = torch.randn(lse.shape, generator=gen).to(lse)
        loss = loss + torch.where(lse.isfinite(), lse * weights, 0.0).sum()
    loss.backward()
    return out, lse, {name: leaf.grad for name, leaf in leaves.items()}


def backend_params(cases=CASES, dtypes=GRID_DTYPES, *, need_backward=False):
    """pytest params (backend, case, dtype) for every combination a backend declares."""
    params = []
    for backend in dispatch.registry().values():
        if need_backward and "backward" not in backend.capabilities.features:
            continue
        unavailable = backend.unavailable_reason()
        if unavailable:
            skip = pytest.mark.skip(reason=unavailable)
            params.append(pytest.param(backend, None, None, marks=skip, id=f"{backend.name}"))
            continue
        device = device_for(backend)
        for case in cases:
            for dtype in dtypes:
                if backend.capability_reasons(prepare(**case.build(dtype, device))):
                    continue
                name = f"{backend.name}-{case.id}-{DTYPE_NAMES[dtype]}"
                params.append(pytest.param(backend, case, dtype, id=name))
    return params


def preset_params(presets: dict, dtypes, prepare_call):
    """pytest params (backend, preset, dtype) for every preset of a serving call that a
    backend's declarations serve; prepare_call(dtype, device, **preset) -> its inputs."""
    params = []
    for backend in dispatch.registry().values():
        unavailable = backend.unavailable_reason()
        if unavailable:
            skip = pytest.mark.skip(reason=unavailable)
            params.append(pytest.param(backend, None, None, marks=skip, id=backend.name))
            continue
        for preset, variant in presets.items():
            for dtype in dtypes:
                if not backend.capability_reasons(
                    prepare_call(dtype, device_for(backend), **variant)
                ):
                    name = f"{backend.name}-{preset}-{DTYPE_NAMES[dtype]}"
                    params.append(pytest.param(backend, preset, dtype, id=name))
    return params


@contextlib.contextmanager
def torch_may_deviate(backend: Backend, case: Case, dtype: torch.dtype, which_pass: str):
    """A failed agreement is an xfail, naming torch's CPU path, where torch's own CPU kernel
    is known to deviate (PEER_DEVIATIONS); anywhere else, and wherever it agrees, the test
    stands as it is."""
    deviation = PEER_DEVIATIONS.get((backend.name, case.id, dtype, which_pass))
    try:
        yield
    except AssertionError:
        if deviation is None or device_for(backend) != "cpu":
            raise
        path = torch.backends.cpu.get_cpu_capability()
        pytest.xfail(f"{deviation} (torch's {path} CPU path)")


def device_for(backend: Backend | str) -> str:
    """Where the tests run `backend` (or the backend of that name): CUDA when it is there,
    else CPU; "auto" on CPU, where its tests make their tensors."""
    if backend == "auto":
        return "cpu"
    if isinstance(backend, str):
        backend = dispatch.registry()[backend]
    if torch.cuda.is_available() and "cuda" in backend.capabilities.devices:
        return "cuda"
    return "cpu"


def softmax_score_tile(keys: int, seed: int):
    """(s_t (keys, 32) float32 scores transposed, shift (32,), factor) for the explicit
    exp2 passes: key 0 holds -inf, NaN, a score far below its shift and one at it (2 ** 0
    for row 3); row 8 sees no key (-inf throughout)."""
    gen = torch.Generator().manual_seed(seed)
    s_t = (torch.randn(keys, 32, generator=gen) * 40).numpy()
    s_t[0, :4] = (-np.inf, np.nan, -1e30, 10.0)
    s_t[:, 8] = -np.inf
    shift = (torch.randn(32, generator=gen) * 3).numpy()
    shift[3] = 5.0  # the row's max: its score gives 2 ** 0
    return s_t, shift, np.float32(0.5)
