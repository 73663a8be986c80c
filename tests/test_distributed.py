"""Ring attention over spawned gloo process groups of 2 and 4 ranks (one thread each),
against single-process attention on the gathered sequence: forward, LSE, gradients, both
layouts, training equivalence, shard/gather round trips and bad inputs."""

import multiprocessing
import os
import queue
import traceback

import pytest
import torch
import torch.distributed as dist

import attnperf
from attnperf import distributed
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

CHUNK = 8  # tokens per zigzag chunk: L = 2 W CHUNK
TIMEOUT_S = 300
FAILED_PEERS_S = 30


def run_ranks(world: int, target: str, tmp_path) -> list:
    """Run `target(rank, world)` (a function of this module) on `world` spawned ranks of a
    gloo group; its return values by rank. A rank's exception fails the test with the
    tracebacks of every rank that failed (a rank that raises can break its peers' collectives,
    and theirs may arrive first); every process is gone when this returns, whatever
    happened."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_rank_main, args=(rank, world, init, target, results))
             for rank in range(world)]  # fmt: skip
    for process in ranks:
        process.start()
    try:
        answers, errors = {}, {}
        while len(answers) + len(errors) < world:
            try:
                # After a failure the others get a short while to report theirs.
                rank, status, value = results.get(timeout=FAILED_PEERS_S if errors else TIMEOUT_S)
            except queue.Empty:
                if errors:
                    break
                pytest.fail(f"{target}: no answer from every rank within {TIMEOUT_S} s")
            (answers if status == "ok" else errors)[rank] = value
        if errors:
            pytest.fail("\n".join(f"{target} failed on rank {rank}:\n{value}"
                                  for rank, value in sorted(errors.items())))  # fmt: skip
        return [answers[rank] for rank in range(world)]
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


def _rank_main(rank: int, world: int, init: str, target: str, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        results.put((rank, "ok", globals()[target](rank, world)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- agreement
# Each a distinct path: causal steps of both layouts (diagonal, full, half and skipped
# blocks), a full ring, GQA, windows that cut blocks on both sides of the diagonal (negative
# offsets too), softcap, bf16, and the reference backend (its backward through the merge
# rule rather than a fused kernel's launcher).
RING_CASES = {
    2: [
        dict(layout="contiguous", is_causal=True),
        dict(layout="zigzag", is_causal=True),
        dict(layout="zigzag", kv_heads=2),
        dict(layout="zigzag", is_causal=True, window=(6, 0), softcap=2.0),
        dict(layout="contiguous", window=(5, 3)),
        dict(layout="zigzag", is_causal=True, dtype=torch.bfloat16),
        dict(layout="zigzag", is_causal=True, kv_heads=2, backend="reference"),
        dict(layout="contiguous", window=(5, 3), backend="reference"),
        dict(layout="zigzag", is_causal=True, kv_heads=2, sinks=True),
        dict(layout="contiguous", window=(5, 3), sinks=True, backend="reference"),
    ],
    4: [
        dict(layout="zigzag", is_causal=True, kv_heads=2),
        dict(layout="contiguous", is_causal=True),
        dict(layout="zigzag", window=(9, 4), softcap=2.0),
        dict(layout="zigzag", is_causal=True, dtype=torch.bfloat16, backend="reference"),
        dict(layout="zigzag", window=(3, 0), sinks=True, dtype=torch.bfloat16),
    ],
}


def check_agreement(rank: int, world: int) -> int:
    for case in RING_CASES[world]:
        check_case(world, **case)
    return len(RING_CASES[world])


def check_case(world, layout, dtype=torch.float32, kv_heads=4, backend="numba", sinks=False,
               **variant):  # fmt: skip
    """Forward, LSE and gradients (through both) of one case against the whole sequence;
    with `sinks`, random sinks too, whose gradient is summed over the ranks."""
    length = 2 * world * CHUNK
    gen = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    q = (torch.randn(1, 4, length, 16, generator=gen) * 2).to(dtype)
    k, v = ((torch.randn(1, kv_heads, length, 16, generator=gen) * 2).to(dtype)
            for _ in range(2))  # fmt: skip
    grad_out = torch.randn(1, 4, length, 16, generator=gen).to(dtype)
    grad_lse = torch.randn(1, 4, length, generator=gen)
    sink_logits = [torch.randn(4, generator=gen) * 2] if sinks else []

    def shard(x):
        return distributed.shard_sequence(x, 2, layout=layout)

    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    leaves += [t.clone().requires_grad_() for t in sink_logits]
    out, lse = distributed.ring_attention(*leaves[:3], layout=layout, backend=backend,
                                          return_lse=True, sinks=(leaves[3:] or [None])[0],
                                          **variant)  # fmt: skip
    ((out * shard(grad_out)).sum() + (lse * shard(grad_lse)).sum()).backward()
    for leaf in leaves[3:]:  # each rank's rows' share
        dist.all_reduce(leaf.grad)
    actual = [out, lse, *(leaf.grad for leaf in leaves)]

    def whole(reference, cast):
        tensors = [t.to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
        tensors += [t.to(cast or t.dtype).requires_grad_() for t in sink_logits]
        out, lse = reference(*tensors[:3], enable_gqa=kv_heads != 4, return_lse=True,
                             sinks=(tensors[3:] or [None])[0], **variant)  # fmt: skip
        ((out * grad_out.to(out.dtype)).sum() + (lse * grad_lse.to(lse.dtype)).sum()).backward()
        grads = [shard(t.grad) for t in tensors[:3]] + [t.grad for t in tensors[3:]]
        return [shard(out), shard(lse), *grads]

    exact = whole(float64_reference, torch.float64)
    baseline = whole(same_precision_reference, None)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, a, e, b in zip(names, actual, exact, baseline, strict=False):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_agrees(a, e, b, what=f"{name} of {layout} {backend} {variant} W={world}")


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_attention_on_the_gathered_sequence(world, tmp_path):
    assert run_ranks(world, "check_agreement", tmp_path) == [len(RING_CASES[world])] * world


# ---------------------------------------------------------------------------- layouts
def check_round_trips(rank: int, world: int) -> dict:
    x = torch.arange(2 * 2 * world * 3 * 2, dtype=torch.float32).view(2, 2 * world * 3, 2)
    kinds = {}
    for layout in distributed.LAYOUTS:
        mine = distributed.shard_sequence(x, 1, layout=layout)
        assert torch.equal(distributed.gather_sequence(mine, 1, layout=layout), x), layout
        kinds[layout] = mine[0, :, 0].tolist()
    return kinds


def test_shard_and_gather_are_exact_inverses(tmp_path):
    """zigzag: rank r holds chunks r and 2W - 1 - r of 2W (here 6 tokens, chunks of 3)."""
    shards = run_ranks(2, "check_round_trips", tmp_path)
    token = [2 * t for t in range(12)]  # element [0, t, 0] of the test tensor
    assert [s["contiguous"] for s in shards] == [token[:6], token[6:]]
    assert [s["zigzag"] for s in shards] == [token[:3] + token[9:], token[3:9]]


# ---------------------------------------------------------------------------- training
class TinyTransformer(torch.nn.Module):
    """2 pre-norm blocks of GQA self-attention (4 heads over 2) and an MLP."""

    def __init__(self, **attention):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList()
        for _ in range(2):
            self.blocks.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(32), "norm2": torch.nn.LayerNorm(32),
                "attention": attnperf.nn.SelfAttention(32, 4, num_kv_heads=2, causal=True,
                                                       **attention),
                "mlp": torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                           torch.nn.Linear(64, 32)),
            }))  # fmt: skip

    def forward(self, x):
        for block in self.blocks:
            x = x + block["attention"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return x


def train(model, x, y, tokens, reduce_gradients=None):
    """3 SGD steps on the squared error per token of the whole sequence (`tokens` of them)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        (((model(x) - y) ** 2).sum() / tokens).backward()
        if reduce_gradients:
            reduce_gradients(model)
        optimizer.step()
    return dict(model.named_parameters())


def check_training(rank: int, world: int) -> int:
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, 2 * world * CHUNK, 32, generator=gen) for _ in range(2))

    def all_reduce(model):  # the loss is a sum over the shards: so are the gradients
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)

    tokens = x.shape[0] * x.shape[1]
    shards = [distributed.shard_sequence(t, 1) for t in (x, y)]
    ring = train(TinyTransformer(context_parallel=True, backend="numba"), *shards, tokens,
                 all_reduce)  # fmt: skip
    exact = train(TinyTransformer(backend="reference").double(), x.double(), y.double(), tokens)
    baseline = train(TinyTransformer(backend="reference"), x, y, tokens)
    for name, parameter in ring.items():
        assert_agrees(parameter.detach(), exact[name].detach(), baseline[name].detach(),
                      what=f"{name} after 3 steps")  # fmt: skip
        # A key bias adds one q.b to a whole row of scores, which the softmax ignores: its
        # gradient is 0 but for rounding, which may or may not move it.
        if not name.endswith("k_proj.bias"):
            assert not torch.equal(parameter, TinyTransformer().state_dict()[name]), name
    return len(ring)


def test_training_with_the_sequence_sharded_ends_with_the_same_parameters(tmp_path):
    assert min(run_ranks(2, "check_training", tmp_path)) > 0


# ---------------------------------------------------------------------------- bad input
def check_bad_inputs(rank: int, world: int) -> int:
    q = torch.randn(1, 2, 8, 16)
    short = q[:, :, : 8 - 2 * rank]  # a shard length that differs on rank 1
    mixed = q.to(torch.bfloat16 if rank else torch.float32)  # a dtype that differs
    ring = distributed.ring_attention
    calls = [
        (lambda: ring(short, short, short), "shards differ"),
        (lambda: ring(mixed, mixed, mixed), "dtype differs across ranks"),
        (lambda: ring(q[:, :, :7], q[:, :, :7], q[:, :, :7]), "must be even"),
        (lambda: ring(q, q[:, :, :6], q[:, :, :6], is_causal=True), "must equal S_local"),
        (lambda: ring(q, q, q, layout="spiral"), "layout must be one of"),
        (lambda: distributed.shard_sequence(torch.zeros(1, 6), 1), "does not split into 4"),
        (lambda: distributed.gather_sequence(torch.zeros(1, 3), 1), "must be even"),
        (lambda: ring(q, q, q, backend="sdpa"), "return_lse not supported"),
    ]
    for call, message in calls:  # every rank refuses, naming what is wrong
        with pytest.raises((ValueError, RuntimeError), match=message):
            call()
    dist.barrier()
    return len(calls)


def test_bad_input_is_refused_naming_the_argument(tmp_path):
    assert run_ranks(2, "check_bad_inputs", tmp_path) == [8, 8]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        distributed.ring_attention(*(torch.zeros(1, 1, 4, 8) for _ in range(3)))


def test_spawned_ranks_are_gone_after_a_failure(tmp_path):
    """A rank that raises fails the test with its traceback and leaves no process behind."""
    before = set(multiprocessing.active_children())
    with pytest.raises(pytest.fail.Exception, match="ZeroDivisionError"):
        run_ranks(2, "fail_on_rank_1", tmp_path)
    assert set(multiprocessing.active_children()) <= before
    assert os.getpid()


def fail_on_rank_1(rank: int, world: int) -> int:
    # Every rank through its init first: a rank done at once tears its group down, and a
    # peer still connecting then fails there (gloo's "connection closed by peer"), not here.
    dist.barrier()
    return 1 // (1 - rank)
