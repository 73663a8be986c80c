"""The agreement grid: call shapes and features, crossed with each backend's declarations."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from attnperf import dispatch
from attnperf.backend import DTYPE_NAMES, Backend
from attnperf.inputs import prepare

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


DIFFERENTIABLE = ("query", "key", "value", "attn_mask")


def output_and_gradients(fn, args, grad_out, cast=None):
    """fn's output and d(sum(out * grad_out))/d(each differentiable input), optionally cast
    first."""
    leaves = {}
    call = dict(args)
    for name in DIFFERENTIABLE:
        tensor = args.get(name)
        if tensor is None or not tensor.is_floating_point():
            continue
        leaf = (tensor if cast is None else tensor.to(cast)).detach().requires_grad_()
        leaves[name] = call[name] = leaf
    out = fn(**call)
    out.backward(grad_out.to(out.dtype))
    return out, {name: leaf.grad for name, leaf in leaves.items()}


def backend_params(cases=CASES, dtypes=GRID_DTYPES, *, need_backward=False):
    """pytest params (backend, case, dtype) for every combination a backend declares."""
    params = []
    for backend in dispatch.registry().values():
        if need_backward and not backend.capabilities.backward:
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


def device_for(backend: Backend) -> str:
    """Where the tests run `backend`: CUDA when it is there, else CPU."""
    if torch.cuda.is_available() and "cuda" in backend.capabilities.devices:
        return "cuda"
    return "cpu"
