"""Hugging Face models run their attention through attnperf: same logits, same tokens."""

import pytest
import torch

from attnperf import dispatch

transformers = pytest.importorskip("transformers", reason="transformers not installed")

from attnperf.integrations.transformers import register  # noqa: E402

# The CPU backends that serve models here; numba only where it is installed.
BACKENDS = [
    name
    for name in ("reference", "numba")
    if dispatch.registry()[name].unavailable_reason() is None
]


def llama():
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return config


def gpt2():
    return transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def build(config, implementation):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=torch.float32
    )
    return model.eval()


def left_padded_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # the second sequence is shorter: left padding
    return ids, mask


@pytest.mark.parametrize("make_config", [llama, gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_sdpa_with_left_padding(make_config, backend):
    name = register(f"attnperf-{backend}", backend=backend)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        expected = build(make_config(), "sdpa")(input_ids=ids, attention_mask=mask).logits
        actual = build(make_config(), name)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make_config", [llama, gpt2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_gives_the_same_tokens(make_config, backend):
    """Prefill, then cached decoding: one query against the growing key cache."""
    name = register(f"attnperf-{backend}", backend=backend)
    ids, mask = left_padded_batch()
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = build(make_config(), "sdpa").generate(ids, attention_mask=mask, **kwargs)
        model = build(make_config(), "sdpa")
        model.set_attn_implementation(name)
        actual = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(actual, expected)


def test_the_registered_function_really_runs(monkeypatch):
    """Guards the tests above against a silent fall back to transformers' own SDPA."""
    import attnperf.integrations.transformers as integration

    calls = []
    original = integration.attention
    monkeypatch.setattr(
        integration, "attention", lambda *a, **k: calls.append(k["backend"]) or original(*a, **k)
    )
    name = register("attnperf-probe", backend="reference")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        build(llama(), name)(input_ids=ids, attention_mask=mask)
    assert calls == ["reference", "reference"]  # one call per layer
