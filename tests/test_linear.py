"""linear_attention on every backend that declares it, against the float64 recurrence: the
outputs, the final state and the gradients of every input, by the relative RMS rule."""

import os
import re
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from cases import device_for

import attnperf
from attnperf import dispatch
from attnperf.backend import FEATURES
from attnperf.kernels.numba import launch as numba_launch
from attnperf.testing import assert_linear_agrees, linear_reference

BACKENDS = [
    name
    for name, backend in dispatch.registry().items()
    if "linear" in backend.capabilities.features and backend.unavailable_reason() is None
]
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@dataclass(frozen=True)
class Case:
    """One call: shapes, the gate kind, the rule, the state, packing, the dtype."""

    batch: int = 2
    steps: int = 100
    heads: int = 2
    value_heads: int = 2
    head_dim: int = 16
    value_dim: int = 12
    gate: str = "none"  # "none", "scalar" or "vector"
    gate_scale: float = 0.25  # g = logsigmoid(x) * gate_scale
    delta: bool = False
    initial_state: bool = False
    final_state: bool = True
    l2norm: bool = False
    cu_seqlens: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32


CASES = {
    # the additive rule, ungated, T not a multiple of the chunk
    "additive": Case(),
    # scalar gates, grouped value heads, odd head dims
    "scalar_gqa_odd_dims": Case(
        heads=2, value_heads=4, head_dim=100, value_dim=60, steps=70, gate="scalar"
    ),
    # Qwen3-Next's rule: gated delta, l2norm, carried state, strong decays (down to ~-70)
    "gated_delta": Case(
        gate="scalar", gate_scale=20.0, delta=True, initial_state=True, l2norm=True, steps=150
    ),
    "delta_ungated": Case(delta=True, l2norm=True, initial_state=True),
    # a wide key head (triton's chunks shrink to 16 steps at K > 128)
    "wide_delta": Case(
        batch=1, heads=1, value_heads=2, head_dim=150, value_dim=20, steps=40, gate="scalar",
        gate_scale=3.0, delta=True, l2norm=True, initial_state=True,
    ),
    # per-key-dim gates: GLA (additive) and Kimi's KDA (delta)
    "gla": Case(gate="vector", steps=70, initial_state=True),
    "kda": Case(gate="vector", delta=True, l2norm=True, steps=70, heads=1, value_heads=2),
    # a decoding step and a few speculative ones (the recurrent kernel without gradients)
    "step": Case(steps=1, gate="scalar", delta=True, l2norm=True, initial_state=True),
    "short": Case(steps=5, gate="vector", delta=True, l2norm=True, initial_state=True),
    "empty": Case(steps=0, gate="scalar", delta=True, initial_state=True),
    # packed sequences: empty, one token, longer than a chunk
    "varlen": Case(
        batch=1,
        steps=150,
        head_dim=20,  # not a power of 2 either
        cu_seqlens=(0, 0, 1, 70, 70, 150),
        gate="scalar",
        delta=True,
        l2norm=True,
        initial_state=True,
    ),
    "bf16": Case(
        gate="scalar", delta=True, l2norm=True, initial_state=True, dtype=torch.bfloat16
    ),
    "fp16": Case(gate="vector", initial_state=True, dtype=torch.float16),
}  # fmt: skip


def make(case: Case, seed: int = 0, device: str = "cpu") -> dict:
    """The call's tensors (leaves) and keywords, on `device`."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, hv, k, v = (case.batch, case.steps, case.heads, case.value_heads, case.head_dim,
                         case.value_dim)  # fmt: skip

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    call = {"q": randn(b, t, h, k), "k": randn(b, t, h, k), "v": randn(b, t, hv, v)}
    if not case.l2norm and case.delta:  # the delta rule is stable for keys of norm <= 1
        call["k"] = F.normalize(call["k"], dim=-1)
    for name in ("q", "k", "v"):
        call[name] = call[name].to(case.dtype)
    if case.gate != "none":
        shape = (b, t, hv) if case.gate == "scalar" else (b, t, hv, k)
        call["g"] = F.logsigmoid(randn(*shape)) * case.gate_scale
    if case.delta:
        call["beta"] = torch.rand(b, t, hv, generator=gen)
    count = b if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    if case.initial_state:
        call["initial_state"] = randn(count, hv, k, v)
    keywords = {"output_final_state": case.final_state, "use_qk_l2norm": case.l2norm}
    if case.cu_seqlens is not None:
        keywords["cu_seqlens"] = torch.tensor(case.cu_seqlens, dtype=torch.int32, device=device)
    return {"tensors": {name: t.to(device) for name, t in call.items()}, "keywords": keywords}


def run(fn, call: dict, grads: tuple[torch.Tensor, torch.Tensor] | None, cast=None) -> tuple:
    """(out, state, {name: gradient}) of fn on fresh leaves (cast to `cast` if given), the
    gradients through both results when `grads` (grad_out, grad_state) are given."""
    leaves = {}
    for name, tensor in call["tensors"].items():
        leaf = tensor.to(cast) if cast is not None else tensor.clone()
        leaves[name] = leaf.requires_grad_(grads is not None)
    q, k, v = (leaves.pop(name) for name in ("q", "k", "v"))
    out, state = fn(q, k, v, **leaves, **call["keywords"])
    gradients = {}
    if grads is not None:
        loss = (out * grads[0].to(out.dtype)).sum() + (state * grads[1].to(state.dtype)).sum()
        inputs = {"q": q, "k": k, "v": v, **leaves}
        values = torch.autograd.grad(
            loss, list(inputs.values()), allow_unused=True, materialize_grads=True
        )
        gradients = dict(zip(inputs, values, strict=True))
    return out, state, gradients


def check(backend: str, case: Case, backward: bool) -> None:
    device = device_for(backend)
    call = make(case, device=device)
    grads = None
    if backward:
        b, t, hv, v = case.batch, case.steps, case.value_heads, case.value_dim
        count = b if case.cu_seqlens is None else len(case.cu_seqlens) - 1
        gen = torch.Generator().manual_seed(1)
        grads = (torch.randn(b, t, hv, v, generator=gen).to(device),
                 torch.randn(count, hv, case.head_dim, v, generator=gen).to(device))  # fmt: skip

    def kernel(*args, **kwargs):
        return attnperf.linear_attention(*args, **kwargs, backend=backend)

    out, state, gradients = run(kernel, call, grads)
    exact = run(linear_reference, call, grads, cast=torch.float64)
    baseline = run(linear_reference, call, grads)
    assert out.dtype == case.dtype and state.dtype == torch.float32
    assert_linear_agrees(out, exact[0], baseline[0], what="out")
    assert_linear_agrees(state, exact[1], baseline[1], what="final state")
    for name, gradient in gradients.items():
        assert gradient.dtype == call["tensors"][name].dtype, name
        assert_linear_agrees(gradient, exact[2][name], baseline[2][name], what="d" + name)


# Under Triton's interpreter (CPU) a triton call takes seconds: there, one case per path of
# its kernels (gate none, scalar and per key; both rules; a state; chunks of 64, 32 and 16
# steps; token by token; packing).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETER_CASES = {"additive", "gated_delta", "scalar_gqa_odd_dims", "wide_delta", "kda",
                     "step", "empty", "varlen"}  # fmt: skip


def grid(names: list[str]) -> list:
    """(backend, case) pairs of `names` for every backend (triton's subset when interpreted)."""
    return [
        pytest.param(backend, CASES[name], id=f"{backend}-{name}")
        for backend in BACKENDS
        for name in names
        if backend != "triton" or not INTERPRETED or name in INTERPRETER_CASES
    ]


@pytest.mark.parametrize("backend, case", grid(list(CASES)))
def test_forward_agrees(backend, case):
    check(backend, case, backward=False)


@pytest.mark.parametrize("backend, case", grid([name for name in CASES if name != "short"]))
def test_gradients_agree(backend, case):
    check(backend, case, backward=True)


# Fused backends keep each chunk's start state (and WY results) from the forward for the
# backward, within a memory budget; past it the backward recomputes them.
FUSED = [name for name in BACKENDS if hasattr(dispatch.registry()[name], "linear_forward")]


def set_launcher_constant(backend: str, monkeypatch, name: str, value: int) -> None:
    """Sets a constant of the backend's linear launchers' module for this test."""
    module = sys.modules[dispatch.registry()[backend].linear_forward.__module__]
    monkeypatch.setattr(module, name, value)


@pytest.mark.parametrize("backend", FUSED)
def test_forward_keeps_its_chunks_for_the_backward_within_its_budget(backend, monkeypatch):
    call = make(Case(steps=20, gate="scalar", delta=True, initial_state=True),
                device=device_for(backend))  # fmt: skip
    inputs = attnperf.linear_inputs.prepare_linear(**call["tensors"], **call["keywords"])
    launch = dispatch.registry()[backend].linear_forward
    assert launch(inputs, False)[2] == ()
    assert launch(inputs, True)[2], "nothing kept within the budget"
    set_launcher_constant(backend, monkeypatch, "KEPT_MAX_BYTES", 0)
    assert launch(inputs, True)[2] == ()


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is unavailable")
def test_numba_keeps_its_chunks_in_the_memory_an_earlier_backward_freed(monkeypatch):
    """numba's kept chunks are recycled memory: a forward whose predecessor's chunks are all
    freed keeps its own in their memory (never while they live), and gradients stay right
    on memory the last call left."""
    monkeypatch.setattr(numba_launch, "RECYCLED_MIN_BYTES", 64)  # the cases' chunks are small
    monkeypatch.setattr(numba_launch, "_SPARE", {})
    monkeypatch.setattr(numba_launch, "_SPARE_BYTES", [0])
    case = Case(steps=20, gate="scalar", delta=True, initial_state=True)
    call = make(case, device="cpu")
    inputs = attnperf.linear_inputs.prepare_linear(**call["tensors"], **call["keywords"])
    forward = dispatch.registry()["numba"].linear_forward
    kept = forward(inputs, True)[2]
    addresses = sorted(t.data_ptr() for t in kept)
    held = forward(inputs, True)[2]
    assert not set(addresses) & {t.data_ptr() for t in held}
    del kept
    assert sorted(t.data_ptr() for t in forward(inputs, True)[2]) == addresses
    for _ in range(2):
        check("numba", case, backward=True)


@pytest.mark.parametrize(
    "backend, case",
    [p for p in grid(["gated_delta", "additive", "wide_delta"]) if p.values[0] in FUSED],
)
def test_gradients_agree_when_the_backward_recomputes_the_chunks(backend, case, monkeypatch):
    set_launcher_constant(backend, monkeypatch, "KEPT_MAX_BYTES", 0)
    check(backend, case, backward=True)


# Packed short sequences (empty, one token, several) on an odd count of value heads: each
# thread's run of items shares its scratch across sequences and heads.
SHORT_PACKED = Case(
    batch=1, steps=20, heads=1, value_heads=3, cu_seqlens=(0, 0, 1, 6, 20), gate="vector",
    delta=True, l2norm=True, initial_state=True,
)  # fmt: skip


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is unavailable")
@pytest.mark.parametrize("case", [CASES["step"], CASES["short"], SHORT_PACKED],
                         ids=["step", "short", "short_packed"])  # fmt: skip
def test_numba_decoding_step_agrees_on_its_threads_too(case, monkeypatch):
    """Small steps run numba's per-token kernel on the calling thread; large ones in
    parallel: the same steps both ways."""
    set_launcher_constant("numba", monkeypatch, "PARALLEL_MIN_BYTES", 0)
    check("numba", case, backward=False)


# numba's chunked forward runs the value heads of a key head in one item where the items
# still fill the threads: both ways on groups of 3 and 2 (gates per step and per key dim).
GROUPED = {
    "gated_delta_groups_of_3": Case(
        heads=2, value_heads=6, steps=150, gate="scalar", gate_scale=3.0, delta=True,
        l2norm=True, initial_state=True, cu_seqlens=(0, 30, 150), batch=1,
    ),
    "kda": CASES["kda"],
    "scalar_gqa_odd_dims": CASES["scalar_gqa_odd_dims"],
}  # fmt: skip


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is unavailable")
@pytest.mark.parametrize("items_per_thread", [0, 1000])
@pytest.mark.parametrize("case", GROUPED.values(), ids=list(GROUPED))
def test_numba_forward_agrees_with_a_key_heads_value_heads_in_one_item_or_not(
    case, items_per_thread, monkeypatch
):
    set_launcher_constant("numba", monkeypatch, "ITEMS_PER_THREAD", items_per_thread)
    call = make(case)
    inputs = attnperf.linear_inputs.prepare_linear(**call["tensors"], **call["keywords"])
    group = case.value_heads // case.heads
    module = sys.modules[dispatch.registry()["numba"].linear_forward.__module__]
    assert module.value_heads_per_item(inputs, 2) == (group if items_per_thread == 0 else 1)
    check("numba", case, backward=False)


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba is unavailable")
def test_numba_chunk_buffers_start_on_cache_lines():
    """The chunked kernels' own operands of the micro-kernels (scratch, WY results, kept
    chunks, running states) start on 64-byte lines, and so do their rows where they hold
    whole lines: a vector load off a line touches two."""
    from attnperf.kernels.numba import linear_stages as module  # numba is there (skipif)

    scratch = module.new_scratch(48, 1)
    states = module.new_states(3, 48, 32)
    arrays = [
        *(scratch[i] for i in (3, 4, 7, 8, 9, 10, 11)), *module.new_update(48, 32),
        *module.new_kept(3, 2, 48, 32, True), states,
    ]  # fmt: skip
    for array in arrays:
        assert array.ctypes.data % 64 == 0 and array.strides[-2] % 64 == 0, array.shape
    assert states.shape == (3, 48, 32 + module.STATE_PAD)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_in_pieces_then_steps_equals_one_call(backend):
    case = Case(steps=90, gate="scalar", delta=True, l2norm=True, initial_state=True)
    call = make(case, device=device_for(backend))
    tensors, keywords = call["tensors"], call["keywords"]
    whole, whole_state = attnperf.linear_attention(**tensors, **keywords, backend=backend)
    state, outs, t = tensors["initial_state"], [], 0
    for length in (70, 13, 1, 1, 1, 4):
        piece = {
            name: x[:, t : t + length] for name, x in tensors.items() if name != "initial_state"
        }
        out, state = attnperf.linear_attention(**piece, initial_state=state, **keywords,
                                               backend=backend)  # fmt: skip
        outs.append(out)
        t += length
    torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("feature", ["linear", "linear_backward"])
@pytest.mark.parametrize(
    "backend", [b for b in dispatch.registry().values() if b.unavailable_reason() is None],
    ids=lambda b: b.name,
)  # fmt: skip
def test_backend_serves_linear_attention_or_refuses_it_with_a_reason(backend, feature):
    call = make(Case(steps=3, gate="scalar", delta=True, initial_state=True),
                device=device_for(backend))  # fmt: skip
    tensors = call["tensors"]
    if feature == "linear_backward":
        tensors = {name: t.requires_grad_() for name, t in tensors.items()}
    if feature in backend.capabilities.features:
        out, _ = attnperf.linear_attention(**tensors, backend=backend.name)
        if feature == "linear_backward":
            out.sum().backward()
            assert all(t.grad is not None for t in tensors.values())
        return
    with pytest.raises(attnperf.BackendNotSupportedError, match=re.escape(FEATURES[feature])):
        attnperf.linear_attention(**tensors, backend=backend.name)


def test_auto_chooses_numba_on_cpu_and_sdpa_refuses():
    call = make(CASES["gated_delta"])
    inputs = attnperf.linear_inputs.prepare_linear(**call["tensors"], **call["keywords"])
    expected = "numba" if "numba" in BACKENDS else "reference"
    assert dispatch.select(inputs).name == expected
    with pytest.raises(attnperf.BackendNotSupportedError, match="linear attention"):
        attnperf.linear_attention(**call["tensors"], backend="sdpa")


def test_final_state_is_none_unless_asked():
    call = make(Case(final_state=False))
    out, state = attnperf.linear_attention(**call["tensors"], **call["keywords"])
    assert state is None and out.shape == (2, 100, 2, 12)


def test_normalised_linear_attention_of_the_textbook():
    """phi(q) . sum_j phi(k_j) v_j^T / phi(q) . sum_j phi(k_j): the call with a column of ones
    appended to v gives the numerator and the normaliser together (the README's example)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 50, 2, 8, generator=gen) for _ in range(3))
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    ones = torch.ones(*v.shape[:-1], 1)
    both, _ = attnperf.linear_attention(phi_q, phi_k, torch.cat([v, ones], -1), scale=1.0)
    out = both[..., :-1] / both[..., -1:]
    scores = torch.einsum("bihd,bjhd->bhij", phi_q, phi_k).tril()
    expected = torch.einsum("bhij,bjhd->bihd", scores / scores.sum(-1, keepdim=True), v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def bad_calls():
    q, v = torch.randn(2, 8, 2, 4), torch.randn(2, 8, 4, 3)
    g, beta, state = torch.zeros(2, 8, 4), torch.rand(2, 8, 4), torch.zeros(2, 4, 4, 3)
    cu = torch.tensor([0, 3, 8])
    packed = {"q": q[:1], "k": q[:1], "v": v[:1]}
    return {
        "q rank": ({"q": q[0], "k": q, "v": v}, ValueError, "q must be"),
        "v rank": ({"q": q, "k": q, "v": v[..., 0]}, ValueError, "v must be"),
        "head dims": ({"q": q, "k": torch.randn(2, 8, 2, 5), "v": v}, ValueError,
                      "q and k head dims differ"),
        "k heads": ({"q": q, "k": torch.randn(2, 8, 1, 4), "v": v}, ValueError, "k must be"),
        "value heads": ({"q": q, "k": q, "v": torch.randn(2, 8, 3, 3)}, ValueError,
                        "multiple of q's and k's heads"),
        "T": ({"q": q, "k": q, "v": torch.randn(2, 7, 4, 3)}, ValueError, "v must have q's"),
        "g shape": ({"q": q, "k": q, "v": v, "g": g[:, :, :2]}, ValueError, "g must be"),
        "g batch": ({"q": q, "k": q, "v": v, "g": g[:1]}, ValueError, "g must be"),
        "g vector": ({"q": q, "k": q, "v": v, "g": torch.zeros(2, 8, 4, 5)}, ValueError,
                     "g must be"),
        "g int": ({"q": q, "k": q, "v": v, "g": g.int()}, TypeError, "g must be a floating"),
        "beta shape": ({"q": q, "k": q, "v": v, "beta": beta[..., None]}, ValueError,
                       "beta must be"),
        "beta batch": ({"q": q, "k": q, "v": v, "beta": beta[:1]}, ValueError, "beta must be"),
        "state shape": ({"q": q, "k": q, "v": v, "initial_state": state[:, :2]}, ValueError,
                        "initial_state must be"),
        "state batch": ({"q": q, "k": q, "v": v, "initial_state": state[:1]}, ValueError,
                        "initial_state must be"),
        "mixed dtypes": ({"q": q, "k": q.double(), "v": v}, TypeError, "k dtype"),
        "int q": ({"q": q.int(), "k": q, "v": v}, TypeError, "q must be a floating"),
        "non-tensor": ({"q": q.tolist(), "k": q, "v": v}, TypeError, "q must be a torch.Tensor"),
        "cu_seqlens B > 1": ({"q": q, "k": q, "v": v, "cu_seqlens": cu}, ValueError,
                             "cu_seqlens needs B == 1"),
        "cu_seqlens end": ({**packed, "cu_seqlens": torch.tensor([0, 3, 7])}, ValueError,
                           "last entry"),
        "cu_seqlens decreasing": ({**packed, "cu_seqlens": torch.tensor([0, 5, 3, 8])},
                                  ValueError, "non-decreasing"),
        "cu_seqlens float": ({**packed, "cu_seqlens": cu.float()}, TypeError, "cu_seqlens must"),
        "cu_seqlens state rows": ({**packed, "cu_seqlens": cu, "initial_state": state[:1]},
                                  ValueError, "initial_state must be"),
        "scale nan": ({"q": q, "k": q, "v": v, "scale": float("nan")}, ValueError, "scale"),
        "scale zero": ({"q": q, "k": q, "v": v, "scale": 0.0}, ValueError, "scale"),
        "scale negative": ({"q": q, "k": q, "v": v, "scale": -1}, ValueError, "scale"),
        "scale str": ({"q": q, "k": q, "v": v, "scale": "1"}, TypeError, "scale"),
        "flag": ({"q": q, "k": q, "v": v, "output_final_state": 1}, TypeError,
                 "output_final_state must be a bool"),
        "backend": ({"q": q, "k": q, "v": v, "backend": "fast"}, ValueError, "unknown backend"),
        "backend type": ({"q": q, "k": q, "v": v, "backend": None}, TypeError, "backend"),
    }  # fmt: skip


BAD = bad_calls()


@pytest.mark.parametrize("call, error, message", BAD.values(), ids=BAD.keys())
def test_bad_input_names_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        attnperf.linear_attention(**call)
