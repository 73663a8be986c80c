"""Validation of a linear-attention call (`linear_attention`), in fla's and transformers'
layout: (batch, time, heads, dim).

Per value head the recurrence is, in this order: S = diag(exp(g_t)) S; the additive rule
S = S + k_t v_t^T, or the delta rule u = beta_t (v_t - S^T k_t), S = S + k_t u^T; then
o_t = S^T (scale q_t). The state S is (K, V), float32 (float64 for float64 calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnperf.inputs import SUPPORTED_DTYPES, check_flag, check_real, func_grad_active
from attnperf.layouts import describe_type
from attnperf.serving import check_cu_seqlens

L2NORM_EPS = 1e-6  # fla's and transformers': x / sqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class LinearAttentionInputs:
    """A validated linear_attention call.

    query, key (B, T, H, K); value (B, T, HV, V), HV a multiple of H (value head j reads key
    head j // (HV // H)); g None, (B, T, HV) or (B, T, HV, K), natural-log decays; beta None
    (the additive rule) or (B, T, HV) (the delta rule); initial_state None or (N, HV, K, V).
    l2norm: the kernels first normalise q and k (`l2norm`, in the compute dtype). sequences
    (N, 3) int64 on the CPU: (slot, start, length) of each sequence, rows
    start .. start + length of batch entry `slot` (N = B, each (b, 0, T), without
    cu_seqlens). `dtype` is the caller's: the output's dtype.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    g: Tensor | None
    beta: Tensor | None
    initial_state: Tensor | None
    scale: float
    output_final_state: bool
    l2norm: bool
    sequences: Tensor
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.value.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 for float64 calls, else float32 (fp16 and bf16 are computed in float32)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def key_heads(self) -> int:
        return self.key.shape[2]

    @property
    def value_heads(self) -> int:
        return self.value.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    @property
    def value_dim(self) -> int:
        return self.value.shape[3]

    @property
    def count(self) -> int:
        """N: the number of sequences, the state's first dim."""
        return self.sequences.shape[0]

    @property
    def gate(self) -> str:
        """ "none", "scalar" (one decay per head and step) or "vector" (one per key dim)."""
        if self.g is None:
            return "none"
        return "scalar" if self.g.dim() == 3 else "vector"

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.count, self.value_heads, self.head_dim, self.value_dim)

    @property
    def needs_grad(self) -> bool:
        tensors = (self.query, self.key, self.value, self.g, self.beta, self.initial_state)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def features(self) -> set[str]:
        wanted = {"linear": True, "linear_backward": self.needs_grad,
                  "func_grad": func_grad_active()}  # fmt: skip
        return {name for name, needed in wanted.items() if needed}

    def as_gradients(self, *grads: Tensor) -> tuple[Tensor | None, ...]:
        """A kernel's float32 gradients of (q, k, v, g, beta, initial_state), each viewed as
        its input and in its dtype; None where the call has no such input."""
        inputs = (self.query, self.key, self.value, self.g, self.beta, self.initial_state)
        return tuple(None if tensor is None else grad.view(tensor.shape).to(tensor.dtype)
                     for grad, tensor in zip(grads, inputs, strict=True))  # fmt: skip


def _check_tensor(name: str, tensor: object, dims: tuple[int, ...], layout: str) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested or tensor.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {describe_type(tensor)}")
    if tensor.dim() not in dims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")
    return tensor


def _check_shape(name: str, tensor: Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must be {layout} = {expected}, got {tuple(tensor.shape)}")


def l2norm(x: Tensor) -> Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, differentiably (fla's and
    transformers')."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def prepare_linear(
    q: object,
    k: object,
    v: object,
    *,
    g: object = None,
    beta: object = None,
    scale: object = None,
    initial_state: object = None,
    output_final_state: object = False,
    cu_seqlens: object = None,
    use_qk_l2norm: object = False,
) -> LinearAttentionInputs:
    """Check a linear_attention call and describe it as LinearAttentionInputs.

    Raises TypeError or ValueError naming the offending argument; computes nothing before.
    """
    q = _check_tensor("q", q, (4,), "(B, T, H, K)")
    k = _check_tensor("k", k, (4,), "(B, T, H, K)")
    v = _check_tensor("v", v, (4,), "(B, T, HV, V)")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be fp16, bf16, fp32 or fp64, got {tensor.dtype}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} must match q's {q.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
    batch, steps, key_heads, head_dim = q.shape
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k head dims differ: q has K = {head_dim}, k has {k.shape[3]}")
    _check_shape("k", k, tuple(q.shape), "q's (B, T, H, K)")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have q's (B, T) = {tuple(q.shape[:2])}, got "
                         f"{tuple(v.shape[:2])}")  # fmt: skip
    value_heads, value_dim = v.shape[2], v.shape[3]
    if key_heads == 0 or value_heads % key_heads:
        raise ValueError(f"v's heads ({value_heads}) must be a multiple of q's and k's heads "
                         f"({key_heads})")  # fmt: skip
    if g is not None:
        g = _check_tensor("g", g, (3, 4), "(B, T, HV) or (B, T, HV, K)")
        gate_shape = (batch, steps, value_heads) + ((head_dim,) if g.dim() == 4 else ())
        _check_shape("g", g, gate_shape, "(B, T, HV)" if g.dim() == 3 else "(B, T, HV, K)")
    if beta is not None:
        beta = _check_tensor("beta", beta, (3,), "(B, T, HV)")
        _check_shape("beta", beta, (batch, steps, value_heads), "(B, T, HV)")
    for name, tensor in (("g", g), ("beta", beta)):
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
    if scale is None:
        scale = head_dim**-0.5 if head_dim else 1.0
    scale = check_real("scale", scale, "a float or None")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    output_final_state = check_flag("output_final_state", output_final_state)
    use_qk_l2norm = check_flag("use_qk_l2norm", use_qk_l2norm)
    if cu_seqlens is None:
        sequences = torch.stack(
            (torch.arange(batch), torch.zeros(batch, dtype=torch.int64),
             torch.full((batch,), steps, dtype=torch.int64)), 1,
        )  # fmt: skip
    else:
        if isinstance(cu_seqlens, Tensor) and batch != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (sequences packed along T), got B = {batch}")
        starts, lengths = check_cu_seqlens("cu_seqlens", cu_seqlens, steps)
        sequences = torch.stack((torch.zeros_like(starts), starts, lengths), 1)
    state_shape = (sequences.shape[0], value_heads, head_dim, value_dim)
    if initial_state is not None:
        initial_state = _check_tensor("initial_state", initial_state, (4,), "(N, HV, K, V)")
        _check_shape("initial_state", initial_state, state_shape, "(N, HV, K, V)")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return LinearAttentionInputs(
        q, k, v, g, beta, initial_state, scale, output_final_state, use_qk_l2norm, sequences,
        q.dtype,
    )  # fmt: skip
