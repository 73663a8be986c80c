"""A Qwen3-Next-like model on CPU: prefill and decode tokens/s with transformers' own linear
attention (its torch fallback) and with attnperf's (patch_linear_attention), same weights.

    python benches/linear_model.py [--prompt 2048] [--new 32] [--rounds 3]

Four layers (three gated delta rule, one full attention) with the real model's heads: 16 key
heads and 32 value heads of 128 dims in the linear layers, 16 query heads over 2 key/value
heads of 256 dims in the full one; a small mixture of experts; fp32, B = 1, greedy. The two
models take turns round by round; medians. Prefill is generate(max_new_tokens=1), decode the
extra time of `--new` more tokens, per token.
"""

import argparse
import statistics
import time

import torch
import transformers

from attnperf.integrations.transformers import patch_linear_attention
from attnperf.machine import cpu_description


def config() -> transformers.Qwen3NextConfig:
    return transformers.Qwen3NextConfig(
        vocab_size=2048, hidden_size=2048, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        layer_types=["linear_attention"] * 3 + ["full_attention"], eos_token_id=None,
    )  # fmt: skip


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()


def timed(model, ids, new: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)  # fmt: skip
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = {"transformers": build(), "attnperf": patch_linear_attention(build())}
    ids = torch.randint(0, 2048, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the same tokens either way
        tokens = [m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
                  for m in models.values()]  # fmt: skip
    assert torch.equal(*tokens), "the two models disagree"
    prefill = {name: [] for name in models}
    decode = {name: [] for name in models}
    for round_ in range(args.rounds):
        for name in list(models)[:: 1 if round_ % 2 == 0 else -1]:
            first = timed(models[name], ids, 1)
            whole = timed(models[name], ids, 1 + args.new)
            prefill[name].append(first)
            decode[name].append((whole - first) / args.new)
    cpu = cpu_description()
    print(f"{cpu['cpu_model']} ({cpu['vector_isa']}), {torch.get_num_threads()} threads, fp32; "
          f"prompt {args.prompt} tokens, then {args.new} generated")  # fmt: skip
    print("| linear attention | prefill tokens/s | decode tokens/s |")
    print("|---|---|---|")
    for name in models:
        p, d = statistics.median(prefill[name]), statistics.median(decode[name])
        print(f"| {name} | {args.prompt / p:.0f} | {1 / d:.1f} |")
    ratio_p = statistics.median(prefill["transformers"]) / statistics.median(prefill["attnperf"])
    ratio_d = statistics.median(decode["transformers"]) / statistics.median(decode["attnperf"])
    print(f"attnperf / transformers: prefill {ratio_p:.2f}x, decode {ratio_d:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
