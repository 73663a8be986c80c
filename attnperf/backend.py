"""The contract every backend implements: declared capabilities and reasons for refusing a call."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from attnperf.inputs import DTYPE_NAMES, VARIANT_KEYWORDS, AttentionInputs
from attnperf.linear_inputs import LinearAttentionInputs
from attnperf.serving import KVCacheInputs

# Every feature a call may need, with the words a refusal uses. A backend serves only what
# it lists: a feature nobody listed (a new variant's, say) is refused everywhere, with its
# reason, until a backend that implements it lists it.
FEATURES = {
    "bool_mask": "bool attn_mask",
    "float_mask": "float attn_mask",
    "causal": "is_causal",
    # The variant keywords' own, as they declare them (attnperf.inputs.VARIANT_KEYWORDS).
    **{keyword.feature: keyword.words for keyword in VARIANT_KEYWORDS if keyword.feature},
    "bottom_right": "align='bottom_right' with L != S",
    "gqa": "grouped-query attention",
    "dropout": "dropout_p > 0",
    "backward": "backward (inputs require grad)",
    "func_grad": "torch.func's grad and jvp transforms (use loss.backward(), or vmap alone)",
    "varlen": "packed variable-length sequences (attention_varlen)",
    "kvcache": "KV-cache attention (attention_with_kvcache)",
    "kvcache_backward": "backward through attention_with_kvcache (inference only)",
    "kvcache_int8": "an int8 KV cache (k_scale, v_scale)",
    "linear": "linear attention (linear_attention)",
    "linear_backward": "backward through linear_attention",
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can serve, as data: dispatch, `attnperf info` and the tests read it."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None  # None: any head dim
    features: frozenset[str]

    def __post_init__(self):
        unknown = self.features - FEATURES.keys()
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {list(FEATURES)}")


# Variants that SDPA's kernels serve only under an L x S mask built per call, where a fused
# kernel skips what is masked: window, ALiBi, block masks, sinks (an extra key column
# under such a mask); packed and KV-cache calls, which sdpa pads to a batch under a mask
# (but a decoding step that sees its whole cache: `built_mask`). Figures in
# benches/README.md ("Variants", "Sinks", "Serving").
BUILT_MASK_FEATURES = frozenset({"window", "alibi", "block_mask", "varlen", "kvcache", "sinks"})


def built_mask(inputs: AttentionInputs | KVCacheInputs) -> bool:
    """Whether SDPA's kernels would serve this call only under a mask built for it."""
    if isinstance(inputs, KVCacheInputs) and inputs.sees_whole_cache:
        return False
    return bool(inputs.features() & BUILT_MASK_FEATURES)


class Backend:
    """A named attention implementation; subclasses set `name`, `capabilities`, `run`, and
    where "auto" tries it: `rank` per device, lower first, and `leads` for the calls it
    goes first for. A device it does not rank: never tried by "auto"."""

    name: str
    description: str
    capabilities: Capabilities
    rank: ClassVar[Mapping[str, int]] = {}

    def leads(self, inputs: AttentionInputs | KVCacheInputs | LinearAttentionInputs) -> bool:
        """Whether "auto" tries this backend before the ranked order for this call."""
        return False

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all on this machine (missing package, no GPU), or None."""
        return None

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Every reason this backend cannot serve `inputs`; empty when it can."""
        unavailable = self.unavailable_reason()
        if unavailable:
            return [unavailable]
        return self.capability_reasons(inputs)

    def capability_reasons(self, inputs: AttentionInputs) -> list[str]:
        """The reasons that follow from the declarations alone, available or not: device,
        dtype, head dim, then each requested feature not declared."""
        caps = self.capabilities
        reasons = []
        if inputs.device.type not in caps.devices:
            reasons.append(f"device {inputs.device.type} not in {caps.devices}")
        if inputs.dtype not in caps.dtypes:
            supported = ", ".join(DTYPE_NAMES[d] for d in caps.dtypes)
            reasons.append(f"dtype {DTYPE_NAMES[inputs.dtype]} not in ({supported})")
        largest = max(inputs.head_dim, inputs.value_dim)
        if caps.max_head_dim is not None and largest > caps.max_head_dim:
            reasons.append(f"head dim {largest} > {caps.max_head_dim}")
        missing = inputs.features() - caps.features
        reasons += [f"{FEATURES[f]} not supported" for f in FEATURES if f in missing]
        return reasons + self.extra_reasons(inputs)

    def extra_reasons(self, inputs: AttentionInputs) -> list[str]:
        """Limits that the declared capabilities cannot express."""
        return []

    def run(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor | None]:
        """(output (B, Hq, L, Ev), natural-log LSE (B, Hq, L) float32 when the call asked for
        it, else None) for inputs this backend has accepted."""
        raise NotImplementedError

    def forward_for(self, inputs: AttentionInputs) -> Callable[..., object] | None:
        """A forward launcher for the next calls with the metadata of an accepted call like
        `inputs` (whose checks found no tensor variant), or None (the default: each call
        runs whole). attnperf.plans keeps it per call metadata and passes it to a fused
        backend's `run` or `run_kept` (FusedBackend: forward(query, key, value) -> (out,
        stats, residual) as its own `forward` returns them, of a call with that metadata,
        whose q, k, v are all it holds; stats may be None where the metadata reads none: no
        gradient to come, no LSE asked)."""
        return None

    def run_kept(
        self, forward: Callable[..., object], query: Tensor, key: Tensor, value: Tensor,
        return_lse: bool,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """`run` of a call with the metadata `forward` (`forward_for`'s) was made for, where
        no gradient is to come: from the call's 4-D q, k, v alone (its whole Python is a
        short call's cost: no inputs record made)."""
        raise NotImplementedError

    def run_kvcache(self, inputs: KVCacheInputs) -> tuple[Tensor, Tensor | None]:
        """(output (B, Hq, Lq, Ev), LSE (B, Hq, Lq) float32 when asked for, else None) of an
        accepted KV-cache call whose new keys are already written into the cache."""
        raise NotImplementedError

    def kvcache_step(self, inputs: KVCacheInputs) -> Callable[..., object] | None:
        """A launcher for the next steps of an accepted KV-cache call like `inputs` (a
        contiguous cache, one int length for every sequence, no new keys, left padding,
        ALiBi, sinks or int8 scales), or None (the default: every call runs whole).
        step(q, k_cache, v_cache, cache_seqlens) takes a call's own arguments, its metadata
        that of `inputs` but for the cache's length and its values checked
        (`serving.check_step`), and returns what attention_with_kvcache returns; with
        heads_first=True, q, k_cache and v_cache come in SDPA's (B, H, L, E) layout
        (`api.heads_first_step`). attnperf.plans keeps it per call metadata."""
        return None

    def run_linear(self, inputs: LinearAttentionInputs) -> tuple[Tensor, Tensor]:
        """(output (B, T, HV, V) in the call's dtype, final state (N, HV, K, V) in the compute
        dtype) of an accepted linear_attention call; differentiable where declared."""
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        caps = self.capabilities
        return {
            "name": self.name,
            "available": self.unavailable_reason() is None,
            "unavailable_reason": self.unavailable_reason(),
            "description": self.description,
            "devices": list(caps.devices),
            "dtypes": [DTYPE_NAMES[d] for d in caps.dtypes],
            "max_head_dim": caps.max_head_dim,
            "features": [f for f in FEATURES if f in caps.features],
        }


def lse_from_stats(stats: Tensor) -> Tensor:
    """Natural-log LSEs (B, Hq, L) float32 from a fused kernel's statistics (B, Hq, L, 2),
    each row's max in base 2 and its sum of 2 ** (score - max); -inf for a row that sees no
    key (sum 0)."""
    row_max, row_sum = stats.unbind(-1)
    lse = (row_max + torch.log2(row_sum)) * math.log(2)
    return torch.where(row_sum > 0, lse, float("-inf"))


# Outputs a kernel computes in fp32 and rounds: their residual goes to the backward.
ROUNDED_DTYPES = (torch.bfloat16, torch.float16)


def rounding_residual(exact: Tensor, out: Tensor) -> Tensor:
    """What rounding `exact` (fp32) to `out` (bf16 or fp16) took off each value, rounded to
    bf16 (fp32's range: fp16's would lose the small ones; 2 bytes a value, against 4 for
    keeping `exact`): `exact_output` restores `exact` to about 16 bits (bf16) or 19 (fp16).
    A backward's rowsum(dO * O) reads O so: from the rounded out, its error (2^-9 of O in
    bf16, 2^-12 in fp16) cancels against dP's where the softmax is peaked, and left dq and
    dk many times as far from float64 as PyTorch's own attention in the same dtype."""
    return (exact - out.float()).to(torch.bfloat16)


def rounded_output(
    exact: Tensor, dtype: torch.dtype, keep_residual: bool
) -> tuple[Tensor, Tensor | None]:
    """(exact (fp32) rounded to dtype, its `rounding_residual` where keep_residual and the
    rounding takes something off, else None): a kernel's fp32 output for its caller."""
    out = exact.to(dtype)
    keep = keep_residual and out.dtype in ROUNDED_DTYPES
    return out, rounding_residual(exact, out) if keep else None


def exact_output(out: Tensor, residual: Tensor | None) -> Tensor:
    """A forward's output as its kernel computed it: out, fp32 with its `rounding_residual`."""
    return out if residual is None else out.float() + residual.float()


def sink_gradient(
    sinks: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None
) -> Tensor:
    """d loss / d sinks (Hq,) in the sinks' dtype, from an attention with sinks: out (B, Hq,
    L, Ev), its natural-log lse (B, Hq, L) (the sink's term included; -inf on rows of no
    sequence, which take no part) and their gradients. The sink's weight in row i is p_i =
    exp(sink - lse_i), so dsink = -sum_i p_i (rowsum(dO * O)_i - dLSE_i)."""
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    weight = torch.where(lse > float("-inf"), torch.exp(sinks.float()[:, None] - lse.float()), 0.0)
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


def stats_from_lse(lse: Tensor) -> Tensor:
    """A fused kernel's (max, sum) statistics (B, Hq, L, 2) standing for given natural-log
    LSEs: (lse * log2(e), 1), or (0, 0) for -inf. The backward launchers take them, so a
    caller may run a block's backward against the LSE of a larger attention (ring attention)."""
    finite = lse > float("-inf")
    row_max = torch.where(finite, lse.float() * math.log2(math.e), 0.0)
    return torch.stack((row_max, finite.float()), -1)


class FusedBackend(Backend):
    """A fused kernel served through FusedAttention: subclasses set `forward` and
    `backward`, its two launchers (staticmethods), which are also its interface for split-K
    decoding and ring attention:

    forward(inputs) -> (out (B, Hq, L, Ev), stats (B, Hq, L, 2) float32: each row's max in
    base 2 and its sum of 2 ** (score - max); (0, 0) for a row that sees no key; residual:
    a bf16 or fp16 out's `rounding_residual` where an input requires grad, or None);
    backward(inputs, out, stats, grad_out, grad_lse or None, partial_keys=False) -> (dq, dk,
    dv, dmask or None), out as computed (`exact_output`), or as returned; partial_keys: out
    and stats are a larger attention's, the call's keys a part of it (ring attention);
    kvcache_forward(KVCacheInputs) -> (out (B, Hq, Lq, Ev), stats (B, Hq, Lq, 2)).
    `lse_from_stats` and `stats_from_lse` convert between stats and natural-log LSEs.
    """

    forward: Callable[[AttentionInputs], tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor | None, ...]]
    kvcache_forward: Callable[[KVCacheInputs], tuple[Tensor, Tensor]]
    # linear_forward(inputs, backward) -> (out (B, T, HV, V), final state (N, HV, K, V)
    # float32, kept: a tuple of tensors for the backward when one follows, () when it keeps
    # nothing); linear_backward(inputs, kept, grad_out, grad_state or None) -> (dq, dk, dv,
    # dg, dbeta, dstate), None where the call has no such input.
    linear_forward: Callable[[LinearAttentionInputs, bool], tuple[Tensor, Tensor, tuple]]
    linear_backward: Callable[..., tuple[Tensor | None, ...]]

    def run_linear(self, inputs: LinearAttentionInputs) -> tuple[Tensor, Tensor]:
        if not inputs.needs_grad:  # a decoding step: autograd.Function.apply binds its
            return self.linear_forward(inputs, False)[:2]  # arguments by signature (slow)
        tensors = (inputs.query, inputs.key, inputs.value, inputs.g, inputs.beta,
                   inputs.initial_state)  # fmt: skip
        launchers = (self.linear_forward, self.linear_backward)
        return FusedLinearAttention.apply(launchers, inputs, *tensors)[:2]

    def run_kvcache(self, inputs: KVCacheInputs) -> tuple[Tensor, Tensor | None]:
        out, stats = self.kvcache_forward(inputs)
        return out, lse_from_stats(stats) if inputs.variant.return_lse else None

    def run(
        self, inputs: AttentionInputs, forward: Callable[..., object] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """`Backend.run`; `forward`: a launcher `forward_for` gave for the call's metadata,
        in place of the backend's own `forward`."""
        transformed = torch._C._are_functorch_transforms_active()
        # Without a gradient to come, the launcher alone: autograd.Function.apply binds its
        # arguments by signature (as long as a short call's kernel). Under torch.func transforms
        # (vmap) the Function's own rules must run, as its apply checks, on the backend's
        # own forward (vmap folds its dim into the batch: shapes no kept forward was for).
        if not transformed and not inputs.needs_grad:
            if forward is not None:
                return self.run_kept(forward, inputs.query, inputs.key, inputs.value,
                                     inputs.variant.return_lse)  # fmt: skip
            out, stats, _ = self.forward(inputs)
            return out, lse_from_stats(stats) if inputs.variant.return_lse else None
        forward = self.forward if forward is None or transformed else _inputs_forward(forward)
        launchers = (forward, self.backward)
        out, lse, *_ = FusedAttention.apply(
            launchers, inputs, inputs.query, inputs.key, inputs.value, inputs.attn_mask,
            inputs.variant.sinks,
        )  # fmt: skip
        return out, lse if inputs.variant.return_lse else None

    def run_kept(
        self, forward: Callable[..., object], query: Tensor, key: Tensor, value: Tensor,
        return_lse: bool,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        out, stats, _ = forward(query, key, value)
        return out, lse_from_stats(stats) if return_lse else None


def _inputs_forward(forward: Callable[..., object]) -> Callable[[AttentionInputs], object]:
    """A kept forward (`Backend.forward_for`'s, of q, k, v) as the backend's own `forward`
    is called: of the inputs."""
    return lambda inputs: forward(inputs.query, inputs.key, inputs.value)


class FusedAttention(torch.autograd.Function):
    """Autograd over a fused kernel's two launchers: (out, lse, stats, residual) from
    apply((forward, backward), inputs, query, key, value, attn_mask, sinks); lse (natural
    log, empty unless the call asked for it) is differentiable, stats and residual (a bf16
    or fp16 out's `rounding_residual`, else empty) are not. The launchers' stats hold the
    sinks' terms, so their backward needs nothing more; the sinks' own gradient is
    `sink_gradient`. Both read the output as the kernel computed it (`exact_output`).

    Saves the inputs, out, stats and residual, never L x S, through save_for_backward, so that an
    in-place edit after the forward raises in backward as it does for SDPA. Double backward
    raises a clear error when reached; torch.vmap folds its dim into the batch.
    """

    @staticmethod
    def forward(launchers, inputs: AttentionInputs, query, key, value, attn_mask, sinks):
        out, stats, residual = launchers[0](inputs)
        # Only when asked: a torch op between two numba kernels costs the second one (see
        # attnperf.kernels.numba.launch.float32_array).
        lse = lse_from_stats(stats) if inputs.variant.return_lse else stats.new_empty(0)
        return out, lse, stats, stats.new_empty(0) if residual is None else residual

    @staticmethod
    def setup_context(ctx, inputs, output):
        launchers, call, query, key, value, attn_mask, sinks = inputs
        ctx.launch_backward, ctx.call = launchers[1], call
        out, lse, stats, residual = output
        ctx.save_for_backward(query, key, value, attn_mask, sinks, out, stats, residual)
        ctx.mark_non_differentiable(stats, residual)
        if not call.variant.return_lse:
            ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_stats, _grad_residual):
        query, key, value, attn_mask, sinks, out, stats, residual = ctx.saved_tensors  # edits
        out = exact_output(out, residual if residual.numel() else None)
        inputs = replace(ctx.call, query=query, key=key, value=value, attn_mask=attn_mask,
                         variant=replace(ctx.call.variant, sinks=sinks))  # fmt: skip
        if not inputs.variant.return_lse:
            grad_lse = None  # nobody saw the LSE: its gradient is zeros
        with torch.no_grad():
            grads = ctx.launch_backward(inputs, out, stats, grad_out, grad_lse)
            dsinks = None
            if sinks is not None and ctx.needs_input_grad[6]:
                dsinks = sink_gradient(sinks, out, lse_from_stats(stats), grad_out, grad_lse)
            grads = (*grads, dsinks)
        saved = (grad_out, grad_lse, query, key, value, attn_mask, sinks)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in saved):
            grads = _refuse_double_backward(grads)
        return None, None, *grads

    @staticmethod
    def vmap(info, in_dims, launchers, inputs: AttentionInputs, query, key, value, attn_mask,
             sinks):  # fmt: skip
        size, batch = info.batch_size, inputs.batch
        if in_dims[6] is not None:
            raise NotImplementedError("torch.vmap over the sinks (one set per vmapped item)")

        def fold(tensor, dim):  # (size, B, ...) -> (size * B, ...)
            if tensor is None:
                return None
            tensor = tensor.expand(size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)
            return tensor.reshape(size * batch, *tensor.shape[2:])

        tensors = (query, key, value, attn_mask)
        q, k, v, m = (fold(t, d) for t, d in zip(tensors, in_dims[2:6], strict=True))
        variant = inputs.variant
        if variant.alibi_slopes is not None:  # (B, Hq): the same slopes for every vmapped item
            variant = replace(variant, alibi_slopes=variant.alibi_slopes.repeat(size, 1))
        if variant.block_mask is not None and variant.block_mask.shape[0] != 1:
            raise NotImplementedError("torch.vmap over a call with a per-batch block_mask")
        folded = replace(inputs, query=q, key=k, value=v, attn_mask=m, variant=variant)
        out, lse, stats, residual = FusedAttention.apply(launchers, folded, q, k, v, m, sinks)
        out, stats = out.unflatten(0, (size, batch)), stats.unflatten(0, (size, batch))
        # lse and residual: empty where the call has none, and then not batched
        lse_dim = residual_dim = None
        if variant.return_lse:
            lse, lse_dim = lse.unflatten(0, (size, batch)), 0
        if residual.numel():
            residual, residual_dim = residual.unflatten(0, (size, batch)), 0
        return (out, lse, stats, residual), (0, lse_dim, 0, residual_dim)


class FusedLinearAttention(torch.autograd.Function):
    """Autograd over a fused linear-attention kernel's two launchers: (out, final_state,
    *kept) from apply((forward, backward), inputs, q, k, v, g, beta, initial_state); out and
    final_state are differentiable, kept (what the forward kept of its chunks for the
    backward, if anything) is not. Saves the inputs and kept."""

    @staticmethod
    def forward(launchers, inputs: LinearAttentionInputs, q, k, v, g, beta, initial_state):
        out, final, kept = launchers[0](inputs, True)  # (grad mode is off in here)
        return out, final, *kept

    @staticmethod
    def setup_context(ctx, inputs, output):
        launchers, call, *tensors = inputs
        ctx.launch_backward, ctx.call = launchers[1], call
        ctx.save_for_backward(*tensors, *output[2:])
        ctx.mark_non_differentiable(*output[2:])
        ctx.set_materialize_grads(False)  # not kept's zero gradients; the launchers take None

    @staticmethod
    def backward(ctx, grad_out, grad_state, *_grad_kept):
        q, k, v, g, beta, initial_state, *kept = ctx.saved_tensors  # checks in-place edits
        inputs = replace(ctx.call, query=q, key=k, value=v, g=g, beta=beta,
                         initial_state=initial_state)  # fmt: skip
        with torch.no_grad():
            grads = ctx.launch_backward(inputs, tuple(kept), grad_out, grad_state)
        saved = (grad_out, grad_state, q, k, v, g, beta, initial_state)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in saved):
            grads = _refuse_double_backward(grads)
        return None, None, *grads


def _refuse_double_backward(grads):
    """The gradients, wired so that differentiating them again raises a clear error."""
    error = torch._C._functions.DelayedError(
        b"attnperf's fused kernels have no double backward (second derivatives); "
        b"use backend='reference' or 'sdpa' for them",
        sum(g is not None for g in grads),
    )
    present = [g.detach().requires_grad_() for g in grads if g is not None]
    wired = iter(error(*present) if len(present) > 1 else (error(*present),))
    return tuple(None if g is None else next(wired) for g in grads)
