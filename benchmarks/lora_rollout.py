"""The hf rollout of a LoRA actor, two ways: merged weights at each hand-off, or the adapters alone.

`merged` (what ketch does): after each update the actor's weights go to the rollout with the adapters merged in
(`TrainEngine.full_parameters`), and the rollout decodes a plain model. `unmerged`: the rollout's model carries the
same PEFT adapters, the hand-off copies only the adapter tensors (`TrainEngine.trained_parameters`), and every
decode step runs each adapted layer's extra two matmuls. Both decode the same prompts to the same length with
`ignore_eos`, with transformers' `generate` (the only decoding of the unmerged model; merged weights also take the
static decoder on GPUs); the figure that matters is hand-off + generation per step.

    PYTHONPATH=. python3 benchmarks/lora_rollout.py --rank 8 --out benchmarks/results/DATE_cpu_lora_rollout.json

`--size builtin` is the built-in model's shape (4 layers of width 128); `--size 0.5b` the Qwen2.5-0.5B shape.
Prints the median seconds over `--repeats` rounds of each way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.config import load_config
from ketch.config.schema import LoraConfig
from ketch.data import build_char_tokenizer
from ketch.engine.distributed import init_process_group, resolve_device
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel
from ketch.engine.lora import add_lora
from ketch.models import load_causal_lm, save_tiny_model
from ketch.protocol import DataProto
from ketch.rollout.hf import HFRollout

SIZES = {
    "builtin": {"hidden_size": 128, "intermediate_size": 512, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2},
}


def prompts(rows: int, length: int, vocab: int, device: torch.device) -> DataProto:
    ids = torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})


def time_round(engine: TrainEngine, rollout: HFRollout, batch: DataProto, merged: bool, device) -> dict[str, float]:
    """One hand-off and one generation, in seconds."""
    start = time.perf_counter()
    if merged:
        rollout.update_weights(engine.full_parameters(prefix="lm.", dtype=rollout.model.dtype))
    else:
        params = dict(rollout.model.named_parameters())
        with torch.no_grad():
            for name, tensor in engine.trained_parameters():
                params[name.removeprefix("lm.")].copy_(tensor)
    handed = time.perf_counter()
    rollout.generate(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"hand_off_s": handed - start, "generate_s": time.perf_counter() - handed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="builtin")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="sequences per generation")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = resolve_device(args.device)
    init_process_group(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "model", build_char_tokenizer(), **SIZES[args.size])
    lora = LoraConfig(rank=args.rank)
    policy = PolicyModel(load_causal_lm(str(model_dir), dtype))
    add_lora(policy.lm, lora)
    for name, param in policy.named_parameters():  # trained adapters: B is not zero
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    engine = TrainEngine(policy, device, param_dtype=dtype if dtype != torch.float32 else None)
    config = load_config(
        overrides=[
            f"model.path={model_dir}",
            f"trainer.device={device.type}",
            f"data.max_prompt_length={args.prompt_len}",
            f"data.max_response_length={args.response_len}",
            "rollout.ignore_eos=true",
            "rollout.hf_decoding=generate",
        ]
    )
    batch = prompts(args.rows, args.prompt_len, len(build_char_tokenizer()), device)
    rollouts = {"merged": HFRollout(config, str(model_dir), build_char_tokenizer(), dtype, device, seed=0)}
    rollouts["unmerged"] = HFRollout(config, str(model_dir), build_char_tokenizer(), dtype, device, seed=0)
    add_lora(rollouts["unmerged"].model, lora)
    rollouts["unmerged"].model.to(device, dtype)
    rounds = {way: [] for way in rollouts}
    for _ in range(args.repeats + 1):  # the first round of each is a warm-up
        for way, rollout in rollouts.items():
            rounds[way].append(time_round(engine, rollout, batch, way == "merged", device))
    result = {
        "size": args.size,
        "rank": args.rank,
        "rows": args.rows,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }
    for way, times in rounds.items():
        median = {key: statistics.median(t[key] for t in times[1:]) for key in times[0]}
        result[way] = median | {"step_s": median["hand_off_s"] + median["generate_s"]}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
