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
    """Grouped-query attention, 8 query heads over 2 key/value heads."""
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip


def mistral():
    """Sliding window of 5 keys on every layer: shorter than the 12-token prompts."""
    return transformers.MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=5,
    )  # fmt: skip


def gemma2(softcap=50.0, initializer_range=0.02):
    """Sliding (5 keys) and global layers in turn, attention logits softcapped (Gemma 2's
    50; or, with larger weights, a cap that bites: it moves the logits by up to 3.4)."""
    return transformers.Gemma2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        max_position_embeddings=128, attn_logit_softcapping=softcap,
        initializer_range=initializer_range, query_pre_attn_scalar=1,
    )  # fmt: skip


def gpt2():
    return transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def build(config, implementation):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=torch.float32
    )
    return model.eval()


# Where transformers' own SDPA path computes what the model means; Gemma 2's softcap only
# its eager attention does.
CONFIGS = {
    "llama-gqa": llama,
    "gpt2": gpt2,
    "mistral-sliding": mistral,
    "gemma2-softcap50": gemma2,
    "gemma2-softcap1": lambda: gemma2(softcap=1.0, initializer_range=0.2),
}
PEER = {name: "sdpa" if name in ("llama-gqa", "gpt2") else "eager" for name in CONFIGS}


def left_padded_batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # the second sequence is shorter: left padding
    return ids, mask


@pytest.mark.parametrize("padded", [True, False], ids=["left_padding", "no_padding"])
@pytest.mark.parametrize("model", CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_transformers(model, backend, padded):
    name = register(f"attnperf-{backend}", backend=backend)
    ids, mask = left_padded_batch()
    if not padded:
        mask = torch.ones_like(mask)
    with torch.no_grad():
        expected = build(CONFIGS[model](), PEER[model])(input_ids=ids, attention_mask=mask)
        actual = build(CONFIGS[model](), name)(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(actual.logits[real], expected.logits[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_gives_the_same_tokens(model, backend):
    """Prefill, then cached decoding: one query against the growing key cache (for the
    sliding layers, bottom-right aligned windows past the prompt's length)."""
    name = register(f"attnperf-{backend}", backend=backend)
    ids, mask = left_padded_batch()
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = build(CONFIGS[model](), PEER[model]).generate(ids, attention_mask=mask,
                                                                  **kwargs)  # fmt: skip
        model = build(CONFIGS[model](), PEER[model])
        model.set_attn_implementation(name)
        actual = model.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(actual, expected)


def test_sliding_layers_build_no_mask_without_padding(monkeypatch):
    """A pure causal or sliding pattern reaches the kernels as is_causal / window, not as
    an L x S mask; the window is the model's W keys, the query's own included."""
    import attnperf.integrations.transformers as integration

    calls = []
    original = integration.attention
    monkeypatch.setattr(integration, "attention",
                        lambda *a, **k: calls.append(k) or original(*a, **k))  # fmt: skip
    name = register("attnperf-probe-window", backend="reference")
    ids = left_padded_batch()[0]
    with torch.no_grad():
        build(gemma2(), name)(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert [call["attn_mask"] for call in calls] == [None, None]
    assert [call["window"] for call in calls] == [(4, 0), None]  # sliding, then global
    assert all(call["softcap"] == 50.0 for call in calls)


def test_the_registered_function_really_runs(monkeypatch):
    """Guards the tests above against a silent fall back to transformers' own SDPA; and
    shows the paths: a left-padded prompt reaches the kernels as each sequence's rows of real
    tokens (no L x S mask), every single-token step as a KV-cache call."""
    import attnperf.integrations.transformers as integration

    calls = []
    for name in ("attention", "attention_with_kvcache", "padded_batch"):
        original = getattr(integration, name)
        spy = lambda *a, _name=name, _original=original, **k: (  # noqa: E731
            calls.append(_name) or _original(*a, **k)
        )
        monkeypatch.setattr(integration, name, spy)
    name = register("attnperf-probe", backend="numba")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        model = build(llama(), name)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    layers = model.config.num_hidden_layers
    assert calls == ["padded_batch"] * layers + ["attention_with_kvcache"] * 2 * layers
