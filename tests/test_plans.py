"""Call plans: a repeated call skips its checks and choice, and only where they would pass."""

import gc
import threading
import weakref

import pytest
import torch

import attnperf
from attnperf import api, cpu_table, dispatch, plans
from attnperf.backend import FEATURES
from attnperf.inputs import PLAIN_KINDS, VARIANT_KEYWORDS, prepare
from attnperf.kernels.numba import attention, launch
from attnperf.kernels.triton.attention import TritonForward


@pytest.fixture(autouse=True)
def no_plans():
    plans.clear()
    yield
    plans.clear()


def count_calls(monkeypatch, name: str) -> list[int]:
    """[how many times attnperf.api's `name` has run], counted from now on."""
    count = [0]
    checked = getattr(api, name)

    def counting(*args, **kwargs):
        count[0] += 1
        return checked(*args, **kwargs)

    monkeypatch.setattr(api, name, counting)
    return count


@pytest.fixture
def prepares(monkeypatch):
    """How many calls went through the full checks."""
    return count_calls(monkeypatch, "prepare")


def qkv(*shape, **options):
    return tuple(torch.randn(*shape, **options) for _ in range(3))


@pytest.mark.parametrize("backend", ["auto", "reference", "numba"])
@pytest.mark.parametrize("shape", [(2, 3, 16, 8), (3, 16, 8), (16, 8)])
def test_a_repeated_call_runs_on_its_plan_with_the_same_result(prepares, backend, shape):
    q, k, v = qkv(*shape)
    first = attnperf.attention(q, k, v, is_causal=True, backend=backend)
    q2, k2, v2 = qkv(*shape)
    second = attnperf.attention(q2, k2, v2, is_causal=True, backend=backend)
    assert prepares[0] == 1
    expected = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    assert second.shape == first.shape == expected.shape
    torch.testing.assert_close(second, expected, atol=1e-5, rtol=1e-5)


def test_other_metadata_is_checked_again(prepares):
    q, k, v = qkv(1, 2, 8, 4)
    attnperf.attention(q, k, v)
    attnperf.attention(q, k, v, is_causal=True)
    attnperf.attention(q[:, :1], k[:, :1], v[:, :1])
    attnperf.attention(q.double(), k.double(), v.double())
    attnperf.attention(q, k, v, scale=0.5)
    attnperf.attention(q, k, v, window=(2, 0))
    attnperf.attention(q, k, v, return_lse=True)
    assert prepares[0] == 7


def test_a_call_that_would_fail_its_checks_still_fails():
    q, k, v = qkv(1, 2, 8, 4)
    attnperf.attention(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="is_causal"):
        attnperf.attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="window"):
        attnperf.attention(q, k, v, window=(2.0, 0))
    with pytest.raises(ValueError, match="window"):
        attnperf.attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match="heads"):
        attnperf.attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="unknown backend"):
        attnperf.attention(q, k, v, backend="nope")


def test_tensor_variants_are_never_planned(prepares):
    q, k, v = qkv(1, 2, 8, 4)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    sinks = torch.zeros(2)
    for _ in range(2):
        attnperf.attention(q, k, v, attn_mask=mask)
        attnperf.attention(q, k, v, sinks=sinks)
    assert prepares[0] == 4


def test_gradients_follow_the_call_not_the_plan(prepares):
    q, k, v = qkv(1, 2, 8, 4)
    with torch.no_grad():
        attnperf.attention(q, k, v, backend="numba")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnperf.attention(*leaves, backend="numba").sum().backward()
    again = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnperf.attention(*again, backend="numba")
    assert out.requires_grad and prepares[0] == 2
    out.sum().backward()
    for first, second in zip(leaves, again, strict=True):
        torch.testing.assert_close(first.grad, second.grad)


def test_a_plan_holds_no_tensor():
    q, k, v = qkv(1, 2, 8, 4)
    out = attnperf.attention(q, k, v)
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_new_cpu_table_or_registry_makes_the_choice_again(prepares, monkeypatch):
    q, k, v = qkv(1, 2, 8, 4)
    attnperf.attention(q, k, v)
    attnperf.attention(q, k, v)
    assert prepares[0] == 1
    state = dispatch.selection_state("auto")
    monkeypatch.setattr(dispatch, "selection_state", lambda backend: (state[0], object()))
    attnperf.attention(q, k, v)
    assert prepares[0] == 2


def test_a_named_backends_plan_outlives_a_new_cpu_table(prepares, monkeypatch):
    """Only "auto" reads the CPU table: a plan for a named backend stays good under a new
    one, and goes with a new registry."""
    q, k, v = qkv(1, 2, 8, 4)
    attnperf.attention(q, k, v, backend="numba")
    monkeypatch.setattr(cpu_table, "load_table", lambda path=None: (None, [], "a new table"))
    attnperf.attention(q, k, v, backend="numba")
    assert prepares[0] == 1
    fresh = dict(dispatch.registry())
    monkeypatch.setattr(dispatch, "registry", lambda: fresh)
    attnperf.attention(q, k, v, backend="numba")
    assert prepares[0] == 2


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 2)
    for length in (4, 5, 6):
        attnperf.attention(*qkv(1, 1, length, 4))
    assert len(plans._PLANS) == 1


def test_thread_count_is_part_of_the_metadata(prepares):
    q, k, v = qkv(1, 2, 8, 4)
    threads = torch.get_num_threads()
    attnperf.attention(q, k, v, backend="numba")
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        attnperf.attention(q, k, v, backend="numba")
    finally:
        torch.set_num_threads(threads)
    assert prepares[0] == 2


@pytest.fixture
def kvcache_checks(monkeypatch):
    """How many attention_with_kvcache calls had their metadata checked."""
    return count_calls(monkeypatch, "check_kvcache_call")


def test_a_growing_cache_keeps_its_plan_and_each_step_its_own_result(kvcache_checks):
    """transformers' cache grows a row a step: the checks of its metadata run once, the
    steps' results are each the attention over their own keys."""
    q = torch.randn(1, 1, 4, 8)
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    for length in (16, 17, 18):
        k_cache, v_cache = (t[:, :, :length].transpose(1, 2) for t in (keys, values))
        out = attnperf.attention_with_kvcache(q, k_cache, v_cache, length, backend="numba")
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys[:, :, :length], values[:, :, :length], enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert kvcache_checks[0] == 1


def test_a_planned_kvcache_call_still_checks_its_values(kvcache_checks):
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    attnperf.attention_with_kvcache(q, k_cache, v_cache, 8)
    with pytest.raises(ValueError, match="capacity"):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, 17)
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, -1)
    with pytest.raises(ValueError, match="v_cache's first 3 dims"):
        attnperf.attention_with_kvcache(q, torch.randn(2, 12, 2, 8), v_cache, 8)
    with pytest.raises(ValueError, match="must not exceed"):
        lengths, leftpad = torch.tensor([8, 8], dtype=torch.int32), torch.tensor([0, 9])
        attnperf.attention_with_kvcache(q, k_cache, v_cache, lengths, cache_leftpad=leftpad)
    pages, table = torch.randn(4, 16, 2, 8), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    attnperf.attention_with_kvcache(q, pages, pages, 20, block_table=table)
    with pytest.raises(ValueError, match="is not a page"):
        attnperf.attention_with_kvcache(q, pages, pages, 20, block_table=table + 2)
    assert kvcache_checks[0] == 3  # an int length, tensor lengths with leftpad, a paged cache


def test_kvcache_calls_with_alibi_or_int8_scales_are_checked_every_time(kvcache_checks):
    q = torch.randn(1, 1, 2, 8)
    k_cache, v_cache = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    slopes = torch.ones(2)
    (k_codes, k_scale), (v_codes, v_scale) = (attnperf.quantize_kv(t) for t in (k_cache, v_cache))
    for _ in range(2):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, alibi_slopes=slopes)
        attnperf.attention_with_kvcache(q, k_codes, v_codes, 8, k_scale=k_scale, v_scale=v_scale)
    assert kvcache_checks[0] == 4


@pytest.fixture
def binds(monkeypatch):
    """How many attention_with_kvcache calls ran whole (their values bound to KVCacheInputs)."""
    return count_calls(monkeypatch, "bind_kvcache")


def whole_call(q, k_cache, v_cache, cache_seqlens, **kwargs):
    """attention_with_kvcache on the backend's launcher of whole calls (`run_kvcache`): its
    lengths as a tensor, which no step launcher serves; checked and bound, no plan kept."""
    plans.clear()
    lengths = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    result = attnperf.attention_with_kvcache(q, k_cache, v_cache, lengths, **kwargs)
    plans.clear()
    return result


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_named_backends_plain_steps_run_on_its_step_launcher(binds, dtype, q_len):
    """transformers' decoding (a growing head-major cache, an int length, numba named): the
    first call runs whole, the next ones on numba's step launcher, each with the whole
    call's result (the same kernel on the same operands); a cache of the other layout
    under the same metadata too, a whole head-major cache read in place, and LSEs; one
    token (read and written where it lies) or a few."""
    q = torch.randn(1, q_len, 8, 64, dtype=dtype)
    keys, values = (torch.randn(1, 2, 300, 64, dtype=dtype) for _ in range(2))
    steps = [(length, *(t[:, :, :length].transpose(1, 2) for t in (keys, values)))
             for length in (100, 101, 299)]  # fmt: skip
    steps.append((200, steps[-1][1].contiguous(), steps[-1][2].contiguous()))  # row-major
    steps.append((250, keys.transpose(1, 2), values.transpose(1, 2)))  # head-major, in place
    expected = [whole_call(q, k, v, length, backend="numba", return_lse=True)
                for length, k, v in steps]  # fmt: skip
    assert binds[0] == len(steps)
    for (length, k_cache, v_cache), (out, lse) in zip(steps, expected, strict=True):
        got = attnperf.attention_with_kvcache(q, k_cache, v_cache, length, backend="numba",
                                              return_lse=True)  # fmt: skip
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)
        assert torch.equal(
            attnperf.attention_with_kvcache(q, k_cache, v_cache, length, backend="numba"), out
        )
    assert binds[0] == len(steps) + 2  # the first call with an LSE, the first without


def test_planned_steps_on_several_threads_each_read_their_own_lengths():
    """A kept step launcher rewrites its sequence table in place, a table per thread: four
    threads stepping at once (on the calling threads: small caches), each through a cache
    of its own length, each get the whole call's result every time."""
    q = torch.randn(1, 1, 8, 64)
    keys, values = (torch.randn(1, 2, 300, 64) for _ in range(2))
    caches = {n: (keys[:, :, :n].transpose(1, 2), values[:, :, :n].transpose(1, 2))
              for n in (37, 100, 211, 299)}  # fmt: skip
    expected = {n: whole_call(q, *cache, n, backend="numba") for n, cache in caches.items()}
    attnperf.attention_with_kvcache(q, *caches[37], 37, backend="numba")  # keeps the step
    wrong = []

    def steps(n):
        for _ in range(100):
            out = attnperf.attention_with_kvcache(q, *caches[n], n, backend="numba")
            if not torch.equal(out, expected[n]):
                wrong.append(n)

    threads = [threading.Thread(target=steps, args=(n,)) for n in caches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_planned_step_still_checks_its_values(binds):
    q = torch.randn(2, 1, 4, 8)
    k_cache, v_cache = torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, backend="numba")
    with pytest.raises(ValueError, match=r"capacity \(S_max = 16\)"):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, 17, backend="numba")
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, -1, backend="numba")
    with pytest.raises(ValueError, match="v_cache's first 3 dims"):
        attnperf.attention_with_kvcache(q, torch.randn(2, 12, 2, 8), v_cache, 8, backend="numba")
    with pytest.raises(TypeError, match="cache_seqlens must be an int"):
        attnperf.attention_with_kvcache(q, k_cache, v_cache, 8.0, backend="numba")
    assert binds[0] == 1 + 2  # the first call; the negative and the float lengths, whole


def test_steps_are_kept_for_plain_calls_only(binds):
    """Tensor lengths, new keys, left padding, sinks, a paged cache and an fp16 cache
    (converted per call) run whole every time."""
    q = torch.randn(1, 1, 4, 8)
    k_cache, v_cache = torch.randn(1, 32, 2, 8), torch.randn(1, 32, 2, 8)
    new = torch.randn(1, 1, 2, 8)
    pages, table = torch.randn(2, 16, 2, 8), torch.tensor([[0, 1]], dtype=torch.int32)
    calls = [
        lambda: attnperf.attention_with_kvcache(
            q, k_cache, v_cache, torch.tensor([8], dtype=torch.int32), backend="numba"),
        lambda: attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, new, new,
                                                backend="numba"),
        lambda: attnperf.attention_with_kvcache(
            q, k_cache, v_cache, 8, cache_leftpad=torch.tensor([1], dtype=torch.int32),
            backend="numba"),
        lambda: attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, sinks=torch.zeros(4),
                                                backend="numba"),
        lambda: attnperf.attention_with_kvcache(q, pages, pages, 20, block_table=table,
                                                backend="numba"),
        lambda: attnperf.attention_with_kvcache(q.half(), k_cache.half(), v_cache.half(), 8,
                                                backend="numba"),
    ]  # fmt: skip
    for call in calls:
        before = binds[0]
        call()
        call()
        assert binds[0] == before + 2


@pytest.mark.parametrize("q_len, is_causal", [(1, True), (3, False)])
def test_sdpas_plain_steps_run_on_its_step_launcher(binds, q_len, is_causal):
    """sdpa's step launcher (rows that see their whole cache: one token, or no causality)
    gives the whole call's result: a growing head-major cache, a row-major one, a cache
    longer than its length, no keys at all."""
    q = torch.randn(2, q_len, 8, 64)
    keys, values = (torch.randn(2, 2, 300, 64) for _ in range(2))
    steps = [(length, *(t[:, :, :length].transpose(1, 2) for t in (keys, values)))
             for length in (100, 101)]  # fmt: skip
    steps.append((50, steps[-1][1].contiguous(), steps[-1][2].contiguous()))
    steps.append((0, keys.transpose(1, 2), values.transpose(1, 2)))
    expected = [whole_call(q, k, v, length, is_causal=is_causal, backend="sdpa")
                for length, k, v in steps]  # fmt: skip
    for (length, k_cache, v_cache), out in zip(steps, expected, strict=True):
        got = attnperf.attention_with_kvcache(q, k_cache, v_cache, length, is_causal=is_causal,
                                              backend="sdpa")  # fmt: skip
        assert got.shape == out.shape and torch.equal(got, out)
    # the first step; under causality no keys too (its band not shifted: dispatch.step_lengths)
    assert binds[0] == len(steps) + (2 if is_causal else 1)


def test_auto_steps_run_on_the_launcher_of_the_backend_it_chose(binds, monkeypatch):
    """ "auto" keeps the chosen backend's step launcher for the lengths its choice stands
    at (`dispatch.step_lengths`): under a decode rule that puts numba first from 4 KiB of K
    and V (fp32, 2 kv heads, E = 8: 128 bytes a key, 32 keys), steps of 20 to 31 keys run
    on sdpa's, from 32 on numba's, each with the whole call's result; crossing the rule
    runs whole."""
    rule = cpu_table.DecodeRule(numba_from_bytes=4096, ratios={})
    monkeypatch.setattr(cpu_table, "active_decode_rule", lambda dtype: rule)
    q = torch.randn(1, 1, 4, 8)
    keys, values = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    lengths = (20, 21, 31, 32, 33, 39, 31)
    caches = [(n, *(t[:, :, :n].transpose(1, 2) for t in (keys, values))) for n in lengths]
    expected = [whole_call(q, k, v, n) for n, k, v in caches]
    chosen = [whole_call(q, k, v, n, backend="numba" if n >= 32 else "sdpa") for n, k, v in caches]
    assert all(torch.equal(a, b) for a, b in zip(expected, chosen, strict=True))
    binds[0] = 0
    for (n, k_cache, v_cache), out in zip(caches, expected, strict=True):
        assert torch.equal(attnperf.attention_with_kvcache(q, k_cache, v_cache, n), out)
    assert binds[0] == 3  # the first step, the first from 32 keys on, 31 keys again


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("backend", ["numba", "sdpa"])
def test_heads_first_steps_run_on_the_launcher_their_call_kept(binds, backend, q_len):
    """api.heads_first_step (transformers' decoding: q (B, Hq, Lq, E), caches (B, H, S, E),
    every key in use) runs where the same call through attention_with_kvcache kept a
    launcher, with its result; else (no launcher yet, or none for the call: sdpa's needs
    one token) it answers None, and so it does where v's length differs (the call's own
    error follows)."""
    q = torch.randn(1, 8, q_len, 64)
    keys, values = (torch.randn(1, 2, 300, 64) for _ in range(2))

    def heads_first(q, k, v):
        return api.heads_first_step(q, k, v, scale=0.1, window=None, softcap=None,
                                    backend=backend)  # fmt: skip

    def whole(q, k, v):
        return attnperf.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), k.shape[2], scale=0.1,
                                               backend=backend)  # fmt: skip

    caches = [(keys[:, :, :n].contiguous(), values[:, :, :n].contiguous()) for n in (101, 150)]
    caches.append((keys[:, :, :200], values[:, :, :200]))  # a static cache's rows: strided
    expected = [whole_call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), k.shape[2],
                           scale=0.1, backend=backend) for k, v in caches]  # fmt: skip
    assert heads_first(q, keys, values) is None
    whole(q, keys[:, :, :100], values[:, :, :100])
    kept = backend == "numba" or q_len == 1
    for (k, v), out in zip(caches, expected, strict=True):
        got = heads_first(q, k, v)
        assert (got is not None) == kept
        if kept:
            assert got.shape == out.shape and torch.equal(got, out)
    assert heads_first(q, keys[:, :, :120], values[:, :, :121]) is None


def test_a_step_is_kept_per_thread_count_and_grad_mode(binds):
    q = torch.randn(1, 1, 4, 8)
    k_cache, v_cache = torch.randn(1, 32, 2, 8), torch.randn(1, 32, 2, 8)
    threads = torch.get_num_threads()
    try:
        for count in (threads, 1, threads):
            torch.set_num_threads(count)
            attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, backend="numba")
        with torch.no_grad():
            attnperf.attention_with_kvcache(q, k_cache, v_cache, 8, backend="numba")
    finally:
        torch.set_num_threads(threads)
    assert binds[0] == (2 if threads == 1 else 3)  # a thread count's first, no_grad's first


@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_a_fused_plan_keeps_its_forward_and_reads_each_calls_strides(prepares, backend):
    """A fused backend's plan keeps its forward (`Backend.forward_for`: numba's
    DenseForward, triton's TritonForward), which reads each call's q, k, v at their own
    strides: a (B, L, H, E) view of the planned shape gives its own result, not one of the
    layout the plan was made for; with a gradient to come too."""
    chosen = dispatch.registry()[backend]
    if chosen.unavailable_reason() is not None:
        pytest.skip(chosen.unavailable_reason())
    q, k, v = qkv(2, 3, 16, 8)
    attnperf.attention(q, k, v, backend=backend)
    (plan,) = plans._PLANS.values()
    kept = {"numba": attention.DenseForward, "triton": TritonForward}[backend]
    assert isinstance(plan.forward, kept)
    views = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv(2, 3, 16, 8))
    for call in (views, qkv(2, 3, 16, 8), views):  # the strides it reuses, then others
        out = attnperf.attention(*call, backend=backend)
        expected = torch.nn.functional.scaled_dot_product_attention(*call)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert prepares[0] == 1
    leaves = [t.clone().requires_grad_() for t in views]
    attnperf.attention(*leaves, backend=backend).sum().backward()
    attnperf.attention(*leaves, backend=backend).sum().backward()  # on its kept forward
    expected = [t.clone().requires_grad_() for t in views]
    torch.nn.functional.scaled_dot_product_attention(*expected).sum().backward()
    for got, want in zip(leaves, expected, strict=True):
        torch.testing.assert_close(got.grad, 2 * want.grad, atol=1e-5, rtol=1e-5)


def test_a_first_numba_call_works_out_its_forward_once(monkeypatch):
    """One route per call: a first call's plan, kept or not, makes the one forward it runs
    on (a tensor variant's call, which keeps none, makes its own)."""
    made = []

    class Counted(attention.DenseForward):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(attention, "DenseForward", Counted)
    q, k, v = qkv(1, 2, 16, 8)
    attnperf.attention(q, k, v, backend="numba")
    assert len(made) == 1
    attnperf.attention(q, k, v, backend="numba", sinks=torch.zeros(2))
    assert len(made) == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no plan kept under autocast
        attnperf.attention(q, k, v, backend="numba")
    assert len(made) == 3


@pytest.mark.parametrize("backend", ["numba", "sdpa"])
def test_a_first_plain_step_runs_on_the_step_launcher_it_keeps(backend, monkeypatch):
    """One launcher per backend for plain steps: the first one runs on the step launcher it
    keeps for the next, not on the backend's launcher of whole calls (`run_kvcache`); its
    result is that launcher's for the same call with its lengths as a tensor."""
    q = torch.randn(2, 1, 8, 64)
    k_cache, v_cache = (torch.randn(2, 2, 40, 64).transpose(1, 2) for _ in range(2))
    expected = whole_call(q, k_cache, v_cache, 33, backend=backend)
    whole = []
    chosen = dispatch.registry()[backend]
    monkeypatch.setattr(type(chosen), "run_kvcache",
                        lambda self, inputs: whole.append(1) or 1 / 0)  # fmt: skip
    got = attnperf.attention_with_kvcache(q, k_cache, v_cache, 33, backend=backend)
    assert not whole
    assert any(isinstance(plan, plans.KVCacheStep) for plan in plans._PLANS.values())
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_numba_keeps_no_forward_for_tensor_variants():
    """A kept forward holds its call's variant: never one made of a call's tensors."""
    q, k, v = qkv(1, 2, 8, 4)
    assert attention.numba_forward_for(prepare(q, k, v)) is not None
    masked = prepare(q, k, v, attn_mask=torch.randn(8, 8))
    sinks = prepare(q, k, v, sinks=torch.zeros(2))
    assert attention.numba_forward_for(masked) is None
    assert attention.numba_forward_for(sinks) is None


def test_a_numba_plans_forward_keeps_stats_only_for_calls_that_read_them():
    """Without a gradient to come or an LSE asked, numba's kept forward writes its stats to
    a thread's kept memory and returns none; with either, its stats are the call's own: on
    the plan's forward, the LSE and the gradients through the stats are SDPA's."""
    q, k, v = qkv(1, 2, 16, 8)
    inference = attention.numba_forward_for(prepare(q, k, v))
    out, stats, _ = inference(q, k, v)
    assert stats is None
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    with_lse = prepare(q, k, v, return_lse=True)
    assert attention.numba_forward_for(with_lse)(q, k, v)[1] is not None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert attention.numba_forward_for(prepare(*leaves))(*leaves)[1] is not None
    with pytest.MonkeyPatch.context() as patch:  # stats too large to keep: allocated
        patch.setattr(launch, "SCRATCH_MAX_BYTES", 0)
        patch.setattr(launch, "_UNREAD", threading.local())
        out, stats, _ = inference(q, k, v)
        assert stats is not None
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    peers = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*peers).sum().backward()
    expected_lse = torch.logsumexp((q @ k.transpose(-1, -2)) * 8**-0.5, -1)
    for _ in range(2):  # the second call runs on the plan's forward
        attnperf.attention(q, k, v, backend="numba")  # an inference call between
        _, lse = attnperf.attention(q, k, v, backend="numba", return_lse=True)
        torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
        for t in leaves:
            t.grad = None
        attnperf.attention(*leaves, backend="numba").sum().backward()
        for ours, peer in zip(leaves, peers, strict=True):
            torch.testing.assert_close(ours.grad, peer.grad, atol=1e-5, rtol=1e-5)


def test_the_variant_declarations_give_the_features_and_the_plan_keys():
    """Each declared variant keyword (attnperf.inputs.VARIANT_KEYWORDS), set on a call,
    asks for its declared feature (one of backend.FEATURES), and a plan's key holds its
    value (another value, another key) or, for a tensor's, no plan stands for the call."""
    q, k, v = qkv(1, 2, 8, 4)
    layout = attnperf.block_mask(attnperf.layouts.causal(), None, None, 8, 8, block_size=16)
    given = {
        "window": (2, 0), "softcap": 5.0, "alibi_slopes": torch.ones(2), "block_mask": layout,
        "align": "bottom_right", "return_lse": True, "sinks": torch.zeros(2),
    }  # fmt: skip
    assert set(given) == {keyword.name for keyword in VARIANT_KEYWORDS}
    defaults = {keyword.name: keyword.default for keyword in VARIANT_KEYWORDS}
    plain_key = plans.dense_key(q, k, v, None, 0.0, True, None, False, "auto", defaults)
    assert plain_key is not None
    for keyword in VARIANT_KEYWORDS:
        variants = {**defaults, keyword.name: given[keyword.name]}
        inputs = prepare(q, k, v, is_causal=True, **variants)
        if keyword.feature is not None:
            assert keyword.feature in FEATURES and keyword.feature in inputs.features()
        key = plans.dense_key(q, k, v, None, 0.0, True, None, False, "auto", variants)
        assert (key is None) == (keyword.kind not in PLAIN_KINDS)
        assert key != plain_key
