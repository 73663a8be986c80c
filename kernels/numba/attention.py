"""numba's attention launchers: a call's forward route (BLAS tiles, the packed micro-kernel
forward, fp32 transposed or AMX; `DenseForward`) and backward (fp32 or bf16 tiles, two
passes or one fused), chosen and bound to the call's tensors. The jitted kernels live in
one module per route: softmax (the walk they share), forward_rows, forward_fp32,
forward_amx, backward_fp32, backward_bf16."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch
from torch import Tensor

from attnperf.backend import ROUNDED_DTYPES, rounded_output
from attnperf.inputs import AttentionInputs
from attnperf.kernels.numba.amx import TILE_PAIRS
from attnperf.kernels.numba.backward_bf16 import (
    bf16_backward_dkdv,
    bf16_backward_dq,
    bf16_backward_fused,
    pack_bf16_backward,
)
from attnperf.kernels.numba.backward_fp32 import (
    attention_backward_dkdv,
    attention_backward_dq,
    attention_backward_fused,
    pack_panels,
    softmax_delta,
)
from attnperf.kernels.numba.forward_amx import amx_forward, amx_workspace_bytes
from attnperf.kernels.numba.forward_fp32 import fp32_forward, fp32_workspace_bytes
from attnperf.kernels.numba.forward_rows import (
    online_softmax_forward,
    packed_forward,
    packed_workspace_bytes,
)
from attnperf.kernels.numba.jit import serial
from attnperf.kernels.numba.launch import (
    any_layout,
    as_bf16_bits,
    as_fp32,
    as_numpy,
    empty_output,
    float32_array,
    fp32_operand,
    memory_at,
    memory_of,
    run_parallel,
    scratch,
    stats_output,
    strided_memory,
    zero_memory,
)
from attnperf.kernels.numba.microkernels import BF16, FP32, LANES, tile_route
from attnperf.kernels.numba.softmax import F32, U16, forward_items, scores_by_rows
from attnperf.kernels.numba.tiles import OWN_TILES, tiles_flag
from attnperf.kernels.numba.variant import LoweredVariant, longest_in_table, lower_variant

# Tile sizes: of 64/128/256 x 128/256/512, 128 x 512 was as fast as any, causal or not,
# forward or backward; square tiles lost causal too: a causal query tile stops its last key
# tile at its own diagonal, so wide key tiles waste at most a triangle.
BLOCK_M = 128
BLOCK_N = 512
# A band bounded on both sides (a sliding window): a tile sees its rows' window plus a
# triangle on each side, which smaller tiles shrink: the fastest measured, forward 64 x
# 512, backward (which walks a key tile's query rows) 64 x 128.
BANDED_BLOCK_M = 64
BANDED_BACKWARD_BLOCK_N = 128
# Query rows of a call's tiles where whole ones (BLOCK_M) leave a thread fewer than two.
SHORT_CALL_BLOCK_M = 64


def tensor_rows_apart(tensor: Tensor) -> bool:
    """`rows_apart` of a tensor: whether its rows (its last dim) do not lie side by side."""
    return tensor.stride(-2) != tensor.shape[-1]


def rows_side_by_side(tensor: Tensor) -> Tensor:
    """`tensor` itself where its rows lie side by side, else a contiguous copy: the
    backward's products read Q, K, V and dO rows in place, and rows a head apart ((B, L, H,
    E) transposed) fall into a few of L1's sets and slowed the backward; one copy of each
    is O(L E), the backward O(L^2 E)."""
    return tensor.contiguous() if tensor_rows_apart(tensor) else tensor


class DenseForward:
    """numba's forward for calls of one metadata: what a call's metadata decides (the
    micro-kernel kind, the kernel, its tiles and threads' workspace, the variant of a call
    without tensor variants) worked out once; a call binds its own q, k, v, which the kernel
    reads in place at their strides (`strided_memory`). attnperf.plans keeps one per call
    metadata (`Backend.forward_for`): working it out per call cost a short call more than
    its kernel.

    forward(query, key, value) -> (out (B, Hq, L, Ev) in the inputs' dtype, softmax stats
    (B, Hq, L, 2) fp32: each row's base-2 max and sum, 0 and 0 for a row that sees no key,
    residual: a bf16 or fp16 out's rounding residual where an input requires grad, else
    None), of a call with the metadata it was made for, whose q, k, v are all it holds
    besides; stats None where made with keep_stats=False (`numba_forward_for`: for calls
    that read none), unless too large to keep (`stats_output`)."""

    def __init__(self, inputs: AttentionInputs, keep_stats: bool = True):
        self.kind = kind = forward_kind(inputs)
        self.keep_stats = keep_stats
        # bf16 and fp16 outputs with a gradient to come: their rounding residual for the
        # backward (`rounding_residual`).
        self.keep_residual = inputs.differentiable and inputs.dtype in ROUNDED_DTYPES
        self.dtype, self.value_dim, self.scale = inputs.dtype, inputs.value_dim, inputs.scale
        # The bf16 tiles take E in pairs: an odd E runs on a zero column more (`bf16_operand`).
        head_dim = inputs.head_dim + (kind == BF16 and inputs.head_dim % 2)
        value_dim = inputs.value_dim + (kind == BF16 and inputs.value_dim % 2)
        self.out_shape = (*inputs.query.shape[:3], value_dim)
        # bf16 calls on our tiles write their output rounded (the kernel's last pass), and
        # its rounding residual where a backward will read it.
        self.out_dtype = torch.bfloat16 if kind == BF16 else torch.float32
        self.stats_shape = (*self.out_shape[:3], 2)
        # The strides of the last call's q, k, v read in place, and their memory but for
        # its address (`operands`).
        self.layout = None
        # Without pairs no key is seen: zeros (with sinks the kernel still writes each row's
        # sink term), nor by a padded batch's padding rows.
        no_work = not inputs.has_pairs and inputs.variant.sinks is None
        self.zero = no_work or inputs.has_padding
        self.kernel, self.variant, self.workspace, self.blocks = None, None, None, ()
        self.parallel = True
        if no_work:
            return
        self.variant = variant = lower_variant(inputs)
        if kind is None:
            self.kernel, self.blocks = online_softmax_forward, tile_sizes(inputs)
            return
        self.blocks = block_m, _ = short_call_tiles(inputs, variant)
        # On the threads wherever there are two query tiles to share: faster even at a
        # call of two heads of 64 rows.
        self.parallel = query_tiles(inputs, variant, block_m) >= 2
        # Room to copy a kv head's rows side by side where the first call's lie apart
        # (`rows_apart`; a later call of other strides runs without it if it must).
        apart = tensor_rows_apart(inputs.key) or tensor_rows_apart(inputs.value)
        if kind == BF16 and amx_tiles(inputs):
            size = amx_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                       *self.blocks, scores_by_rows(variant), apart)  # fmt: skip
            parallel = amx_forward
        elif kind == FP32 and transposed_fp32():
            size = fp32_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                        *self.blocks, scores_by_rows(variant), apart)  # fmt: skip
            parallel = fp32_forward
        else:
            like = U16 if kind == BF16 else F32
            size = packed_workspace_bytes(longest_in_table(variant, 4), head_dim, value_dim,
                                          *self.blocks, like)  # fmt: skip
            parallel = packed_forward
        # A workspace row per thread (`amx_forward`, `packed_forward`).
        runs = torch.get_num_threads() if self.parallel else 1
        self.workspace = ("forward workspace", (runs, size), np.uint8)
        self.kernel = parallel if self.parallel else serial(parallel)

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        operands, _alive = self.operands(query, key, value)  # converted copies: to the end
        out = empty_output(self.out_shape, self.out_dtype)
        stats, stats_memory = stats_output(self.stats_shape, self.keep_stats)
        residual, residual_memory = None, _no_residual()[1]
        if self.keep_residual and self.kind == BF16:
            residual = empty_output(self.out_shape, torch.bfloat16)
            residual_memory = memory_of(residual)
        if self.zero:
            for tensor in (out, stats, residual):
                if tensor is not None:
                    zero_memory(tensor)
        if self.kernel is not None:
            memory = (*operands, memory_at(out, self.out_shape), stats_memory, residual_memory)
            workspace = () if self.workspace is None else (scratch(*self.workspace),)
            args = (memory, *workspace, self.variant, self.scale, *self.blocks)
            if self.parallel:
                run_parallel(self.kernel, *args)
            else:
                self.kernel(*args)
        if self.out_shape[3] != self.value_dim:  # a bf16 call of odd E ran on a zero column more
            out = out[..., : self.value_dim].contiguous()
            residual = None if residual is None else residual[..., : self.value_dim].contiguous()
        if self.out_dtype != self.dtype:  # fp32 tiles' output: rounded here, its residual kept
            out, residual = rounded_output(out, self.dtype, self.keep_residual)
        return out, stats, residual

    def operands(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[tuple[tuple, ...], tuple[Tensor, ...]]:
        """(the `strided_memory` of q, k and v as the kernel reads them, the tensors it is
        of: each converted where it must be, `bf16_operand` or `fp32_operand`, and kept
        alive by the caller through the kernel). Where the three are read in place, a call
        of the last such call's strides reuses their memory's shape and strides: a model's
        calls, layer after layer, repeat one layout, and the checks are a visible part of a
        short call."""
        tensors = (query, key, value)
        strides = (query.stride(), key.stride(), value.stride())
        layout = self.layout  # read once: another thread may replace it
        if layout is not None and layout[0] == strides:
            q_tail, k_tail, v_tail = layout[1]
            memory = ((query.data_ptr(), *q_tail), (key.data_ptr(), *k_tail),
                      (value.data_ptr(), *v_tail))  # fmt: skip
            return memory, tensors
        operand = bf16_operand if self.kind == BF16 else fp32_operand
        kept = tuple(map(operand, tensors))
        memory = tuple(map(strided_memory, kept))
        if all(map(operator.is_, kept, tensors)):
            self.layout = (strides, tuple(m[1:] for m in memory))
        return memory, kept


@functools.cache
def _no_residual() -> tuple[Tensor, tuple]:
    """An empty bf16 residual and its memory: the forward kernels' where none is kept."""
    empty = torch.empty((0, 0, 0, 0), dtype=torch.bfloat16)
    return empty, memory_of(empty)


def numba_attention_forward(inputs: AttentionInputs) -> tuple[Tensor, Tensor, Tensor | None]:
    """(out (B, Hq, L, Ev) in the inputs' dtype, softmax stats (B, Hq, L, 2) fp32: each
    row's base-2 max and sum, 0 and 0 for a row that sees no key, a bf16 or fp16 out's
    rounding residual or None: `DenseForward`)."""
    return DenseForward(inputs)(inputs.query, inputs.key, inputs.value)


def numba_forward_for(inputs: AttentionInputs) -> DenseForward | None:
    """numba's `Backend.forward_for`: the forward for calls with `inputs`' metadata, where
    no variant is a tensor (a mask, ALiBi slopes, a block layout or sinks: the kernel's
    variant holds their values), else None. Its calls' metadata fixes whether they read the
    stats (a gradient to come, the LSE asked): where not, it returns None for them."""
    if inputs.has_tensor_variant:
        return None
    return DenseForward(inputs, keep_stats=inputs.needs_grad or inputs.variant.return_lse)


def query_tiles(inputs: AttentionInputs, variant: LoweredVariant, block_m: int) -> int:
    """The forward's work items: (sequence, query head, query tile) triples."""
    return forward_items(variant, inputs.q_heads, block_m)


def short_call_tiles(inputs: AttentionInputs, variant: LoweredVariant) -> tuple[int, int]:
    """`tile_sizes`, with SHORT_CALL_BLOCK_M query rows where whole tiles leave a thread
    fewer than two (a third faster there)."""
    block_m, block_n = tile_sizes(inputs)
    if query_tiles(inputs, variant, block_m) < 2 * torch.get_num_threads():
        block_m = min(block_m, SHORT_CALL_BLOCK_M)
    return block_m, block_n


def forward_kind(inputs: AttentionInputs) -> int | None:
    """The forward's micro-kernel kind: BF16 for bf16 inputs where the CPU has the bf16 dot
    product (AMX's or AVX-512's), FP32 where our fp32 tiles serve, None for BLAS tiles."""
    if inputs.dtype == torch.bfloat16 and tile_route("bf16")[0] in ("amx", "avx512-bf16"):
        return BF16
    return FP32 if tiles_flag() == OWN_TILES else None


def transposed_fp32() -> bool:
    """Whether the fp32 forward holds its scores transposed (`fp32_forward`): where our
    micro-kernels run AVX-512 (its softmax's `column_maxima` and `exp2_columns`); by rows
    (`packed_forward`) on AVX2."""
    return tile_route("fp32")[0] == "avx512"


def amx_tiles(inputs: AttentionInputs) -> bool:
    """Whether a bf16 call's dense products run on AMX tiles (the forward's two, the
    backward's five): where the route is AMX and both head dims fill whole steps of depth
    (multiples of 32); vdpbf16ps micro-kernels otherwise."""
    step = 2 * TILE_PAIRS
    return (
        tile_route("bf16")[0] == "amx"
        and inputs.head_dim % step == 0
        and inputs.value_dim % step == 0
    )


def bf16_bits(tensor: Tensor) -> np.ndarray:
    """`as_bf16_bits` of `bf16_operand`: zero-padded to an even E (the micro-kernel takes
    depth in pairs)."""
    return as_bf16_bits(bf16_operand(tensor))


def bf16_operand(tensor: Tensor) -> Tensor:
    """A bf16 tensor as the bf16 tiles read it: itself where E is even and of unit stride,
    else zero-padded to an even E, contiguous (detached; as `fp32_operand`)."""
    if tensor.shape[-1] % 2:
        return torch.nn.functional.pad(tensor.detach(), (0, 1))
    return tensor if tensor.stride(-1) == 1 else tensor.detach().contiguous()


def tile_sizes(inputs: AttentionInputs, backward: bool = False) -> tuple[int, int]:
    """(query rows, keys) of the kernels' tiles for this call."""
    if inputs.band is None or None in inputs.band:
        return BLOCK_M, BLOCK_N
    return BANDED_BLOCK_M, min(BANDED_BACKWARD_BLOCK_N, BLOCK_N) if backward else BLOCK_N


def transposed_panels(k, v, variant) -> tuple[np.ndarray, np.ndarray]:
    """K and V packed once as panels for the backward's two products against their
    transposes (S = Q K^T, dP = dO V^T) on our tiles; empty on BLAS tiles."""
    if variant.tiles != OWN_TILES:
        empty = np.zeros((0, 0, 0, 0, 0), np.float32)
        return empty, empty
    count, kv_heads = variant.sequences.shape[0], k.shape[1]
    panels = (longest_in_table(variant, 4) + LANES - 1) // LANES
    packed = []
    for slot, x in (("key panels", k), ("value panels", v)):
        x_panels = scratch(slot, (count, kv_heads, panels, x.shape[3], LANES), np.float32)
        run_parallel(pack_panels, any_layout(x), variant, x_panels)
        packed.append(x_panels)
    return packed[0], packed[1]


def bf16_backward_operands(q, k, v, do, variant) -> tuple[np.ndarray, ...]:
    """`pack_bf16_backward`'s operands, packed: (key panels, value panels, key pairs, Q^T,
    dO^T) from bf16 bits of even E."""
    count, q_heads, kv_heads = variant.sequences.shape[0], q.shape[1], k.shape[1]
    longest_keys, longest_queries = longest_in_table(variant, 4), longest_in_table(variant, 2)
    panels = (longest_keys + LANES - 1) // LANES
    # AMX's products read a step of 32 keys or query rows past a tile's last: zeros there.
    pairs, columns = (longest_keys + 1) // 2 + TILE_PAIRS, longest_queries + 1 + 2 * TILE_PAIRS
    operands = (
        scratch("key panels", (count, kv_heads, panels, k.shape[3] // 2, 2 * LANES), np.uint16),
        scratch("value panels", (count, kv_heads, panels, v.shape[3] // 2, 2 * LANES), np.uint16),
        scratch("key pairs", (count, kv_heads, pairs, 2 * k.shape[3]), np.uint16),
        scratch("Q^T", (count, q_heads, q.shape[3], columns), np.uint16),
        scratch("dO^T", (count, q_heads, do.shape[3], columns), np.uint16),
    )
    run_parallel(pack_bf16_backward, *map(any_layout, (q, k, v, do)), variant, operands)
    return operands


def fused_backward_pays(items: int, threads: int) -> bool:
    """Whether the one-pass backward beats the two passes for `items` (batch, kv head) pairs.

    The one pass computes 5 tile products per (query tile, key tile), the two passes 7 (P and
    dP twice), but it has only `items` to share out: it pays while they keep at least 3/4 of
    the threads busy.
    """
    return items > 0 and items / (threads * math.ceil(items / threads)) >= 0.75


def numba_attention_backward(
    inputs: AttentionInputs,
    out: Tensor,
    stats: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None = None,
    fused: bool | None = None,
    partial_keys: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, dmask or None) in the inputs' dtypes, by FlashAttention-2 recomputation:
    on bf16 tiles for bf16 inputs where the forward runs on them (`forward_kind`), P and dS
    rounded to bf16 there, else on fp32 tiles. `grad_lse` (B, Hq, L), the LSE's gradient,
    only shifts delta = rowsum(dO * O).

    `fused`: one pass over (batch, kv head) items, or a dq pass and a dk/dv pass over tiles;
    None picks the fused pass where it pays (`fused_backward_pays`). `partial_keys`: out and
    stats are a larger attention's, of which the call's keys are a part (ring attention's
    blocks), so a row's P over them sums short of 1.
    """
    bf16 = forward_kind(inputs) == BF16
    query, key = inputs.query, inputs.key
    if inputs.head_dim == 0:  # the same zero scores on one zero column: numba types a
        # zero-size array as contiguous, and compiled every backward kernel anew for it
        query, key = (torch.nn.functional.pad(t.detach(), (0, 1)) for t in (query, key))
    if bf16:  # on bf16 tiles: the bits (E even), dO in bf16 as FlashAttention takes it
        grad_out = grad_out.to(torch.bfloat16)
        q, k, v, do = map(bf16_bits, (query, key, inputs.value, grad_out))
    else:
        q, k, v, do = (as_numpy(rows_side_by_side(fp32_operand(t)))
                       for t in (query, key, inputs.value, grad_out))  # fmt: skip
    variant = lower_variant(inputs)
    stats = as_numpy(stats.contiguous())
    no_lse = np.zeros((0, 0, 0), np.float32)
    lse_grad = no_lse if grad_lse is None else as_numpy(grad_lse.detach().float().contiguous())
    # (tensor, array): kept bound while the kernels run, as the tensor owns the array's memory.
    delta_buffer = float32_array(stats.shape[:3])
    delta = delta_buffer[1]
    (dq, dq_array), (dk, dk_array), (dv, dv_array) = (
        float32_array(t.shape, zero=True) for t in (q, k, v)
    )
    want_dmask = inputs.mask_kind == "float" and inputs.attn_mask.requires_grad
    dmask_shape = inputs.attn_mask.shape if want_dmask else (0, 0, 0, 0)
    dmask, dmask_array = float32_array(dmask_shape, zero=True)
    if fused is None:
        fused = fused_backward_pays(
            inputs.sequence_count * inputs.kv_heads, torch.get_num_threads()
        )
    if inputs.has_pairs:
        blocks = tile_sizes(inputs, backward=True)
        # On fp32 tiles, where one key tile holds every key a row sees, the tiles correct
        # delta (`score_gradients`' whole rows); not where a dLSE, a sink's share of the
        # softmax (whose dP is 0) or other keys' would enter it.
        whole_rows = (
            not bf16 and grad_lse is None and inputs.variant.sinks is None and not partial_keys
            and longest_in_table(variant, 4) <= blocks[1]
        )  # fmt: skip
        do_fp32 = as_fp32(grad_out) if bf16 else do
        run_parallel(softmax_delta, as_fp32(out), do_fp32, stats, lse_grad, delta)
        if bf16:
            common = (any_layout(q), any_layout(do), bf16_backward_operands(q, k, v, do, variant),
                      variant, inputs.scale, stats, delta)  # fmt: skip
            amx = amx_tiles(inputs)
            if fused:
                run_parallel(bf16_backward_fused, *common, dq_array, dk_array, dv_array,
                             dmask_array, *blocks, amx)  # fmt: skip
            else:
                run_parallel(bf16_backward_dq, *common, dq_array, dmask_array, *blocks, amx)
                run_parallel(bf16_backward_dkdv, *common, dk_array, dv_array, *blocks, amx)
        else:
            common = (*map(any_layout, (q, k, v)), transposed_panels(k, v, variant), variant,
                      inputs.scale, stats, any_layout(do), delta, whole_rows)  # fmt: skip
            if fused:
                grads = dq_array, dk_array, dv_array, dmask_array
                run_parallel(attention_backward_fused, *common, *grads, *blocks)
            else:
                run_parallel(attention_backward_dq, *common, dq_array, dmask_array, *blocks)
                run_parallel(attention_backward_dkdv, *common, dk_array, dv_array, *blocks)
    if bf16 or inputs.head_dim == 0:  # E = 0 or an odd E (bf16) ran on a zero column more
        dq, dk = dq[..., : inputs.head_dim], dk[..., : inputs.head_dim]
        dv = dv[..., : inputs.value_dim]
    dmask = dmask.to(inputs.attn_mask.dtype) if want_dmask else None
    return dq.to(inputs.dtype), dk.to(inputs.dtype), dv.to(inputs.dtype), dmask
