"""The fused kernels under autograd and torch's transforms behave as SDPA does, or refuse."""

import subprocess
import sys
import textwrap

import pytest
import torch
from cases import device_for

import attnperf
from attnperf import dispatch
from attnperf.backend import FusedBackend

AVAILABLE = [b for b in dispatch.registry().values() if b.unavailable_reason() is None]
FUSED = [b.name for b in AVAILABLE if isinstance(b, FusedBackend)]
EVERY = [b.name for b in AVAILABLE]


def leaves(*shapes, backend: str, seed=0):
    """Leaves of `shapes` on the device where the tests run `backend`."""
    gen = torch.Generator().manual_seed(seed)
    device = device_for(backend)
    return [torch.randn(*shape, generator=gen).to(device).requires_grad_() for shape in shapes]


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("edited", ["query", "key", "value"])
def test_in_place_edit_after_forward_raises_in_backward(backend, edited):
    q, k, v = leaves((1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), backend=backend)
    out = attnperf.attention(q, k, v, backend=backend)
    with torch.no_grad():
        {"query": q, "key": k, "value": v}[edited].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("backend", FUSED)
def test_double_backward_raises_a_clear_error_and_first_derivatives_stay_right(backend):
    q, k, v = leaves((1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8), backend=backend)
    out = attnperf.attention(q, k, v, backend=backend)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    expected = attnperf.attention(q, k, v, backend="reference")
    (expected_dq,) = torch.autograd.grad(expected.pow(2).sum(), q)
    torch.testing.assert_close(dq, expected_dq, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="no double backward"):
        dq.sum().backward()


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("in_dims", [(0, 0, 0), (1, None, None)], ids=["all", "query-only"])
def test_vmap_matches_a_loop(backend, in_dims):
    shapes = (3, 2, 4, 9, 8), (2, 4, 11, 8), (2, 4, 11, 8)
    q, k, v = (t.detach() for t in leaves(*shapes, backend=backend))
    if in_dims == (0, 0, 0):
        k, v = k.expand(3, *k.shape).clone(), v.expand(3, *v.shape).clone()
    else:
        q = q.movedim(0, 1)  # vmapped over dim 1

    def one(q, k, v):
        return attnperf.attention(q, k, v, is_causal=True, backend=backend)

    out = torch.vmap(one, in_dims=in_dims)(q, k, v)
    q_slices = q.unbind(in_dims[0])
    k_slices = k.unbind(0) if in_dims[1] == 0 else [k] * 3
    v_slices = v.unbind(0) if in_dims[2] == 0 else [v] * 3
    expected = torch.stack([one(*s) for s in zip(q_slices, k_slices, v_slices, strict=True)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", EVERY)
@pytest.mark.parametrize("shape", [(0, 2, 8, 16), (2, 0, 8, 16)], ids=["batch_0", "heads_0"])
def test_zero_size_batch_or_heads_give_empty_outputs_and_gradients(backend, shape):
    q, k, v = leaves(shape, shape, shape, backend=backend)
    out = attnperf.attention(q, k, v, backend=backend)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == k.grad.shape == v.grad.shape == shape


CONCURRENT = """
import threading, torch, attnperf
torch.manual_seed(0)
q = torch.randn(1, 2, 512, 32)
expected = attnperf.attention(q, q, q, backend="numba")
results, errors = [], []
def work():
    try:
        for _ in range(20):
            results.append(attnperf.attention(q, q, q, backend="numba"))
    except Exception as error:
        errors.append(error)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
assert len(results) == 80 and all(torch.equal(r, expected) for r in results)
print("ok")
"""


@pytest.mark.skipif("numba" not in EVERY, reason="numba is not available")
def test_numba_called_from_four_threads_gives_the_single_thread_result():
    # A subprocess: before the fix, concurrent calls aborted the whole process.
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONCURRENT)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize("backend", FUSED)
def test_torch_func_grad_is_refused_by_name_and_served_by_auto(backend):
    """torch.func's grad transform wraps tensors with no memory of their own, which a fused
    kernel reads: named, the backend refuses with the reason (it crashed deep in a launcher
    before); "auto" takes a backend that serves it, and the gradient is the reference's."""
    q, k, v = (t.detach() for t in leaves((2, 9, 8), (2, 11, 8), (2, 11, 8), backend=backend))

    def loss(q, k, v, backend):
        return attnperf.attention(q, k, v, is_causal=True, backend=backend).sum()

    with pytest.raises(attnperf.BackendNotSupportedError, match=r"torch\.func's grad"):
        torch.func.grad(loss)(q, k, v, backend)
    expected = torch.func.grad(loss)(q, k, v, "reference")
    torch.testing.assert_close(torch.func.grad(loss)(q, k, v, "auto"), expected)
    attnperf.attention(q, k, v, backend=backend)  # outside the transform it serves again


@pytest.mark.parametrize("backend", FUSED)
def test_torch_func_grad_of_linear_attention_is_refused_by_name_and_served_by_auto(backend):
    q, k, v = (t.detach() for t in leaves(*[(1, 16, 2, 8)] * 3, backend=backend))

    def loss(q, k, v, backend):
        return attnperf.linear_attention(q, k, v, backend=backend)[0].sum()

    with pytest.raises(attnperf.BackendNotSupportedError, match=r"torch\.func's grad"):
        torch.func.grad(loss)(q, k, v, backend)
    expected = torch.func.grad(loss)(q, k, v, "reference")
    torch.testing.assert_close(torch.func.grad(loss)(q, k, v, "auto"), expected)
