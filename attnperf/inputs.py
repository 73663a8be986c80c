"""Validation of an attention call and its normalised, 4-D form shared by every backend."""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionInputs:
    """One validated call with the leading dims flattened into a batch dim B.

    query (B, Hq, L, E), key (B, H, S, E), value (B, H, S, Ev); attn_mask is None or a
    broadcast view (B, Hq, L, S), bool (True takes part) or float (added to the scores),
    whose stride is 0 along every broadcast dim. `out_shape` is the caller's output shape.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    out_shape: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def mask_kind(self) -> str | None:
        """None, "bool" or "float"."""
        if self.attn_mask is None:
            return None
        return "bool" if self.attn_mask.dtype == torch.bool else "float"

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def kv_len(self) -> int:
        return self.key.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[3]

    @property
    def value_dim(self) -> int:
        return self.value.shape[3]

    @property
    def has_pairs(self) -> bool:
        """Whether any (query, key) pair exists: zero-size batch, heads or lengths have none
        (head dim 0 still has pairs, of score 0)."""
        return self.batch * self.q_heads * self.q_len * self.kv_len > 0

    @property
    def needs_grad(self) -> bool:
        tensors = (self.query, self.key, self.value, self.attn_mask)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def restore(self, out: Tensor) -> Tensor:
        """Reshape a (B, Hq, L, Ev) result to the caller's layout."""
        return out.reshape(self.out_shape)


def prepare(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
) -> AttentionInputs:
    """Check a call against SDPA's contract and flatten it to AttentionInputs.

    Raises TypeError or ValueError naming the offending argument.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_nested or tensor.layout != torch.strided:
            kind = "a nested (jagged) tensor" if tensor.is_nested else f"layout {tensor.layout}"
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got {kind}; pad the sequences "
                "and pass a padding mask instead"
            )
    assert isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"query must be a floating-point tensor (fp16, bf16, fp32, fp64), got {query.dtype}"
        )
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} must match query dtype {query.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        raise ValueError(
            "query, key and value must have the same number of dims, at least 2 "
            f"(..., L, E); got {query.dim()}, {key.dim()} and {value.dim()}"
        )
    is_causal = _flag("is_causal", is_causal)
    enable_gqa = _flag("enable_gqa", enable_gqa)
    dropout_p = _real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if scale is not None:
        scale = _real("scale", scale, "a float or None")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    if _is_causal_bias(attn_mask):
        # torch's causal_upper_left / causal_lower_right objects, as SDPA takes them.
        if is_causal:
            raise ValueError("attn_mask (a CausalBias) and is_causal=True cannot be given together")
        attn_mask, is_causal = _causal_bias(attn_mask, query, key)

    # Heads are dim -3 (absent for 2-D inputs); every dim before them is batch.
    head_axis = () if rank == 2 else (rank - 3,)
    batch_shape = tuple(query.shape[: rank - 2 - len(head_axis)])
    for name, tensor in (("key", key), ("value", value)):
        other = tuple(tensor.shape[: len(batch_shape)])
        if other != batch_shape:
            raise ValueError(
                f"batch dims of {name} {other} must match those of query {batch_shape}"
            )
    q_heads = query.shape[-3] if head_axis else 1
    kv_heads = key.shape[-3] if head_axis else 1
    if head_axis and value.shape[-3] != kv_heads:
        raise ValueError(f"key has {kv_heads} heads (dim -3) but value has {value.shape[-3]}")
    if q_heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"query has {q_heads} heads but key/value have {kv_heads}; "
                "pass enable_gqa=True for grouped-query attention"
            )
        if kv_heads == 0 or q_heads % kv_heads:
            raise ValueError(
                f"enable_gqa needs key/value heads ({kv_heads}) to divide query heads ({q_heads})"
            )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key embedding dim E={key.shape[-1]} (last dim) must match query's E={query.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key sequence length S={key.shape[-2]} (dim -2) must match value's S={value.shape[-2]}"
        )

    batch = math.prod(batch_shape)
    q_len, kv_len, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    mask4 = None
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be given together")
        full_shape = (*batch_shape, *((q_heads,) if head_axis else ()), q_len, kv_len)
        mask4 = _prepare_mask(attn_mask, query, full_shape, len(batch_shape), (batch, q_heads))

    return AttentionInputs(
        query=query.reshape(batch, q_heads, q_len, head_dim),
        key=key.reshape(batch, kv_heads, kv_len, head_dim),
        value=value.reshape(batch, kv_heads, kv_len, value.shape[-1]),
        attn_mask=mask4,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=_default_scale(head_dim) if scale is None else float(scale),
        enable_gqa=enable_gqa,
        out_shape=(*query.shape[:-1], value.shape[-1]),
    )


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _real(name: str, value: object, expected: str = "a float") -> float:
    """A Python or numpy real number as a float (bools are refused, as SDPA does)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return float(value)


def _is_causal_bias(mask: object) -> bool:
    # Imported only where the caller made one: the module imports triton.
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def _causal_bias(bias: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) for one of torch's CausalBias objects.

    Upper-left (and lower-right when L == S, the same band) is is_causal=True, in-kernel;
    lower-right with L != S is materialised as a bool (L, S) mask for now.
    """
    shape = (bias.seq_len_q, bias.seq_len_kv)
    if shape != (query.shape[-2], key.shape[-2]):
        raise ValueError(
            f"attn_mask is a CausalBias for (L, S) = {shape}, but query and key have "
            f"(L, S) = {(query.shape[-2], key.shape[-2])}"
        )
    upper_left = sys.modules["torch.nn.attention.bias"].CausalVariant.UPPER_LEFT
    if bias.variant == upper_left or shape[0] == shape[1]:
        return None, True
    rows = torch.arange(shape[0], device=query.device)[:, None]
    cols = torch.arange(shape[1], device=query.device)[None, :]
    return cols <= rows + (shape[1] - shape[0]), False


def _default_scale(head_dim: int) -> float:
    # E = 0: every score is an empty sum, 0, whatever the scale; SDPA gives the mean of V.
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def _prepare_mask(
    mask: object,
    query: Tensor,
    full_shape: tuple[int, ...],
    batch_dims: int,
    batch_and_heads: tuple[int, int],
) -> Tensor:
    """Broadcast the mask to (B, Hq, L, S) as a view; only its own batch dims may be copied."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"attn_mask must be bool or floating point matching query ({query.dtype}) "
            f"or float32, got {mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {query.device}")
    try:
        broadcast = torch.broadcast_shapes(mask.shape, full_shape)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(full_shape):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
            f"(..., Hq, L, S) = {full_shape}"
        )
    mask = mask.reshape((1,) * (len(full_shape) - mask.dim()) + tuple(mask.shape))
    batch, heads = batch_and_heads
    own = tuple(mask.shape[batch_dims:])
    if any(size != 1 for size in mask.shape[:batch_dims]):
        # Flattening batch dims of which only some are broadcast cannot be a view:
        # this copies the mask over its batch dims only, never over heads, L or S.
        mask = mask.expand(*full_shape[:batch_dims], *own).reshape(batch, *own)
    else:
        mask = mask.reshape(1, *own)
    if len(own) == 2:  # 2-D inputs have no head dim
        mask = mask.unsqueeze(1)
    return mask.expand(batch, heads, full_shape[-2], full_shape[-1])
