"""Model-level prefill and decode speed: a transformers model on attnperf against the same
model on transformers' own "sdpa", in one process, taking turns round by round.

    python benches/generate_model.py                      # Llama-like, 4096-token prompt
    python benches/generate_model.py --model mistral --prompt 8192 --window 512
    python benches/generate_model.py --dtype bfloat16     # the model and its cache in bf16

Random weights from a config (no download), fp32 (or --dtype), batch 1. Prefill: one
forward over the prompt into a DynamicCache. Decode: `--new` greedy steps on that cache, one
token each; tokens/s from the median round. The models' logits are compared first (same weights).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from attnperf.integrations.transformers import register
from attnperf.machine import cpu_description


def build(kind: str, window: int | None, implementation: str, dtype: torch.dtype):
    common = dict(
        vocab_size=1000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
    )  # fmt: skip
    if kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=window)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    )
    return model.to(dtype).eval()


def prefill_and_decode(model, ids: torch.Tensor, new: int) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds for `new` tokens, the prompt's last logits)."""
    with torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, past_key_values=transformers.DynamicCache(), use_cache=True)
        prefill = time.perf_counter() - start
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new):
            step = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, step.logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    return prefill, decode, out.logits[:, -1]


def print_medians(times: dict[str, list[tuple[float, float]]], prompt: int, new: int,
                  peer: str) -> None:  # fmt: skip
    """Each model's median prefill and decode, and attnperf's tokens/s over `peer`'s."""
    medians = {name: [statistics.median(t[i] for t in rounds) for i in (0, 1)]
               for name, rounds in times.items()}  # fmt: skip
    for name, (prefill, decode) in medians.items():
        print(
            f"  {name:9s} prefill {prefill:6.2f} s ({prompt / prefill:7.0f} tokens/s)  "
            f"decode {decode / new * 1e3:6.1f} ms/token ({new / decode:5.1f} tokens/s)"
        )
    (pp, pd), (ap, ad) = medians[peer], medians["attnperf"]
    print(f"  attnperf / {peer} tokens/s: prefill {pp / ap:.2f}x, decode {pd / ad:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "mistral"], default="llama")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--window", type=int, default=512, help="mistral's sliding window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="attnperf's backend")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    register("attnperf", backend=args.backend)
    models = {name: build(args.model, args.window, name, dtype) for name in ("sdpa", "attnperf")}
    ids = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    logits = {}
    for round_ in range(args.rounds + 1):  # round 0: warm-up (JIT, allocator), not counted
        for name in models if round_ % 2 else reversed(models):
            prefill, decode, logits[name] = prefill_and_decode(models[name], ids, args.new)
            if round_:
                times[name].append((prefill, decode))
    error = (logits["attnperf"] - logits["sdpa"]).abs().max().item()
    cpu = cpu_description()
    print(f"{args.model}, prompt {args.prompt}, {args.new} new tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads, cpu {cpu['cpu_model']} ({cpu['vector_isa']}); "
          f"max |logits difference| {error:.1e}; medians of {args.rounds} rounds")  # fmt: skip
    print_medians(times, args.prompt, args.new, "sdpa")


if __name__ == "__main__":
    main()
