"""The numba backend's own choices: the BLAS it binds, both backward schedules, its exp2."""

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from cases import CASES, VARIANT_CASES, assert_gradients_agree, results_and_gradients

import attnperf
from attnperf import dispatch, plans
from attnperf.inputs import prepare
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

pytest.importorskip("numba")
from attnperf.kernels.numba import (
    attention,
    blas,
    fastmath,
    forward_amx,
    forward_fp32,
    forward_rows,
    jit,
    launch,
    softmax,
    variant,
)
from attnperf.kernels.numba.jit import numba
from attnperf.kernels.numba.microkernels import BF16

if dispatch.registry()["numba"].unavailable_reason():
    pytest.skip(dispatch.registry()["numba"].unavailable_reason(), allow_module_level=True)


@pytest.fixture
def small_tiles(monkeypatch):
    """8 x 16 tiles: the grid's short calls then span many query and key tiles. No call
    plan is kept across (a kept forward keeps its own tiles)."""
    monkeypatch.setattr(attention, "BLOCK_M", 8)
    monkeypatch.setattr(attention, "BANDED_BLOCK_M", 8)
    monkeypatch.setattr(attention, "BLOCK_N", 16)
    plans.clear()
    yield
    plans.clear()


@pytest.mark.parametrize("case", CASES + VARIANT_CASES, ids=lambda case: case.id)
def test_many_tiles_agree_with_float64_reference(case, small_tiles):
    """Online rescaling across key tiles, tiles that the band and the block layout cut,
    skip or leave whole, unaligned band starts: forward, LSE and backward."""
    args = case.build(torch.float32)

    def numba(**call):
        return attnperf.attention(**call, backend="numba")

    *actual_results, actual = results_and_gradients(numba, args)
    *exact_results, exact = results_and_gradients(float64_reference, args, cast=torch.float64)
    *baseline_results, baseline = results_and_gradients(same_precision_reference, args)
    for what, a, e, b in zip(("output", "lse"), actual_results, exact_results,
                             baseline_results, strict=True):  # fmt: skip
        if b is not None:
            assert_agrees(a, e, b, what=what)
    for name in actual:
        assert_agrees(actual[name], exact[name], baseline[name], what=f"grad of {name}")


@pytest.mark.parametrize("case", CASES + VARIANT_CASES, ids=lambda case: case.id)
def test_fp32_forward_by_rows_agrees_with_float64_reference(case, small_tiles, monkeypatch):
    """The fp32 forward with its scores by rows (`packed_forward`, AVX2's route; AVX-512
    holds them transposed) on the same many tiles: output and LSE."""
    monkeypatch.setattr(attention, "transposed_fp32", lambda: False)
    args = {name: value.detach() if isinstance(value, torch.Tensor) else value
            for name, value in case.build(torch.float32).items()}  # fmt: skip
    forward = attention.DenseForward(prepare(**args))
    if forward.kernel is not None:
        assert forward.kernel in (attention.packed_forward, jit.serial(attention.packed_forward))
    actual = attnperf.attention(**args, backend="numba")
    exact, baseline = float64_reference(**args), same_precision_reference(**args)
    names = ("output", "lse")
    if not args.get("return_lse"):
        names, actual, exact, baseline = names[:1], (actual,), (exact,), (baseline,)
    for what, a, e, b in zip(names, actual, exact, baseline, strict=True):
        assert_agrees(a, e, b, what=what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call", ["full", "causal", "variants"])
def test_fused_and_two_pass_backward_agree(call, dtype, small_tiles):
    """Both schedules (on bf16 tiles for bf16 where the CPU has the bf16 dot product) give
    the same gradients: fp32 to rounding, bf16 to a rounding of the result."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 301, 32, generator=gen).to(dtype)  # odd rows: a row pair's half
    k, v = (torch.randn(2, 2, 279, 32, generator=gen).to(dtype) for _ in range(2))
    mask = None if call != "full" else torch.randn(301, 279, generator=gen).requires_grad_()
    variants = {}
    if call == "variants":
        layout = attnperf.block_mask(lambda b, h, i, j: (i // 40 + j // 24) % 3 != 1, None, 4,
                                     301, 279, block_size=(16, 32))  # fmt: skip
        variants = {"window": (50, 7), "align": "bottom_right", "softcap": 3.0,
                    "alibi_slopes": torch.rand(4, generator=gen), "block_mask": layout}  # fmt: skip
    inputs = prepare(q, k, v, attn_mask=mask, is_causal=call == "causal", enable_gqa=True,
                     **variants)  # fmt: skip
    out, lse, _ = attention.numba_attention_forward(inputs)
    grad_out = torch.randn(out.shape, generator=gen).to(dtype)
    fused = attention.numba_attention_backward(inputs, out, lse, grad_out, fused=True)
    two_pass = attention.numba_attention_backward(inputs, out, lse, grad_out, fused=False)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), fused, two_pass, strict=True):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a, b, **tolerance, msg=name)


def test_a_zero_head_dim_backward_runs_on_the_kernels_of_other_head_dims():
    """E = 0 runs on one zero column of q and k (the same zero scores): numba types a
    zero-size array as contiguous, which compiled the backward anew (~40 s of a cold test
    run). dq and dk keep E = 0; dv is P^T dO with P uniform over the keys."""
    gen = torch.Generator().manual_seed(0)

    def gradients(head_dim):
        q = torch.randn(1, 2, 9, head_dim, generator=gen)
        k = torch.randn(1, 2, 11, head_dim, generator=gen)
        inputs = prepare(q, k, torch.randn(1, 2, 11, 3, generator=gen))
        out, lse, _ = attention.numba_attention_forward(inputs)
        grad_out = torch.randn(out.shape, generator=gen)
        return grad_out, attention.numba_attention_backward(inputs, out, lse, grad_out, fused=True)

    gradients(4)
    compiled = list(attention.attention_backward_fused.signatures)
    grad_out, (dq, dk, dv, _) = gradients(0)
    assert attention.attention_backward_fused.signatures == compiled
    assert dq.shape == (1, 2, 9, 0) and dk.shape == (1, 2, 11, 0)
    expected = grad_out.sum(dim=2, keepdim=True).expand(1, 2, 11, 3) / 11
    torch.testing.assert_close(dv, expected)


@pytest.mark.parametrize("trans_a", [False, True], ids=["a", "a.T"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "b.T"])
def test_gemm_on_strided_tile_views(trans_a, trans_b):
    blas.setup()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((40, 50), dtype=np.float32)[3 : 8 + 3, 2 : 7 + 2]  # rows 8, cols 7
    a = a.T.copy()[:, :8] if trans_a else a  # op(a) is 8 x 7 either way
    b = rng.standard_normal((30, 20), dtype=np.float32)[:7, :5]
    b = b.T.copy() if trans_b else b
    c_full = rng.standard_normal((12, 9), dtype=np.float32)
    c = c_full[:8, :5]
    expected = 0.5 * (a.T if trans_a else a) @ (b.T if trans_b else b) + 2.0 * c
    untouched = c_full.copy()
    blas.gemm(a, b, c, 0.5, 2.0, trans_a, trans_b)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-5)
    untouched[:8, :5] = c
    np.testing.assert_array_equal(c_full, untouched)  # nothing outside the view written


def test_blas_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv("ATTNPERF_NUMBA_BLAS", "mkl-please")
    with pytest.raises(ValueError, match="ATTNPERF_NUMBA_BLAS must be one of"):
        blas.setup.__wrapped__()  # raises before binding anything


OPENBLAS_CHECK = """
import torch
from cases import output_and_gradients
from attnperf import attention
from attnperf.kernels.numba import blas
from attnperf.testing import assert_agrees, float64_reference, same_precision_reference

gen = torch.Generator().manual_seed(0)
args = {name: torch.randn(1, 2, 300, 48, generator=gen) for name in ("query", "key", "value")}
grad_out = torch.randn(1, 2, 300, 48, generator=gen)

for causal in (False, True):
    def numba(**call):
        return attention(**call, is_causal=causal, backend="numba")

    def exact(**call):
        return float64_reference(**call, is_causal=causal)

    def baseline(**call):
        return same_precision_reference(**call, is_causal=causal)

    actual_out, actual = output_and_gradients(numba, args, grad_out)
    exact_out, exact = output_and_gradients(exact, args, grad_out, torch.float64)
    baseline_out, baseline = output_and_gradients(baseline, args, grad_out)
    assert_agrees(actual_out, exact_out, baseline_out, what="out")
    for name in actual:
        assert_agrees(actual[name], exact[name], baseline[name], what="d" + name)
print(blas.setup()[0])
"""


def test_scipy_openblas_serves_when_asked():
    tests = str(Path(__file__).parent)  # for `cases`
    env = {**os.environ, "ATTNPERF_NUMBA_BLAS": "scipy", "PYTHONPATH": tests}
    result = subprocess.run(
        [sys.executable, "-c", OPENBLAS_CHECK], capture_output=True, text=True, env=env,
        timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("scipy's OpenBLAS")


THREADS_CHECK = """
import torch
torch.set_num_threads(1)
import attnperf
q = torch.randn(1, 8, 256, 64)
attnperf.attention(q, q, q, backend="numba")  # parallel: 8 query tiles
print(torch.get_num_threads())
"""


def _parallel_calls():
    """A forward and backward and a decoding step, each large enough for numba's threads;
    their results as numpy arrays."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=gen).requires_grad_() for _ in range(3))
    out = attnperf.attention(q, k, v, is_causal=True, backend="numba")
    out.backward(torch.randn(out.shape, generator=gen))
    k_cache, v_cache = (torch.randn(1, 4096, 2, 64, generator=gen) for _ in range(2))
    step = attnperf.attention_with_kvcache(torch.randn(1, 1, 8, 64, generator=gen), k_cache,
                                           v_cache, 4096, backend="numba")  # fmt: skip
    return [t.detach().numpy().copy() for t in (out, q.grad, k.grad, v.grad, step)]


def _in_child(connection):
    torch.set_num_threads(1)  # as a DataLoader worker does (torch's MKL hangs otherwise)
    connection.send(_parallel_calls())


def test_a_process_forked_after_parallel_kernels_runs_them():
    """A DataLoader worker forked after a training step: GNU OpenMP's threads do not
    survive a fork, and numba ended the child at its first parallel kernel. The child runs
    them on its calling thread (`jit.serial`), with the parent's results."""
    expected = _parallel_calls()
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_in_child, args=(send,))
    child.start()
    got = None
    for _ in range(600):  # seconds; a child that dies sends nothing
        if receive.poll(1):
            got = receive.recv()
            break
        if not child.is_alive():
            break
    child.join(60)
    assert child.exitcode == 0 and got is not None
    for name, a, b in zip(("out", "dq", "dk", "dv", "step"), got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_kernels_cache_stamp_covers_every_module_of_its_folder(tmp_path):
    """numba inlines helpers of other files into a kernel but stamped its cache with the
    kernel's own file: an edit to a helper module left the others' kernels stale."""
    kernel, helper = tmp_path / "kernel.py", tmp_path / "helper.py"
    kernel.write_text("x = 1\n")
    helper.write_text("y = 2\n")
    before = jit.folder_stamp(str(tmp_path))
    helper.write_text("y = 3\n")
    assert jit.folder_stamp(str(tmp_path)) != before
    fastmath.exp2_shifted(np.zeros(4, np.float32), 4, np.float32(0.0), np.float32(1.0))
    locator = fastmath.exp2_shifted._cache._impl._locator
    assert locator.get_source_stamp() == jit.folder_stamp()


COMPILE_NOTE_PROBE = """
import sys
from attnperf.kernels.numba import jit
jit.KERNELS_FOLDER, jit.COMPILE_NOTE_AFTER_S = sys.argv[1], float(sys.argv[2])
sys.path.insert(0, sys.argv[1])
import tiny
print(tiny.twice(21))
"""


@pytest.mark.parametrize("after_s", [0.0, 60.0])
def test_a_long_compile_says_so_once_on_stderr(tmp_path, after_s):
    """A first call that compiles for long prints one line (what, how long); the next
    process loads the kernel from the disk cache and prints nothing; a short compile
    (here: shorter than the note's delay) prints nothing either."""
    (tmp_path / "tiny.py").write_text(
        "from attnperf.kernels.numba.jit import njit\n\n\n@njit()\ndef twice(x):\n"
        "    return 2 * x\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-c", COMPILE_NOTE_PROBE, str(tmp_path), str(after_s)]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                           check=True) for _ in range(2)]  # fmt: skip
    assert [run.stdout for run in runs] == ["42\n", "42\n"]
    if after_s:
        assert [run.stderr for run in runs] == ["", ""]
        return
    first = runs[0].stderr.splitlines()
    assert len(first) == 1, runs[0].stderr
    assert first[0].startswith("attnperf: numba compiles twice for this CPU, once")
    assert first[0].endswith(" s")
    assert runs[1].stderr == ""


def test_the_first_parallel_kernel_leaves_torch_its_thread_count():
    """numba's pool, started by the process's first parallel kernel, shares GNU OpenMP with
    torch: the caller's torch.set_num_threads(1) must still hold after it."""
    result = subprocess.run([sys.executable, "-c", THREADS_CHECK], capture_output=True,
                            text=True, timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "1"


def test_numba_is_given_torchs_thread_count_when_it_changes(monkeypatch):
    """run_parallel tells numba torch's thread count once, then again only when it changes."""
    given = []
    monkeypatch.setattr(launch.numba, "set_num_threads", given.append)
    monkeypatch.setattr(launch, "_NUMBA_THREADS", threading.local())
    threads = torch.get_num_threads()
    for count in (threads, threads, 1, 1, threads):
        torch.set_num_threads(count)
        launch.run_parallel(lambda: None)
    torch.set_num_threads(threads)
    assert given == ([threads, 1, threads] if threads > 1 else [1])


def test_scratch_is_kept_per_slot_and_thread_on_a_line(monkeypatch):
    """A slot's memory serves the next call (no fresh pages to fault in); slots and threads
    never share it; a pack over SCRATCH_MAX_BYTES is allocated afresh."""
    first = launch.scratch("a", (3, 5), np.float32)
    again = launch.scratch("a", (2, 7), np.uint16)
    other = launch.scratch("b", (3, 5), np.float32)
    assert first.ctypes.data % 64 == 0 and again.ctypes.data % 64 == 0
    assert first.shape == (3, 5) and again.dtype == np.uint16
    assert np.shares_memory(first, again) and not np.shares_memory(first, other)
    assert launch.scratch("b", (3, 5), np.float32) is other  # a repeated request's, kept
    from_thread = []
    worker = threading.Thread(
        target=lambda: from_thread.append(launch.scratch("a", (3, 5), np.float32))
    )
    worker.start()
    worker.join()
    assert not np.shares_memory(first, from_thread[0])
    monkeypatch.setattr(launch, "SCRATCH_MAX_BYTES", 32)
    assert not np.shares_memory(launch.scratch("a", (3, 5), np.float32), first)


def test_recycled_outputs_reuse_memory_only_once_nothing_uses_it(monkeypatch):
    """A recycled output's memory serves a later request of its size once its tensor, views
    and arrays are all freed, never while one lives; spare memory past
    RECYCLED_SPARE_BYTES is freed; small outputs are plain tensors."""
    monkeypatch.setattr(launch, "RECYCLED_MIN_BYTES", 64)
    monkeypatch.setattr(launch, "_SPARE", {})
    monkeypatch.setattr(launch, "_SPARE_BYTES", [0])
    shape = (4, 16)
    tensor, array = launch.recycled_float32(shape, zero=True)
    address = tensor.data_ptr()
    assert address % 64 == 0 and array.ctypes.data == address and not tensor.any()
    view = tensor[1:]
    del tensor, array
    held, _ = launch.recycled_float32(shape)  # `view` still uses the first one's memory
    assert held.data_ptr() != address
    del view
    again, _ = launch.recycled_float32(shape, zero=True)
    assert again.data_ptr() == address and not again.any()
    held_address = held.data_ptr()
    del held
    assert launch.recycled_float32((3, 16))[0].data_ptr() != held_address  # another size
    taken, _ = launch.recycled_float32(shape)
    assert taken.data_ptr() == held_address
    monkeypatch.setattr(launch, "RECYCLED_SPARE_BYTES", 0)
    spare_bytes = launch._SPARE_BYTES[0]
    del again  # freed, not kept (malloc may hand its address out again)
    assert launch._SPARE_BYTES[0] == spare_bytes and not launch._SPARE[4 * 16 * 4]
    small, _ = launch.recycled_float32((3,))
    assert small.untyped_storage().resizable()  # under RECYCLED_MIN_BYTES: torch's own


def test_fp32_views_are_read_in_place_and_other_layouts_copied():
    blhe = torch.randn(2, 300, 4, 32)
    in_place = blhe.transpose(1, 2)  # (B, H, L, E) with unit stride along E
    assert np.shares_memory(launch.as_fp32(in_place), blhe.numpy())
    one_row_repeated = in_place[:, :, :1].expand(2, 4, 300, 32)  # row stride 0
    for copied in (in_place.transpose(-1, -2), in_place.half(), one_row_repeated):
        array = launch.as_fp32(copied)
        assert array.dtype == np.float32 and array.flags.c_contiguous
        np.testing.assert_array_equal(array, copied.float().numpy())


def test_any_layout_gives_every_layout_one_numba_type():
    """Contiguous arrays, (B, L, H, E) views and broadcast masks reach the kernels as one
    type, so one compiled kernel serves them all: the same elements at [0] and [1]."""
    blhe = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4)
    arrays = (np.ascontiguousarray(blhe.transpose(0, 2, 1, 3)), blhe.transpose(0, 2, 1, 3),
              np.broadcast_to(blhe.transpose(0, 2, 1, 3)[:1, :, :1], (2, 3, 5, 4)))  # fmt: skip
    views = [launch.any_layout(a) for a in arrays]
    assert len({numba.typeof(view) for view in views}) == 1
    for array, view in zip(arrays, views, strict=True):
        assert view.shape == (2, *array.shape)
        np.testing.assert_array_equal(view[0], array)
        np.testing.assert_array_equal(view[1], array)


def test_forward_kernels_read_q_k_v_in_place_at_any_strides(monkeypatch):
    """The launcher hands the forward kernel q, k and v's own memory at their own strides
    (`launch.strided_memory`), (B, L, H, E) views too: no copy; with and without a mask
    the variant has one numba type (the mask by blocks: `variant._mask_for_kernel`), so
    one compiled kernel serves both."""
    launched = []

    def run_parallel(kernel, *args):
        launched.append((kernel, args))
        launch.run_parallel(kernel, *args)

    monkeypatch.setattr(attention, "run_parallel", run_parallel)
    q, k, v = (torch.randn(1, 3, 32, 16) for _ in range(3))
    blhe = tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    variant_at = {
        attention.online_softmax_forward: 1,
        attention.packed_forward: 2,
        attention.fp32_forward: 2,
    }
    variant_types = set()
    for tensors in ((q, k, v), blhe):
        for mask in (None, torch.randn(32, 32)):
            attnperf.attention(*tensors, attn_mask=mask, backend="numba")
            kernel, args = launched.pop()
            for tensor, (address, shape, strides, _) in zip(tensors, args[0], strict=False):
                assert address == tensor.data_ptr() and shape == tuple(tensor.shape)
                for size, stride, own in zip(shape, strides, tensor.stride(), strict=True):
                    assert size == 1 or stride == own, (strides, tensor.stride())
            variant_types.add((kernel, numba.typeof(args[variant_at[kernel]])))
    assert not launched and len(variant_types) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("first", ["side by side", "a head apart"])
def test_forward_copies_rows_a_head_apart_where_its_workspace_has_room(first, dtype):
    """K and V rows a head apart ((B, L, H, E) transposed) are copied side by side per kv
    head where the plan's workspace has room for it (a plan made on such a call) and read
    where they lie where not (a plan made on rows side by side, the same shapes): both
    agree with the reference, GQA and ragged key tiles (S = 600) included; fp32, and bf16
    (its keys, on AMX: E and Ev multiples of 32)."""
    gen = torch.Generator().manual_seed(5)
    dim, value_dim = (40, 24) if dtype == torch.float32 else (64, 32)
    shapes = ((2, 4, 130, dim), (2, 2, 600, dim), (2, 2, 600, value_dim))
    side = [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]
    apart = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in side]
    call = {"is_causal": True, "enable_gqa": True}
    plans.clear()
    order = (side, apart) if first == "side by side" else (apart, side)
    for tensors in order:
        out = attnperf.attention(*tensors, **call, backend="numba")
        exact = float64_reference(*tensors, **call)
        assert_agrees(out, exact, same_precision_reference(*tensors, **call))
    forward = attention.DenseForward(prepare(*order[0], **call))
    needs = {  # the room each kernel looks for past its other buffers
        attention.fp32_forward: (attention.fp32_workspace_bytes,
                                 forward_fp32.fp32_head_bytes(600, dim, value_dim)),
        attention.amx_forward: (attention.amx_workspace_bytes,
                                softmax.rows_bytes(600, dim, 2)),
    }  # fmt: skip
    if forward.kernel in needs:  # AVX-512 fp32 and AMX bf16: the room follows the first call
        workspace_bytes, copy_bytes = needs[forward.kernel]
        without = workspace_bytes(600, dim, value_dim, *forward.blocks, False, False)
        room = forward.workspace[1][1] - without
        assert (room >= copy_bytes) == (first == "a head apart")


def test_bf16_backward_runs_on_bf16_tiles(monkeypatch):
    """Where the CPU has the bf16 dot product, bf16 gradients come from the bf16 kernels
    (both schedules), not from fp32 tiles on widened copies."""
    if attention.forward_kind(prepare(*(torch.ones(1, 1, 1, 2).bfloat16(),) * 3)) != BF16:
        pytest.skip("no AVX512-BF16 in numba's target: bf16 runs widened to fp32 tiles")
    launched = []

    def run_parallel(kernel, *args):
        launched.append(kernel)
        launch.run_parallel(kernel, *args)

    monkeypatch.setattr(attention, "run_parallel", run_parallel)
    inputs = prepare(*(torch.randn(1, 2, 64, 16).bfloat16() for _ in range(3)))
    out, stats, _ = attention.numba_attention_forward(inputs)
    for fused in (True, False):
        attention.numba_attention_backward(inputs, out, stats, torch.ones_like(out), fused=fused)
    bf16_kernels = {attention.bf16_backward_dq, attention.bf16_backward_dkdv,
                    attention.bf16_backward_fused}  # fmt: skip
    assert bf16_kernels <= set(launched)
    fp32_kernels = {attention.attention_backward_dq, attention.attention_backward_dkdv,
                    attention.attention_backward_fused}  # fmt: skip
    assert not fp32_kernels & set(launched)


@pytest.mark.parametrize(
    "items, threads, fused",
    [(1, 1, True), (1, 2, False), (2, 2, True), (3, 2, True), (5, 4, False), (8, 2, True)],
)
def test_backward_schedule_follows_thread_occupancy(items, threads, fused):
    assert attention.fused_backward_pays(items, threads) is fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [4, 17, 100])
def test_rows_of_one_key_get_no_query_or_key_gradient(head_dim, dtype):
    """A window of (0, 0): each row sees its own key alone, so autograd's softmax gives dq
    and dk exactly 0. Where one key tile holds a row's keys, its delta is corrected by the
    tile's own dP (`score_gradients`' whole rows); from rowsum(dO * O) alone they were
    1e-5 to 6e-5 off at E = 17 and 100, scale 3."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, head_dim, generator=gen).to(dtype).requires_grad_()
               for _ in range(3))  # fmt: skip
    out = attnperf.attention(q, k, v, window=(0, 0), scale=3.0, backend="numba")
    out.backward(torch.randn(out.shape, generator=gen).to(dtype))
    assert q.grad.count_nonzero() == 0
    assert k.grad.count_nonzero() == 0


@pytest.mark.parametrize(
    "length, causal, scale, seed", [(4, True, 3.0, 6), (4, True, 3.0, 11), (8, False, 1.0, 10)]
)
def test_fp32_gradients_agree_at_peaked_softmaxes(length, causal, scale, seed):
    """Scores 10-30x the default scale (E = 100): a row's softmax mostly on one or two
    keys, where FlashAttention's delta, rowsum(dO * O), and that key's dP differ by their
    roundings and dS carries it. These seeds left dq and dk 1.1-4.3x as far from float64
    as PyTorch's own fp32 attention; with delta corrected by the tile's dP (all keys in one
    tile), 0.05-0.6x."""
    gen = torch.Generator().manual_seed(seed)
    args = {name: torch.randn(1, 2, length, 100, generator=gen)
            for name in ("query", "key", "value")}  # fmt: skip
    args.update(scale=scale, is_causal=causal)
    grad_out = torch.randn(1, 2, length, 100, generator=gen)
    assert_gradients_agree("numba", args, grad_out)


def test_sinks_gradients_agree_where_a_tile_holds_every_key():
    """Sinks take a share of each row's softmax whose dP is 0, so a tile's keys' P sums
    short of 1: such calls keep rowsum(dO * O) (the whole rows' correction of delta, by
    P normalised over the keys alone, left dq 0.9 off). Without the LSE, which the
    variant cases return (its gradient keeps delta as it is too)."""
    gen = torch.Generator().manual_seed(0)
    args = {name: torch.randn(1, 2, 8, 16, generator=gen) for name in ("query", "key", "value")}
    args.update(sinks=torch.tensor([2.0, 0.5]), is_causal=True)
    grad_out = torch.randn(1, 2, 8, 16, generator=gen)
    assert_gradients_agree("numba", args, grad_out)


def test_exp2_is_within_its_stated_error_and_keeps_nan():
    t = np.concatenate([np.linspace(-126, 40, 1_000_001), np.arange(-126, 41)]).astype(np.float32)
    got = t.copy()
    fastmath.exp2_shifted(got, got.size, np.float32(0.0), np.float32(1.0))
    exact = np.exp2(t.astype(np.float64))
    assert np.max(np.abs(got / exact - 1)) < 8e-8
    integers = t[-167:]  # 2 ** n exactly
    np.testing.assert_array_equal(got[-167:], np.exp2(integers))
    edges = np.array([np.nan, -np.inf, -200.0, -126.5], np.float32)
    fastmath.exp2_shifted(edges, 4, np.float32(0.0), np.float32(1.0))
    assert np.isnan(edges[0]) and edges[1] == 0 and edges[2] == 0
    assert edges[3] == np.float32(2.0**-126.5)  # flushed to 0 only below it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overflow", ["scale", "query"])
def test_overflowing_scores_give_sdpas_finite_rows(dtype, overflow):
    """Scores of ~1e21 (scale=1e20, or q times 1e30; fp16 within its range) give SDPA's
    rows, finite: each row's softmax is its largest key's. The scale folded into the
    softmax's pass as one FMA had left half an ulp of ~1e21 against the row's shift, and
    2 ** that made rows inf and NaN (fp32 tiles)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen).to(dtype) for _ in range(3))
    large = dtype != torch.float16
    call = {"scale": 1e20 if large else 1e3}
    if overflow == "query":
        q, call = (q.float() * (1e30 if large else 6e3)).to(dtype), {}
    for causal in (False, True):
        out, lse = attnperf.attention(q, k, v, is_causal=causal, return_lse=True,
                                      backend="numba", **call)  # fmt: skip
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    **call)  # fmt: skip
        assert out.isfinite().all() and lse.isfinite().all()
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_dense_calls_share_one_variant_tuple_per_shape_and_scalars():
    """The lowered variant of a dense call is made once per (shape, band, softcap, threads):
    the same object for an equal call, another for any difference; calls with tensors in
    their variant (a mask) get their own each time."""
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    first = variant.lower_variant(prepare(q, k, v, is_causal=True))
    assert variant.lower_variant(prepare(q + 1, k, v, is_causal=True)) is first
    assert first[2:4] == (variant.UNBOUNDED, 0) and first[4][:, 2].tolist() == [8, 8]
    others = [prepare(q, k, v), prepare(q, k, v, is_causal=True, window=(2, 0)),
              prepare(q, k, v, is_causal=True, softcap=5.0),
              prepare(q[:1], k[:1], v[:1], is_causal=True)]  # fmt: skip
    assert all(variant.lower_variant(inputs) is not first for inputs in others)
    mask = torch.ones(8, 8, dtype=torch.bool)
    masked = prepare(q, k, v, attn_mask=mask)
    assert variant.lower_variant(masked) is not variant.lower_variant(masked)


def test_balanced_order_shares_the_work_evenly_heaviest_first():
    """Sequences of 1, 10, 2 and 9 pairs over 2 threads: 10 + 1 and 9 + 2; equal sequences
    keep their order."""
    table = torch.zeros(4, 6, dtype=torch.int64)
    table[:, 2], table[:, 4] = 1, torch.tensor([1, 10, 2, 9])
    assert variant.balanced_order(table, 2).tolist() == [1, 0, 3, 2]
    table[:, 4] = 5
    assert variant.balanced_order(table, 2) is None
    assert variant.balanced_order(table[:1], 2) is None


@numba.njit
def _strided_copy(memory, out):
    x = jit.strided_at(memory)
    for index in np.ndindex(x.shape):
        out[index] = x[index]


@pytest.mark.parametrize("layout", ["contiguous", "blhe", "broadcast", "bf16"])
def test_strided_at_reads_a_tensor_at_its_own_strides(layout):
    """`launch.strided_memory` and `jit.strided_at`: a kernel reads a tensor's own memory
    at its strides, (B, L, H, E) views and broadcast (stride 0) dims too, bf16 as its bits."""
    base = torch.randn(2, 5, 3, 4)
    tensor = {
        "contiguous": base,
        "blhe": base.transpose(1, 2),
        "broadcast": base[:1, :, :1].expand(2, 5, 3, 4),
        "bf16": base.bfloat16().transpose(1, 2),
    }[layout]
    out = np.empty(tuple(tensor.shape), np.uint16 if layout == "bf16" else np.float32)
    _strided_copy(launch.strided_memory(tensor), out)
    expected = tensor.contiguous()
    if layout == "bf16":
        expected = expected.view(torch.int16)
        out = out.view(np.int16)
    np.testing.assert_array_equal(out, expected.numpy())


@numba.njit
def _carved(address):
    a, at = jit.carve(address, 0, (3, 5), np.empty(0, np.float32))
    b, end = jit.carve(address, at, (2,), np.empty(0, np.uint16))
    return a, b, at, end


def test_carve_lays_arrays_on_lines_in_order_and_measures_from_zero():
    """Each carved array starts on a 64-byte line past the one before; from address 0 the
    offsets alone (a workspace's extent); writes through one never reach another."""
    _, _, at, end = _carved(0)
    assert (at, end) == (60, 64 + 4)
    memory = launch.scratch("test", (end,), np.uint8)
    a, b, _, _ = _carved(memory.ctypes.data)
    a[:] = 1
    b[:] = 7
    assert a.ctypes.data == memory.ctypes.data and b.ctypes.data == memory.ctypes.data + 64
    np.testing.assert_array_equal(memory[:60].view(np.float32), 1)
    np.testing.assert_array_equal(memory[64:68].view(np.uint16), 7)


@numba.njit
def _double_row(matrix, r):
    row = jit.row_view(matrix, r)
    for c in range(row.shape[0]):
        row[c] *= 2


def test_row_view_is_the_matrix_row():
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    _double_row(matrix, 1)
    np.testing.assert_array_equal(matrix, [[0, 1, 2, 3], [8, 10, 12, 14], [8, 9, 10, 11]])


@pytest.mark.parametrize("keys", [1, 33, 100])
@pytest.mark.parametrize("by_rows", [False, True])
def test_forward_workspaces_hold_every_tile_of_the_call(keys, by_rows):
    """A thread's workspace (`amx_workspace_bytes`, `packed_workspace_bytes`,
    `fp32_workspace_bytes`) holds its kv head's packs (or copies) and the buffers of any
    query tile of the call (rows up to block_m, keys up
    to the longest sequence's), each carved from a line."""
    f32, u16 = attention.F32, attention.U16
    for rows in (1, 16, 40, 64):
        for kv_len in range(1, keys + 1, 7):
            width = softmax.key_tile_width(kv_len, 64)
            _, _, values = forward_amx.amx_values_buffers(0, keys, 32)
            _, tile = forward_amx.amx_tile_buffers(0, -(-rows // 16) * 16, width, 64, 32, by_rows)
            needed = -(-values // 64) * 64 + tile + 64
            plain = attention.amx_workspace_bytes(keys, 64, 32, 64, 64, by_rows, False)
            assert needed <= plain
            copying = attention.amx_workspace_bytes(keys, 64, 32, 64, 64, by_rows, True)
            assert copying - plain >= softmax.rows_bytes(keys, 64, 2)  # the kernel's test
            _, tile = forward_fp32.fp32_tile_buffers(0, -(-rows // 16) * 16, width, 40, 24,
                                                  by_rows)  # fmt: skip
            without = attention.fp32_workspace_bytes(keys, 40, 24, 64, 64, by_rows, False)
            assert tile + 64 <= without
            with_room = attention.fp32_workspace_bytes(keys, 40, 24, 64, 64, by_rows, True)
            head = forward_fp32.fp32_head_bytes(keys, 40, 24)
            assert head >= softmax.rows_bytes(keys, 40, 4) + keys * 24 * 4
            assert with_room - without >= head  # fp32_forward_items' test for room
            for like in (f32, u16):
                _, _, kv = forward_rows.packed_kv_buffers(0, keys, 40, 24, like)
                *_, tile = forward_rows.packed_tile_buffers(0, rows, width, 24, like is u16)
                needed = -(-kv // 64) * 64 + tile + 64
                assert needed <= attention.packed_workspace_bytes(keys, 40, 24, 64, 64, like)


@numba.njit
def _through_unowned(x):
    view = jit.unowned(x)
    view[0, 1] = -1.0
    return view.shape, view.strides, view[1].sum()


def test_unowned_is_the_same_array():
    """`jit.unowned`: the same memory, shape and strides (a strided view too), writes
    reaching the owner's memory."""
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for x in (base, base[:, ::2]):
        shape, strides, row_sum = _through_unowned(x)
        assert shape == x.shape and strides == x.strides and row_sum == x[1].sum()
        assert x[0, 1] == -1.0


def _structured_mask(dtype):
    """A 37 x 50 mask (blocks of 16: 3 x 4, the last row and column of blocks cut short)
    and the kind of each block: open, shut, sieve, and for a float mask values, and -0.0
    among zeros (open: it adds nothing either) and among -inf (a sieve)."""
    opened, shut = (True, False) if dtype == torch.bool else (0.0, float("-inf"))
    mask = torch.full((37, 50), opened, dtype=dtype)
    mask[:16, 16:32] = shut
    mask[16:32:2, :16] = shut
    mask[32:, 48:] = shut
    o, s, e, v = variant.MASK_OPEN, variant.MASK_SHUT, variant.MASK_SIEVE, variant.MASK_VALUES
    kinds = [[o, s, o, o], [e, o, o, o], [o, o, o, s]]
    if dtype != torch.bool:
        mask[20, 20] = 0.5
        mask[0, 40] = -0.0
        mask[33, 49] = -0.0
        kinds[1][1], kinds[2][3] = v, e
    return mask, kinds


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float16, torch.float32])
def test_mask_blocks_name_what_the_mask_does_to_each_block(dtype):
    """`_mask_for_kernel`: each 16 x 16 block's kind, and the elements of the blocks that
    the kernels read (sieve and values) in base 2, for each mask dtype; a mask broadcast
    over heads keeps one summary per head's view."""
    mask, kinds = _structured_mask(dtype)
    q = torch.randn(1, 2, 37, 8, dtype=dtype if dtype != torch.bool else torch.float32)
    k = v = torch.randn(1, 2, 50, 8, dtype=q.dtype)
    values, kind, blocks, index = variant._mask_for_kernel(prepare(q, k, v, attn_mask=mask))
    assert kind == (variant.MASK_BOOL if dtype == torch.bool else variant.MASK_FLOAT)
    assert blocks.shape[1:] == index.shape[1:] == (1, 2, 3, 4)
    assert (blocks[0, 0, 1] == np.array(kinds, np.int8)).all()
    assert ((index[0] >= 0) == (blocks[0] >= variant.MASK_SIEVE)).all()
    if dtype == torch.bool:
        base2 = torch.where(mask, 0.0, float("-inf"))
    else:
        base2 = (mask.double() * variant.LOG2E).float()
    for qb, kb in zip(*np.nonzero(index[0, 0, 0] >= 0), strict=True):
        expected = base2[16 * qb : 16 * qb + 16, 16 * kb : 16 * kb + 16]
        rows, cols = expected.shape
        block = torch.from_numpy(values[index[0, 0, 0, qb, kb], :rows, :cols])
        assert torch.equal(block, expected)


def test_a_broadcast_row_of_keys_summarises_every_row_block():
    """A padding mask (B, 1, 1, S): its one row stands for all L rows, in the summary and
    in the elements read."""
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 3:20] = False
    q, k = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 40, 8)
    values, _, blocks, index = variant._mask_for_kernel(prepare(q, k, k, attn_mask=mask))
    s, e, o = variant.MASK_SHUT, variant.MASK_SIEVE, variant.MASK_OPEN
    assert (blocks[0, 0] == np.array([e, e, o], np.int8)).all()  # each head, each row block
    assert (blocks[0, 1] == o).all()
    assert s not in blocks[0]
    row = np.where(mask[0, 0, 0, :32].numpy(), 0.0, -np.inf).astype(np.float32)
    for qb in range(3):
        read = np.concatenate([values[index[0, 0, 2, qb, kb]] for kb in range(2)], axis=1)
        assert (read == row).all()  # every row of the block is the mask's one row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_causal_mask_gives_is_causal_s_output_exactly(dtype):
    """The tiles a causal bool mask shuts are skipped and the rest computed as is_causal
    computes them: the same key tiles, the same scores, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 1000, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 1000, 64, generator=gen).to(dtype) for _ in range(2))
    causal = torch.ones(1000, 1000, dtype=torch.bool).tril()
    masked = attnperf.attention(q, k, v, attn_mask=causal, enable_gqa=True, backend="numba")
    plain = attnperf.attention(q, k, v, is_causal=True, enable_gqa=True, backend="numba")
    assert torch.equal(masked, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_floor_blocks_are_shut_where_each_row_sees_an_ordinary_key(dtype):
    """Blocks of finfo.min (a floor: -1e30 or below) are shut where each row of their strip
    sees a key of ordinary value; a strip with a row of floors alone keeps them as values
    (that row averages its keys, as in SDPA), and so does a call with a window (it may hide
    the key); fp16's finfo.min, -65504, is no floor; +-0 blocks are open."""
    mask = torch.full((40, 48), -0.0, dtype=dtype)
    mask[:16, :16] = 0.0
    mask[:, 32:] = torch.finfo(dtype).min
    mask[16, :] = torch.finfo(dtype).min  # row 16 sees floors alone
    q = torch.randn(1, 1, 40, 8, dtype=dtype)
    k = torch.randn(1, 1, 48, 8, dtype=dtype)
    o, s, v = variant.MASK_OPEN, variant.MASK_SHUT, variant.MASK_VALUES
    floor = s if dtype != torch.float16 else v
    expected = [[o, o, floor], [v, v, v], [o, o, floor]]
    _, _, blocks, _ = variant._mask_for_kernel(prepare(q, k, k, attn_mask=mask))
    assert (blocks[0, 0, 0] == np.array(expected, np.int8)).all()
    windowed = prepare(q, k, k, attn_mask=mask, window=(100, 100))
    _, _, blocks, _ = variant._mask_for_kernel(windowed)
    assert (blocks[0, 0, 0] == np.array([[o, o, v], [v, v, v], [o, o, v]], np.int8)).all()
