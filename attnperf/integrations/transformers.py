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
    transformers' SDPA mask (bool, True takes part), or None where the layer's own pattern
    suffices: causal, or a sliding window (`sliding_window=W`: W keys, the query's own
    included, bottom-right aligned as in cached generation), both in-kernel. `softcap`
    (Gemma 2's attention logit softcapping) is applied in-kernel too.
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("attnperf's transformers attention does not support position_bias")
    sliding_window = kwargs.get("sliding_window")
    q_len = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:  # a static cache's unused tail, as transformers does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    window = None
    if sliding_window is not None:  # the mask, where there is one, holds it too: no matter
        window = (sliding_window - 1, 0)
    out = attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1], backend=backend,
        window=window, softcap=kwargs.get("softcap"), align="bottom_right",
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def mask_function(*args, local_size: int | None = None, **kwargs) -> Tensor | None:
    """transformers' SDPA mask, left out (None) for sliding-window layers on the same terms
    as for causal ones (no padding; one query, or as many queries as keys): their window is
    applied in-kernel from the layer's `sliding_window`, so no L x S mask is built for it."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register(name: str = "attnperf", backend: str = "auto") -> str:
    """Register `name` with transformers' attention and mask interfaces; returns `name`.

    The mask function is transformers' SDPA one (`mask_function`), so padding masks reach
    attnperf as bool masks.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, mask_function)
    return name
