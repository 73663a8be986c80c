"""The reference backend: attention as the textbook writes it, in plain PyTorch ops.

Readable first: it is the ground truth that the fused kernels are compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs, prepare


def reference_attention(
    inputs: AttentionInputs, compute_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """(output (B, Hq, L, Ev), weights (B, Hq, L, S)) in the inputs' dtype, computed in
    `compute_dtype` (default: the inputs' own).

    The weights are those applied to the values, after dropout when dropout_p > 0.
    """
    dtype = compute_dtype or inputs.dtype
    query, key, value = (t.to(dtype) for t in (inputs.query, inputs.key, inputs.value))
    group = inputs.q_heads // max(inputs.kv_heads, 1)
    if group > 1:  # grouped-query: each key/value head serves `group` query heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)

    # 1. Similarity of every query with every key, scaled.
    scores = (query @ key.transpose(-2, -1)) * inputs.scale

    # 2. Masking. Like SDPA, a bool mask is added as 0 / -inf, so NaN scores stay NaN.
    if inputs.is_causal:
        causal = torch.ones(inputs.q_len, inputs.kv_len, dtype=torch.bool, device=inputs.device)
        scores = scores.masked_fill(~causal.tril(), float("-inf"))
    if inputs.mask_kind == "bool":
        bias = torch.zeros_like(scores).masked_fill(~inputs.attn_mask, float("-inf"))
        scores = scores + bias
    elif inputs.mask_kind == "float":
        scores = scores + inputs.attn_mask.to(scores.dtype)

    # 3. Numerically stable softmax over the keys. A fully masked row has max -inf:
    #    shift it by 0 instead so its weights come out 0, not NaN.
    if inputs.kv_len > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        exp_scores = torch.exp(scores - row_max)
        row_sum = exp_scores.sum(dim=-1, keepdim=True)
        weights = exp_scores / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    else:
        weights = scores  # no keys: (B, Hq, L, 0), and the output below is zeros
    if inputs.dropout_p > 0:
        weights = F.dropout(weights, p=inputs.dropout_p)

    # 4. Each output row is the weighted sum of the values.
    return (weights @ value).to(inputs.dtype), weights.to(inputs.dtype)


def attention_with_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """SDPA's arguments in, (output (..., Hq, L, Ev), weights (..., Hq, L, S)) out."""
    inputs = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out, weights = reference_attention(inputs)
    weights_shape = (*inputs.out_shape[:-1], inputs.kv_len)
    return inputs.restore(out), weights.reshape(weights_shape)


class ReferenceBackend(Backend):
    name = "reference"
    description = "textbook PyTorch ops; materialises the L x S scores (ground truth)"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        bool_mask=True,
        float_mask=True,
        causal=True,
        gqa=True,
        dropout=True,
        backward=True,
    )

    def run(self, inputs: AttentionInputs) -> Tensor:
        # fp16/bf16 computed in fp32, as SDPA does: fp16 scores overflow at |q.k| > 65504.
        half = inputs.dtype in (torch.float16, torch.bfloat16)
        return reference_attention(inputs, torch.float32 if half else None)[0]


BACKEND = ReferenceBackend()
