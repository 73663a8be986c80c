"""Block-sparse attention layouts: which (query block, key block) pairs are empty, full or
partial, and the element masks of the partial ones only.

`block_mask(mask_fn, B, H, L, S)` follows FlexAttention's `mask_mod` convention: mask_fn(b,
h, q_idx, kv_idx) returns a bool tensor (True = attend) from index tensors that broadcast.
It is evaluated one row of query blocks at a time, so building a layout never needs an
L x S tensor; only partial blocks keep their element masks (O(L x block) for causal,
sliding-window, document and prefix-LM layouts). `alibi_slopes(n)`: ALiBi's position slopes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2
BLOCK_SIZES = (16, 32, 64, 128)

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A block-sparse layout for calls of shape (B, H, L, S) (B or H 1: the same for all).

    kinds (B, H, QB, KB) int8: EMPTY, PARTIAL or FULL per (query block, key block);
    partial_index (B, H, QB, KB) int32: the block's row in `partial`, -1 unless partial;
    partial (P, block_q, block_k) bool: the element masks of the partial blocks (elements
    past L or S are False).
    """

    shape: tuple[int, int, int, int]
    block_size: tuple[int, int]
    kinds: Tensor
    partial_index: Tensor
    partial: Tensor

    @property
    def num_blocks(self) -> tuple[int, int]:
        return tuple(self.kinds.shape[2:])

    def sparsity(self) -> float:
        """The share of blocks that are empty (skipped by the fused kernels)."""
        return float((self.kinds == EMPTY).float().mean()) if self.kinds.numel() else 0.0

    def allowed_pairs(self) -> int:
        """How many (query, key) pairs the layout lets take part, over its batch and heads."""
        (block_q, block_k), (q_blocks, k_blocks) = self.block_size, self.num_blocks
        rows = (self.shape[2] - torch.arange(q_blocks) * block_q).clamp(max=block_q)
        cols = (self.shape[3] - torch.arange(k_blocks) * block_k).clamp(max=block_k)
        full = (self.kinds.cpu() == FULL).long() * (rows[:, None] * cols[None, :])
        return int(full.sum()) + int(self.partial.sum())

    def to_dense(self) -> Tensor:
        """The element mask (B, H, L, S) bool: for the reference and as SDPA's attn_mask."""
        batch, heads, q_len, kv_len = self.shape
        block_q, block_k = self.block_size
        blocks = torch.zeros((batch, heads, *self.num_blocks, block_q, block_k), dtype=torch.bool)
        kinds = self.kinds.cpu()
        blocks[kinds == FULL] = True
        partial = kinds == PARTIAL
        blocks[partial] = self.partial.cpu()[self.partial_index.cpu()[partial].long()]
        dense = blocks.permute(0, 1, 2, 4, 3, 5).reshape(
            batch, heads, self.num_blocks[0] * block_q, self.num_blocks[1] * block_k
        )
        return dense[..., :q_len, :kv_len].to(self.kinds.device)

    def to(self, device: torch.device | str) -> BlockMask:
        """The same layout with its tensors on `device`."""
        return BlockMask(
            self.shape,
            self.block_size,
            self.kinds.to(device),
            self.partial_index.to(device),
            self.partial.to(device),
        )

    @classmethod
    def from_dense(cls, mask: Tensor, block_size: int | tuple[int, int] = 128) -> BlockMask:
        """The layout of a bool mask (L, S), (H, L, S) or (B, H, L, S) (True = attend)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or not 2 <= mask.dim() <= 4:
            raise TypeError("mask must be a bool tensor of shape (L, S), (H, L, S) or (B, H, L, S)")
        mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        batch, heads, q_len, kv_len = mask4.shape

        def rows(b, h, q_idx, kv_idx):
            return mask4[:, :, q_idx.reshape(-1)][..., kv_idx.reshape(-1)]

        return block_mask(rows, batch, heads, q_len, kv_len, block_size=block_size)


def _block_sizes(block_size: object) -> tuple[int, int]:
    sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    if len(sizes) != 2 or any(isinstance(s, bool) or s not in BLOCK_SIZES for s in sizes):
        raise ValueError(
            f"block_size must be one of {BLOCK_SIZES} or a (query, key) pair of them, "
            f"got {block_size!r}"
        )
    return sizes


def block_mask(
    mask_fn: MaskFn,
    B: int | None,
    H: int | None,
    L: int,
    S: int,
    *,
    block_size: int | tuple[int, int] = 128,
    device: torch.device | str = "cpu",
) -> BlockMask:
    """The block-sparse layout of `mask_fn` over (B, H, L, S); B or H None: the same for all.

    mask_fn(b (B,1,1,1), h (1,H,1,1), q_idx (1,1,Lb,1), kv_idx (1,1,1,S)) -> bool tensor
    broadcastable to (B, H, Lb, S), True where the query attends the key; it is called once
    per row of query blocks (Lb = block rows), never over all of L x S at once.
    """
    for name, value in (("L", L), ("S", S)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    for name, value in (("B", B), ("H", H)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{name} must be an int >= 1 or None (same for all), got {value!r}")
    block_q, block_k = _block_sizes(block_size)
    batch, heads = B or 1, H or 1
    q_blocks, k_blocks = -(-L // block_q), -(-S // block_k)
    kinds = torch.zeros((batch, heads, q_blocks, k_blocks), dtype=torch.int8)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv_idx = torch.arange(S, device=device).view(1, 1, 1, -1)
    padded_s = k_blocks * block_k
    partial_masks = []
    for qb in range(q_blocks):
        q_idx = torch.arange(qb * block_q, min((qb + 1) * block_q, L), device=device)
        rows = mask_fn(b, h, q_idx.view(1, 1, -1, 1), kv_idx)
        if not isinstance(rows, Tensor) or rows.dtype != torch.bool:
            raise TypeError(f"mask_fn must return a bool tensor, got {describe_type(rows)}")
        rows = rows.expand(batch, heads, q_idx.numel(), S).cpu()
        padded = torch.zeros((batch, heads, block_q, padded_s), dtype=torch.bool)
        padded[:, :, : q_idx.numel(), :S] = rows
        tiles = padded.view(batch, heads, block_q, k_blocks, block_k).permute(0, 1, 3, 2, 4)
        count = tiles.sum((-2, -1))
        inside = min(block_q, q_idx.numel()) * torch.tensor(
            [min(block_k, S - kb * block_k) for kb in range(k_blocks)]
        )
        kind = torch.where(count == 0, EMPTY, torch.where(count == inside, FULL, PARTIAL))
        kinds[:, :, qb] = kind.to(torch.int8)
        partial_masks.append(tiles[kind == PARTIAL])
    partial = torch.cat(partial_masks) if partial_masks else torch.zeros(0, block_q, block_k)
    # Row-major order of (b, h, qb, kb) is the order the partial tiles were gathered in.
    order = kinds.permute(2, 0, 1, 3) == PARTIAL
    index = torch.full(order.shape, -1, dtype=torch.int32)
    index[order] = torch.arange(int(order.sum()), dtype=torch.int32)
    partial_index = index.permute(1, 2, 0, 3).contiguous()
    return BlockMask(
        (batch, heads, L, S),
        (block_q, block_k),
        kinds.to(device),
        partial_index.to(device),
        partial.to(torch.bool).contiguous().to(device),
    )


def describe_type(value: object) -> str:
    """What an argument is, for error messages: "a torch.float32 tensor", "list", ..."""
    return f"a {value.dtype} tensor" if isinstance(value, Tensor) else type(value).__name__


# ---------------------------------------------------------------------- common layouts
def causal(align_offset: int = 0) -> MaskFn:
    """mask_fn of causal attention: key j for query i iff j <= i + align_offset."""
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + align_offset


def sliding_window(window: int, align_offset: int = 0) -> MaskFn:
    """mask_fn of a causal sliding window of `window` keys (the query's own included)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")

    def mask_fn(b, h, q_idx, kv_idx):
        diagonal = q_idx + align_offset
        return (kv_idx <= diagonal) & (kv_idx > diagonal - window)

    return mask_fn


def document(offsets: Tensor, is_causal: bool = False) -> MaskFn:
    """mask_fn of packed sequences: `offsets` (D + 1,) are cu_seqlens (0, ..., total); a
    token attends only within its own document (causally with `is_causal`); tokens past
    `total` belong to no document and attend nothing. Pure tensor ops, so FlexAttention's
    vmap can trace it too."""
    offsets = torch.as_tensor(offsets)
    if offsets.dim() != 1 or offsets.numel() < 2 or int(offsets[0]) != 0:
        raise ValueError("offsets must be 1-D cumulative lengths starting at 0")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("offsets must be non-decreasing")
    lengths = (offsets[1:] - offsets[:-1]).long()
    # One id per token, and -1 for "no document" past the end (at index total).
    doc = torch.cat([torch.repeat_interleave(torch.arange(len(lengths)), lengths),
                     torch.tensor([-1])])  # fmt: skip
    total = int(offsets[-1])

    def mask_fn(b, h, q_idx, kv_idx):
        ids = doc.to(q_idx.device)
        q_doc, kv_doc = ids[q_idx.clamp(max=total)], ids[kv_idx.clamp(max=total)]
        same = (q_doc == kv_doc) & (q_doc >= 0)
        return same & (kv_idx <= q_idx) if is_causal else same

    return mask_fn


def prefix_lm(prefix_length: int) -> MaskFn:
    """mask_fn of a prefix LM: every query sees the first `prefix_length` keys, and causally
    after them."""
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
        raise ValueError(f"prefix_length must be an int >= 0, got {prefix_length!r}")
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix_length)


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's standard head slopes (Press et al.; BLOOM's, MPT's): 2^(-8 i / n) for i =
    1..n when n is a power of 2, else those of the power of 2 below n and every other one
    of the power above."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")

    def power_of_2(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    below = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(below) + power_of_2(2 * below)[0::2][: num_heads - below]
