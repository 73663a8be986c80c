"""Validation of the serving calls: packed variable-length batches (`attention_varlen`) and
KV-cache attention (`attention_with_kvcache`), in FlashAttention's layouts.

Both describe their ragged sequences with one `Sequences` table that the kernels walk, so
that no tile crosses a sequence boundary and no padding is computed.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from attnperf.inputs import (
    ALIGNMENTS,
    DTYPE_NAMES,
    SUPPORTED_DTYPES,
    AttentionInputs,
    QueryShaped,
    Sequences,
    Variant,
    band,
    check_alibi_slopes,
    check_flag,
    check_scale,
    check_sinks,
    check_softcap,
    check_window,
    variant_features,
)
from attnperf.layouts import describe_type

DTYPE_WORDS = {**DTYPE_NAMES, torch.int8: "int8"}


def _check_tensors(names_and_tensors, dims: int, layout: str, dtypes=SUPPORTED_DTYPES) -> None:
    """Each a dense tensor of `dims` dims, of one of `dtypes` (one dtype for all), on one
    device."""
    first_name, first = names_and_tensors[0]
    for name, tensor in names_and_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != dims:
            raise ValueError(f"{name} must be {layout} ({dims} dims), got shape "
                             f"{tuple(tensor.shape)}")  # fmt: skip
        if tensor.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(DTYPE_WORDS[d] for d in dtypes)}, got "
                            f"{tensor.dtype}")  # fmt: skip
        if tensor.dtype != first.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} must match {first_name}'s {first.dtype}")
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


def _is_int8(tensor: object) -> bool:
    return isinstance(tensor, Tensor) and tensor.dtype == torch.int8


def _check_scale(name: str, scale: object, cache: Tensor, cache_name: str) -> Tensor | None:
    """An int8 cache's scales: float32 (rows..., H, E // G) beside its (rows..., H, E), G
    dividing E; None for a float cache, which takes none."""
    if not _is_int8(cache):
        if scale is not None:
            raise ValueError(f"{name} is given but {cache_name} is {cache.dtype}: scales go "
                             "with int8 caches only")  # fmt: skip
        return None
    if scale is None:
        raise ValueError(f"{cache_name} is int8: pass its {name} (attnperf.quantize_kv's "
                         "scales)")  # fmt: skip
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got {describe_type(scale)}")
    head_dim = cache.shape[3]
    groups = scale.shape[3] if scale.dim() == 4 else 0
    if (
        scale.dim() != 4
        or tuple(scale.shape[:3]) != tuple(cache.shape[:3])
        or (groups == 0 or head_dim % groups)
    ):
        raise ValueError(f"{name} must be {(*cache.shape[:3], 'E // G')} for {cache_name} of "
                         f"shape {tuple(cache.shape)} (a group size G dividing E = {head_dim}), "
                         f"got {tuple(scale.shape)}")  # fmt: skip
    if scale.device != cache.device:
        raise ValueError(f"{name} is on {scale.device} but {cache_name} is on {cache.device}")
    return scale


def quantize_kv(x: Tensor, *, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8 codes of x (..., E), any float dtype: per group of G = group_size (E
    when None; G must divide E) consecutive values along the last dim, scale = max|x| / 127
    in float32 and codes = round-half-to-even(x / scale) clamped to [-127, 127]; a group of
    zeros gets scale 0 and codes 0. Returns (codes (..., E) int8, scale (..., E // G)
    float32): the group's values are codes * scale."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {describe_type(x)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (..., E)")
    head_dim = x.shape[-1]
    if group_size is None:
        group_size = head_dim
    if isinstance(group_size, (bool, np.bool_)) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
    if group_size <= 0 or head_dim % group_size:
        raise ValueError(f"group_size ({group_size}) must divide the last dim E = {head_dim}")
    groups = x.detach().float().unflatten(-1, (head_dim // group_size, group_size))
    scale = groups.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, 1.0)[..., None]
    codes = torch.round(groups / safe).clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2), scale


def dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (..., E) int8 times their group's scale (..., E // G), in `dtype`."""
    group = codes.shape[-1] // scale.shape[-1]
    values = codes.float().unflatten(-1, (scale.shape[-1], group)) * scale[..., None]
    return values.flatten(-2).to(dtype)


def _check_heads(q_heads: int, kv_heads: int, what: str) -> None:
    if kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"{what} heads ({kv_heads}) must divide the query heads ({q_heads})")


def check_cu_seqlens(name: str, cu_seqlens: object, total: int) -> tuple[Tensor, Tensor]:
    """(starts, lengths) int64 on the CPU of FlashAttention's cumulative lengths."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 (or int64) tensor, got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")  # fmt: skip
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must be 1-D (B + 1,), got shape {tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.detach().to("cpu", torch.int64)
    if int(offsets[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    lengths = offsets[1:] - offsets[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must be non-decreasing, got {offsets.tolist()}")
    if int(offsets[-1]) != total:
        raise ValueError(f"{name}'s last entry {int(offsets[-1])} must be the number of packed "
                         f"rows, {total}")  # fmt: skip
    return offsets[:-1], lengths


def _max_seqlen(name: str, value: object, lengths: Tensor) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    longest = int(lengths.max()) if len(lengths) else 0
    if value < longest:
        b = int(lengths.argmax())
        raise ValueError(f"{name} ({value}) is smaller than sequence {b}'s length {longest}")


def prepare_varlen(
    q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object,
    max_seqlen_q: object, max_seqlen_k: object, *, is_causal: object = False,
    scale: object = None, window: object = None, softcap: object = None,
    alibi_slopes: object = None, align: object = "bottom_right", return_lse: object = False,
    sinks: object = None,
) -> AttentionInputs:  # fmt: skip
    """Check an attention_varlen call and describe it as AttentionInputs: query
    (1, Hq, total_q, E), key/value (1, H, total_k, E) views of the packed tensors, the
    sequences in variant.sequences. Raises TypeError or ValueError naming the argument."""
    _check_tensors((("q", q), ("k", k), ("v", v)), 3, "(total, heads, head dim)")
    total_q, q_heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    if k.shape[2] != head_dim:
        raise ValueError(f"k's head dim {k.shape[2]} must match q's {head_dim}")
    if tuple(v.shape[:2]) != (total_k, kv_heads):
        raise ValueError(f"v's (total_k, H) {tuple(v.shape[:2])} must match k's "
                         f"{(total_k, kv_heads)}")  # fmt: skip
    _check_heads(q_heads, kv_heads, "k/v")
    q_starts, q_lens = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    k_starts, k_lens = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if len(q_lens) != len(k_lens):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got "
                         f"{len(q_lens)} and {len(k_lens)}")  # fmt: skip
    _max_seqlen("max_seqlen_q", max_seqlen_q, q_lens)
    _max_seqlen("max_seqlen_k", max_seqlen_k, k_lens)
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    count = len(q_lens)
    variant = Variant(
        window=check_window(window),
        align=align,
        softcap=check_softcap(softcap),
        alibi_slopes=check_alibi_slopes(alibi_slopes, q, (count,), q_heads, count),
        return_lse=check_flag("return_lse", return_lse),
        sequences=Sequences.build(q_starts, q_lens, k_starts, k_lens, align, packed=True),
        sinks=check_sinks(sinks, q.device, q_heads),
    )
    return AttentionInputs(
        query=q.transpose(0, 1).unsqueeze(0),
        key=k.transpose(0, 1).unsqueeze(0),
        value=v.transpose(0, 1).unsqueeze(0),
        attn_mask=None,
        dropout_p=0.0,
        is_causal=check_flag("is_causal", is_causal),
        scale=check_scale(scale, head_dim),
        enable_gqa=q_heads != kv_heads,
        out_shape=(total_q, q_heads, v.shape[2]),
        variant=variant,
    )


def padded_batch(
    inputs: AttentionInputs, q_starts: Tensor, q_lens: Tensor, k_starts: Tensor, k_lens: Tensor
) -> AttentionInputs:
    """A plain call restricted to the real tokens of a padded batch: entry b's queries are
    rows q_starts[b] .. + q_lens[b], its keys rows k_starts[b] .. + k_lens[b] (int64 CPU
    tensors (B,)), aligned within those ranges; the padding's output rows are 0. No kernel
    then computes a padded row or key."""
    q_ends, k_ends = q_starts + q_lens, k_starts + k_lens
    inside = [q_starts >= 0, k_starts >= 0, q_lens >= 0, k_lens >= 0, q_ends <= inputs.q_len,
              k_ends <= inputs.kv_len]  # fmt: skip
    if not all(bool(condition.all()) for condition in inside):
        raise ValueError(f"row ranges out of the call's (L, S) = {(inputs.q_len, inputs.kv_len)}")
    if inputs.attn_mask is not None or inputs.variant.block_mask is not None:
        raise ValueError("a padded batch's row ranges replace attn_mask and block_mask")
    align = inputs.variant.align
    sequences = Sequences.build(q_starts, q_lens, k_starts, k_lens, align, packed=False)
    return replace(inputs, variant=replace(inputs.variant, sequences=sequences))


@dataclass(frozen=True)
class KVCacheInputs(QueryShaped):
    """A validated attention_with_kvcache call.

    query (B, Hq, Lq, E), a view of the caller's (B, Lq, Hq, E). The cache as pages:
    k_pages (P, page_size, H, E), v_pages (P, page_size, H, Ev), the caller's tensors (a
    contiguous cache (B, S_max, H, E) is B pages of S_max rows); block_table (B, pages per
    sequence) int64: sequence b's cache row j is row j % page_size of page block_table[b,
    j // page_size]. cache_seqlens (B,) int64 on the CPU: rows filled before the append of
    k_new, v_new (B, Lnew, H, E) (or None). variant.sequences: each sequence's keys after
    the append (rows k_start .. k_start + k_len, k_start its left padding), bottom-right
    aligned. num_splits: 0 lets the backend choose. An int8 cache holds codes, with
    k_scale, v_scale float32 (P, page_size, H, E // G) beside its pages (None for a float
    cache): a cached row is codes * scale per group of G values.
    """

    query: Tensor
    k_pages: Tensor
    v_pages: Tensor
    k_scale: Tensor | None
    v_scale: Tensor | None
    block_table: Tensor
    cache_seqlens: Tensor
    k_new: Tensor | None
    v_new: Tensor | None
    is_causal: bool
    scale: float
    num_splits: int
    variant: Variant

    attn_mask = None
    mask_kind = None
    dropout_p = 0.0

    @property
    def kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def value_dim(self) -> int:
        return self.v_pages.shape[3]

    @property
    def sequences(self) -> Sequences:
        return self.variant.sequences

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def band(self) -> tuple[int | None, int | None] | None:
        return band(self.is_causal, self.variant.window)

    @property
    def contiguous(self) -> bool:
        """Whether the cache is a contiguous (B, S_max, H, E) one: page b is sequence b's."""
        return self.block_table.shape[1] == 1 and self.k_pages.shape[0] == self.batch

    @property
    def quantized(self) -> bool:
        """Whether the cache holds int8 codes (with k_scale, v_scale)."""
        return self.k_scale is not None

    @property
    def kv_keys(self) -> int:
        """Keys the call's sequences read, summed over them."""
        return sum(self.sequences.table.numpy()[:, 4].tolist())  # a list: see Sequences

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the call's sequences read (`key_bytes` a key)."""
        return self.kv_keys * self.key_bytes

    @property
    def key_bytes(self) -> int:
        """Bytes of K and V a key takes in the cache, every kv head: int8 codes and their
        float32 scales, else the elements of its dtype."""
        if self.quantized:
            per_key = self.head_dim + self.value_dim + 4 * (self.k_scale.shape[3]
                                                            + self.v_scale.shape[3])  # fmt: skip
            return self.kv_heads * per_key
        return self.kv_heads * (self.head_dim + self.value_dim) * self.k_pages.element_size()

    @property
    def sees_whole_cache(self) -> bool:
        """Whether every query row attends to all of its sequence's keys, unbiased: one
        token (bottom-right causal sees the whole cache) or no causality; no window, ALiBi
        or sinks. SDPA then serves the step exactly with no mask (the group's query heads
        packed as rows)."""
        variant = self.variant
        plain = variant.window is None and variant.alibi_slopes is None and variant.sinks is None
        return plain and (self.q_len == 1 or not self.is_causal)

    @property
    def needs_grad(self) -> bool:
        tensors = (self.query, self.k_pages, self.v_pages, self.k_new, self.v_new,
                   self.variant.sinks)  # fmt: skip
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def features(self) -> set[str]:
        variant = self.variant
        shifted = any(variant.sequences.table.numpy()[:, 5].tolist())
        wanted = {
            "kvcache": True,
            "causal": self.is_causal,
            "bottom_right": shifted and (self.band is not None or variant.alibi_slopes is not None),
            "gqa": self.q_heads != self.kv_heads,
            "kvcache_backward": self.needs_grad,
            "kvcache_int8": self.quantized,
        }
        return {name for name, needed in wanted.items() if needed} | variant_features(variant)

    def restore(self, out: Tensor, lse: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """(B, Hq, Lq, Ev) -> the caller's (B, Lq, Hq, Ev); the LSE stays (B, Hq, Lq)."""
        out = out.transpose(1, 2)
        return (out, lse) if self.variant.return_lse else out


@dataclass(frozen=True)
class KVCacheCall:
    """What an attention_with_kvcache call's checks of its metadata found (shapes, dtypes,
    devices, the scalar arguments), before any tensor's values: the sizes the values are
    checked against (B, Lq, Hq, the cache's pages), a contiguous cache's own block table
    (None for a paged cache: the caller's, per call), the new keys' length and the checked
    scalars. `bind_kvcache` adds a call's values; attnperf.plans keeps these
    for calls whose metadata recurs (a growing cache's length aside)."""

    batch: int
    q_len: int
    q_heads: int
    pages: int
    table: Tensor | None
    new_len: int
    is_causal: bool
    scale: float
    num_splits: int
    window: tuple[int | None, int | None] | None
    softcap: float | None
    return_lse: bool


def prepare_kvcache(
    q: object, k_cache: object, v_cache: object, cache_seqlens: object, k_new: object = None,
    v_new: object = None, *, block_table: object = None, cache_leftpad: object = None,
    is_causal: object = True,
    scale: object = None, window: object = None, softcap: object = None,
    alibi_slopes: object = None, num_splits: object = 0, return_lse: object = False,
    sinks: object = None, k_scale: object = None, v_scale: object = None,
) -> KVCacheInputs:  # fmt: skip
    """Check an attention_with_kvcache call, writing nothing. Raises TypeError or ValueError
    naming the argument."""
    call = check_kvcache_call(
        q, k_cache, v_cache, k_new, v_new, block_table=block_table, is_causal=is_causal,
        scale=scale, window=window, softcap=softcap, num_splits=num_splits,
        return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return bind_kvcache(
        call, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=block_table,
        cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip


def check_kvcache_call(
    q: object, k_cache: object, v_cache: object, k_new: object = None, v_new: object = None,
    *, block_table: object = None, is_causal: object = True, scale: object = None,
    window: object = None, softcap: object = None, num_splits: object = 0,
    return_lse: object = False, k_scale: object = None, v_scale: object = None,
) -> KVCacheCall:  # fmt: skip
    """The checks of `prepare_kvcache` that read no tensor's values."""
    quantized = _is_int8(k_cache) or _is_int8(v_cache)
    if quantized:  # int8 codes: the caches are checked against each other, q alone
        _check_tensors((("q", q),), 4, "(B, L, heads, head dim)")
        _check_tensors((("k_cache", k_cache), ("v_cache", v_cache)), 4,
                       "(pages or B, rows, heads, head dim)", dtypes=(torch.int8,))  # fmt: skip
        if k_cache.device != q.device:
            raise ValueError(f"k_cache is on {k_cache.device} but q is on {q.device}")
    else:
        _check_tensors((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), 4,
                       "(B, L, heads, head dim)")  # fmt: skip
    _check_scale("k_scale", k_scale, k_cache, "k_cache")
    _check_scale("v_scale", v_scale, v_cache, "v_cache")
    batch, q_len, q_heads, head_dim = q.shape
    pages, page_size, kv_heads, _ = k_cache.shape
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache's head dim {k_cache.shape[3]} must match q's {head_dim}")
    _check_same_rows(k_cache, v_cache)
    _check_heads(q_heads, kv_heads, "k_cache/v_cache")
    table = _block_table(block_table, batch, pages, page_size, q.device)
    new_len = _new_keys(k_new, v_new, k_cache, v_cache, batch, q)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 0, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: chosen per call), got {num_splits}")
    return KVCacheCall(
        batch=batch,
        q_len=q_len,
        q_heads=q_heads,
        pages=pages,
        table=table if block_table is None else None,
        new_len=new_len,
        is_causal=check_flag("is_causal", is_causal),
        scale=check_scale(scale, head_dim),
        num_splits=int(num_splits),
        window=check_window(window),
        softcap=check_softcap(softcap),
        return_lse=check_flag("return_lse", return_lse),
    )


def bind_kvcache(
    call: KVCacheCall, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: object,
    k_new: Tensor | None = None, v_new: Tensor | None = None, *,
    block_table: Tensor | None = None, cache_leftpad: object = None,
    alibi_slopes: object = None, sinks: object = None, k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> KVCacheInputs:  # fmt: skip
    """The inputs of a call whose metadata `call` checked: its lengths checked against the
    cache's rows (a growing cache's own, or its pages), its variant's tensors."""
    _check_same_rows(k_cache, v_cache)  # a plan kept for another length has not seen these
    batch, page_size = call.batch, k_cache.shape[1]
    table = call.table if call.table is not None else block_table.long()
    capacity = table.shape[1] * page_size
    # The lengths in numpy: see Sequences.
    seqlens = _cache_seqlens("cache_seqlens", cache_seqlens, batch)
    leftpad = 0  # not numpy's arrays of zeros (here and below): each costs a decoding step
    if cache_leftpad is not None:
        leftpad = _cache_seqlens("cache_leftpad", cache_leftpad, batch)
        if bool((leftpad > seqlens).any()):
            raise ValueError(f"cache_leftpad {leftpad.tolist()} must not exceed cache_seqlens "
                             f"{seqlens.tolist()}")  # fmt: skip
    new_len = call.new_len
    lengths = seqlens + new_len
    if len(lengths) and int(lengths.max()) > capacity:
        b = int(lengths.argmax())
        where = (f"{table.shape[1]} pages of {page_size} in block_table" if block_table is not None
                 else f"S_max = {capacity}")  # fmt: skip
        raise ValueError(_past_capacity(b, int(seqlens[b]), new_len, where))
    if block_table is not None:
        _check_pages(table, lengths, page_size, call.pages)
    variant = Variant(
        window=call.window,
        align="bottom_right",
        softcap=call.softcap,
        alibi_slopes=check_alibi_slopes(alibi_slopes, q, (batch,), call.q_heads, batch),
        return_lse=call.return_lse,
        sequences=Sequences.build(
            0, call.q_len, leftpad, lengths - leftpad, "bottom_right", packed=False
        ),
        sinks=check_sinks(sinks, q.device, call.q_heads),
    )
    return KVCacheInputs(
        query=q.transpose(1, 2),
        k_pages=k_cache,
        v_pages=v_cache,
        k_scale=k_scale,
        v_scale=v_scale,
        block_table=table,
        cache_seqlens=torch.from_numpy(seqlens),
        k_new=k_new,
        v_new=v_new,
        is_causal=call.is_causal,
        scale=call.scale,
        num_splits=call.num_splits,
        variant=variant,
    )


def check_step(k_cache: Tensor, v_cache: Tensor, cache_seqlens: int) -> None:
    """bind_kvcache's checks of a planned step's values (`Backend.kvcache_step`: a
    contiguous cache, no new keys, one int length), with its messages."""
    k_shape = k_cache.shape
    if v_cache.shape[:3] != k_shape[:3]:
        _check_same_rows(k_cache, v_cache)
    _check_length("cache_seqlens", cache_seqlens)
    if cache_seqlens > k_shape[1]:
        raise ValueError(_past_capacity(0, cache_seqlens, 0, f"S_max = {k_shape[1]}"))


def _past_capacity(b: int, seqlen: int, new_len: int, where: str) -> str:
    return (f"cache_seqlens[{b}] + k_new's length = {seqlen} + {new_len} keys exceed the "
            f"cache's capacity ({where})")  # fmt: skip


def _check_length(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_same_rows(k_cache: Tensor, v_cache: Tensor) -> None:
    if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"v_cache's first 3 dims {tuple(v_cache.shape[:3])} must match "
                         f"k_cache's {tuple(k_cache.shape[:3])}")  # fmt: skip


def _block_table(table: object, batch: int, pages: int, page_size: int, device) -> Tensor:
    """The block table as int64 on the cache's device; a contiguous cache's own (b -> page b)."""
    if table is None:
        if pages != batch:
            raise ValueError(f"k_cache has {pages} sequences (dim 0) but q has {batch}; pass "
                             "block_table for a paged cache")  # fmt: skip
        return torch.arange(batch, device=device).unsqueeze(1)
    if not isinstance(table, Tensor) or table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table must be an int32 tensor, got "
                        f"{getattr(table, 'dtype', type(table).__name__)}")  # fmt: skip
    if table.dim() != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must be (B, max_pages) with B = {batch}, got shape "
                         f"{tuple(table.shape)}")  # fmt: skip
    if table.device != device:
        raise ValueError(f"block_table is on {table.device} but q is on {device}")
    if page_size % 16:
        raise ValueError(f"a paged cache's page size (k_cache dim 1) must be a multiple of 16, "
                         f"got {page_size}")  # fmt: skip
    return table.long()


def _check_pages(table: Tensor, lengths: np.ndarray, page_size: int, pages: int) -> None:
    """Every page a sequence uses names a page of the cache."""
    used = torch.arange(table.shape[1]) * page_size < torch.from_numpy(lengths)[:, None]
    entries = table.cpu()
    bad = used & ((entries < 0) | (entries >= pages))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {i}] = {int(entries[b, i])} is not a page of the "
                         f"cache (0 .. {pages - 1})")  # fmt: skip


def _cache_seqlens(name: str, value: object, batch: int) -> np.ndarray:
    """cache_seqlens (or cache_leftpad) as a (B,) int64 numpy array."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        _check_length(name, value)
        return np.full(batch, int(value), np.int64)
    if not isinstance(value, Tensor) or value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int or an int32 tensor, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")  # fmt: skip
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must be an int or of shape (B,) = ({batch},), got "
                         f"{tuple(value.shape)}")  # fmt: skip
    # A CPU tensor's own values, converted (a copy: the caller may change its tensor).
    lengths = (value if value.device.type == "cpu" else value.cpu()).numpy().astype(np.int64)
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths


def _new_keys(
    k_new: object, v_new: object, k_cache: Tensor, v_cache: Tensor, batch: int, q: Tensor
) -> int:
    """The number of new keys per sequence (0 without): of the cache's dtype, or of q's for
    an int8 cache (quantized as they are written)."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is None:
        return 0
    like = ("q", q) if _is_int8(k_cache) else ("k_cache", k_cache)
    _check_tensors((like, ("k_new", k_new), ("v_new", v_new)), 4,
                   "(B, Lnew, H, head dim)")  # fmt: skip
    for name, new, cache in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
        expected = (batch, k_new.shape[1], *cache.shape[2:])
        if tuple(new.shape) != expected:
            raise ValueError(f"{name} must have shape (B, Lnew, H, dim) = {expected}, got "
                             f"{tuple(new.shape)}")  # fmt: skip
    return k_new.shape[1]


def append_to_cache(inputs: KVCacheInputs) -> None:
    """Write k_new, v_new into the caller's cache at cache_seqlens, in place; into an int8
    cache as quantize_kv's codes and scales, at the cache's group size."""
    if inputs.k_new is None or inputs.k_new.shape[1] == 0:
        return
    positions = inputs.cache_seqlens[:, None] + torch.arange(inputs.k_new.shape[1])
    positions = positions.to(inputs.device)
    pages = inputs.block_table.gather(1, positions // inputs.page_size)
    rows = positions % inputs.page_size
    with torch.no_grad():
        if not inputs.quantized:
            inputs.k_pages[pages, rows] = inputs.k_new
            inputs.v_pages[pages, rows] = inputs.v_new
            return
        for new, codes, scale in ((inputs.k_new, inputs.k_pages, inputs.k_scale),
                                  (inputs.v_new, inputs.v_pages, inputs.v_scale)):  # fmt: skip
            group = codes.shape[3] // scale.shape[3]
            codes[pages, rows], scale[pages, rows] = quantize_kv(new, group_size=group)


def cached_keys(inputs: KVCacheInputs, b: int) -> tuple[Tensor, Tensor]:
    """Sequence b's keys and values gathered from the pages: (H, S_b, E), (H, S_b, Ev);
    an int8 cache's dequantized, in q's dtype."""
    start, length = inputs.variant.sequences.table[b, 3:5].tolist()
    positions = torch.arange(start, start + length, device=inputs.device)
    pages = inputs.block_table[b, positions // inputs.page_size]
    rows = positions % inputs.page_size
    keys, values = inputs.k_pages[pages, rows], inputs.v_pages[pages, rows]
    if inputs.quantized:
        keys = dequantize_kv(keys, inputs.k_scale[pages, rows], inputs.dtype)
        values = dequantize_kv(values, inputs.v_scale[pages, rows], inputs.dtype)
    return keys.transpose(0, 1), values.transpose(0, 1)
