"""The reference backend: attention as the textbook writes it, in plain PyTorch ops.

Readable first: it is the ground truth that the fused kernels are compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs, prepare
from attnperf.linear_inputs import LinearAttentionInputs, l2norm
from attnperf.serving import KVCacheInputs, cached_keys


def variant_masks(
    inputs: AttentionInputs, dtype: torch.dtype, offset: int | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """The variant as dense tensors: (allowed, bool (B or 1, Hq or 1, L, S): the band and
    the block mask; alibi, (B, Hq, L, S) in `dtype`: -slope * |i + o - j|), each None when
    the call has none. Query i's diagonal is key i + o (o = 0 top-left, S - L bottom-right,
    or `offset`).
    """
    offset = inputs.offset if offset is None else offset
    allowed, alibi = dense_masks(inputs, inputs.q_len, inputs.kv_len, offset, dtype)
    block_mask = inputs.variant.block_mask
    if block_mask is not None:
        dense = block_mask.to_dense().to(inputs.device)
        allowed = dense if allowed is None else allowed & dense
    return allowed, alibi


def dense_masks(
    inputs: AttentionInputs | KVCacheInputs,
    q_len: int,
    kv_len: int,
    offset: int | Tensor,
    dtype: torch.dtype,
    kv_lens: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """(allowed, alibi) as in variant_masks over L x S for the band and ALiBi, with `offset`
    an int or per sequence (B, 1, 1, 1); keys at or past `kv_lens` (B, 1, 1, 1), if given,
    are padding and never allowed."""
    rows = torch.arange(q_len, device=inputs.device)[:, None]
    cols = torch.arange(kv_len, device=inputs.device)[None, :]
    distance = cols - (rows + offset)  # how far right of row i's diagonal key j is
    allowed = None if kv_lens is None else cols < kv_lens
    if inputs.band is not None:
        left, right = inputs.band
        if left is not None:
            allowed = distance >= -left if allowed is None else allowed & (distance >= -left)
        if right is not None:
            allowed = distance <= right if allowed is None else allowed & (distance <= right)
    alibi = None
    if inputs.variant.alibi_slopes is not None:
        slopes = inputs.variant.alibi_slopes.to(dtype)[:, :, None, None]
        alibi = -slopes * distance.abs().to(dtype)
    return allowed, alibi


def reference_attention(
    inputs: AttentionInputs, compute_dtype: torch.dtype | None = None, offset: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(output (B, Hq, L, Ev), weights (B, Hq, L, S), both in the inputs' dtype, natural-log
    LSE (B, Hq, L) float32), computed in `compute_dtype` (default: the inputs' own), the
    diagonal at key i + `offset` (default: the call's alignment).

    The weights are those applied to the values, after dropout when dropout_p > 0.
    """
    dtype = compute_dtype or inputs.dtype
    variant = inputs.variant
    query, key, value = (t.to(dtype) for t in (inputs.query, inputs.key, inputs.value))
    group = inputs.q_heads // max(inputs.kv_heads, 1)
    if group > 1:  # grouped-query: each key/value head serves `group` query heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)

    # 1. Similarity of every query with every key, scaled, then softly capped.
    scores = (query @ key.transpose(-2, -1)) * inputs.scale
    if variant.softcap is not None:
        scores = variant.softcap * torch.tanh(scores / variant.softcap)

    # 2. Masks and ALiBi. The structure (band, block mask) overwrites scores with -inf, as
    #    SDPA's is_causal does; a bool attn_mask is added as 0 / -inf, so NaN stays NaN.
    allowed, alibi = variant_masks(inputs, scores.dtype, offset)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if inputs.mask_kind == "bool":
        scores = scores + torch.zeros_like(scores).masked_fill(~inputs.attn_mask, float("-inf"))
    elif inputs.mask_kind == "float":
        scores = scores + inputs.attn_mask.to(scores.dtype)
    if alibi is not None:
        scores = scores + alibi

    # 3. Numerically stable softmax over the keys. A fully masked row has max -inf:
    #    shift it by 0 instead so its weights come out 0 (and its LSE -inf), not NaN.
    #    Sinks are one more column of each row's scores, whose weight is dropped after.
    if variant.sinks is not None:
        sink_column = variant.sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sink_column), -1)
    if scores.shape[-1] > 0:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        exp_scores = torch.exp(scores - row_max)
        row_sum = exp_scores.sum(dim=-1, keepdim=True)
        seen = row_sum > 0
        weights = exp_scores / torch.where(seen, row_sum, torch.ones_like(row_sum))
        log_sum = torch.log(torch.where(seen, row_sum, torch.ones_like(row_sum)))
        lse = torch.where(seen, row_max + log_sum, float("-inf")).squeeze(-1)
        if variant.sinks is not None:
            weights = weights[..., :-1]
    else:
        weights = scores  # no keys: (B, Hq, L, 0), and the output below is zeros
        lse = scores.new_full(scores.shape[:-1], float("-inf"))
    if inputs.dropout_p > 0:
        weights = F.dropout(weights, p=inputs.dropout_p)

    # 4. Each output row is the weighted sum of the values.
    out = (weights @ value).to(inputs.dtype)
    lse = lse if dtype == torch.float64 else lse.float()
    return out, weights.to(inputs.dtype), lse


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
    out, weights, _ = reference_attention(inputs)
    weights_shape = (*inputs.out_shape[:-1], inputs.kv_len)
    return inputs.restore(out), weights.reshape(weights_shape)


class ReferenceBackend(Backend):
    name = "reference"
    description = "textbook PyTorch ops; materialises the L x S scores (ground truth)"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        # Every one (it is the ground truth) but a backward through the KV cache, which
        # attention_with_kvcache is not for.
        features=frozenset({
            "bool_mask", "float_mask", "causal", "window", "softcap", "alibi", "block_mask",
            "lse", "sinks", "bottom_right", "gqa", "dropout", "backward", "func_grad", "varlen",
            "kvcache", "kvcache_int8", "linear", "linear_backward",
        }),
    )  # fmt: skip
    rank = {"cpu": 2, "cuda": 2}  # noqa: RUF012 (the last resort)

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
        if inputs.variant.sequences is not None:
            return self.run_sequences(inputs)
        return self.run_plain(inputs)

    def run_plain(
        self, inputs: AttentionInputs, offset: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        # fp16/bf16 computed in fp32, as SDPA does: fp16 scores overflow at |q.k| > 65504.
        half = inputs.dtype in (torch.float16, torch.bfloat16)
        out, _, lse = reference_attention(inputs, torch.float32 if half else None, offset)
        return out, lse if inputs.variant.return_lse else None

    def run_sequences(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
        """One sequence at a time, on views of its rows; rows of no sequence give 0."""
        slots, heads, rows = inputs.query.shape[:3]
        # Row-major (slot, row, head) while filling: a sequence's rows are then one index.
        out = inputs.query.new_zeros((slots, rows, heads, inputs.value_dim))
        lse = out.new_full((slots, rows, heads), float("-inf"), dtype=torch.float32)
        for b, (slot, q0, q_len, k0, k_len, offset) in enumerate(inputs.sequences.table.tolist()):
            query = inputs.query[slot : slot + 1, :, q0 : q0 + q_len]
            key, value = (
                t[slot : slot + 1, :, k0 : k0 + k_len] for t in (inputs.key, inputs.value)
            )
            part = sequence_call(inputs, b, query, key, value)
            part_out, part_lse = self.run_plain(part, offset)  # the table's own alignment
            where = (torch.tensor(slot), torch.arange(q0, q0 + q_len))
            out = out.index_put(where, part_out[0].transpose(0, 1))
            if part_lse is not None:
                lse = lse.index_put(where, part_lse[0].transpose(0, 1))
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
        return out, lse if inputs.variant.return_lse else None

    def run_kvcache(self, inputs: KVCacheInputs) -> tuple[Tensor, Tensor | None]:
        parts = []
        for b in range(inputs.batch):  # one sequence at a time, its keys gathered from pages
            keys, values = cached_keys(inputs, b)
            part = sequence_call(inputs, b, inputs.query[b : b + 1], keys[None], values[None])
            parts.append(self.run(part))
        out = torch.cat([out for out, _ in parts])
        lse = torch.cat([lse for _, lse in parts]) if inputs.variant.return_lse else None
        return out, lse

    def run_linear(self, inputs: LinearAttentionInputs) -> tuple[Tensor, Tensor]:
        return reference_linear_attention(inputs)


def reference_linear_attention(inputs: LinearAttentionInputs) -> tuple[Tensor, Tensor]:
    """The linear-attention recurrence token by token, in the compute dtype (float32, or
    float64 for float64 calls), one sequence at a time; differentiable by autograd.
    (out (B, T, HV, V) in the call's dtype, final state (N, HV, K, V))."""
    compute = inputs.compute_dtype
    group = inputs.value_heads // inputs.key_heads
    q, k = (t.to(compute) for t in (inputs.query, inputs.key))
    if inputs.l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = (t.repeat_interleave(group, 2) for t in (q, k))
    v = inputs.value.to(compute)
    g = None if inputs.g is None else inputs.g.to(compute)
    beta = None if inputs.beta is None else inputs.beta.to(compute)
    h0 = inputs.initial_state
    rows, states = [], []
    for n, (slot, start, length) in enumerate(inputs.sequences.tolist()):
        state = q.new_zeros(inputs.state_shape[1:]) if h0 is None else h0[n].to(compute)
        for t in range(start, start + length):
            if g is not None:  # (HV,) -> (HV, 1, 1), or (HV, K) -> (HV, K, 1)
                decay = g[slot, t].exp()
                state = state * (decay[:, None, None] if decay.dim() == 1 else decay[..., None])
            k_t, v_t = k[slot, t], v[slot, t]
            if beta is not None:
                v_t = beta[slot, t, :, None] * (v_t - torch.einsum("hkv,hk->hv", state, k_t))
            state = state + k_t[:, :, None] * v_t[:, None, :]
            rows.append(torch.einsum("hkv,hk->hv", state, q[slot, t] * inputs.scale))
        states.append(state)
    batch, steps = inputs.value.shape[:2]
    shape = (batch, steps, inputs.value_heads, inputs.value_dim)
    # Sequences are either each batch entry (0..T) or consecutive along T (cu_seqlens).
    out = torch.stack(rows).reshape(shape) if rows else v.new_zeros(shape)
    final = torch.stack(states) if states else v.new_zeros(inputs.state_shape)
    return out.to(inputs.dtype), final


def sequence_call(
    inputs: AttentionInputs | KVCacheInputs, b: int, query: Tensor, key: Tensor, value: Tensor
) -> AttentionInputs:
    """Sequence b of a ragged call as a plain (1, H, L, E) call with the same variant."""
    variant = inputs.variant
    slopes = variant.alibi_slopes
    return prepare(
        query, key, value, None, 0.0, inputs.is_causal, inputs.scale,
        query.shape[1] != key.shape[1], window=variant.window, softcap=variant.softcap,
        alibi_slopes=None if slopes is None else slopes[b], align=variant.align,
        return_lse=variant.return_lse, sinks=variant.sinks,
    )  # fmt: skip


BACKEND = ReferenceBackend()
