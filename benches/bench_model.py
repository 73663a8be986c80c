"""A small Llama-style model (grouped-query attention) on attnperf against the same on sdpa.

    pytest benches/bench_model.py --benchmark-columns=median,iqr,rounds

Random weights from a config (no download); forward over one 1024-token sequence.
"""

import pytest
import torch

from attnperf import dispatch

transformers = pytest.importorskip("transformers", reason="transformers not installed")

from attnperf.integrations.transformers import register  # noqa: E402

IMPLEMENTATIONS = ["sdpa"] + [
    f"attnperf-{name}"
    for name in ("numba", "reference", "sdpa")
    if dispatch.registry()[name].unavailable_reason() is None
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_llama_forward(benchmark, implementation):
    if implementation.startswith("attnperf-"):
        register(implementation, backend=implementation.removeprefix("attnperf-"))
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    ).eval()
    ids = torch.randint(0, 1000, (1, 1024))

    def forward():
        with torch.no_grad():
            return model(input_ids=ids).logits

    benchmark.group = "llama-style, 4 layers, 8 heads / 2 kv heads, 1024 tokens"
    benchmark.pedantic(forward, rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(implementation=implementation, tokens=1024)
