"""The sdpa backend: torch's own scaled_dot_product_attention, the peer every figure names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import FEATURES, Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs
from attnperf.kernels.reference import variant_masks


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention on 4-D views"
    # Window, alignment, ALiBi and block masks the way a user would today: materialised into
    # an L x S mask (the cost the fused kernels save). SDPA has no softcap and no LSE.
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        features=frozenset(FEATURES) - {"softcap", "lse"},
    )

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, None]:
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
