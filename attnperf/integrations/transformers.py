"""Hugging Face transformers: run a model's attention through attnperf.

from attnperf.integrations.transformers import register
register()  # name "attnperf", backend "auto"
model.set_attn_implementation("attnperf")
# or AutoModelForCausalLM.from_config(config, attn_implementation="attnperf")

patch_linear_attention(model)  # its gated-delta-rule layers (Qwen3-Next, Qwen3.5, ...)
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys

import torch
from torch import Tensor

from attnperf import dispatch
from attnperf.api import attention, attention_with_kvcache, linear_attention
from attnperf.inputs import prepare
from attnperf.serving import padded_batch


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
    """transformers' attention-function contract, computed by attnperf.

    query (B, Hq, L, E), key/value (B, H, S, E) -> ((B, L, Hq, E), None). The mask is
    transformers' SDPA mask (bool, True takes part), or None where the layer's own pattern
    suffices: causal, or a sliding window (`sliding_window=W`: W keys, the query's own
    included, bottom-right aligned as in cached generation), both in-kernel. `softcap`
    (Gemma 2's attention logit softcapping) is applied in-kernel too.

    A mask that is exactly padding around each sequence's causal (or sliding) pattern is
    not applied as an L x S mask: the kernels are given each sequence's rows of real tokens
    (`padding_ranges`), as for packed sequences. Inference steps with a few queries against
    the cache go through attention_with_kvcache (split-K, the query heads of a group
    together).
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("attnperf's transformers attention does not support position_bias")
    sliding_window = kwargs.get("sliding_window")
    q_len = query.shape[2]
    causal_layer = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and causal_layer)
    if is_causal and key.shape[2] > q_len:  # a static cache's unused tail, as transformers does
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    # The mask, where there is one, holds the window too: no matter.
    window = None if sliding_window is None else (sliding_window - 1, 0)
    softcap = kwargs.get("softcap")
    ranges = None
    if causal_layer and dropout == 0.0:
        band = (None if window is None else window[0], 0)
        ranges = padding_ranges(attention_mask, query.shape[0], q_len, key.shape[2], band)
    gqa = query.shape[1] != key.shape[1]
    if ranges is not None:
        q_starts, q_lens, k_starts, k_lens = ranges
        unpadded = attention_mask is None  # a decode step's usual case: no tensor ops
        every_query = unpadded or bool((q_starts == 0).all() & (q_lens == q_len).all())
        every_key = unpadded or bool((k_starts == 0).all() & (k_lens == key.shape[2]).all())
        if every_query and q_len <= DECODE_QUERIES and not _wants_grad(query, key, value):
            device = query.device
            lengths, leftpad = key.shape[2], None
            if not every_key:
                lengths, leftpad = (k_starts + k_lens).int().to(device), k_starts.int().to(device)
            out = attention_with_kvcache(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), lengths,
                cache_leftpad=leftpad, scale=scaling, window=window, softcap=softcap,
                backend=backend,
            )  # fmt: skip
            return out.contiguous(), None
        if not (every_query and every_key):
            inputs = prepare(
                query, key, value, None, dropout, True, scaling, gqa, window=window,
                softcap=softcap, align="bottom_right",
            )  # fmt: skip
            out = dispatch.attend(padded_batch(inputs, *ranges), backend)
            return out.transpose(1, 2).contiguous(), None
        attention_mask, is_causal = None, True  # the mask is exactly the causal pattern
    out = attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=scaling, enable_gqa=gqa, backend=backend, window=window, softcap=softcap,
        align="bottom_right",
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


# Steps with at most this many queries per sequence (decoding, speculative decoding) read
# the cache through attention_with_kvcache.
DECODE_QUERIES = 8


def _wants_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def padding_ranges(
    mask: Tensor | None, batch: int, q_len: int, kv_len: int, band: tuple[int | None, int]
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(q_starts, q_lens, k_starts, k_lens), int64 CPU (B,), of each sequence's real tokens
    when `mask` (None, or bool (B, 1, L, S)) is exactly those ranges with the bottom-right
    `band` (left, right) inside them; else None. None is every row and key.

    transformers builds one mask per forward pass for all layers: the last answer is kept.
    """
    if mask is None:
        full = torch.ones(batch, dtype=torch.int64)
        return full * 0, full * q_len, full * 0, full * kv_len
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    key = (mask, mask._version, band)
    if _LAST_RANGES[0] is not None and _same_key(_LAST_RANGES[0], key):
        return _LAST_RANGES[1]
    pattern = mask[:, 0].expand(batch, q_len, kv_len)
    rows, keys = pattern.any(2), pattern.any(1)
    q_starts, q_lens = rows.int().argmax(1), rows.sum(1)
    k_starts, k_lens = keys.int().argmax(1), keys.sum(1)
    i = torch.arange(q_len, device=mask.device)[None, :, None] - q_starts[:, None, None]
    j = torch.arange(kv_len, device=mask.device)[None, None, :] - k_starts[:, None, None]
    q_n, k_n = q_lens[:, None, None], k_lens[:, None, None]
    expected = (i >= 0) & (i < q_n) & (j >= 0) & (j < k_n)
    distance = j - (i + k_n - q_n)  # right of row i's bottom-right diagonal
    left, right = band
    expected &= distance <= right
    if left is not None:
        expected &= distance >= -left
    result = None
    if torch.equal(expected, pattern):
        result = tuple(t.to("cpu", torch.int64) for t in (q_starts, q_lens, k_starts, k_lens))
    _LAST_RANGES[:] = [key, result]
    return result


_LAST_RANGES: list = [None, None]


def _same_key(old: tuple, new: tuple) -> bool:
    return old[0] is new[0] and old[1:] == new[1:]


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


# ---------------------------------------------------------------------- linear attention
# The functions through which transformers' linear-attention layers run their recurrence
# (its torch fallbacks of fla's kernels), per modeling module: Qwen3-Next, Qwen3.5 and
# OLMo-hybrid's gated delta rule, Kimi Linear's KDA (per key dim gates). Each has fla's
# arguments: (query, key, value, g, beta, ..., initial_state, output_final_state,
# use_qk_l2norm_in_kernel, cu_seqlens).
LINEAR_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
)
# The backend of the patched layer now running on this thread (None: transformers' own).
_LINEAR_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attnperf_linear_backend", default=None
)


def _serve_linear(original):
    """`original` (one of LINEAR_FUNCTIONS) unchanged, except inside a patched layer."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def serve(*args, **kwargs):
        backend = _LINEAR_BACKEND.get()
        if backend is None:
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs).arguments
        extra = call.get("kwargs", {})
        return linear_attention(
            call["query"], call["key"], call["value"], g=call["g"], beta=call["beta"],
            initial_state=call.get("initial_state"),
            output_final_state=bool(call.get("output_final_state", False)),
            cu_seqlens=call.get("cu_seqlens", extra.get("cu_seqlens")),
            use_qk_l2norm=bool(call.get("use_qk_l2norm_in_kernel", False)), backend=backend,
        )  # fmt: skip

    serve.attnperf_original = original
    return serve


def _run_with_backend(forward, backend: str, *args, **kwargs):
    token = _LINEAR_BACKEND.set(backend)
    try:
        return forward(*args, **kwargs)
    finally:
        _LINEAR_BACKEND.reset(token)


def patch_linear_attention(model: torch.nn.Module, backend: str = "auto") -> torch.nn.Module:
    """Run `model`'s linear-attention layers on attnperf's linear_attention; returns `model`.

    Every submodule whose modeling module defines one of LINEAR_FUNCTIONS (the gated delta
    rule of Qwen3-Next, Qwen3.5 and OLMo-hybrid; Kimi Linear's KDA) runs its recurrence on
    `backend`: prefill on the chunked kernel, cached decoding on the recurrent one, with
    transformers' own cache and padding handling around it. Other models in the process are
    untouched: the modeling module's functions are wrapped once, and serve attnperf only
    while a patched layer runs. Raises ValueError when the model has no such layer.
    """
    dispatch.check_name(backend)
    patched = 0
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        names = [n for n in LINEAR_FUNCTIONS if callable(getattr(module, n, None))]
        if not names or not _calls_any(type(layer).forward, names):
            continue
        for name in names:
            function = getattr(module, name)
            if not hasattr(function, "attnperf_original"):
                setattr(module, name, _serve_linear(function))
        original = layer.__dict__.get("attnperf_forward", layer.forward)
        layer.attnperf_forward = original
        layer.forward = functools.partial(_run_with_backend, original, backend)
        patched += 1
    if not patched:
        raise ValueError(f"{type(model).__name__} has no linear-attention layer that attnperf "
                         f"serves (it looks for {', '.join(LINEAR_FUNCTIONS)})")  # fmt: skip
    return model


def _calls_any(forward, names: list[str]) -> bool:
    """Whether `forward`'s code refers to one of `names` (the layer that runs them)."""
    return any(name in inspect.unwrap(forward).__code__.co_names for name in names)
