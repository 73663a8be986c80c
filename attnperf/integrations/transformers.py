"""Hugging Face transformers: run a model's attention through attnperf.

from attnperf.integrations.transformers import register
register()  # name "attnperf", backend "auto"
model.set_attn_implementation("attnperf")
# or AutoModelForCausalLM.from_config(config, attn_implementation="attnperf")
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attnperf.api import attention


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract, computed by `attnperf.attention`.

    query (B, Hq, L, E), key/value (B, H, S, E) -> ((B, L, Hq, E), None). The mask is
    transformers' SDPA mask (bool, True takes part), or None where plain causal suffices.
    """
    for unsupported in ("softcap", "sliding_window", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"attnperf's transformers attention does not support {unsupported}")
    q_len = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:  # a static cache's unused tail, as transformers does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1], backend=backend,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "attnperf", backend: str = "auto") -> str:
    """Register `name` with transformers' attention and mask interfaces; returns `name`.

    The mask function is transformers' SDPA one, so padding masks reach attnperf as bool masks.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
