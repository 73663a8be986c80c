"""Validation of an attention call and its normalised, 4-D form shared by every backend."""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from attnperf.layouts import BlockMask, describe_type

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}
ALIGNMENTS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class Sequences:
    """Ragged sequences of one call (packed varlen batches, padded batches, KV caches of
    different lengths): `table` (B, 6) int64 on the CPU, one row per sequence b: (slot,
    q_start, q_len, k_start, k_len, offset): its queries are rows q_start .. q_start + q_len
    of batch entry `slot` of the query array, its keys rows k_start .. k_start + k_len of
    the key/value arrays, and its diagonal is key i + offset (k_len - q_len bottom-right, 0
    top-left). `packed`: one slot (0) holds every sequence (attention_varlen); otherwise
    sequence b is slot b, and query rows outside its range are padding (output 0)."""

    table: Tensor
    packed: bool

    @property
    def count(self) -> int:
        return self.table.shape[0]

    # Read as lists: a torch op on a tensor this small, or even numpy's reductions, cost
    # more, and a short call or a decoding step is made of such steps.
    @property
    def max_q_len(self) -> int:
        return max(self.table.numpy()[:, 2].tolist(), default=0)

    @property
    def max_kv_len(self) -> int:
        return max(self.table.numpy()[:, 4].tolist(), default=0)

    @staticmethod
    def build(q_starts, q_lens, k_starts, k_lens, align: str, packed: bool) -> Sequences:
        """The table from per-sequence starts and lengths (int64 CPU tensors or numpy
        arrays; ints for a column alike in every sequence; k_lens an array), made in numpy
        (see `dense`)."""
        count = len(k_lens)
        table = np.zeros((count, 6), np.int64)
        table[:, 0] = 0 if packed else np.arange(count)
        for column, values in enumerate((q_starts, q_lens, k_starts, k_lens), 1):
            table[:, column] = np.asarray(values)
        if align == "bottom_right":
            table[:, 5] = table[:, 4] - table[:, 2]
        return Sequences(torch.from_numpy(table), packed)

    @staticmethod
    def dense(batch: int, q_len: int, k_len: int, align: str) -> Sequences:
        """One sequence per batch entry, all alike: `build`'s table (`dense_table`)."""
        return Sequences(torch.from_numpy(Sequences.dense_table(batch, q_len, k_len, align)),
                         packed=False)  # fmt: skip

    @staticmethod
    def dense_table(batch: int, q_len: int, k_len: int, align: str) -> np.ndarray:
        """`dense`'s table as a numpy array, made from a list (faster than numpy's column
        writes or torch's small ops: a short call or a decoding step is made of such
        steps)."""
        offset = k_len - q_len if align == "bottom_right" else 0
        rows = [(b, 0, q_len, 0, k_len, offset) for b in range(batch)]
        return np.array(rows, np.int64).reshape(batch, 6)


@dataclass(frozen=True)
class Variant:
    """What a call asks beyond SDPA's arguments, as one value: each kernel file lowers it
    once into its launch arguments (one place to add a field).

    window (left, right): query i sees keys i + o - left .. i + o + right (inclusive, None
    unbounded), o = 0 for align "top_left", S - L for "bottom_right"; softcap c: scores
    become c * tanh(s / c) before masks and ALiBi; alibi_slopes (B, Hq) float32: adds
    -slope * |i + o - j|; block_mask: a block-sparse layout; return_lse: the row LSEs too;
    sequences: ragged sequences (attention_varlen), each with its own alignment o; sinks
    (Hq,) float: one logit per query head added to each row's softmax denominator
    (gpt-oss's, FlashAttention 4's learnable_sink), unscaled, used in float32.
    """

    window: tuple[int | None, int | None] | None = None
    align: str = "top_left"
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    block_mask: BlockMask | None = None
    return_lse: bool = False
    sequences: Sequences | None = None
    sinks: Tensor | None = None


# The scalar types a plan's key may hold of a number argument: each value of these types
# checks alike (is_causal=1 is refused where True is not, so a key never mixes them).
PLAIN_NUMBERS = (float, int)


def plain_window(window: object) -> bool:
    """Whether `window` is None or a tuple of two ints or Nones, as a plan's key holds it."""
    return window is None or (
        type(window) is tuple
        and len(window) == 2
        and all(side is None or type(side) is int for side in window)
    )


# A variant keyword's values by their kind: how a plan's key tests that a value is plain
# enough to hold (attnperf.plans); "tensor" (an optional tensor) and "layout" (an optional
# BlockMask) are never plain: a call that sets one is checked every time. attnperf.ops
# carries each kind through torch.compile's custom op.
PLAIN_KINDS = {
    "window": plain_window,
    "number": lambda value: value is None or type(value) in PLAIN_NUMBERS,
    "flag": lambda value: type(value) is bool,
    "choice": lambda value: type(value) is str,
}
VARIANT_KINDS = (*PLAIN_KINDS, "tensor", "layout")


@dataclass(frozen=True)
class VariantKeyword:
    """One of `attention`'s variant keywords, declared once. Derived from it: the feature a
    call that sets it needs a backend to declare (backend.FEATURES, `variant_features`),
    whether and how a plan's key holds it (attnperf.plans), and how it travels through
    torch.compile's custom op (attnperf.ops). Its check is `prepare`'s, its semantics the
    reference's (kernels/reference.py)."""

    name: str  # the keyword, and the `Variant` field it sets
    default: object  # its default in `attention`
    feature: str | None  # the backend feature it asks for where set (not None or False)
    words: str  # what a refusal calls that feature
    kind: str  # one of VARIANT_KINDS
    choices: tuple[str, ...] = ()  # a "choice" kind's values
    differentiable: bool = False  # a "tensor" kind's: whether gradients reach it

    def __post_init__(self):
        if self.kind not in VARIANT_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {VARIANT_KINDS}, got {self.kind!r}")


VARIANT_KEYWORDS = (
    VariantKeyword("window", None, "window", "window", "window"),
    VariantKeyword("softcap", None, "softcap", "softcap", "number"),
    VariantKeyword("alibi_slopes", None, "alibi", "alibi_slopes", "tensor"),
    VariantKeyword("block_mask", None, "block_mask", "block_mask", "layout"),
    VariantKeyword("align", "top_left", None, "align", "choice", choices=ALIGNMENTS),
    VariantKeyword("return_lse", False, "lse", "return_lse", "flag"),
    VariantKeyword("sinks", None, "sinks", "sinks", "tensor", differentiable=True),
)


# The keywords whose values are tensors (or hold some): a call's own, never a plan's.
TENSOR_KEYWORDS = tuple(k.name for k in VARIANT_KEYWORDS if k.kind not in PLAIN_KINDS)


def variant_features(variant: Variant) -> set[str]:
    """The backend features a call's variant keywords ask for: each one's that is set."""
    features = set()
    for keyword in VARIANT_KEYWORDS:
        value = getattr(variant, keyword.name)
        if keyword.feature is not None and value is not None and value is not False:
            features.add(keyword.feature)
    return features


class QueryShaped:
    """What a call's (B, Hq, L, E) `query` tells of it, for the inputs records that hold one."""

    query: Tensor

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[3]


@dataclass(frozen=True)
class AttentionInputs(QueryShaped):
    """One validated call with the leading dims flattened into a batch dim B.

    query (B, Hq, L, E), key (B, H, S, E), value (B, H, S, Ev); attn_mask is None or a
    broadcast view (B, Hq, L, S), bool (True takes part) or float (added to the scores),
    whose stride is 0 along every broadcast dim. `out_shape` is the caller's output shape.
    A packed varlen call (variant.sequences.packed) has B = 1 and the sequences' rows along
    L and S.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    out_shape: tuple[int, ...]
    variant: Variant = field(default_factory=Variant)

    @property
    def mask_kind(self) -> str | None:
        """None, "bool" or "float"."""
        if self.attn_mask is None:
            return None
        return "bool" if self.attn_mask.dtype == torch.bool else "float"

    @property
    def kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def kv_len(self) -> int:
        return self.key.shape[2]

    @property
    def value_dim(self) -> int:
        return self.value.shape[3]

    @property
    def sequence_count(self) -> int:
        """B of the kernels: the batch, or the number of ragged sequences."""
        sequences = self.variant.sequences
        return self.batch if sequences is None else sequences.count

    @property
    def sequences(self) -> Sequences:
        """The call's sequences: the ragged ones, or one per batch entry (L queries, S keys)."""
        if self.variant.sequences is not None:
            return self.variant.sequences
        return Sequences.dense(self.batch, self.q_len, self.kv_len, self.variant.align)

    @property
    def offset(self) -> int:
        """o of the alignment: query i's diagonal is key i + o (per sequence for ragged
        calls: see Sequences; this is then the largest |o|, for the feature check)."""
        sequences = self.variant.sequences
        if sequences is not None:
            return int(np.abs(sequences.table.numpy()[:, 5]).max(initial=0))
        return self.kv_len - self.q_len if self.variant.align == "bottom_right" else 0

    @property
    def band(self) -> tuple[int | None, int | None] | None:
        """(left, right) of the band around the diagonal i + o that causality and the window
        leave (None: unbounded side), or None when neither limits the keys."""
        return band(self.is_causal, self.variant.window)

    def features(self) -> set[str]:
        """The features this call needs a backend to declare (see backend.FEATURES)."""
        variant = self.variant
        wanted = {
            "bool_mask": self.mask_kind == "bool",
            "float_mask": self.mask_kind == "float",
            "causal": self.is_causal,
            "bottom_right": self.offset != 0 and (self.band is not None
                                                  or variant.alibi_slopes is not None),
            "gqa": self.q_heads != self.kv_heads,
            "dropout": self.dropout_p > 0,
            "backward": self.needs_grad,
            "varlen": variant.sequences is not None,
            "func_grad": func_grad_active(),
        }  # fmt: skip
        return {name for name, needed in wanted.items() if needed} | variant_features(variant)

    @property
    def has_tensor_variant(self) -> bool:
        """Whether the mask or a variant is a tensor (or a table of this call's sequences):
        values that belong to this call alone, which no forward kept for its metadata holds
        (`Backend.forward_for`)."""
        variant = self.variant
        return (
            self.attn_mask is not None
            or variant.sequences is not None
            or any(getattr(variant, name) is not None for name in TENSOR_KEYWORDS)
        )

    @property
    def has_pairs(self) -> bool:
        """Whether any (query, key) pair exists: zero-size batch, heads or lengths have none
        (head dim 0 still has pairs, of score 0)."""
        sequences = self.variant.sequences
        if sequences is not None:
            table = sequences.table.numpy()
            return self.q_heads > 0 and bool((table[:, 2] * table[:, 4] > 0).any())
        return self.batch * self.q_heads * self.q_len * self.kv_len > 0

    @property
    def has_padding(self) -> bool:
        """Whether some query rows belong to no sequence (a padded batch's padding)."""
        sequences = self.variant.sequences
        return sequences is not None and not sequences.packed

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and self.differentiable

    @property
    def differentiable(self) -> bool:
        """Whether an input requires grad, whatever the grad mode (off inside an
        autograd.Function's forward, where a kernel learns that a backward will follow)."""
        mask, sinks = self.attn_mask, self.variant.sinks  # written out: a generator costs
        return (
            self.query.requires_grad
            or self.key.requires_grad
            or self.value.requires_grad
            or (mask is not None and mask.requires_grad)
            or (sinks is not None and sinks.requires_grad)
        )

    def restore(self, out: Tensor, lse: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Reshape a (B, Hq, L, Ev) result (and its (B, Hq, L) LSE when the call asked for
        it) to the caller's layout: (total_q, Hq, Ev) and (Hq, total_q) for packed calls."""
        if self.variant.sequences is not None and self.variant.sequences.packed:
            out = out[0].transpose(0, 1).contiguous()
            return (out, lse[0]) if self.variant.return_lse else out
        return restore_dense(out, lse, self.out_shape, self.variant.return_lse)


def restore_dense(
    out: Tensor, lse: Tensor | None, out_shape: tuple[int, ...], return_lse: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """A dense call's (B, Hq, L, Ev) result (and (B, Hq, L) LSE) as the caller's out_shape."""
    if out.shape != out_shape:  # no view op where none is needed: short calls pay
        out = out.reshape(out_shape)
    if not return_lse:
        return out
    return out, lse.reshape(out_shape[:-1])


# torch.func transforms whose tensors are wrappers without memory (vmap batches memory).
_GRAD_TRANSFORMS = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


def func_grad_active() -> bool:
    """Whether a torch.func grad or jvp transform is active (vmap alone is not): its
    tensors are wrappers with no memory of their own, and a fused kernel reads memory."""
    if not torch._C._are_functorch_transforms_active():
        return False
    levels = torch._C._functorch.get_interpreter_stack() or ()
    return any(level.key() in _GRAD_TRANSFORMS for level in levels)


def band(
    is_causal: bool, window: tuple[int | None, int | None] | None
) -> tuple[int | None, int | None] | None:
    """(left, right) around the diagonal that causality and the window leave, or None."""
    if not is_causal and window is None:
        return None
    left, right = window or (None, None)
    return left, 0 if is_causal else right


def prepare(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
    *,
    window: object = None,
    softcap: object = None,
    alibi_slopes: object = None,
    block_mask: object = None,
    align: object = "top_left",
    return_lse: object = False,
    sinks: object = None,
) -> AttentionInputs:
    """Check a call against SDPA's contract (and the variant's arguments) and flatten it to
    AttentionInputs.

    Raises TypeError or ValueError naming the offending argument.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_nested or tensor.layout != torch.strided:
            kind = "a nested (jagged) tensor" if tensor.is_nested else f"layout {tensor.layout}"
            raise TypeError(
                f"{name} must be a dense (strided) tensor, got {kind}; pad the sequences "
                "and pass a padding mask instead"
            )
    assert isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"query must be a floating-point tensor (fp16, bf16, fp32, fp64), got {query.dtype}"
        )
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} dtype {tensor.dtype} must match query dtype {query.dtype}")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}")
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        raise ValueError(
            "query, key and value must have the same number of dims, at least 2 "
            f"(..., L, E); got {query.dim()}, {key.dim()} and {value.dim()}"
        )
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    dropout_p = check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    if scale is not None:
        check_scale(scale, 1)
    if align not in ALIGNMENTS:
        raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
    if _is_causal_bias(attn_mask):
        # torch's causal_upper_left / causal_lower_right objects, as SDPA takes them.
        if is_causal:
            raise ValueError("attn_mask (a CausalBias) and is_causal=True cannot be given together")
        attn_mask, is_causal, align = _causal_bias(attn_mask, query, key, align)

    # Heads are dim -3 (absent for 2-D inputs); every dim before them is batch.
    head_axis = () if rank == 2 else (rank - 3,)
    batch_shape = tuple(query.shape[: rank - 2 - len(head_axis)])
    for name, tensor in (("key", key), ("value", value)):
        other = tuple(tensor.shape[: len(batch_shape)])
        if other != batch_shape:
            raise ValueError(
                f"batch dims of {name} {other} must match those of query {batch_shape}"
            )
    q_heads = query.shape[-3] if head_axis else 1
    kv_heads = key.shape[-3] if head_axis else 1
    if head_axis and value.shape[-3] != kv_heads:
        raise ValueError(f"key has {kv_heads} heads (dim -3) but value has {value.shape[-3]}")
    if q_heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"query has {q_heads} heads but key/value have {kv_heads}; "
                "pass enable_gqa=True for grouped-query attention"
            )
        if kv_heads == 0 or q_heads % kv_heads:
            raise ValueError(
                f"enable_gqa needs key/value heads ({kv_heads}) to divide query heads ({q_heads})"
            )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"key embedding dim E={key.shape[-1]} (last dim) must match query's E={query.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key sequence length S={key.shape[-2]} (dim -2) must match value's S={value.shape[-2]}"
        )

    batch = math.prod(batch_shape)
    q_len, kv_len, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    mask4 = None
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be given together")
        full_shape = (*batch_shape, *((q_heads,) if head_axis else ()), q_len, kv_len)
        mask4 = _prepare_mask(attn_mask, query, full_shape, len(batch_shape), (batch, q_heads))

    variant = Variant(
        window=check_window(window),
        align=align,
        softcap=check_softcap(softcap),
        alibi_slopes=check_alibi_slopes(alibi_slopes, query, batch_shape, q_heads, batch),
        block_mask=_block_mask(block_mask, query, batch, q_heads, q_len, kv_len),
        return_lse=check_flag("return_lse", return_lse),
        sinks=check_sinks(sinks, query.device, q_heads),
    )
    return AttentionInputs(
        query=query.reshape(batch, q_heads, q_len, head_dim),
        key=key.reshape(batch, kv_heads, kv_len, head_dim),
        value=value.reshape(batch, kv_heads, kv_len, value.shape[-1]),
        attn_mask=mask4,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=check_scale(scale, head_dim),
        enable_gqa=enable_gqa,
        out_shape=(*query.shape[:-1], value.shape[-1]),
        variant=variant,
    )


def check_window(window: object) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a (left, right) pair, got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, (bool, np.bool_))
                                 or not isinstance(side, numbers.Integral)):  # fmt: skip
            raise TypeError(f"window sides must be ints >= 0 or None, got {window!r}")
        if side is not None and side < 0:
            raise ValueError(f"window sides must be >= 0 (None: unbounded), got {window!r}")
    return tuple(None if side is None else int(side) for side in window)


def check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    value = check_real("softcap", softcap, "a float > 0 or None")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a finite float > 0, got {softcap!r}")
    return value


def check_alibi_slopes(
    slopes: object, query: Tensor, batch_shape: tuple[int, ...], q_heads: int, batch: int
) -> Tensor | None:
    """The slopes as a (B, Hq) float32 tensor."""
    if slopes is None:
        return None
    if not isinstance(slopes, Tensor) or slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {describe_type(slopes)}")
    if slopes.device != query.device:
        raise ValueError(f"alibi_slopes is on {slopes.device} but query is on {query.device}")
    if tuple(slopes.shape) not in ((q_heads,), (*batch_shape, q_heads)):
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = ({q_heads},) or (*batch, Hq) = "
            f"{(*batch_shape, q_heads)}, got {tuple(slopes.shape)}"
        )
    if slopes.requires_grad:
        raise ValueError("alibi_slopes must not require grad: no gradient is computed for them")
    return slopes.reshape(-1, q_heads).expand(batch, q_heads).contiguous()


def check_sinks(sinks: object, device: torch.device, q_heads: int) -> Tensor | None:
    """The sinks as given: a floating-point (Hq,) tensor on the call's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {describe_type(sinks)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but the call is on {device}")
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(
            f"sinks must have shape (Hq,) = ({q_heads},), one logit per query head, got "
            f"{tuple(sinks.shape)}"
        )
    return sinks


def _block_mask(
    mask: object, query: Tensor, batch: int, q_heads: int, q_len: int, kv_len: int
) -> BlockMask | None:
    if mask is None:
        return None
    if not isinstance(mask, BlockMask):
        raise TypeError(f"block_mask must be an attnperf.BlockMask, got {type(mask).__name__}")
    b, h, length, kv = mask.shape
    if (length, kv) != (q_len, kv_len) or b not in (1, batch) or h not in (1, q_heads):
        raise ValueError(
            f"block_mask is for (B, H, L, S) = {mask.shape}, which does not fit the call's "
            f"(B, Hq, L, S) = {(batch, q_heads, q_len, kv_len)} (B and H may be 1)"
        )
    if mask.kinds.device != query.device:
        raise ValueError(f"block_mask is on {mask.kinds.device} but query is on {query.device}")
    return mask


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_real(name: str, value: object, expected: str = "a float") -> float:
    """A Python or numpy real number as a float (bools are refused, as SDPA does)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return float(value)


def _is_causal_bias(mask: object) -> bool:
    # Imported only where the caller made one: the module imports triton.
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def _causal_bias(bias: Tensor, query: Tensor, key: Tensor, align: str) -> tuple[None, bool, str]:
    """(attn_mask, is_causal, align) for one of torch's CausalBias objects: causal, in-kernel,
    aligned as the object says."""
    shape = (bias.seq_len_q, bias.seq_len_kv)
    if shape != (query.shape[-2], key.shape[-2]):
        raise ValueError(
            f"attn_mask is a CausalBias for (L, S) = {shape}, but query and key have "
            f"(L, S) = {(query.shape[-2], key.shape[-2])}"
        )
    upper_left = sys.modules["torch.nn.attention.bias"].CausalVariant.UPPER_LEFT
    aligned = "top_left" if bias.variant == upper_left else "bottom_right"
    if align != "top_left" and align != aligned and shape[0] != shape[1]:
        raise ValueError(f"attn_mask is a {aligned} CausalBias but align={align!r} was given")
    return None, True, aligned


def check_scale(scale: object, head_dim: int) -> float:
    """The scale as a float: 1 / sqrt(E) when None, else a finite real number."""
    if scale is None:
        # E = 0: every score is an empty sum, 0, whatever the scale; SDPA gives the mean of V.
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    value = check_real("scale", scale, "a float or None")
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale}")
    return value


def _prepare_mask(
    mask: object,
    query: Tensor,
    full_shape: tuple[int, ...],
    batch_dims: int,
    batch_and_heads: tuple[int, int],
) -> Tensor:
    """Broadcast the mask to (B, Hq, L, S) as a view; only its own batch dims may be copied."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"attn_mask must be bool or floating point matching query ({query.dtype}) "
            f"or float32, got {mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(f"attn_mask is on {mask.device} but query is on {query.device}")
    try:
        broadcast = torch.broadcast_shapes(mask.shape, full_shape)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(full_shape):
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
            f"(..., Hq, L, S) = {full_shape}"
        )
    mask = mask.reshape((1,) * (len(full_shape) - mask.dim()) + tuple(mask.shape))
    batch, heads = batch_and_heads
    own = tuple(mask.shape[batch_dims:])
    if any(size != 1 for size in mask.shape[:batch_dims]):
        # Flattening batch dims of which only some are broadcast cannot be a view:
        # this copies the mask over its batch dims only, never over heads, L or S.
        mask = mask.expand(*full_shape[:batch_dims], *own).reshape(batch, *own)
    else:
        mask = mask.reshape(1, *own)
    if len(own) == 2:  # 2-D inputs have no head dim
        mask = mask.unsqueeze(1)
    return mask.expand(batch, heads, full_shape[-2], full_shape[-1])
