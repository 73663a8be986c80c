"""The public entry points."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from attnperf import dispatch, ops, plans
from attnperf.inputs import check_sinks, func_grad_active, prepare
from attnperf.layouts import BlockMask
from attnperf.linear_inputs import prepare_linear
from attnperf.serving import (
    append_to_cache,
    bind_kvcache,
    check_kvcache_call,
    check_step,
    prepare_varlen,
)


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
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    block_mask: BlockMask | None = None,
    align: str = "top_left",
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Drop-in for torch's scaled_dot_product_attention, served by `backend`, with
    FlashAttention's variants.

    query (N, ..., Hq, L, E), key (N, ..., H, S, E), value (N, ..., H, S, Ev) ->
    (N, ..., Hq, L, Ev). Same semantics as SDPA: a bool mask's True takes part, a float
    mask is added to the scores, scale defaults to 1/sqrt(E), enable_gqa lets H divide Hq.
    attn_mask may also be torch's causal_upper_left / causal_lower_right objects.

    Variants (keyword-only), with o = 0 for align="top_left" (SDPA's) and o = S - L for
    "bottom_right" (FlashAttention's, every KV-cache step's):
    - is_causal: query i sees key j iff j <= i + o.
    - window=(left, right): query i sees key j iff i + o - left <= j <= i + o + right
      (inclusive; None: unbounded side); (W - 1, 0) is a sliding window of W keys. With
      is_causal the right side is 0 whatever is given.
    - softcap=c > 0: each score s = scale * q.k becomes c * tanh(s / c), before masks and
      ALiBi; gradients go through the tanh.
    - alibi_slopes: float32 (Hq,) or (*batch, Hq); adds -slope * |i + o - j| after the
      softcap (no gradient for the slopes).
    - block_mask: an attnperf.BlockMask layout, intersected with everything above.
    - return_lse: return (out, lse), lse (N, ..., Hq, L) float32, the natural-log
      log-sum-exp of each row's final scores, -inf for a row that sees no key;
      differentiable.
    - sinks: a float (Hq,) tensor, one logit per query head (gpt-oss's, FlashAttention 4's
      learnable_sink), unscaled, used in float32, added to each row's softmax denominator:
      out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij)); the LSE includes it
      (a row that sees no key: out 0, lse = sink). Differentiable.
    Rows that see no key give zeros. `backend` is "auto" or a name from `backends()`.
    Under torch.compile it is one custom op (`torch.ops.attnperf.attention`), traced
    without graph breaks.
    """
    variants = {
        "window": window, "softcap": softcap, "alibi_slopes": alibi_slopes,
        "block_mask": block_mask, "align": align, "return_lse": return_lse, "sinks": sinks,
    }  # fmt: skip
    if torch.compiler.is_compiling():
        return ops.attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend,
            variants,
        )  # fmt: skip
    autocast = _autocast_dtype(query)
    # A call whose metadata was seen before (outside autocast) skips its checks and the
    # backend's choice: they are kept (attnperf.plans).
    metadata = None
    if autocast is None and not func_grad_active():  # a plan's backend may not serve these
        metadata = plans.dense_key(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                   enable_gqa, backend, variants)  # fmt: skip
    plan = None if metadata is None else plans.dense_plan(metadata)
    if plan is not None:
        return plan(query, key, value)
    outside_autocast = contextlib.nullcontext()
    if autocast is not None:
        # As SDPA under autocast: q, k, v in autocast's dtype; the kernels then run as asked.
        query, key, value = (t.to(autocast) if t.is_floating_point() else t
                             for t in (query, key, value))  # fmt: skip
        outside_autocast = torch.autocast(query.device.type, enabled=False)
    with outside_autocast:
        inputs = prepare(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **variants
        )
        plan = plans.plan_dense(inputs, backend)
        if metadata is not None:
            plans.keep_dense_plan(metadata, plan)
        return plan.run(inputs)


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    align: str = "bottom_right",
    backend: str = "auto",
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a packed batch of variable-length sequences (FlashAttention's
    flash_attn_varlen_func): q (total_q, Hq, E), k (total_k, H, E), v (total_k, H, Ev) ->
    out (total_q, Hq, Ev) (and lse (Hq, total_q) float32 with return_lse).

    Sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] ..
    cu_seqlens_k[b + 1] of k and v (int32 (B + 1,), from 0 to the totals) and attends only
    within itself; max_seqlen_* bound the lengths. is_causal, window, softcap, alibi_slopes
    ((Hq,) or (B, Hq)) and sinks (Hq,) as in `attention`, per sequence, aligned
    bottom-right by default (o = S_b - L_b). H divides Hq (grouped-query). Differentiable.
    """
    inputs = prepare_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=is_causal,
        scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, align=align,
        return_lse=return_lse, sinks=sinks,
    )  # fmt: skip
    return plans.plan_dense(inputs, backend).run(inputs)


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: int | Tensor,
    k_new: Tensor | None = None,
    v_new: Tensor | None = None,
    *,
    block_table: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    backend: str = "auto",
    return_lse: bool = False,
    sinks: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of a few new queries over a KV cache (FlashAttention's
    flash_attn_with_kvcache), inference only: q (B, Lq, Hq, E) -> out (B, Lq, Hq, Ev) (and
    lse (B, Hq, Lq) float32 with return_lse).

    k_cache, v_cache: (B, S_max, H, E), or with block_table (B, pages) int32 a paged cache
    (num_pages, page_size, H, E), page_size a multiple of 16. cache_seqlens: int or (B,)
    int32, the keys already cached. k_new, v_new (B, Lnew, H, E), if given, are written into
    the caller's cache in place at cache_seqlens first; sequence b then attends over its
    cache_seqlens[b] + Lnew keys, bottom-right aligned (causal by default); cache_leftpad (B,)
    int32, if given, starts sequence b's keys at that row (left padding). num_splits:
    split-K chunks per sequence merged by their LSEs (the sinks (Hq,), as in `attention`,
    applied once after the merge), 0 chooses, 1 disables. A call that raises writes nothing.

    An int8 cache (k_cache, v_cache int8 codes) takes its scales: k_scale, v_scale float32
    (B, S_max, H, E // G) (paged: (num_pages, page_size, H, E // G)), G dividing E and free
    to differ between K and V; a cached row is codes * scale per group of G values
    (`quantize_kv`). k_new, v_new (in q's dtype) are then quantized by quantize_kv's rule
    as they are written, codes and scales. The output is in q's dtype.
    """
    # A plain step (transformers' decoding) whose metadata was seen before runs on the
    # chosen backend's step launcher once its values are checked. Other calls keep the
    # checks of their metadata (attnperf.plans); their lengths and the backend's choice are
    # worked out every call.
    step_key = plans.kvcache_step_key(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_leftpad, is_causal,
        scale, window, softcap, alibi_slopes, num_splits, return_lse, sinks, k_scale, v_scale,
        backend,
    )  # fmt: skip
    step = None if step_key is None else plans.kept_kvcache_step(step_key, cache_seqlens)
    if step is not None:
        check_step(k_cache, v_cache, cache_seqlens)
        return step(q, k_cache, v_cache, cache_seqlens)
    metadata = plans.kvcache_key(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_leftpad, is_causal,
        scale, window, softcap, alibi_slopes, num_splits, return_lse, sinks, k_scale, v_scale,
    )  # fmt: skip
    call = None if metadata is None else plans.kept_kvcache_call(metadata)
    if call is None:
        call = check_kvcache_call(
            q, k_cache, v_cache, k_new, v_new, block_table=block_table, is_causal=is_causal,
            scale=scale, window=window, softcap=softcap, num_splits=num_splits,
            return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        if metadata is not None:
            plans.keep_kvcache_call(metadata, call)
    inputs = bind_kvcache(
        call, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=block_table,
        cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale,
    )  # fmt: skip
    chosen = dispatch.select(inputs, backend)
    append_to_cache(inputs)
    if step_key is not None and not inputs.needs_grad:
        # A plain step runs on the backend's step launcher, kept for the steps that follow.
        step = chosen.kvcache_step(inputs)
        if step is not None:
            lengths = dispatch.step_lengths(inputs, backend)
            plans.keep_kvcache_step(step_key, backend, step, lengths)
            return step(q, k_cache, v_cache, cache_seqlens)
    return inputs.restore(*chosen.run_kvcache(inputs))


def heads_first_step(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, *, scale: float | None, window, softcap,
    backend: str,
) -> Tensor | None:  # fmt: skip
    """attention_with_kvcache(q.transpose(1, 2), k_cache.transpose(1, 2),
    v_cache.transpose(1, 2), S, scale=scale, window=window, softcap=softcap,
    backend=backend) of SDPA-layout tensors whose every key is in use (transformers'
    decoding: q (B, Hq, Lq, E), caches (B, H, S, E)), run on the step launcher such a call
    kept, with no view made: out (B, Lq, Hq, Ev). None where no launcher is kept for it:
    the caller makes that call (checked, and keeping one)."""
    step_key = plans.kvcache_step_key(
        q, k_cache, v_cache, 0, None, None, None, None, True, scale, window, softcap, None, 0,
        False, None, None, None, backend, heads_first=True,
    )  # fmt: skip
    if step_key is None:
        return None
    length = k_cache.shape[2]
    step = plans.kept_kvcache_step(step_key, length)
    if step is None or v_cache.shape[2] != length:  # v's length: the call's own message
        return None
    return step(q, k_cache, v_cache, length, heads_first=True)


def _autocast_dtype(query: object) -> torch.dtype | None:
    """The dtype autocast gives attention on query's device, or None outside autocast."""
    if not isinstance(query, Tensor):
        return None
    # is_cpu and is_cuda, not device.type: a device object made per call.
    device = "cpu" if query.is_cpu else "cuda" if query.is_cuda else None
    if device is None or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


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
    **variants: object,
) -> str:
    """The name of the backend that `attention` would run for these arguments (the variant
    keywords as `attention` takes them)."""
    inputs = prepare(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **variants
    )
    return dispatch.select(inputs, backend).name


def backends() -> list[dict[str, object]]:
    """The capability table: one dict per backend (name, availability, devices, dtypes, ...)."""
    return [backend.describe() for backend in dispatch.registry().values()]


def merge_attention(
    outs: list[Tensor], lses: list[Tensor], *, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Exact attention of the same queries over the union of disjoint key sets, from each
    set's (out (..., L, Ev), lse (..., L)): lse = logsumexp_i lse_i, out = sum_i
    exp(lse_i - lse) * out_i. Parts whose LSE is -inf (no key seen) weigh 0; a row no part
    sees gives out 0, lse -inf. Computed in float32 (float64 for float64 parts) and
    differentiable; out in the parts' dtype, lse float32 (float64 for float64).

    sinks (Hq,), with heads at dim -2 of the LSEs (-3 of the outputs), are applied once, to
    parts computed without them: they join as one more part of output 0 and LSE sink (so a
    row no part sees gives out 0, lse = sink)."""
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outs and lses must be lists of tensors")
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"outs and lses must be non-empty and of one length, got "
                         f"{len(outs)} and {len(lses)}")  # fmt: skip
    for i, (out, lse) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(out, Tensor) or not isinstance(lse, Tensor):
            raise TypeError(f"outs[{i}] and lses[{i}] must be tensors")
        if out.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] has shape {tuple(out.shape)}, outs[0] "
                             f"{tuple(outs[0].shape)}")  # fmt: skip
        if lse.shape != out.shape[:-1]:
            raise ValueError(f"lses[{i}] must have shape {tuple(out.shape[:-1])} (outs[{i}] "
                             f"without its last dim), got {tuple(lse.shape)}")  # fmt: skip
    wide = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    stacked = [lse.to(wide) for lse in lses]
    if sinks is not None:
        if lses[0].dim() < 2:
            raise ValueError("sinks need the LSEs' heads at dim -2; the LSEs are 1-D")
        check_sinks(sinks, lses[0].device, lses[0].shape[-2])
        stacked.append(sinks.to(wide)[:, None].expand(lses[0].shape))
    stacked = torch.stack(stacked)
    # Shifted by the largest part (0 where every part is -inf: weights 0, never NaN, in the
    # forward or the backward, which torch.logsumexp gives there).
    largest = stacked.amax(0).detach()
    shift = torch.where(largest > float("-inf"), largest, 0.0)
    scaled = torch.exp(stacked - shift)
    total = scaled.sum(0)
    seen = total > 0
    total = torch.where(seen, total, 1.0)
    lse = torch.where(seen, shift + torch.log(total), float("-inf"))
    weights = scaled / total  # the sink's part, if any, is last and has no output
    out = sum(w.unsqueeze(-1) * o.to(wide) for w, o in zip(weights, outs, strict=False))
    return out.to(outs[0].dtype), lse


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    g: Tensor | None = None,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Linear attention (additive, gated, delta rule) in fla's layout: (B, T, heads, dim),
    not attention's (B, heads, L, E).

    q, k (B, T, H, K); v (B, T, HV, V), HV a multiple of H (value head j reads key head
    j // (HV // H)); g None, (B, T, HV) or (B, T, HV, K): per-step decays in natural log,
    <= 0 (g > 0 is outside the contract and not checked), used in float32; beta None (the
    additive rule) or (B, T, HV) (the delta rule's step size). Per value head, in this order:
    S = diag(exp(g_t)) S; additive S = S + k_t v_t^T, or delta u = beta_t (v_t - S^T k_t),
    S = S + k_t u^T; o_t = S^T (scale q_t). scale defaults to K ** -0.5. use_qk_l2norm first
    normalises q and k as x / sqrt(sum(x^2) + 1e-6), differentiably.

    The state is (N, HV, K, V) float32: initial_state (zeros when None) and, with
    output_final_state, the state after the last token (else None is returned). cu_seqlens
    (N + 1,) int32/int64 packs N sequences along T (B == 1), each from its own state row.
    Returns (out (B, T, HV, V) in q's dtype, final state or None); fp16 and bf16 are computed
    in float32. Gradients reach q, k, v, g, beta and initial_state, through both results. A
    short T with an initial_state is a decoding step (the recurrent kernel).
    """
    dispatch.check_name(backend)
    inputs = prepare_linear(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    return dispatch.linear(inputs, backend)
