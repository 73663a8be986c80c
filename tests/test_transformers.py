"""Hugging Face models run their attention through attnperf: same logits, same tokens."""

import pytest
import torch

from attnperf import dispatch, plans

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


def gpt_oss():
    """Sinks in every layer, sliding (5 keys) and full layers in turn, experts."""
    return transformers.GptOssConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip


def gpt2():
    return transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def build(config, implementation):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(2)
    for name, parameter in model.named_parameters():
        if name.endswith("sinks"):  # drawn large enough to matter (initialised at ~0.02)
            parameter.data = torch.randn(parameter.shape, generator=gen) * 2
    return model.eval()


# Where transformers' own SDPA path computes what the model means; Gemma 2's softcap only
# its eager attention does.
CONFIGS = {
    "llama-gqa": llama,
    "gpt2": gpt2,
    "mistral-sliding": mistral,
    "gemma2-softcap50": gemma2,
    "gemma2-softcap1": lambda: gemma2(softcap=1.0, initializer_range=0.2),
    "gpt-oss-sinks": gpt_oss,  # transformers runs it eager only (no SDPA, no CPU flex)
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


@pytest.mark.parametrize("backend", ["numba", "auto"])
def test_unpadded_decoding_runs_on_the_kept_step_launcher(backend, monkeypatch):
    """Without padding, the first single-token step is a KV-cache call, which keeps its
    backend's step launcher; every later step of every layer (the same metadata) runs on
    it through api.heads_first_step, with no view of the query and the cache made."""
    import attnperf.integrations.transformers as integration

    calls = []
    for name in ("attention_with_kvcache", "heads_first_step"):
        original = getattr(integration, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            result = _original(*args, **kwargs)
            calls.append((_name, result is not None))
            return result

        monkeypatch.setattr(integration, name, spy)
    name = register(f"attnperf-probe-{backend}", backend=backend)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    plans.clear()  # none kept by an earlier test's model
    with torch.no_grad():
        model = build(llama(), name)
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    steps = 3 * model.config.num_hidden_layers
    assert calls[:2] == [("heads_first_step", False), ("attention_with_kvcache", True)]
    assert calls[2:] == [("heads_first_step", True)] * (steps - 1)


# ---------------------------------------------------------------------- linear attention
def qwen3_next():
    """Gated delta rule (3 layers) and full attention (1), 4 value heads over 2 key heads."""
    return transformers.Qwen3NextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip


def qwen3_5():
    return transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip


LINEAR_CONFIGS = {"qwen3-next": qwen3_next, "qwen3.5": qwen3_5}


def build_linear(config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("model", LINEAR_CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_attention_models_give_transformers_logits_and_tokens(model, backend, monkeypatch):
    """A left-padded prompt (the chunked kernel), then greedy cached decoding (one token a
    step on the carried state: the recurrent kernel): transformers' own logits and tokens,
    every recurrence served by attnperf; an unpatched model of the same kind is untouched."""
    import attnperf.integrations.transformers as integration
    from attnperf.integrations.transformers import patch_linear_attention

    steps = []
    original = integration.linear_attention

    def spy(q, *args, **kwargs):
        steps.append(q.shape[1])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(integration, "linear_attention", spy)
    ids, mask = left_padded_batch()
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    reference, patched = (build_linear(LINEAR_CONFIGS[model]()) for _ in range(2))
    patch_linear_attention(patched, backend=backend)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert steps == []  # the unpatched model ran transformers' own recurrence
        actual = patched(input_ids=ids, attention_mask=mask).logits
        assert steps == [12] * 3
        expected_tokens = reference.generate(ids, attention_mask=mask, **kwargs)
        tokens = patched.generate(ids, attention_mask=mask, **kwargs)
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, expected_tokens)
    assert steps[3:] == [12] * 3 + [1] * 3 * 5  # prefill, then 5 single-token steps


def test_patch_linear_attention_refuses_a_model_without_such_layers():
    from attnperf.integrations.transformers import patch_linear_attention

    with pytest.raises(ValueError, match="no linear-attention layer"):
        patch_linear_attention(build(llama(), "sdpa"))
    with pytest.raises(ValueError, match="unknown backend"):
        patch_linear_attention(build_linear(qwen3_next()), backend="fast")


@pytest.mark.parametrize(
    "function", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
)
def test_linear_attention_equals_transformers_fallbacks(function):
    """On the fallbacks' own inputs (grouped value heads, l2norm, a carried state)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    import attnperf

    fallback = getattr(modeling, function)
    fallback = getattr(fallback, "attnperf_original", fallback)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 70, 4, 8, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(2, 70, 4, generator=gen))
    beta = torch.rand(2, 70, 4, generator=gen)
    state = torch.randn(2, 4, 16, 8, generator=gen)
    call = {"g": g, "beta": beta, "initial_state": state, "output_final_state": True}
    expected = fallback(q, k, v, **call, use_qk_l2norm_in_kernel=True)
    actual = attnperf.linear_attention(q, k, v, **call, use_qk_l2norm=True)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- int8 KV cache
def llama_e32():
    """Head dim 32, so that an int8 row (32 codes and one float32 scale) is 28% of fp32's."""
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
    )  # fmt: skip


@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_cache_gives_the_float_cache_logits_within_3_percent(backend, group_size, monkeypatch):
    """Teacher-forced: a left-padded prompt, then 6 given tokens one step at a time, on an
    Int8KVCache and on transformers' DynamicCache; every step's logits within 3% of the
    largest, each step served by attention_with_kvcache over the int8 codes."""
    import attnperf.integrations.transformers as integration
    from attnperf.integrations.transformers import Int8KVCache

    steps = []
    original = integration.attention_with_kvcache
    monkeypatch.setattr(integration, "attention_with_kvcache",
                        lambda *a, **k: steps.append(a[1].dtype) or original(*a, **k))  # fmt: skip
    model = build(llama_e32(), register(f"attnperf-{backend}", backend=backend))
    ids, mask = left_padded_batch()
    forced = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    int8 = Int8KVCache(model, 64, group_size=group_size)
    caches = {"float": transformers.DynamicCache(), "int8": int8}
    logits = {name: [] for name in caches}
    with torch.no_grad():
        for name, cache in caches.items():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            logits[name].append(out.logits[:, -1])
            for t in range(forced.shape[1]):
                mask_t = torch.cat((mask, torch.ones(2, t + 1, dtype=mask.dtype)), 1)
                out = model(input_ids=forced[:, t : t + 1], attention_mask=mask_t,
                            past_key_values=cache)  # fmt: skip
                logits[name].append(out.logits[:, -1])
    for step, (float_logits, int8_logits) in enumerate(zip(logits["float"], logits["int8"],
                                                           strict=True)):  # fmt: skip
        tolerance = 0.03 * float_logits.abs().max()
        assert (int8_logits - float_logits).abs().max() <= tolerance, step
        # The prefill attends over its own keys in float; the steps read the int8 codes.
        assert torch.equal(int8_logits, float_logits) == (step == 0), step
    assert steps.count(torch.int8) == forced.shape[1] * model.config.num_hidden_layers
    fp32_bytes = 2 * 2 * 2 * 64 * 2 * 32 * 4  # layers, K and V, B, max_cache_len, H, E, fp32
    group = group_size or 32  # codes and a float32 scale per group
    assert int8.storage_bytes == fp32_bytes // 4 * (group + 4) // group
    if group_size is None:
        assert int8.storage_bytes <= 0.3 * fp32_bytes


def test_int8_cache_generates_and_refuses_another_attention():
    from attnperf.integrations.transformers import Int8KVCache

    model = build(llama_e32(), register("attnperf-numba", backend="numba"))
    ids, mask = left_padded_batch()
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        tokens = model.generate(ids, attention_mask=mask, past_key_values=Int8KVCache(model, 32),
                                **kwargs)  # fmt: skip
    assert tokens.shape == (2, 18)
    with pytest.raises(ValueError, match="12 new keys exceed the Int8KVCache's max_cache_len = 8"):
        model(input_ids=ids, attention_mask=mask, past_key_values=Int8KVCache(model, 8))
    with pytest.raises(ValueError, match="Int8KVCache serves attnperf's attention"):
        Int8KVCache(build(llama_e32(), "sdpa"), 64)
