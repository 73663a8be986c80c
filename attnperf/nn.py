"""Modules built on `attnperf.attention`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnperf.api import attention


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
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """x (batch, seq, embed_dim) -> (batch, seq, embed_dim).

        attn_mask: a padding mask (batch, seq), True (or 1) for real tokens, or an SDPA mask
        broadcastable to (batch, num_heads, seq, seq): bool (True takes part) or float (added).
        """
        batch, seq, _ = x.shape

        def heads(projected: Tensor, count: int) -> Tensor:
            return projected.view(batch, seq, count, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        mask, is_causal = self._mask(attn_mask, batch, seq, x.device)
        out = attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
            backend=self.backend,
        )  # fmt: skip
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _mask(self, attn_mask, batch, seq, device) -> tuple[Tensor | None, bool]:
        """(SDPA mask or None, is_causal): SDPA takes either a mask or is_causal, not both."""
        if attn_mask is None:
            return None, self.causal
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (batch, seq):
                raise ValueError(
                    f"a 2-D attn_mask is a padding mask of shape (batch, seq) = {(batch, seq)}, "
                    f"got {tuple(attn_mask.shape)}"
                )
            attn_mask = attn_mask.bool()[:, None, None, :]  # keys of padding are left out
        elif attn_mask.dim() != 4:
            raise ValueError(
                "attn_mask must be (batch, seq) padding or 4-D broadcastable to "
                f"(batch, heads, seq, seq), got shape {tuple(attn_mask.shape)}"
            )
        if self.causal:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
            if attn_mask.dtype == torch.bool:
                attn_mask = attn_mask & causal
            else:
                attn_mask = attn_mask.masked_fill(~causal, float("-inf"))
        return attn_mask, False
