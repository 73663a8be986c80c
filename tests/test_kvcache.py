"""attention_with_kvcache on every backend that declares it, against attention over each
sequence's cached keys (float64 and same precision): contiguous and paged caches, split-K,
GQA packing, in-place append, and bad inputs that must leave the cache untouched."""

import dataclasses
import itertools
import re

import numpy as np
import pytest
import torch
from cases import device_for, preset_params

import attnperf
from attnperf import dispatch
from attnperf.backend import FEATURES
from attnperf.kernels.numba import kvcache as numba_kvcache
from attnperf.kernels.numba.jit import numba
from attnperf.kernels.numba.microkernels import tile_route
from attnperf.serving import prepare_kvcache
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

HEADS, KV_HEADS, HEAD_DIM, S_MAX, PAGE = 8, 2, 16, 96, 16
# Keys already cached per sequence: empty, short, across several pages and tiles, near full.
CACHED = (0, 5, 41, 90)

# Distinct paths: one query per step (decode), speculative decoding (Lq = 3, appends 3), left
# padding (keys start mid-page; one sequence all padding but its new key), a sliding window
# with softcap and ALiBi (the band cuts the split ranges).
PRESETS = {
    "decode": {"q_len": 1, "new": 1},
    "speculative": {"q_len": 3, "new": 3},
    "left_padded": {"q_len": 1, "new": 1, "cache_leftpad": torch.tensor((0, 5, 10, 33)).int()},
    "window_softcap_alibi": {
        "q_len": 2, "new": 2, "window": (9, 0), "softcap": 3.0,
        "alibi_slopes": torch.rand(HEADS, generator=torch.Generator().manual_seed(5)),
    },
    # Sinks, and a sequence of no key (cached 0, nothing appended): out 0, lse = sink.
    "sinks_speculative": {
        "q_len": 3, "new": 0,
        "sinks": torch.randn(HEADS, generator=torch.Generator().manual_seed(6)) * 2,
    },
}  # fmt: skip


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """numba's key tiles of 16: the splits and pages hold several."""
    monkeypatch.setattr(numba_kvcache, "DECODE_BLOCK_N", 16)


def cache_call(dtype, device="cpu", q_len=1, new=1, cached=CACHED, seed=0, heads=HEADS,
               head_dim=HEAD_DIM, s_max=S_MAX, **variant) -> dict:  # fmt: skip
    """A contiguous-cache call (B, s_max, H, E) with `new` keys to append."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(cached)

    def tensor(*shape):
        return (torch.randn(*shape, generator=gen) * 2).to(device, dtype)

    call = {
        "q": tensor(batch, q_len, heads, head_dim),
        "k_cache": tensor(batch, s_max, KV_HEADS, head_dim),
        "v_cache": tensor(batch, s_max, KV_HEADS, head_dim),
        "cache_seqlens": torch.tensor(cached, dtype=torch.int32, device=device),
        "k_new": tensor(batch, new, KV_HEADS, head_dim) if new else None,
        "v_new": tensor(batch, new, KV_HEADS, head_dim) if new else None,
    }
    return call | {n: v.to(device) if torch.is_tensor(v) else v for n, v in variant.items()}


def paged(call: dict, seed: int = 1) -> dict:
    """The same cache as pages of PAGE rows, shuffled, with spare pages in the pool."""
    batch = call["k_cache"].shape[0]
    per_sequence = S_MAX // PAGE
    order = torch.randperm(batch * per_sequence + 3, generator=torch.Generator().manual_seed(seed))
    table = order[: batch * per_sequence].view(batch, per_sequence)
    result = dict(call, block_table=table.int().to(call["q"].device))
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if call.get(name) is None:
            continue
        cache = call[name]
        pool = torch.zeros(
            len(order), PAGE, *cache.shape[2:], dtype=cache.dtype, device=cache.device
        )
        pool[table.flatten()] = cache.reshape(batch * per_sequence, PAGE, *cache.shape[2:])
        result[name] = pool
    return result


def head_major(call: dict) -> dict:
    """The same cache as a (B, S_max, H, E) view of (B, H, S_max, E) memory: transformers'
    layout, which the kernels read in place."""
    return dict(call, **{name: call[name].transpose(1, 2).contiguous().transpose(1, 2)
                         for name in ("k_cache", "v_cache")})  # fmt: skip


def expected(fn, call: dict) -> tuple:
    """(out (B, Lq, Hq, E), lse (B, Hq, Lq)) of `fn`, an SDPA-style reference, over each
    sequence's cached and new keys, bottom-right aligned."""
    outs, lses = [], []
    slopes = call.get("alibi_slopes")
    leftpad = call.get("cache_leftpad", torch.zeros(len(CACHED), dtype=torch.int32)).tolist()
    for b, cached in enumerate(call["cache_seqlens"].tolist()):
        keys = [call["k_cache"][b, leftpad[b] : cached], call["v_cache"][b, leftpad[b] : cached]]
        if call["k_new"] is not None:
            keys = [torch.cat((keys[0], call["k_new"][b])), torch.cat((keys[1], call["v_new"][b]))]
        k, v = (t.transpose(0, 1)[None] for t in keys)
        variant = {n: call[n] for n in ("window", "softcap", "sinks") if n in call}
        out, lse = fn(
            call["q"][b : b + 1].transpose(1, 2), k, v, is_causal=call.get("is_causal", True),
            enable_gqa=True, align="bottom_right", return_lse=True,
            alibi_slopes=None if slopes is None else slopes, **variant,
        )  # fmt: skip
        outs.append(out.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run(backend, call: dict, **options):
    """attention_with_kvcache on copies of the cache: (out, lse, the updated caches)."""
    call = dict(call, **{name: call[name].clone() for name in ("k_cache", "v_cache")})
    with_lse = "lse" in backend.capabilities.features
    result = attnperf.attention_with_kvcache(**call, backend=backend.name, return_lse=with_lse,
                                             **options)  # fmt: skip
    out, lse = result if with_lse else (result, None)
    return out, lse, call["k_cache"], call["v_cache"]


def kvcache_params(dtypes):
    return preset_params(PRESETS, dtypes, lambda *a, **k: prepare_kvcache(**cache_call(*a, **k)))


@pytest.mark.parametrize("backend, preset, dtype", kvcache_params((torch.float32, torch.bfloat16)))
def test_kvcache_equals_attention_over_the_cached_keys(backend, preset, dtype):
    """Contiguous, head-major and paged caches, each agreeing with the reference; paged and
    contiguous ones (the same walk) with each other too."""
    call = cache_call(dtype, device_for(backend), **PRESETS[preset])
    exact, baseline = expected(float64_reference, call), expected(same_precision_reference, call)
    results = {"contiguous": run(backend, call), "paged": run(backend, paged(call)),
               "head_major": run(backend, head_major(call))}  # fmt: skip
    for layout, (out, lse, _, _) in results.items():
        assert out.shape == call["q"].shape and out.dtype == dtype, layout
        assert_agrees(out, exact[0], baseline[0], what=f"{layout} output")
        if lse is not None:
            assert lse.shape == (len(CACHED), HEADS, call["q"].shape[1])
            assert_agrees(lse, exact[1], baseline[1], what=f"{layout} lse")
    torch.testing.assert_close(results["paged"][0], results["contiguous"][0])
    for index in (2, 3):  # the appended caches, written in the caller's strides
        torch.testing.assert_close(results["head_major"][index], results["contiguous"][index])


@pytest.mark.parametrize(
    "backend", [b for b in dispatch.registry().values() if b.name in ("numba", "triton")],
    ids=lambda b: b.name,
)  # fmt: skip
@pytest.mark.parametrize("num_splits", [1, 2, 7, 0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_split_k_results_agree_whatever_the_number_of_splits(backend, num_splits, sinks):
    """1 (off), 2, more splits than some sequences have key tiles, 0 (chosen): merged by
    their LSEs, the same result as one pass; the sinks applied once, after the merge."""
    if backend.unavailable_reason():
        pytest.skip(backend.unavailable_reason())
    variant = (
        {"sinks": torch.randn(HEADS, generator=torch.Generator().manual_seed(7))} if sinks else {}
    )
    contiguous = cache_call(torch.float32, device_for(backend), q_len=2, new=2, **variant)
    call = paged(contiguous)
    out, lse, _, _ = run(backend, call, num_splits=num_splits)
    single, _, _, _ = run(backend, call, num_splits=1)
    exact = expected(float64_reference, contiguous)
    baseline = expected(same_precision_reference, contiguous)
    assert_agrees(out, exact[0], baseline[0])
    assert_agrees(lse, exact[1], baseline[1], what="lse")
    torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-6)


def test_split_k_splits_when_the_threads_would_idle():
    """A batch below the thread count: split (never below MIN_SPLIT_KEYS keys a split); at
    or above it: one pass."""
    q, cache = torch.zeros(2, 1, HEADS, HEAD_DIM), torch.zeros(2, 4096, KV_HEADS, HEAD_DIM)
    two = prepare_kvcache(q, cache, cache, 4096)  # an item per sequence, all heads in it
    assert numba_kvcache.kvcache_splits(two, threads=8) == 4
    assert numba_kvcache.kvcache_splits(two, threads=3) == 3  # 6 items: two rounds of 3
    assert numba_kvcache.kvcache_splits(two, threads=2) == 1
    short = prepare_kvcache(q[:1], cache[:1], cache[:1], numba_kvcache.MIN_SPLIT_KEYS * 2)
    assert numba_kvcache.kvcache_splits(short, threads=8) == 2


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_append_writes_exactly_the_new_rows_in_place(layout):
    call = cache_call(torch.float32, q_len=2, new=2)
    call = paged(call) if layout == "paged" else call
    before = call["k_cache"].clone(), call["v_cache"].clone()
    caches = call["k_cache"], call["v_cache"]
    attnperf.attention_with_kvcache(**call)
    assert call["k_cache"] is caches[0] and call["v_cache"] is caches[1]
    for cache, old, new in zip(caches, before, (call["k_new"], call["v_new"]), strict=True):
        wanted = old.clone()
        for b, cached in enumerate(CACHED):
            for t in range(new.shape[1]):
                position = cached + t
                if layout == "paged":
                    page = call["block_table"][b, position // PAGE]
                    wanted[page, position % PAGE] = new[b, t]
                else:
                    wanted[b, position] = new[b, t]
        assert torch.equal(cache, wanted)


def test_an_int_cache_seqlens_serves_every_sequence():
    call = cache_call(torch.float32, cached=(12, 12), new=1)
    out = attnperf.attention_with_kvcache(**dict(call, cache_seqlens=12), backend="numba")
    torch.testing.assert_close(out, attnperf.attention_with_kvcache(**call, backend="reference"))


@pytest.mark.parametrize(
    "backend", [b for b in dispatch.registry().values() if b.unavailable_reason() is None],
    ids=lambda b: b.name,
)  # fmt: skip
def test_gradients_are_refused_with_a_reason_and_nothing_is_written(backend):
    """Inference only: every backend's declarations say so."""
    assert "kvcache_backward" not in backend.capabilities.features
    call = cache_call(torch.float32, device_for(backend))
    call["q"].requires_grad_()
    before = call["k_cache"].clone()
    with pytest.raises(
        attnperf.BackendNotSupportedError, match=re.escape(FEATURES["kvcache_backward"])
    ):
        attnperf.attention_with_kvcache(**call, backend=backend.name)
    assert torch.equal(call["k_cache"], before)


def _table(c, value):
    return dict(block_table=torch.full_like(c["block_table"], value))


BAD_CALLS = [
    ("beyond S_max", lambda c: dict(cache_seqlens=S_MAX), ValueError, "exceed the cache's"),
    ("beyond the pages", lambda c: dict(block_table=c["block_table"][:, :5]), ValueError,
     r"exceed the cache's capacity \(5 pages of 16"),
    ("page out of range", lambda c: _table(c, 99), ValueError, r"block_table\[0, 0\] = 99"),
    ("negative page", lambda c: _table(c, -1), ValueError, "is not a page of the cache"),
    ("float block_table", lambda c: dict(block_table=c["block_table"].float()), TypeError,
     "block_table must be an int32"),
    ("block_table batch", lambda c: dict(block_table=c["block_table"][:2]), ValueError,
     r"block_table must be \(B, max_pages\)"),
    ("k_new alone", lambda c: dict(v_new=None), ValueError, "k_new and v_new must be given"),
    ("k_new heads", lambda c: dict(k_new=c["k_new"][:, :, :1]), ValueError, "k_new must have"),
    ("k_new dtype", lambda c: dict(k_new=c["k_new"].double()), TypeError, "k_new dtype"),
    ("cache heads", lambda c: dict(q=c["q"][:, :, :3]), ValueError, "must divide the query heads"),
    ("v_cache shape", lambda c: dict(v_cache=c["v_cache"][:, :, :1]), ValueError, "v_cache's"),
    ("head dim", lambda c: dict(q=c["q"][..., :8]), ValueError, "head dim"),
    ("negative seqlens", lambda c: dict(cache_seqlens=-1), ValueError, "cache_seqlens must be >="),
    ("float seqlens", lambda c: dict(cache_seqlens=1.0), TypeError, "cache_seqlens must be an int"),
    ("seqlens shape", lambda c: dict(cache_seqlens=c["cache_seqlens"][:2]), ValueError,
     r"cache_seqlens must be an int or of shape \(B,\)"),
    ("num_splits", lambda c: dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    ("leftpad", lambda c: dict(cache_leftpad=c["cache_seqlens"] + 1), ValueError,
     "cache_leftpad .* must not exceed"),
    ("softcap", lambda c: dict(softcap=0.0), ValueError, "softcap must be"),
    ("sinks shape", lambda c: dict(sinks=torch.zeros(KV_HEADS)), ValueError, "sinks must have"),
    ("sinks dtype", lambda c: dict(sinks=torch.zeros(HEADS, dtype=torch.int32)), TypeError,
     "sinks must be a floating-point"),
    ("q dims", lambda c: dict(q=c["q"][0]), ValueError, "q must be"),
]  # fmt: skip


@pytest.mark.parametrize("what, change, error, match", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_is_refused_naming_the_argument_and_the_cache_is_unchanged(
    what, change, error, match
):
    call = paged(cache_call(torch.float32, new=2))
    call |= change(call)
    before = call["k_cache"].clone(), call["v_cache"].clone()
    with pytest.raises(error, match=match):
        attnperf.attention_with_kvcache(**call)
    assert torch.equal(call["k_cache"], before[0]) and torch.equal(call["v_cache"], before[1])


@pytest.mark.parametrize(
    "cached, q_len, is_causal",
    [((40, 40, 40, 40), 1, True), (CACHED, 1, True), (CACHED, 3, False)],
    ids=["one_call", "per_sequence", "non_causal_rows"],
)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_sdpa_packs_the_group_as_rows_where_every_row_sees_its_whole_cache(
    cached, q_len, is_causal, layout
):
    """sdpa's careful decode form (no mask): one call over equal caches, else one per
    sequence (an empty one included), also for several rows that see every key."""
    call = cache_call(torch.float32, q_len=q_len, new=q_len, cached=cached, is_causal=is_causal)
    exact, baseline = expected(float64_reference, call), expected(same_precision_reference, call)
    out, _, _, _ = run(dispatch.registry()["sdpa"], paged(call) if layout == "paged" else call)
    assert_agrees(out, exact[0], baseline[0])


@pytest.mark.parametrize("q_heads, q_len", [(6, 1), (2, 3), (8, 3)])
def test_numba_decode_any_rows_per_group_any_keys_per_tile(q_heads, q_len):
    """numba's value loop takes 4 keys at a time: tiles that end mid-block, group x Lq rows
    of 3, 3 and 12, both cache layouts."""
    gen = torch.Generator().manual_seed(7)
    cached = (0, 6, 37, 90)
    batch = len(cached)
    call = {
        "q": torch.randn(batch, q_len, q_heads, HEAD_DIM, generator=gen),
        "k_cache": torch.randn(batch, S_MAX, KV_HEADS, HEAD_DIM, generator=gen),
        "v_cache": torch.randn(batch, S_MAX, KV_HEADS, HEAD_DIM, generator=gen),
        "cache_seqlens": torch.tensor(cached, dtype=torch.int32),
        "k_new": torch.randn(batch, q_len, KV_HEADS, HEAD_DIM, generator=gen),
        "v_new": torch.randn(batch, q_len, KV_HEADS, HEAD_DIM, generator=gen),
    }
    exact, baseline = expected(float64_reference, call), expected(same_precision_reference, call)
    numba = dispatch.registry()["numba"]
    for layout in (call, head_major(call)):
        out, lse, _, _ = run(numba, layout)
        assert_agrees(out, exact[0], baseline[0])
        assert_agrees(lse, exact[1], baseline[1], what="lse")


STEP_DTYPES = {  # a step's (queries, pages): fp32, bf16 (bits), bf16 pages in the loops, int8
    "fp32": (np.float32, np.float32), "bf16": (np.uint16, np.uint16),
    "bf16 loops": (np.float32, np.uint16), "int8": (np.float32, np.int8),
}  # fmt: skip
ROUTES_TAKEN = {
    "amx_route": {"bf16"}, "micro_kernel_route": {"fp32", "bf16"},
    "quantized_scores_route": {"int8"}, "quantized_values_route": {"int8"},
    "cached_scores_route": {"fp32", "bf16", "bf16 loops"},
    "cached_values_route": {"fp32", "bf16", "bf16 loops"},
}  # fmt: skip


@pytest.mark.parametrize("route", ROUTES_TAKEN)
def test_a_step_compiles_only_the_tile_routes_its_cache_can_take(route):
    """Each route of a step's key tile is its function for the caches that take it
    (`decode_kind`) and nothing for the others, whose kernels then carry none of its code:
    there a no-op that takes any arguments, where the function's own typing refuses these."""
    call_route = getattr(numba_kvcache, route)

    @numba.njit
    def call(q_rows, pages):
        call_route(q_rows, pages)  # the route's other arguments left out

    for cache, (q_dtype, pages_dtype) in STEP_DTYPES.items():
        arrays = np.zeros((1, 1, 1), q_dtype), np.zeros((1, 1, 1, 1), pages_dtype)
        if cache in ROUTES_TAKEN[route]:
            with pytest.raises(numba.core.errors.TypingError):
                call(*arrays)
        else:
            call(*arrays)


NO_AMX = pytest.mark.skipif(tile_route("bf16")[0] != "amx", reason=tile_route("bf16")[1])
STEP_KINDS = [
    (torch.float32, numba_kvcache.FP32, (1, 40, 59, 100)),
    (torch.float32, numba_kvcache.LOOPS, (40,)),
    (torch.bfloat16, numba_kvcache.BF16, (2, 40, 100)),
    (torch.bfloat16, numba_kvcache.LOOPS, (40, 59)),
    pytest.param(torch.bfloat16, numba_kvcache.AMX, (32, 64), marks=NO_AMX),
]


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("dtype, kind, head_dims", STEP_KINDS, ids=lambda x: str(x))
def test_numba_decode_every_step_kind_keeps_the_2x_rule(dtype, kind, head_dims, prefetch,
                                                        monkeypatch):  # fmt: skip
    """Each way a step runs, forced whatever this CPU would choose: the micro-kernels (fp32,
    or bf16 dot products where the CPU has them and two FMAs where not) and the per-key
    loops, at head dims off the vector width, both cache layouts, GQA rows of 3; with and
    without the walk's prefetching."""
    monkeypatch.setattr(numba_kvcache, "decode_kind", lambda inputs: kind)
    monkeypatch.setattr(numba_kvcache, "prefetches", lambda: prefetch)
    numba = dispatch.registry()["numba"]
    for head_dim in head_dims:
        call = cache_call(dtype, q_len=3, new=3, cached=(0, 6, 37, 90), seed=head_dim, heads=6,
                          head_dim=head_dim)  # fmt: skip
        exact = expected(float64_reference, call)
        baseline = expected(same_precision_reference, call)
        for layout in (call, head_major(call)):
            out, lse, _, _ = run(numba, layout)
            assert_agrees(out, exact[0], baseline[0])
            assert_agrees(lse, exact[1], baseline[1], what="lse")


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numba_decode_at_realistic_size_keeps_the_2x_rule(dtype, prefetch, monkeypatch):
    """One token over 4096 cached keys, Llama's head dim and a GQA group of 4, in the
    step's real tiles (192 keys), whichever kind this CPU runs, in both cache layouts
    (transformers' head-major one: the values of a head's whole tile in one product), with
    and without the walk's prefetching."""
    monkeypatch.setattr(numba_kvcache, "DECODE_BLOCK_N", 192)
    monkeypatch.setattr(numba_kvcache, "prefetches", lambda: prefetch)
    call = cache_call(dtype, new=0, cached=(4096, 3096), seed=11, head_dim=128, s_max=4096)
    exact, baseline = expected(float64_reference, call), expected(same_precision_reference, call)
    for layout in (call, head_major(call)):
        out, lse, _, _ = run(dispatch.registry()["numba"], layout)
        assert_agrees(out, exact[0], baseline[0])
        assert_agrees(lse, exact[1], baseline[1], what="lse")


@NO_AMX
@pytest.mark.parametrize("preset", list(PRESETS))
def test_numba_decode_on_amx_keeps_the_2x_rule_in_every_preset_and_layout(preset, monkeypatch):
    """The AMX step (E a multiple of 32) under each preset's variant, in contiguous, paged
    and head-major caches, on numba's threads and split 3 ways: tiles of 16 keys that end
    mid-chunk at each sequence's end (the keys copied before a tile loads them), and 12 rows
    or, with Lq = 5, 20 (two row tiles)."""
    monkeypatch.setattr(numba_kvcache, "PARALLEL_MIN_BYTES", 0)
    numba = dispatch.registry()["numba"]
    for q_len in sorted({PRESETS[preset]["q_len"], 5}):
        variant = dict(PRESETS[preset], q_len=q_len)
        variant["new"] = min(variant["new"], q_len)
        call = cache_call(torch.bfloat16, head_dim=32, **variant)
        assert numba_kvcache.decode_kind(prepare_kvcache(**call)) == numba_kvcache.AMX
        exact = expected(float64_reference, call)
        baseline = expected(same_precision_reference, call)
        for layout in (call, paged(call), head_major(call)):
            for num_splits in (1, 3):
                out, lse, _, _ = run(numba, layout, num_splits=num_splits)
                assert_agrees(out, exact[0], baseline[0])
                assert_agrees(lse, exact[1], baseline[1], what="lse")


def test_decode_kind_reads_bf16_pairs_only_at_even_head_dims():
    """A bf16 cache of odd E would make the dot products read a pair past each row's end:
    it runs on the loops."""
    even = prepare_kvcache(**cache_call(torch.bfloat16, new=0))
    odd = dataclasses.replace(even, query=even.query[..., :15])
    assert numba_kvcache.decode_kind(odd) == numba_kvcache.LOOPS


@pytest.mark.parametrize("num_splits", [1, 3])
def test_numba_parallel_and_serial_walks_agree(num_splits, monkeypatch):
    """Steps below PARALLEL_MIN_BYTES run on the calling thread: the parallel walk (forced
    here) gives the same result."""
    call = paged(cache_call(torch.float32, q_len=2, new=2))
    numba = dispatch.registry()["numba"]
    serial, _, _, _ = run(numba, call, num_splits=num_splits)
    monkeypatch.setattr(numba_kvcache, "PARALLEL_MIN_BYTES", 0)
    parallel, _, _, _ = run(numba, call, num_splits=num_splits)
    torch.testing.assert_close(parallel, serial, rtol=0, atol=0)


def test_numba_step_of_one_item_runs_on_the_calling_thread(monkeypatch):
    """One sequence in one split is one item: over PARALLEL_MIN_BYTES too, waking numba's
    threads for it would only cost (a 2 MiB fp32 step of 256 keys had run so)."""
    call = cache_call(torch.float32, cached=(9,), new=0)
    numba = dispatch.registry()["numba"]
    monkeypatch.setattr(numba_kvcache, "PARALLEL_MIN_BYTES", 0)
    woken = []
    monkeypatch.setattr(numba_kvcache, "run_parallel", lambda *args: woken.append(args))
    run(numba, call, num_splits=1)
    assert woken == []
    run(numba, call, num_splits=2)
    assert len(woken) == 1


# ---------------------------------------------------------------------- int8 caches
def quantized(call: dict, k_group: int = HEAD_DIM, v_group: int = HEAD_DIM) -> dict:
    """The same call over an int8 cache: quantize_kv's codes and scales of the float one."""
    k_cache, k_scale = attnperf.quantize_kv(call["k_cache"], group_size=k_group)
    v_cache, v_scale = attnperf.quantize_kv(call["v_cache"], group_size=v_group)
    return dict(call, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale)


def dequantized(call: dict) -> dict:
    """What an int8 call means: attention over the dequantized cache, the new keys as they
    are stored (quantized and dequantized), in q's dtype."""
    result = {n: v for n, v in call.items() if n not in ("k_scale", "v_scale")}
    for name, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        result[name] = attnperf.dequantize_kv(call[name], call[scale], call["q"].dtype)
    group = {"k_new": HEAD_DIM // call["k_scale"].shape[3],
             "v_new": HEAD_DIM // call["v_scale"].shape[3]}  # fmt: skip
    for name in ("k_new", "v_new"):
        if call.get(name) is not None:
            codes, scale = attnperf.quantize_kv(call[name], group_size=group[name])
            result[name] = attnperf.dequantize_kv(codes, scale, call["q"].dtype)
    return result


def test_quantize_kv_is_symmetric_per_group_round_half_even():
    x = torch.tensor([[0.0, 1.27, -2.54, 0.5 * 2.54 / 127, 0.0, 0.0, 0.0, 0.0]])
    codes, scale = attnperf.quantize_kv(x, group_size=4)
    assert scale.dtype == torch.float32 and scale.shape == (1, 2)
    torch.testing.assert_close(scale, torch.tensor([[2.54 / 127, 0.0]]))
    assert codes.dtype == torch.int8
    # 0.5 code units rounds to the even 0; a group of zeros: scale 0, codes 0.
    assert codes.tolist() == [[0, 64, -127, 0, 0, 0, 0, 0]]
    gen = torch.Generator().manual_seed(0)
    for group in (None, 1, 8, 32):
        x = torch.randn(3, 5, 32, generator=gen, dtype=torch.float64) * 4
        codes, scale = attnperf.quantize_kv(x, group_size=group)
        back = attnperf.dequantize_kv(codes, scale, torch.float64)
        per_value = scale.repeat_interleave(32 // scale.shape[-1], -1).double()
        assert ((back - x).abs() <= per_value / 2 + 1e-12).all(), group
        assert codes.abs().max() == 127


@pytest.mark.parametrize(
    "group_size, error, match",
    [(3, ValueError, "must divide the last dim E = 16"), (0, ValueError, "must divide"),
     (2.0, TypeError, "group_size must be an int")],
)  # fmt: skip
def test_quantize_kv_refuses_a_group_size_that_does_not_divide_e(group_size, error, match):
    with pytest.raises(error, match=match):
        attnperf.quantize_kv(torch.randn(2, 16), group_size=group_size)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        attnperf.quantize_kv(torch.zeros(2, 16, dtype=torch.int8))


INT8_PRESETS = {
    "decode_per_row": {"q_len": 1, "new": 1},
    "speculative_groups_of_8_and_4": {"q_len": 3, "new": 3, "groups": (8, 4)},
    "left_padded_window_sinks": {
        "q_len": 1, "new": 1, "cache_leftpad": torch.tensor((0, 5, 10, 33)).int(),
        "window": (20, 0), "softcap": 3.0, "groups": (4, 16),
        "sinks": torch.randn(HEADS, generator=torch.Generator().manual_seed(8)),
    },
}  # fmt: skip


def int8_call(dtype, device="cpu", groups=(HEAD_DIM, HEAD_DIM), **preset) -> dict:
    return quantized(cache_call(dtype, device, **preset), *groups)


def int8_params(dtypes):
    return preset_params(INT8_PRESETS, dtypes,
                         lambda *a, **k: prepare_kvcache(**int8_call(*a, **k)))  # fmt: skip


@pytest.mark.parametrize("backend, preset, dtype", int8_params((torch.float32, torch.bfloat16)))
def test_int8_cache_equals_attention_over_the_dequantized_cache(backend, preset, dtype):
    """Contiguous and paged int8 caches (K and V with their own group sizes), the new keys
    quantized as they are written: within 2x the error of attention over the dequantized
    cache in q's precision, against float64; split-K agrees with one pass."""
    call = int8_call(dtype, device_for(backend), **INT8_PRESETS[preset])
    meaning = dequantized(call)
    exact = expected(float64_reference, meaning)
    baseline = expected(same_precision_reference, meaning)
    for layout, layout_call in (("contiguous", call), ("paged", paged(call))):
        layout_call = dict(
            layout_call, **{n: layout_call[n].clone() for n in ("k_scale", "v_scale")}
        )
        out, lse, _, _ = run(backend, layout_call)
        assert out.shape == call["q"].shape and out.dtype == dtype, layout
        assert_agrees(out, exact[0], baseline[0], what=f"{layout} output")
        if lse is not None:
            assert_agrees(lse, exact[1], baseline[1], what=f"{layout} lse")
    split, _, _, _ = run(backend, dict(call, k_scale=call["k_scale"].clone(),
                                       v_scale=call["v_scale"].clone()), num_splits=3)  # fmt: skip
    torch.testing.assert_close(split, out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_int8_append_quantizes_exactly_the_new_rows_in_place(layout):
    call = int8_call(torch.float32, q_len=2, new=2, groups=(8, 16))
    call = paged(call) if layout == "paged" else call
    tensors = [call[n] for n in ("k_cache", "k_scale", "v_cache", "v_scale")]
    before = [t.clone() for t in tensors]
    attnperf.attention_with_kvcache(**call, backend="reference")
    for (codes, scale, new), old_codes, old_scale in zip(
        ((tensors[0], tensors[1], call["k_new"]), (tensors[2], tensors[3], call["v_new"])),
        before[0::2], before[1::2], strict=True,
    ):  # fmt: skip
        new_codes, new_scale = attnperf.quantize_kv(new, group_size=16 // old_scale.shape[3])
        wanted_codes, wanted_scale = old_codes.clone(), old_scale.clone()
        for b, cached in enumerate(CACHED):
            for t in range(new.shape[1]):
                position = cached + t
                where = (
                    (call["block_table"][b, position // PAGE], position % PAGE)
                    if layout == "paged"
                    else (b, position)
                )
                wanted_codes[where], wanted_scale[where] = new_codes[b, t], new_scale[b, t]
        assert torch.equal(codes, wanted_codes) and torch.equal(scale, wanted_scale)


INT8_BAD_CALLS = [
    ("no scales", lambda c: dict(k_scale=None), ValueError, "k_cache is int8: pass its k_scale"),
    ("scales of a float cache", lambda c: {n: c[n].float() for n in ("k_cache", "v_cache")},
     ValueError, "k_scale is given but k_cache is torch.float32"),
    ("scale shape", lambda c: dict(v_scale=c["v_scale"][:, :5]), ValueError, "v_scale must be"),
    ("group not dividing E", lambda c: dict(k_scale=torch.ones(*c["k_scale"].shape[:3], 3)),
     ValueError, r"a group size G dividing E = 16"),
    ("integer scales", lambda c: dict(k_scale=c["k_scale"].int()), TypeError,
     "k_scale must be a float32 tensor"),
    ("one cache int8", lambda c: dict(v_cache=c["v_cache"].float(), v_scale=None), TypeError,
     "v_cache must be int8"),
    ("k_new of another dtype", lambda c: {n: c[n].double() for n in ("k_new", "v_new")},
     TypeError, "k_new dtype"),
]  # fmt: skip


@pytest.mark.parametrize("what, change, error, match", INT8_BAD_CALLS,
                         ids=[b[0] for b in INT8_BAD_CALLS])  # fmt: skip
def test_int8_bad_input_is_refused_naming_the_argument_and_nothing_is_written(
    what, change, error, match
):
    call = int8_call(torch.float32, new=2)
    call |= change(call)
    tensors = [call[n] for n in ("k_cache", "v_cache", "k_scale", "v_scale") if call[n] is not None]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=match):
        attnperf.attention_with_kvcache(**call)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))


def test_sdpa_refuses_an_int8_cache_with_the_reason():
    call = int8_call(torch.float32)
    with pytest.raises(attnperf.BackendNotSupportedError, match="an int8 KV cache"):
        attnperf.attention_with_kvcache(**call, backend="sdpa")
    assert dispatch.select(prepare_kvcache(**call)).name != "sdpa"


def test_head_major_pages_are_judged_from_strides_as_torch_judges_contiguity():
    """numba's steps read (P, rows, H, E) pages as (P, H, rows, E) memory where they are a
    view of it: the stride rule agrees with torch's transposed view's is_contiguous for
    every permutation of small shapes (dims of one, sliced views)."""
    for shape in itertools.product([1, 2, 3], repeat=4):
        base = torch.randn(*shape)
        for order in itertools.permutations(range(4)):
            pages = base.permute(*order)
            for view in (pages, pages[:, :1], pages[..., :1]):
                expected = not view.is_contiguous() and view.transpose(1, 2).is_contiguous()
                assert numba_kvcache._is_head_major(view) == expected, (shape, order)
