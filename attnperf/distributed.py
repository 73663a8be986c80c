"""Exact ring (context-parallel) attention over torch.distributed.

Each rank holds a shard of the sequence (its queries, keys and values) in a layout:
"contiguous" (rank r holds chunk r of W) or "zigzag" (the sequence cut into 2W chunks, rank r
holding chunks r and 2W - 1 - r, so that every rank does the same causal work). K/V shards
travel around the ring (the next step's sent and received while the current one computes);
each rank attends its queries to each K/V shard, one (query chunk, key chunk) block at a
time, skipping the blocks that causality or the window leave empty and masking only those
they cut, and merges the partial results by their LSEs in float32 (`merge_attention`'s
rule): exact, with O(L / W) memory per rank. The backward runs each block's backward
against the final (out, lse), keeps dQ local and sends dK/dV around the ring back to their
owners.

    torchrun --nproc-per-node 4 train.py   # CPU: gloo; GPU: NCCL, one GPU per rank
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from attnperf import dispatch
from attnperf.api import merge_attention
from attnperf.backend import (
    Backend,
    FusedBackend,
    exact_output,
    lse_from_stats,
    rounded_output,
    sink_gradient,
    stats_from_lse,
)
from attnperf.inputs import (
    AttentionInputs,
    Sequences,
    band,
    check_sinks,
    check_softcap,
    check_window,
    prepare,
)

LAYOUTS = ("contiguous", "zigzag")
KV_TAG, DKV_TAG = 1, 2
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _group(group) -> tuple[int, int]:
    """(rank, world size) in `group`; a clear error without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attnperf.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group (gloo on CPU, nccl on GPU) first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks(layout: str, rank: int, world: int, local_len: int) -> list[tuple[int, int, int]]:
    """This rank's chunks of the sequence: (local start, global start, length) each."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    half = local_len // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def shard_sequence(x: Tensor, dim: int, *, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's shard of the whole sequence `x` along `dim` in `layout` (a view for
    "contiguous", a copy for "zigzag")."""
    rank, world = _group(group)
    _check_layout(layout)
    length = x.shape[dim]
    parts = world if layout == "contiguous" else 2 * world
    if length % parts:
        raise ValueError(
            f"a sequence of {length} tokens (dim {dim}) does not split into {parts} equal "
            f"chunks, as layout={layout!r} over {world} ranks needs"
        )
    pieces = x.chunk(parts, dim)
    if layout == "contiguous":
        return pieces[rank]
    return torch.cat((pieces[rank], pieces[parts - 1 - rank]), dim)


def gather_sequence(x: Tensor, dim: int, *, group=None, layout: str = "zigzag") -> Tensor:
    """The whole sequence from every rank's shard `x` (the inverse of shard_sequence), on
    every rank; differentiable (each rank's gradient flows back to its own shard)."""
    from torch.distributed.nn.functional import all_gather

    _group(group)
    _check_layout(layout)
    lengths = _all_gather_ints([x.shape[dim]], group)
    if len({row[0] for row in lengths}) != 1:
        raise ValueError(f"gather_sequence needs shards of one length on every rank, got "
                         f"{[row[0] for row in lengths]} along dim {dim}")  # fmt: skip
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"a zigzag shard holds 2 equal chunks: its length (dim {dim}) must be "
                         f"even, got {x.shape[dim]}")  # fmt: skip
    shards = all_gather(x.contiguous(), group=group or dist.group.WORLD)
    if layout == "contiguous":
        return torch.cat(shards, dim)
    halves = [shard.chunk(2, dim) for shard in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def _all_gather_ints(values: list[int], group) -> list[list[int]]:
    """Every rank's `values` (a few ints): one small all_gather."""
    _, world = _group(group)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [row.tolist() for row in every]


@dataclass
class RingTimes:
    """Where the last ring_attention call's time went on this rank (forward, backward)."""

    compute_s: float = 0.0
    wait_s: float = 0.0  # blocked on a receive that the computation did not hide
    steps: int = 0


LAST_TIMES = {"forward": RingTimes(), "backward": RingTimes()}


@dataclass(frozen=True)
class RingCall:
    """A validated ring_attention call: what every block call shares."""

    rank: int
    world: int
    group: object
    layout: str
    is_causal: bool
    scale: float | None
    window: tuple[int | None, int | None] | None
    softcap: float | None
    backend: Backend | None
    return_lse: bool

    @property
    def band(self) -> tuple[int | None, int | None] | None:
        """(left, right) around the global diagonal, or None (see attnperf.inputs.band)."""
        return band(self.is_causal, self.window)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    layout: str = "zigzag",
    backend: str = "auto",
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """This rank's shard of exact attention over the whole sequence, sharded across `group`.

    q (B, Hq, L_local, E), k/v (B, H, S_local, E): this rank's shard in `layout` (see
    shard_sequence); returns out (B, Hq, L_local, Ev) (and the natural-log LSE (B, Hq,
    L_local) float32 with return_lse). Positions are global: is_causal and window=(left,
    right) apply to the whole sequence (query i sees key j iff i - left <= j <= i + right,
    j <= i when causal), softcap and sinks (Hq,) as in `attention` (the sinks applied once,
    after the merge; their gradient is this rank's rows' share); H divides Hq (GQA).
    Differentiable. Every rank must call it with shards of one length, dtype and shape.
    """
    rank, world = _group(group)
    _check_layout(layout)
    window, softcap = check_window(window), check_softcap(softcap)
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a (B, heads, L_local, E) tensor")
    local = prepare(
        q,
        k,
        v,
        None,
        0.0,
        is_causal,
        scale,
        q.shape[1] != k.shape[1],
        window=window,
        softcap=softcap,
    )  # fmt: skip; validates shapes and dtypes
    if (is_causal or window is not None) and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal and windowed ring attention shard queries and keys alike: "
                         f"L_local ({q.shape[2]}) must equal S_local ({k.shape[2]})")  # fmt: skip
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"layout='zigzag' holds 2 equal chunks per rank: L_local must be even, "
                         f"got {q.shape[2]} (the sequence must split into 2W chunks)")  # fmt: skip
    check_sinks(sinks, q.device, q.shape[1])
    _check_ranks_agree(q, k, v, group)
    call = RingCall(rank, world, group, layout, is_causal, scale, window, softcap, None,
                    return_lse)  # fmt: skip
    # The diagonal block asks for every feature that any block will (its band cut, the LSE).
    diagonal = _block(local.query, local.key, local.value, 0, 0, call)
    call = replace(call, backend=dispatch.select(diagonal, backend))
    out, lse = RingAttention.apply(call, q, k, v, sinks)
    return (out, lse) if return_lse else out


def _check_ranks_agree(q: Tensor, k: Tensor, v: Tensor, group) -> None:
    """One small all_gather at the first step: shard shapes and dtypes equal on every rank."""
    mine = [DTYPE_CODES[q.dtype], *q.shape, *k.shape, *v.shape]
    every = _all_gather_ints(mine, group)
    names = ("dtype", "q", "k", "v")
    for r, row in enumerate(every):
        if row == mine:
            continue
        if row[0] != mine[0]:
            dtypes = {code: dtype for dtype, code in DTYPE_CODES.items()}
            raise ValueError(f"q/k/v dtype differs across ranks: {q.dtype} here, "
                             f"{dtypes[row[0]]} on rank {r}")  # fmt: skip
        for name, start in zip(names[1:], (1, 5, 9), strict=True):
            if row[start : start + 4] != mine[start : start + 4]:
                raise ValueError(
                    f"{name} shards differ across ranks: {tuple(mine[start : start + 4])} here, "
                    f"{tuple(row[start : start + 4])} on rank {r}; ring attention needs shards "
                    "of one length (and shape) on every rank"
                )


def _block(
    q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, call: RingCall
) -> AttentionInputs | None:
    """The call (with its LSE) of queries at global positions q_start.. against keys at
    k_start..: None when the band leaves them nothing, a plain call when it leaves them
    everything, else one with the band at the global diagonal (offset q_start - k_start)."""
    band, scale, softcap, gqa = call.band, call.scale, call.softcap, q.shape[1] != k.shape[1]
    plain = prepare(q, k, v, None, 0.0, False, scale, gqa, softcap=softcap, return_lse=True)
    if band is None:
        return plain
    left, right = band
    nearest = k_start - (q_start + q.shape[2] - 1)  # the smallest key - query distance
    farthest = k_start + k.shape[2] - 1 - q_start
    if (right is not None and nearest > right) or (left is not None and farthest < -left):
        return None
    if (right is None or farthest <= right) and (left is None or nearest >= -left):
        return plain
    banded = prepare(q, k, v, None, 0.0, False, scale, gqa, window=band, softcap=softcap,
                     return_lse=True)  # fmt: skip
    count = q.shape[0]
    rows = torch.tensor([[0, 0, q.shape[2], 0, k.shape[2], q_start - k_start]]).repeat(count, 1)
    rows[:, 0] = torch.arange(count)
    return replace(banded, variant=replace(banded.variant, sequences=Sequences(rows, False)))


def _exchange(
    tensors: list[Tensor], rank: int, world: int, group, tag: int
) -> tuple[list, list[Tensor]]:
    """Send `tensors` to the next rank and receive as many from the previous one, started
    now: (requests to wait on, the receive buffers). K/V and dK/dV travel under their own
    tags."""
    buffers = [torch.empty_like(t) for t in tensors]
    following, previous = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        following = dist.get_global_rank(group, following)
        previous = dist.get_global_rank(group, previous)
    ops = [dist.P2POp(dist.isend, t, following, group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, previous, group, tag) for b in buffers]
    return dist.batch_isend_irecv(ops), buffers


def _wait(requests: list, times: RingTimes) -> None:
    start = time.perf_counter()
    for request in requests:
        request.wait()
    times.wait_s += time.perf_counter() - start


class RingAttention(torch.autograd.Function):
    """(out, lse) of ring attention; backward sends dK/dV home around the ring."""

    @staticmethod
    def forward(ctx, call: RingCall, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None):
        times = LAST_TIMES["forward"] = RingTimes()
        q_chunks = chunks(call.layout, call.rank, call.world, q.shape[2])
        outs = [None] * len(q_chunks)
        lses = [None] * len(q_chunks)
        kv = [k.detach().contiguous(), v.detach().contiguous()]
        for step in range(call.world):
            source = (call.rank - step) % call.world
            pending = []
            if step < call.world - 1:
                pending, arriving = _exchange(kv, call.rank, call.world, call.group, KV_TAG)
            start = time.perf_counter()
            for index, _, _, inputs in _step_blocks(call, q, kv, source):
                out, lse = _block_forward(call.backend, inputs)
                if outs[index] is None:
                    outs[index], lses[index] = out.float(), lse
                else:
                    outs[index], lses[index] = merge_attention([outs[index], out.float()],
                                                               [lses[index], lse])  # fmt: skip
            times.compute_s += time.perf_counter() - start
            times.steps += 1
            if pending:
                _wait(pending, times)
                kv = arriving
        value_dim = v.shape[3]
        for index, (_, _, q_len) in enumerate(q_chunks):
            if outs[index] is None:  # no key reached these rows: zeros, LSE -inf
                outs[index] = q.new_zeros((*q.shape[:2], q_len, value_dim), dtype=torch.float32)
                lses[index] = q.new_full((*q.shape[:2], q_len), float("-inf"), dtype=torch.float32)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        if sinks is not None:
            out, lse = merge_attention([out], [lse], sinks=sinks.detach())
        out, residual = rounded_output(out, q.dtype, keep_residual=True)
        ctx.call = call
        ctx.save_for_backward(q, k, v, sinks, out, lse, residual)
        if not call.return_lse:
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
        call: RingCall = ctx.call
        q, k, v, sinks, out, lse, residual = ctx.saved_tensors
        out = exact_output(out, residual)  # rowsum(dO * O) reads O as computed
        times = LAST_TIMES["backward"] = RingTimes()
        if not call.return_lse:
            grad_lse = None
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = [k.detach().contiguous(), v.detach().contiguous()]
        # The dK/dV accumulator of the K/V block in hand, travelling with it.
        dkv = [torch.zeros_like(kv[0], dtype=torch.float32),
               torch.zeros_like(kv[1], dtype=torch.float32)]  # fmt: skip
        dkv_requests, dkv_arriving = [], dkv
        for step in range(call.world):
            source = (call.rank - step) % call.world
            pending = []
            if step < call.world - 1:
                pending, arriving = _exchange(kv, call.rank, call.world, call.group, KV_TAG)
            start = time.perf_counter()
            contribution = [torch.zeros_like(dkv[0]), torch.zeros_like(dkv[1])]
            for _, rows, keys, inputs in _step_blocks(call, q, kv, source):
                block_grads = _block_backward(
                    call.backend, inputs, out[:, :, rows], lse[:, :, rows],
                    grad_out[:, :, rows], None if grad_lse is None else grad_lse[:, :, rows],
                )  # fmt: skip
                dq[:, :, rows] += block_grads[0]
                contribution[0][:, :, keys] += block_grads[1]
                contribution[1][:, :, keys] += block_grads[2]
            times.compute_s += time.perf_counter() - start
            times.steps += 1
            if step > 0:  # the accumulator of this step's K/V, from the previous rank
                _wait(dkv_requests, times)
                dkv = dkv_arriving
            dkv = [dkv[0] + contribution[0], dkv[1] + contribution[1]]
            if call.world > 1:  # passed on: after the last step, each reaches its owner
                dkv_requests, dkv_arriving = _exchange(dkv, call.rank, call.world, call.group,
                                                       DKV_TAG)  # fmt: skip
            if pending:
                _wait(pending, times)
                kv = arriving
        _wait(dkv_requests, times)
        dk, dv = dkv_arriving if call.world > 1 else dkv
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            dsinks = sink_gradient(sinks, out, lse, grad_out, grad_lse)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


def _step_blocks(call: RingCall, q: Tensor, kv: list[Tensor], source: int):
    """The blocks of one step, this rank's query chunks against the chunks of the K/V shard
    from rank `source`, that the band leaves anything: (query chunk index, its rows, the
    keys' rows (slices of the local shards), the block's call)."""
    q_chunks = chunks(call.layout, call.rank, call.world, q.shape[2])
    for index, (q_local, q_global, q_len) in enumerate(q_chunks):
        rows = slice(q_local, q_local + q_len)
        for k_local, k_global, k_len in chunks(call.layout, source, call.world, kv[0].shape[2]):
            keys = slice(k_local, k_local + k_len)
            inputs = _block(q.detach()[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                            q_global, k_global, call)  # fmt: skip
            if inputs is not None:
                yield index, rows, keys, inputs


def _block_forward(backend: Backend, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
    """(out, natural-log LSE float32) of one block; a fused kernel's bf16 or fp16 out as computed
    (`exact_output`) where the block's inputs require grad, for the merge and the backward."""
    with torch.no_grad():
        if isinstance(backend, FusedBackend):
            out, stats, residual = backend.forward(inputs)
            return exact_output(out, residual), lse_from_stats(stats)
        out, lse = backend.run(inputs)
        return out, lse.float()


def _block_backward(backend, inputs, out, lse, grad_out, grad_lse) -> tuple[Tensor, ...]:
    """(dq, dk, dv) of one block, against the whole attention's final out and LSE."""
    if isinstance(backend, FusedBackend):
        with torch.no_grad():
            dq, dk, dv, _ = backend.backward(inputs, out, stats_from_lse(lse), grad_out,
                                             grad_lse, partial_keys=True)  # fmt: skip
        return dq.float(), dk.float(), dv.float()
    # Any other backend: the block's own (out_b, lse_b) again, differentiated through the
    # merge rule: out = sum_b w_b out_b, w_b = exp(lse_b - lse), so d out_b = w_b d out and
    # d lse_b = w_b (rowsum(d out * (out_b - out)) + d lse).
    leaves = [t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value)]
    with torch.enable_grad():
        block = replace(inputs, query=leaves[0], key=leaves[1], value=leaves[2])
        block_out, block_lse = backend.run(block)
        weight = torch.where(block_lse > float("-inf"), torch.exp(block_lse.float() - lse), 0.0)
        mixed = (grad_out.float() * (block_out.float() - out.float())).sum(-1)
        if grad_lse is not None:
            mixed = mixed + grad_lse
        grads = torch.autograd.grad(
            (block_out, block_lse),
            leaves,
            ((weight[..., None] * grad_out.float()).to(block_out.dtype), weight * mixed),
        )
    return tuple(g.float() for g in grads)
