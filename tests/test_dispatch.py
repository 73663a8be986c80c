"""What "auto" picks, and how refusals are reported."""

import pytest
import torch

import attnperf
from attnperf import dispatch
from attnperf.backend import Backend
from attnperf.kernels.reference import BACKEND as REFERENCE


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
        monkeypatch.setattr(dispatch, "registry", lambda: {b.name: b for b in backends})
        monkeypatch.setitem(dispatch.PRIORITY, "cpu", tuple(b.name for b in backends))

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
        capabilities = REFERENCE.capabilities.__class__(
            **{**REFERENCE.capabilities.__dict__, "dropout": False, "dtypes": (torch.float64,)}
        )

    from attnperf.inputs import prepare

    reasons = NoDropout("nodrop").not_supported_reasons(prepare(*qkv(), dropout_p=0.5))
    assert reasons == ["dtype fp32 not in (fp64)", "dropout_p > 0 not supported"]


def test_auto_on_cpu_picks_an_available_backend_from_the_priority_list():
    name = attnperf.choose_backend(*qkv())
    assert name in dispatch.PRIORITY["cpu"]
    assert dispatch.registry()[name].unavailable_reason() is None


def test_auto_with_dropout_picks_a_backend_declaring_dropout():
    name = attnperf.choose_backend(*qkv(), dropout_p=0.1)
    assert dispatch.registry()[name].capabilities.dropout


def test_capability_table_lists_every_backend():
    table = attnperf.backends()
    assert [row["name"] for row in table] == list(dispatch.registry())
    for row in table:
        assert row["available"] == (row["unavailable_reason"] is None)
        assert {"devices", "dtypes", "features", "max_head_dim"} <= row.keys()


def big(length=2048, head_dim=64, requires_grad=False, **shape):
    shape = {"batch": 1, "heads": 2, **shape}
    return tuple(
        torch.empty(shape["batch"], shape["heads"], length, head_dim, requires_grad=requires_grad)
        for _ in range(3)
    )


def gqa(kv_heads):
    q = torch.empty(1, 8, 2048, 64, requires_grad=True)
    k, v = (torch.empty(1, kv_heads, 2048, 64, requires_grad=True) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "call, numba_first",
    [
        pytest.param(lambda: (big(), {"is_causal": True}), True, id="causal-2048"),
        pytest.param(lambda: (big(requires_grad=True), {}), True, id="training-2048"),
        pytest.param(lambda: (big(), {}), False, id="inference-full-2048"),
        pytest.param(lambda: (big(1024), {"is_causal": True}), False, id="causal-1024"),
        pytest.param(lambda: (big(head_dim=256), {"is_causal": True}), False, id="head-dim-256"),
        pytest.param(
            lambda: (big(), {"attn_mask": torch.ones(2048, 2048, dtype=torch.bool)}),
            False,
            id="masked",
        ),
        pytest.param(
            lambda: (tuple(t.half() for t in big()), {"is_causal": True}), False, id="fp16"
        ),
        pytest.param(lambda: (gqa(kv_heads=2), {}), True, id="gqa-2-kv-heads-training"),
        pytest.param(lambda: (gqa(kv_heads=1), {}), False, id="gqa-fewer-kv-heads-than-threads"),
    ],
)
def test_cpu_order_follows_the_measured_shape_classes(call, numba_first, monkeypatch):
    from attnperf.inputs import prepare

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the measured machine's
    tensors, options = call()
    gqa = tensors[1].shape[1] != tensors[0].shape[1]
    order = dispatch.priority(prepare(*tensors, **options, enable_gqa=gqa))
    assert order[:2] == (("numba", "sdpa") if numba_first else ("sdpa", "numba"))
