"""The compile wait of static decoding: the first `generate` of a shape against the next one, and dynamo's part.

A Qwen2.5-0.5B-shaped model (24 blocks of width 896; the vocabulary cut to `--vocab` tokens, which dynamo does
not see) with random weights decodes `--rows` prompts of `--prompt-len` tokens for `--new-tokens` tokens with
the compiled decode step, twice. Dynamo traces the transformer block once per shape (one graph for all blocks),
so its tracing time is what a run pays again even when inductor's code comes from the compiler cache. The
same prompts then decode without compiling (and without a CUDA graph), as a check of the compiled path: the
share of tokens that agree and the largest log-prob difference up to each row's first disagreement (the first
token comes from the prompt's pass, eager in both).

    PYTHONPATH=. python3 benchmarks/decode_compile.py --device cpu --backend eager --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder


def dynamo_seconds() -> dict[str, float]:
    """Seconds dynamo spent so far, by phase (the sum over the compiled frames)."""
    names, values = torch._dynamo.utils.compile_times(repr="csv")
    return {name: sum(float(x) for x in times.split(",")) for name, times in zip(names, values, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: dynamo alone)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=args.layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()
    prompts = torch.randint(3, args.vocab, (args.rows, args.prompt_len), device=args.device)
    decode_args = (prompts, torch.ones_like(prompts), args.new_tokens, Sampling(False), None, 0)
    decoder = StaticDecoder(model, compile_step=True, buckets=False, backend=args.backend)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        tokens, log_probs = decoder.generate(*decode_args)
        tokens.cpu()
        seconds.append(time.perf_counter() - start)
    phases = dynamo_seconds()
    with torch.compiler.set_stance("force_eager"):
        eager_tokens, eager_log_probs = StaticDecoder(model, compile_step=False).generate(*decode_args)
    agreeing = (tokens == eager_tokens).cumprod(-1).bool()  # each row up to its first disagreement
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "backend": args.backend,
        "torch": torch.__version__,
        "layers": args.layers,
        "rows": args.rows,
        "length": args.prompt_len + args.new_tokens,
        "first_generate_s": seconds[0],
        "second_generate_s": seconds[1],
        "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "dynamo_compile_s": phases.get("_compile.compile_inner"),
        "dynamo_tracing_s": phases.get("bytecode_tracing"),
        "dtype": args.dtype,
        "tokens_agreeing_with_eager": (tokens == eager_tokens).float().mean().item(),
        "log_prob_max_diff_while_agreeing": (log_probs - eager_log_probs).abs()[agreeing].max().item(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
