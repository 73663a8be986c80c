"""Model-level prefill and decode speed of a gpt-oss-like model: transformers' GptOss on
attnperf against the same model on transformers' "eager" (its only CPU attention for
gpt-oss), in one process, taking turns round by round.

    python benches/gpt_oss_model.py                       # 4 layers, 4096-token prompt
    python benches/gpt_oss_model.py --layers 2 --prompt 2048 --new 32

gpt-oss-20b's attention (64 query heads over 8 key/value heads, E = 64, hidden size 2880,
sinks in every layer, window-128 and full layers in turn) on a few layers with a small
mixture of experts (4 experts of 512, 2 per token); random weights from a config (no
download), the sinks drawn at gpt-oss's scale, fp32, batch 1. Prefill: one forward over the
prompt into a DynamicCache; decode: `--new` greedy steps on it; tokens/s from the median
round. The models' last logits are compared first (same weights).
"""

from __future__ import annotations

import argparse

import torch
import transformers
from generate_model import prefill_and_decode, print_medians  # benches/, the script's own folder

from attnperf.integrations.transformers import register
from attnperf.machine import cpu_description


def build(layers: int, implementation: str):
    config = transformers.GptOssConfig(
        vocab_size=1000, hidden_size=2880, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=128, max_position_embeddings=16384,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        + ["sliding_attention"] * (layers % 2),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if name.endswith("sinks"):  # gpt-oss's trained sinks are O(1), not the init's 0.02
            parameter.data = torch.randn(parameter.shape, generator=gen)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="attnperf's backend")
    args = parser.parse_args()
    register("attnperf", backend=args.backend)
    models = {name: build(args.layers, name) for name in ("eager", "attnperf")}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (1, args.prompt), generator=gen)
    for model in models.values():  # warm-up (JIT, allocator) on a short prompt, not counted
        prefill_and_decode(model, ids[:, :256], 2)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    logits = {}
    for round_ in range(args.rounds):
        for name in models if round_ % 2 else reversed(models):
            prefill, decode, logits[name] = prefill_and_decode(models[name], ids, args.new)
            times[name].append((prefill, decode))
    error = (logits["attnperf"] - logits["eager"]).abs().max().item()
    cpu = cpu_description()
    print(f"gpt-oss-like, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens, "
          f"fp32, {torch.get_num_threads()} threads, cpu {cpu['cpu_model']} "
          f"({cpu['vector_isa']}); max |logits difference| {error:.1e}; medians of "
          f"{args.rounds} rounds")  # fmt: skip
    print_medians(times, args.prompt, args.new, "eager")


if __name__ == "__main__":
    main()
