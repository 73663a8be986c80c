"""Modules built on `attnperf.attention`."""

from __future__ import annotations

import functools
import numbers

import torch
from torch import Tensor, nn

from attnperf.api import attention
from attnperf.dispatch import check_name
from attnperf.distributed import ring_attention
from attnperf.inputs import check_softcap, check_window
from attnperf.layouts import alibi_slopes


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention, the module the classic tutorials build.

    Step by step, for inputs x of shape (batch, seq, embed_dim):
    1. Three learned projections turn every token into a query, a key and a value, split into
       heads of size head_dim = embed_dim / num_heads (keys and values into num_kv_heads heads,
       each shared by num_heads / num_kv_heads query heads: grouped-query attention).
    2. Each query is compared with every key: the scores are their dot products, scaled by
       1/sqrt(head_dim). Masked pairs (padding, or the future when causal) are left out.
    3. A softmax over the keys turns each query's scores into weights that sum to one.
    4. Each output is the weighted sum of the values; the heads are concatenated and a last
       projection mixes them back to embed_dim.
    Steps 2 to 4 are one `attnperf.attention` call, served by `backend` per call; the
    parameters (and so the state_dict) are the same whatever the backend.

    Variants, in the kernels: `window=(left, right)` limits each query to the keys within
    left before and right after it (a sliding window of W keys: (W - 1, 0) with causal);
    `softcap=c` caps the scores at c (Gemma 2: 50); `alibi=True` adds ALiBi's linear biases
    with the standard slopes (`alibi_slopes(num_heads)`) in place of position embeddings;
    `sinks=True` adds a learnable logit per query head (`self.sinks`, (num_heads,) float32,
    zeros at first) to each softmax's denominator, as gpt-oss does.

    Context parallelism: with `context_parallel` (True for torch.distributed's default group,
    or a process group), x is this rank's shard of the sequence in `context_layout`
    (`attnperf.distributed.shard_sequence(x, 1)`) and steps 2 to 4 are exact ring attention
    across the group (no masks, dropout or ALiBi then).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        backend: str = "auto",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        sinks: bool = False,
        context_parallel: object = None,
        context_layout: str = "zigzag",
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (
            ("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)
        ):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        check_name(backend)
        for name, flag in (("alibi", alibi), ("sinks", sinks)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads)
        self.head_dim = int(embed_dim) // self.num_heads
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.window, self.softcap = check_window(window), check_softcap(softcap)
        # Not in the state_dict: the slopes follow from num_heads, they are not learned.
        slopes = torch.tensor(alibi_slopes(self.num_heads)) if alibi else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None
        if context_parallel not in (None, False) and (alibi or dropout):
            raise ValueError("context_parallel runs ring attention: no alibi or dropout with it")
        self.context_parallel, self.context_layout = context_parallel, context_layout
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x (batch, seq, embed_dim) -> (batch, seq, embed_dim).

        attn_mask: an SDPA mask broadcastable to (batch, num_heads, seq, seq), bool (True
        takes part) or float (added to the scores); a 2-D one is (seq, seq).
        key_padding_mask: (batch, seq), as in torch.nn.MultiheadAttention: bool True marks a
        padding key (left out), or float (added to the scores of that key).
        Both combine with each other and with `causal`.
        """
        if not isinstance(x, Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a (batch, seq, embed_dim) tensor, got {shape}")
        batch, seq, _ = x.shape

        def heads(projected: Tensor, count: int) -> Tensor:
            return projected.view(batch, seq, count, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        if self.context_parallel not in (None, False):
            return self.out_proj(self._ring(q, k, v, attn_mask, key_padding_mask).reshape(
                batch, seq, -1))  # fmt: skip
        mask = self._mask(attn_mask, key_padding_mask, batch, seq, q.dtype, x.device)
        # With a mask or a window, causality is the band's right side 0 (in-kernel; SDPA's
        # is_causal takes no mask); alone, SDPA's is_causal (torch.compile traces it).
        window, is_causal = self.window, self.causal
        if is_causal and (mask is not None or window is not None):
            window, is_causal = (window[0] if window else None, 0), False
        out = attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
            backend=self.backend, window=window, softcap=self.softcap,
            alibi_slopes=self.alibi_slopes, sinks=self.sinks,
        )  # fmt: skip
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _ring(self, q, k, v, attn_mask, key_padding_mask) -> Tensor:
        """Ring attention of this rank's shard: (batch, seq_local, heads, head_dim)."""
        if attn_mask is not None or key_padding_mask is not None:
            raise ValueError("context_parallel runs ring attention: no attn_mask or padding")
        group = None if self.context_parallel is True else self.context_parallel
        out = ring_attention(
            q, k, v, group=group, is_causal=self.causal, window=self.window,
            softcap=self.softcap, layout=self.context_layout, backend=self.backend,
            sinks=self.sinks,
        )  # fmt: skip
        return out.transpose(1, 2)

    def _mask(self, attn_mask, key_padding_mask, batch, seq, dtype, device):
        """attn_mask and key_padding_mask as one SDPA mask, or None."""
        for name, mask in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
            if mask is not None and not isinstance(mask, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
        masks = []  # bool: True takes part; float: added to the scores
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 4):
                raise ValueError(
                    "attn_mask must be (seq, seq) or 4-D broadcastable to (batch, heads, seq, "
                    f"seq), got shape {tuple(attn_mask.shape)}"
                )
            masks.append(attn_mask)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (batch, seq):
                raise ValueError(
                    f"key_padding_mask must be (batch, seq) = {(batch, seq)}, "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            padding = key_padding_mask[:, None, None, :]
            masks.append(~padding if padding.dtype == torch.bool else padding)
        if not masks:
            return None
        if all(mask.dtype == torch.bool for mask in masks):
            return functools.reduce(torch.logical_and, masks)
        bias = [
            torch.zeros((), dtype=dtype, device=device).masked_fill(~m, float("-inf"))
            if m.dtype == torch.bool
            else m.to(dtype)
            for m in masks
        ]
        return functools.reduce(torch.add, bias)
