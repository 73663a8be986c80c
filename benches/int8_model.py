"""Model-level decoding on an int8 KV cache: a Llama-like model with Llama-3-8B's attention
heads decodes after a long prompt on attnperf's Int8KVCache, against transformers' sdpa on
its DynamicCache in fp32 and in bf16.

    python benches/int8_model.py                          # 2 layers, 16k-token prompt
    python benches/int8_model.py --prompt 8192 --new 32

32 query heads over 8 key/value heads, E = 128, hidden size 4096, a small MLP (1024) so that
attention dominates; random weights (no download), batch 1. Each model prefills the prompt
once, then decodes `--new` greedy tokens; the time per token is the median over those
steps. transformers' QuantizedCache is timed too where quanto or HQQ is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch
import transformers

from attnperf.integrations.transformers import Int8KVCache, register
from attnperf.machine import cpu_description


def build(layers: int, implementation: str, dtype: torch.dtype):
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=4096, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=65536,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation, dtype=dtype
    ).eval()


def decode_times(model, ids: torch.Tensor, cache, new: int) -> tuple[list[float], float]:
    """(seconds of each of `new` greedy steps after prefilling `ids` into `cache`, prefill
    seconds)."""
    with torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        prefill = time.perf_counter() - start
        token, steps = out.logits[:, -1:].argmax(-1), []
        for _ in range(new):
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            steps.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
    return steps, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=None, help="int8 groups (None: rows)")
    args = parser.parse_args()
    name = register("attnperf")
    ids = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    runs = {
        "attnperf Int8KVCache": (name, torch.float32,
                                 lambda m: Int8KVCache(m, args.prompt + args.new,
                                                       group_size=args.group_size)),
        "sdpa DynamicCache fp32": ("sdpa", torch.float32, lambda m: transformers.DynamicCache()),
        "sdpa DynamicCache bf16": ("sdpa", torch.bfloat16, lambda m: transformers.DynamicCache()),
    }  # fmt: skip
    installed = [name for name, package in (("quanto", "optimum"), ("hqq", "hqq"))
                 if importlib.util.find_spec(package)]  # fmt: skip
    if installed:
        backend = installed[0]
        runs[f"sdpa QuantizedCache ({backend}, int8)"] = (
            "sdpa", torch.float32,
            lambda m: transformers.QuantizedCache(backend=backend, config=m.config, nbits=8),
        )  # fmt: skip
    cpu = cpu_description()
    print(f"Llama-like, {args.layers} layers, 32/8 heads, E = 128, prompt {args.prompt}, "
          f"{args.new} new tokens, {torch.get_num_threads()} threads, cpu {cpu['cpu_model']} "
          f"({cpu['vector_isa']}); median step time")  # fmt: skip
    per_token = {}
    for label, (implementation, dtype, make_cache) in runs.items():
        model = build(args.layers, implementation, dtype)
        decode_times(model, ids[:, :256], make_cache(model), 2)  # warm-up, not counted
        steps, prefill = decode_times(model, ids, make_cache(model), args.new)
        per_token[label] = statistics.median(steps)
        print(f"  {label:28s} prefill {prefill:6.1f} s  decode {per_token[label] * 1e3:6.1f} "
              f"ms/token ({1 / per_token[label]:5.1f} tokens/s)")  # fmt: skip
        del model
    int8 = per_token["attnperf Int8KVCache"]
    for label, seconds in per_token.items():
        if label != "attnperf Int8KVCache":
            print(f"  attnperf Int8KVCache / {label}: {seconds / int8:.2f}x tokens/s")


if __name__ == "__main__":
    main()
