"""The sdpa backend: torch's own scaled_dot_product_attention, the peer every figure names."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from attnperf.backend import Backend, Capabilities
from attnperf.inputs import SUPPORTED_DTYPES, AttentionInputs


class SdpaBackend(Backend):
    name = "sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention on 4-D views"
    capabilities = Capabilities(
        devices=("cpu", "cuda"),
        dtypes=SUPPORTED_DTYPES,
        max_head_dim=None,
        bool_mask=True,
        float_mask=True,
        causal=True,
        gqa=True,
        dropout=True,
        backward=True,
    )

    def run(self, inputs: AttentionInputs) -> Tensor:
        # Inputs are already 4-D: torch's CPU flash kernel serves only 4-D calls,
        # 3-D and 5-D ones would silently take its slow math path.
        return F.scaled_dot_product_attention(
            inputs.query,
            inputs.key,
            inputs.value,
            attn_mask=inputs.attn_mask,
            dropout_p=inputs.dropout_p,
            is_causal=inputs.is_causal,
            scale=inputs.scale,
            enable_gqa=inputs.enable_gqa,
        )


BACKEND = SdpaBackend()
