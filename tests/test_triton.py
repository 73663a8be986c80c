"""The Triton backend's memory: the fused backward allocates O(L), never L x S for nothing;
its launchers' tables stay on the device."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnperf
from attnperf import dispatch
from attnperf.kernels.triton.jit import _kept_on_device, on_device

TRITON = dispatch.registry()["triton"]
pytestmark = pytest.mark.skipif(
    TRITON.unavailable_reason() is not None, reason=str(TRITON.unavailable_reason())
)


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage (in bytes) of the tensors that torch returns inside the
    mode: views of a broadcast mask count its own size; the interpreter's copies of the
    kernels' arguments are among them."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return result


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_backward_allocates_no_scores_sized_tensor_unless_the_mask_needs_its_gradient(mask):
    batch, heads, length, dim = 1, 2, 64, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(batch, heads, length, dim, device=device).requires_grad_()
               for _ in range(3))  # fmt: skip
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(length, length, device=device) > 0.2
    elif mask == "float":
        attn_mask = torch.randn(length, length, device=device)
    out = attnperf.attention(q, k, v, attn_mask=attn_mask, backend="triton")
    recorder = LargestAllocation()
    with recorder:
        out.backward(torch.ones_like(out))
    scores = batch * heads * length * length * 4  # bytes of an fp32 (B, Hq, L, S) tensor
    assert recorder.largest < scores, f"a {recorder.largest}-byte tensor in backward"

    # A float mask that needs its gradient gets one: (B, Hq, L, S) by nature.
    if mask == "float":
        attn_mask.requires_grad_()
        out = attnperf.attention(q, k, v, attn_mask=attn_mask, backend="triton")
        recorder = LargestAllocation()
        with recorder:
            out.backward(torch.ones_like(out))
        assert recorder.largest >= scores
        assert attn_mask.grad.shape == (length, length)


def test_a_repeated_sequence_table_is_kept_on_the_device_and_a_changed_one_is_not():
    # The keeping itself runs on any device; on a GPU, on_device goes through it.
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    keep = on_device if device.type == "cuda" else (
        lambda t, d: _kept_on_device(d, t.dtype, tuple(t.shape), t.numpy().tobytes()))  # fmt: skip
    table = torch.tensor([[0, 0, 5, 0, 7, 2], [1, 0, 3, 0, 9, 6]])
    kept = keep(table, device)
    assert kept.device.type == device.type and kept.dtype == torch.int64
    assert torch.equal(kept.cpu(), table)
    assert keep(table.clone(), device) is kept  # equal contents: no new copy
    table[1, 4] = 10  # the host's table changed: a new copy, and the kept one stays as it was
    assert torch.equal(keep(table, device).cpu(), table)
    assert kept[1, 4].item() == 9
