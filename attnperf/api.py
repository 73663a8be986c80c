"""The public entry points."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from attnperf import dispatch, ops
from attnperf.inputs import prepare


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
) -> Tensor:
    """Drop-in for torch's scaled_dot_product_attention, served by `backend`.

    query (N, ..., Hq, L, E), key (N, ..., H, S, E), value (N, ..., H, S, Ev) ->
    (N, ..., Hq, L, Ev). Same semantics as SDPA: a bool mask's True takes part, a float
    mask is added to the scores, is_causal is top-left aligned, scale defaults to
    1/sqrt(E), enable_gqa lets H divide Hq. Fully masked rows and empty key sequences
    give zeros. `backend` is "auto" or a name from `backends()`. Under torch.compile it is
    one custom op (`torch.ops.attnperf.attention`), traced without graph breaks.
    """
    if torch.compiler.is_compiling():
        return ops.attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend
        )
    autocast = _autocast_dtype(query)
    outside_autocast = contextlib.nullcontext()
    if autocast is not None:
        # As SDPA under autocast: q, k, v in autocast's dtype; the kernels then run as asked.
        query, key, value = (t.to(autocast) if t.is_floating_point() else t
                             for t in (query, key, value))  # fmt: skip
        outside_autocast = torch.autocast(query.device.type, enabled=False)
    with outside_autocast:
        inputs = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return dispatch.attend(inputs, backend)


def _autocast_dtype(query: object) -> torch.dtype | None:
    """The dtype autocast gives attention on query's device, or None outside autocast."""
    if not isinstance(query, Tensor) or query.device.type not in ("cpu", "cuda"):
        return None
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def choose_backend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "auto",
) -> str:
    """The name of the backend that `attention` would run for these arguments."""
    inputs = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return dispatch.select(inputs, backend).name


def backends() -> list[dict[str, object]]:
    """The capability table: one dict per backend (name, availability, devices, dtypes, ...)."""
    return [backend.describe() for backend in dispatch.registry().values()]
