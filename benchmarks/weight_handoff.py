"""Time the weight hand-off from FSDP2 shards to a whole rollout model, one and two processes.

Each process holds the model sharded by `TrainEngine` (mixed precision in bf16 on GPUs, float32 on the CPU)
and a whole copy as the `hf` rollout holds it, and copies the engine's full weights into it: `unit`, the
engine's `full_parameters` (one all-gather per FSDP unit, in the rollout's dtype), against `per_param`, one
`full_tensor()` per parameter then a cast (the hand-off before it). `--scale 0.5b` is the Qwen2.5-0.5B shape
of `rl_step.py`; `--scale small` runs on the CPU over gloo.

    PYTHONPATH=. python3 benchmarks/weight_handoff.py --scale 0.5b --world 1 2 --out benchmarks/results/x.json

Prints the median seconds of `--repeats` hand-offs of each kind for each world size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_step import join_process_group, qwen2_config
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.engine.distributed import free_port
from ketch.engine.engine import TrainEngine
from ketch.engine.heads import PolicyModel

SCALES = {
    "0.5b": {"vocab": 151936, "hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2},
    "small": {"vocab": 4096, "hidden": 256, "intermediate": 1024, "layers": 8, "heads": 4, "kv_heads": 2},
}


def model(s: dict) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_config(s, tie_word_embeddings=True))


def time_hand_offs(rank: int, world: int, port: int, args, out: str) -> None:
    device = join_process_group(rank, world, port, args.device)
    cuda = device.type == "cuda"
    s = SCALES[args.scale]
    dtype = torch.bfloat16 if cuda else torch.float32
    engine = TrainEngine(PolicyModel(model(s)), device, param_dtype=dtype if cuda else None)
    rollout = model(s).to(device, dtype)
    params = dict(rollout.named_parameters(remove_duplicate=False))
    kinds = {"unit": engine.full_parameters, "per_param": engine._gathered_one_by_one}
    seconds = {kind: [] for kind in kinds}
    for _ in range(args.repeats + 1):  # the first of each is a warm-up
        for kind, gather in kinds.items():
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                for name, tensor in gather("lm.", dtype):
                    params[name].copy_(tensor)
            if cuda:
                torch.cuda.synchronize()
            seconds[kind].append(time.perf_counter() - start)
    if rank == 0:
        medians = {f"{kind}_s": round(statistics.median(t[1:]), 4) for kind, t in seconds.items()}
        Path(out).write_text(json.dumps({"world": world, **medians}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="0.5b")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {"scale": args.scale, "device": args.device, "runs": []}
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/result.json"
            mp.start_processes(time_hand_offs, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
            results["runs"].append(json.loads(Path(out).read_text()))
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
