"""The sdpa backend: torch's own scaled_dot_product_attention, the peer every figure names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs
from attnperf.kernels.reference import dense_masks, variant_masks
from attnperf.serving import KVCacheInputs, cached_keys

# A padded batch costs its padding's pairs; a loop over the sequences costs a call each
# (Python and SDPA's set-up, ~20-50 us): worth it once the padding wastes more than this
# much work per sequence (~0.1 ms at 100 GFLOP/s).
LOOP_FLOPS_PER_CALL = 1e7


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention on 4-D views"
    # Window, alignment, ALiBi and block masks the way a user would today: materialised into
    # an L x S mask (the cost the fused kernels save); packed sequences and KV caches padded
    # to a batch under such a mask. SDPA has no softcap and no LSE, and reads no int8 cache
    # (dequantizing it first would be a copy of the whole cache per step).
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        features=frozenset({
            "bool_mask", "float_mask", "causal", "window", "alibi", "block_mask", "sinks",
            "bottom_right", "gqa", "dropout", "backward", "func_grad", "varlen", "kvcache",
        }),
    )  # fmt: skip
    rank = {"cpu": 0, "cuda": 0}  # noqa: RUF012 (the peer: first unless a kernel leads)

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, None]:
        if inputs.variant.sequences is not None:
            if _loop_pays(inputs):
                return _per_sequence(inputs), None
            return self.run_varlen(inputs), None
        # Inputs are already 4-D: torch's CPU flash kernel serves only 4-D calls,
        # 3-D and 5-D ones would silently take its slow math path.
        mask, is_causal = sdpa_mask(inputs)
        key, value = inputs.key, inputs.value
        if inputs.variant.sinks is not None:
            key, value, mask = with_sink_column(inputs.variant.sinks, inputs.query, key, value,
                                                mask)  # fmt: skip
        out = F.scaled_dot_product_attention(
            inputs.query,
            key,
            value,
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
        """Rows that see their whole cache: the group packed as rows (`_kvcache_rows`).
        Otherwise the cache gathered to (B, H, max S, E) (a view of a contiguous cache
        without left padding) under a mask."""
        if inputs.sees_whole_cache:
            return _kvcache_rows(inputs), None
        table = inputs.sequences.table.to(inputs.device)
        starts, longest = table[:, 3], inputs.sequences.max_kv_len
        if inputs.contiguous and not bool((starts != 0).any()):
            key, value = (t[:, :longest].transpose(1, 2) for t in (inputs.k_pages, inputs.v_pages))
        else:
            positions = starts[:, None] + torch.arange(longest, device=inputs.device)
            capacity = inputs.block_table.shape[1] * inputs.page_size
            positions = positions.clamp(max=capacity - 1)  # past a sequence's end: masked
            pages = inputs.block_table.gather(1, positions // inputs.page_size)
            rows = positions % inputs.page_size
            key, value = (t[pages, rows].transpose(1, 2) for t in (inputs.k_pages, inputs.v_pages))
        return _ragged_sdpa(inputs, inputs.query, key, value, table), None

    def kvcache_step(self, inputs: KVCacheInputs) -> SdpaKVCacheStep | None:
        """A step launcher (`SdpaKVCacheStep`) where the call's rows see their whole cache,
        else None."""
        return SdpaKVCacheStep(inputs) if inputs.sees_whole_cache else None


class SdpaKVCacheStep:
    """sdpa's launcher for the next steps of a call whose rows see their whole cache
    (`Backend.kvcache_step`): `_kvcache_rows`' one call, the group's query heads packed as
    rows over the cache's (B, H, S, E) view, with what it works out of the call's metadata
    worked out once."""

    def __init__(self, inputs: KVCacheInputs):
        batch, q_heads, q_len, head_dim = inputs.query.shape
        self.q_len, self.scale = q_len, inputs.scale
        self.rows_shape = (batch, inputs.kv_heads, q_heads // inputs.kv_heads * q_len, head_dim)
        self.out_shape = (batch, q_heads, q_len, inputs.value_dim)

    def __call__(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: int,
        heads_first: bool = False,
    ) -> Tensor:  # fmt: skip
        """attention_with_kvcache(q, k_cache, v_cache, cache_seqlens) of a step whose metadata
        is the call's this step was made for (a cache of another length), its values checked
        (`serving.check_step`); heads_first: q, k_cache and v_cache in SDPA's (B, H, L, E)
        layout, the output as ever."""
        if heads_first:
            query, seq_dim = q, 2
        else:  # (B, 1, Hq, E) is in the rows' order
            query, seq_dim = (q if self.q_len == 1 else q.transpose(1, 2)), 1
        rows = query.reshape(self.rows_shape)
        if cache_seqlens == 0 or rows.shape[0] == 0:
            out = rows.new_zeros((*self.rows_shape[:3], self.out_shape[3]))
        else:
            if cache_seqlens < k_cache.shape[seq_dim]:
                k_cache, v_cache = (t.narrow(seq_dim, 0, cache_seqlens) for t in (k_cache, v_cache))
            if not heads_first:
                k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
            out = F.scaled_dot_product_attention(rows, k_cache, v_cache, scale=self.scale)
        batch, q_heads, q_len, value_dim = self.out_shape
        if q_len == 1:  # (B, H, group, Ev) is (B, 1, Hq, Ev)
            return out.reshape(batch, 1, q_heads, value_dim)
        return out.reshape(self.out_shape).transpose(1, 2)


def _kvcache_rows(inputs: KVCacheInputs) -> Tensor:
    """SDPA as a careful user calls it to decode: the query rows of a key/value head's group
    packed as that head's rows, (B, H, group x Lq, E), over the cache's (B, H, S, E) view,
    with no mask. Exact when every row sees all its keys; enable_gqa would read the cache
    once per query head. One call when the sequences share their key range, else one per
    sequence (one without keys gives zeros)."""
    batch, q_heads, q_len, _ = inputs.query.shape
    kv_heads = inputs.kv_heads
    rows = inputs.query.reshape(batch, kv_heads, q_heads // kv_heads * q_len, -1)
    starts, lengths = (inputs.sequences.table[:, column].tolist() for column in (3, 4))
    if inputs.contiguous and len(set(starts)) == 1 and len(set(lengths)) == 1 and lengths[0] > 0:
        keys = slice(starts[0], starts[0] + lengths[0])
        key, value = (t[:, keys].transpose(1, 2) for t in (inputs.k_pages, inputs.v_pages))
        out = F.scaled_dot_product_attention(rows, key, value, scale=inputs.scale)
    else:
        out = rows.new_zeros((*rows.shape[:3], inputs.value_dim))
        for b, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            if length == 0:
                continue
            if inputs.contiguous:  # a view, not a copy
                key, value = (t[b, start : start + length].transpose(0, 1)
                              for t in (inputs.k_pages, inputs.v_pages))  # fmt: skip
            else:
                key, value = cached_keys(inputs, b)
            out[b] = F.scaled_dot_product_attention(
                rows[b : b + 1], key[None], value[None], scale=inputs.scale
            )[0]
    return out.reshape(batch, q_heads, q_len, -1)


def _loop_pays(inputs: AttentionInputs) -> bool:
    """Whether ragged sequences go to SDPA one call each (its own causal kernel, no mask), as
    a careful user calls it: possible without a window, ALiBi or a shifted causal diagonal;
    chosen where the padding would waste more than the calls cost."""
    variant, table = inputs.variant, inputs.sequences.table
    if variant.window is not None or variant.alibi_slopes is not None or variant.sinks is not None:
        return False
    if inputs.attn_mask is not None or inputs.dropout_p > 0:
        return False
    if inputs.is_causal and bool((table[:, 5] != 0).any()):
        return False  # SDPA's is_causal is top-left
    q_lens, k_lens = table[:, 2], table[:, 4]
    wasted = len(table) * int(q_lens.max()) * int(k_lens.max()) - int((q_lens * k_lens).sum())
    return 4 * inputs.q_heads * inputs.head_dim * wasted > len(table) * LOOP_FLOPS_PER_CALL


def _per_sequence(inputs: AttentionInputs) -> Tensor:
    """(B, Hq, L, Ev): SDPA on each sequence's rows (views), zeros on rows of no sequence."""
    query, key, value = inputs.query, inputs.key, inputs.value
    out = query.new_zeros((*query.shape[:3], inputs.value_dim))
    for slot, q0, q_len, k0, k_len, _ in inputs.sequences.table.tolist():
        if q_len == 0 or k_len == 0:
            continue
        out[slot, :, q0 : q0 + q_len] = F.scaled_dot_product_attention(
            query[slot : slot + 1, :, q0 : q0 + q_len],
            key[slot : slot + 1, :, k0 : k0 + k_len],
            value[slot : slot + 1, :, k0 : k0 + k_len],
            is_causal=inputs.is_causal,
            scale=inputs.scale,
            enable_gqa=inputs.enable_gqa,
        )[0]
    return out


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
    mask = materialised_mask(inputs, allowed, alibi)
    enable_gqa = query.shape[1] != key.shape[1]
    if inputs.variant.sinks is not None:
        key, value, mask = with_sink_column(inputs.variant.sinks, query, key, value, mask)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=inputs.scale, enable_gqa=enable_gqa
    )


def with_sink_column(
    sinks: Tensor, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(key, value, attn_mask) that give SDPA the sinks (Hq,), as a careful user of SDPA
    gives them: one more key and value of zeros, whose score (0) the float mask's last
    column raises to each query head's sink. The mask is (B, Hq, L, S + 1) in the query's
    dtype, the call's own in front (a bool one as 0 / -inf); differentiable in the sinks."""
    rows = query.shape[:3]
    zero_key, zero_value = (t.new_zeros((*t.shape[:2], 1, t.shape[3])) for t in (key, value))
    bias = torch.zeros((), dtype=query.dtype, device=query.device)
    if mask is not None:
        bias = mask if mask.is_floating_point() else torch.where(mask, bias, float("-inf"))
    column = sinks.to(query.dtype)[:, None, None].expand(*rows, 1)
    mask = torch.cat((bias.expand(*rows, key.shape[2]), column), -1)
    return torch.cat((key, zero_key), 2), torch.cat((value, zero_value), 2), mask


def sdpa_mask(inputs: AttentionInputs) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) that give SDPA this call: the call's own where it has no
    variant; a top-left causal band alone (is_causal, or window (None, 0)) as SDPA's
    is_causal, in its kernel; anything more materialised into one L x S mask, as a user of
    SDPA would build it."""
    variant = inputs.variant
    if variant.alibi_slopes is None and variant.block_mask is None and variant.sinks is None:
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
