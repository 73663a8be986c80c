"""What "auto" picks, and how refusals are reported."""

import copy
from dataclasses import replace

import pytest
import torch

import attnperf
from attnperf import dispatch
from attnperf.backend import Backend, built_mask
from attnperf.inputs import prepare
from attnperf.kernels.reference import BACKEND as REFERENCE
from attnperf.serving import prepare_kvcache, prepare_varlen


class FakeBackend(Backend):
    description = "test double"
    capabilities = REFERENCE.capabilities

    def __init__(self, name, reasons=()):
        self.name = name
        self._reasons = list(reasons)

    def extra_reasons(self, inputs):
        return self._reasons

    def run(self, inputs):
        return torch.full((*inputs.query.shape[:-1], inputs.value_dim), float(len(self.name)))


@pytest.fixture
def fake_registry(monkeypatch):
    def install(*backends):
        for place, backend in enumerate(backends):  # "auto" tries them in this order
            backend.rank = {"cpu": place}
        monkeypatch.setattr(dispatch, "registry", lambda: {b.name: b for b in backends})

    return install


def qkv():
    return tuple(torch.randn(1, 2, 4, 8) for _ in range(3))


def test_auto_takes_the_first_backend_without_reasons(fake_registry):
    fake_registry(FakeBackend("first", ["busy"]), FakeBackend("second"), FakeBackend("third"))
    assert attnperf.choose_backend(*qkv()) == "second"
    assert torch.all(attnperf.attention(*qkv()) == len("second"))


def test_auto_with_nothing_fitting_lists_every_reason(fake_registry):
    fake_registry(FakeBackend("first", ["too busy"]), FakeBackend("second", ["on holiday"]))
    with pytest.raises(attnperf.BackendNotSupportedError) as error:
        attnperf.attention(*qkv())
    assert "first: too busy" in str(error.value)
    assert "second: on holiday" in str(error.value)


def test_explicit_backend_refusal_lists_its_reasons_and_never_falls_back(fake_registry):
    fake_registry(FakeBackend("picky", ["head dim 8 too small"]), FakeBackend("other"))
    with pytest.raises(attnperf.BackendNotSupportedError, match=r"'picky'.*head dim 8 too small"):
        attnperf.attention(*qkv(), backend="picky")


def test_declared_capabilities_refuse_with_reasons():
    class NoDropout(FakeBackend):
        capabilities = replace(
            REFERENCE.capabilities,
            features=REFERENCE.capabilities.features - {"dropout"},
            dtypes=(torch.float64,),
        )

    reasons = NoDropout("nodrop").not_supported_reasons(prepare(*qkv(), dropout_p=0.5))
    assert reasons == ["dtype fp32 not in (fp64)", "dropout_p > 0 not supported"]


def test_auto_on_cpu_picks_an_available_backend_from_the_priority_list():
    name = attnperf.choose_backend(*qkv())
    assert name in dispatch.priority(prepare(*qkv()))
    assert dispatch.registry()[name].unavailable_reason() is None


def test_a_backend_that_leads_a_call_goes_first_whatever_its_rank(fake_registry):
    """The policy names no backend: a new one is tried where it declares itself."""

    class Leader(FakeBackend):
        def leads(self, inputs):
            return inputs.is_causal

    fake_registry(FakeBackend("peer"), FakeBackend("other"), Leader("leader"))
    q, k, v = qkv()
    assert dispatch.priority(prepare(q, k, v)) == ("peer", "other", "leader")
    assert dispatch.priority(prepare(q, k, v, is_causal=True)) == ("leader", "peer", "other")
    assert attnperf.choose_backend(q, k, v, is_causal=True) == "leader"


def test_auto_with_dropout_picks_a_backend_declaring_dropout():
    name = attnperf.choose_backend(*qkv(), dropout_p=0.1)
    assert "dropout" in dispatch.registry()[name].capabilities.features


def test_capability_table_lists_every_backend():
    table = attnperf.backends()
    assert [row["name"] for row in table] == list(dispatch.registry())
    for row in table:
        assert row["available"] == (row["unavailable_reason"] is None)
        assert {"devices", "dtypes", "features", "max_head_dim"} <= row.keys()


@pytest.mark.skipif(
    dispatch.registry()["numba"].unavailable_reason() is not None, reason="numba not installed"
)
@pytest.mark.parametrize(
    "variant",
    [{"window": (31, 0)}, {"alibi_slopes": torch.rand(2)}],
    ids=["window", "alibi"],
)
def test_auto_on_cpu_sends_variants_that_sdpa_would_materialise_to_numba(variant):
    assert attnperf.choose_backend(*qkv(), **variant) == "numba"


def test_auto_sends_softcap_past_sdpa_which_refuses_it():
    assert attnperf.choose_backend(*qkv(), softcap=30.0) != "sdpa"


def cuda_cases():
    """(inputs, whether triton goes first on CUDA): built on the CPU, the rule reads only
    the call's features."""
    q, k, v = qkv()
    packed = torch.randn(6, 2, 8)
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    step = torch.randn(1, 1, 4, 8), torch.randn(1, 16, 2, 8)
    return {
        "plain": (prepare(q, k, v, is_causal=True), False),
        "window": (prepare(q, k, v, window=(1, 0)), True),
        "alibi": (prepare(q, k, v, alibi_slopes=torch.rand(2)), True),
        "varlen": (prepare_varlen(packed, packed, packed, offsets, offsets, 4, 4), True),
        "decode": (prepare_kvcache(step[0], step[1], step[1], 9), False),
        "decode-window": (prepare_kvcache(step[0], step[1], step[1], 9, window=(3, 0)), True),
    }


@pytest.mark.parametrize("case", cuda_cases().keys())
def test_on_cuda_sdpa_goes_first_unless_it_would_need_a_mask(case):
    inputs, triton_first = cuda_cases()[case]
    assert built_mask(inputs) == triton_first
    assert dispatch.registry()["triton"].leads(as_if_on_cuda(inputs)) == triton_first
    assert not dispatch.registry()["triton"].leads(inputs)  # on the CPU: never first


def as_if_on_cuda(inputs):
    """The same call, its device read as CUDA (what `leads` reads of it besides its
    features)."""
    on_cuda = type("OnCuda", (type(inputs),), {"device": property(lambda _: torch.device("cuda"))})
    moved = copy.copy(inputs)
    object.__setattr__(moved, "__class__", on_cuda)
    return moved
