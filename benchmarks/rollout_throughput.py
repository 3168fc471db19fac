"""Rollout throughput of the `hf` and `vllm` backends on the same model and prompts (tokens/s).

    python benchmarks/rollout_throughput.py --backends hf:generate hf:static vllm --prompts 64 --new-tokens 32 \
        [--model DIR] [--device cpu|cuda] [--out results/rollout_cpu.json]

Without --model a random Qwen2 of the given size is built locally (no network). Responses are forced to
exactly --new-tokens tokens (`rollout.ignore_eos`), sampled at temperature 1; the first call of each
backend is a warm-up and is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.engine.distributed import resolve_device
from ketch.models import load_tokenizer, resolve_dtype, save_tiny_model
from ketch.protocol import DataProto
from ketch.rollout import build_rollout


def random_model(directory: str, hidden: int, layers: int) -> str:
    sizes = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_layers": layers, "max_positions": 512}
    sizes |= {"num_heads": hidden // 32, "num_kv_heads": max(1, hidden // 64)}
    return str(save_tiny_model(directory, build_char_tokenizer(), **sizes))


def prompt_batch(tokenizer, prompts: int, prompt_len: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(len(tokenizer), 95), (prompts, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})


def measure(backend: str, model: str, args) -> dict:
    """`backend` is a rollout name, optionally with the hf decoding path: `hf:static`, `hf:generate`."""
    name, _, decoding = backend.partition(":")
    config = load_config(
        overrides=[
            f"model.path={model}",
            f"rollout.name={name}",
            f"rollout.hf_decoding={decoding or 'auto'}",
            "rollout.ignore_eos=true",
            f"data.max_response_length={args.new_tokens}",
            f"data.max_prompt_length={args.prompt_len}",
            f"trainer.device={args.device}",
            f"rollout.max_num_seqs={args.prompts}",
        ]
    )
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(model)
    start = time.perf_counter()
    rollout = build_rollout(config, model, tokenizer, resolve_dtype(config.model.dtype, device), device, seed=0)
    startup = time.perf_counter() - start
    batch = prompt_batch(tokenizer, args.prompts, args.prompt_len)
    rollout.generate(batch)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = rollout.generate(batch)
        times.append(time.perf_counter() - start)
    new_tokens = int(out.batch["response_mask"].sum())
    seconds = statistics.median(times)
    return {
        "backend": backend,
        "startup_s": startup,
        "generate_s": seconds,
        "new_tokens": new_tokens,
        "new_tokens_per_s": new_tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["hf:generate", "hf:static", "vllm"])
    parser.add_argument("--model")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    model = args.model or random_model(tempfile.mkdtemp(prefix="ketch-bench-"), args.hidden, args.layers)
    results = {
        "device": args.device,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "runs": [measure(b, model, args) for b in args.backends],
    }
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
