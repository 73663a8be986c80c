"""The sdpa backend: torch's own scaled_dot_product_attention, the peer every figure names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import FEATURES, Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs
from attnperf.kernels.reference import dense_masks, variant_masks
from attnperf.serving import KVCacheInputs


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention on 4-D views"
    # Window, alignment, ALiBi and block masks the way a user would today: materialised into
    # an L x S mask (the cost the fused kernels save); packed sequences and KV caches padded
    # to a batch under such a mask. SDPA has no softcap and no LSE.
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        features=frozenset(FEATURES)
        - {"softcap", "lse", "kvcache_backward", "linear", "linear_backward"},
    )

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, None]:
        if inputs.variant.sequences is not None:
            return self.run_varlen(inputs), None
        # Inputs are already 4-D: torch's CPU flash kernel serves only 4-D calls,
        # 3-D and 5-D ones would silently take its slow math path.
        mask, is_causal = sdpa_mask(inputs)
        out = F.scaled_dot_product_attention(
            inputs.query,
            inputs.key,
            inputs.value,
            attn_mask=mask,
            dropout_p=inputs.dropout_p,
            is_causal=is_causal,
            scale=inputs.scale,
            enable_gqa=inputs.enable_gqa,
        )
        return out, None

    def run_varlen(self, inputs: AttentionInputs) -> Tensor:
        """Packed sequences padded to (B, H, max L, E), as a user of SDPA would pad them (a
        padded batch's own padding too); rows of no sequence give 0."""
        table = inputs.sequences.table.to(inputs.device)
        (query, where), (key, _), (value, _) = (
            _padded(t, table[:, 0], table[:, start], table[:, length])
            for t, start, length in ((inputs.query, 1, 2), (inputs.key, 3, 4), (inputs.value, 3, 4))
        )  # fmt: skip
        out = _ragged_sdpa(inputs, query, key, value, table)
        slots, heads, rows = inputs.query.shape[:3]
        result = out.new_zeros((slots, rows, heads, inputs.value_dim))
        sequence, row = where
        return result.index_put((table[sequence, 0], table[sequence, 1] + row),
                                out[sequence, :, row]).transpose(1, 2)  # fmt: skip

    def run_kvcache(self, inputs: KVCacheInputs) -> tuple[Tensor, None]:
        """The cache gathered to (B, H, max S, E) (a view of a contiguous cache without left
        padding) under a mask."""
        table = inputs.sequences.table.to(inputs.device)
        starts, longest = table[:, 3], inputs.sequences.max_kv_len
        contiguous = inputs.block_table.shape[1] == 1 and inputs.k_pages.shape[0] == inputs.batch
        if contiguous and not bool((starts != 0).any()):
            key, value = (t[:, :longest].transpose(1, 2) for t in (inputs.k_pages, inputs.v_pages))
        else:
            positions = starts[:, None] + torch.arange(longest, device=inputs.device)
            capacity = inputs.block_table.shape[1] * inputs.page_size
            positions = positions.clamp(max=capacity - 1)  # past a sequence's end: masked
            pages = inputs.block_table.gather(1, positions // inputs.page_size)
            rows = positions % inputs.page_size
            key, value = (t[pages, rows].transpose(1, 2) for t in (inputs.k_pages, inputs.v_pages))
        return _ragged_sdpa(inputs, inputs.query, key, value, table), None


def _padded(
    array: Tensor, slots: Tensor, starts: Tensor, lengths: Tensor
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """(padded (B, H, max length, E): rows starts[b] .. + lengths[b] of array[slots[b]],
    zeros after; (sequence, row) of every real row of the padding)."""
    longest = int(lengths.max()) if len(lengths) else 0
    positions = torch.arange(longest, device=array.device)
    valid = positions < lengths[:, None]
    index = torch.where(valid, starts[:, None] + positions, 0)
    padded = array[slots[:, None], :, index] * valid[:, :, None, None]  # (B, max length, H, E)
    return padded.transpose(1, 2), valid.nonzero(as_tuple=True)


def _ragged_sdpa(
    inputs: AttentionInputs | KVCacheInputs, query: Tensor, key: Tensor, value: Tensor, table
) -> Tensor:
    """SDPA of padded sequences under the mask of their lengths, bands and ALiBi."""
    offsets, kv_lens = (table[:, column].view(-1, 1, 1, 1) for column in (5, 4))
    allowed, alibi = dense_masks(
        inputs, query.shape[2], key.shape[2], offsets, inputs.dtype, kv_lens
    )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=materialised_mask(inputs, allowed, alibi),
        scale=inputs.scale, enable_gqa=query.shape[1] != key.shape[1],
    )  # fmt: skip


def sdpa_mask(inputs: AttentionInputs) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) that give SDPA this call: the call's own where it has no
    variant; a top-left causal band alone (is_causal, or window (None, 0)) as SDPA's
    is_causal, in its kernel; anything more materialised into one L x S mask, as a user of
    SDPA would build it."""
    variant = inputs.variant
    if variant.alibi_slopes is None and variant.block_mask is None:
        if inputs.band is None:
            return inputs.attn_mask, False
        if inputs.band == (None, 0) and inputs.offset == 0 and inputs.attn_mask is None:
            return None, True
    return materialised_mask(inputs, *variant_masks(inputs, inputs.dtype)), False


def materialised_mask(
    inputs: AttentionInputs, allowed: Tensor | None, alibi: Tensor | None
) -> Tensor:
    """The call's attn_mask combined with the variant's dense masks, as SDPA takes one:
    bool where everything is bool, else float in the inputs' dtype."""
    mask = inputs.attn_mask
    if alibi is None and inputs.mask_kind != "float":
        if mask is None:
            return allowed
        return mask if allowed is None else mask & allowed
    bias = torch.zeros((), dtype=inputs.dtype, device=inputs.device)
    if inputs.mask_kind == "float":
        bias = mask
    elif inputs.mask_kind == "bool":
        allowed = mask if allowed is None else mask & allowed
    if alibi is not None:
        bias = bias + alibi
    if allowed is not None:
        bias = torch.where(allowed, bias, float("-inf"))
    return bias.to(inputs.dtype)


BACKEND = SdpaBackend()
