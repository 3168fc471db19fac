"""Time the `hf` rollout's generation at tensor-parallel sizes 1 and 2 (`rollout.tensor_parallel_size`).

Workload (`--scale 7b`): a Qwen2.5-7B-shaped model (28 layers, width 3584, 28 query / 4 key-value heads, MLP
18944, vocabulary 152064, untied) with random weights in bf16, built on each GPU; 16 prompts x 8 samples =
128 rows of 128 random prompt tokens, 256 sampled tokens each (no stop token), temperature 1, the static
decoder (CUDA graphs) or `--decoding generate`. At TP=2 each of the two processes brings half the rows and the
group decodes them together, as in training (`TensorParallel.group_prompts`, one shared sampling seed).
`--scale small` is a tiny copy that runs on the CPU over gloo.

    PYTHONPATH=. python3 benchmarks/tp_rollout.py --tp 1 2 --out benchmarks/results/x.json

Prints, for each size, the median seconds of one generation over `--steps` (after `--warmup`, which compiles),
new tokens per second and each rank's peak GPU memory.
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
from ketch.protocol import DataProto
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder
from ketch.rollout.tensor_parallel import TensorParallel, same_random_numbers

SCALES = {
    "7b": {"vocab": 152064, "hidden": 3584, "intermediate": 18944, "layers": 28, "heads": 28, "kv_heads": 4},
    "small": {"vocab": 2048, "hidden": 128, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2},
}
ROWS, PROMPT_LEN, RESPONSE_LEN = 128, 128, 256


def build_model(s: dict, device: torch.device) -> Qwen2ForCausalLM:
    """The random model (seed 0, the same on every rank), built on `device` in bf16 (float32 on the CPU)."""
    config = qwen2_config(s, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)


def time_generation(rank: int, size: int, port: int, args, out: str) -> None:
    """One process of a TP group of `size`: build, shard, decode its half (TP=2) or all (TP=1) of the rows."""
    device = join_process_group(rank, size, port, args.device)
    cuda = device.type == "cuda"
    s = SCALES[args.scale]
    model = build_model(s, device)
    tp = TensorParallel(size) if size > 1 else None
    if tp is not None:
        model = tp.shard_model(model, device)  # the whole model is dropped here
    decoder = StaticDecoder(model, compile_step=cuda) if args.decoding == "static" else None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, s["vocab"], (ROWS, PROMPT_LEN), generator=g).chunk(size)[rank]
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    seconds = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        together, rows, seed = tp.group_prompts(prompts, 0) if tp else (prompts, slice(None), step)
        b = together.to(device).batch
        with same_random_numbers(seed, device):
            if decoder is not None:
                tokens, _ = decoder.generate(
                    b["input_ids"], b["attention_mask"], RESPONSE_LEN, Sampling(True), None, pad_token_id=0
                )
            else:
                tokens = model.generate(
                    input_ids=b["input_ids"],
                    attention_mask=b["attention_mask"],
                    do_sample=True,
                    top_k=0,
                    max_new_tokens=RESPONSE_LEN,
                    min_new_tokens=RESPONSE_LEN,
                    pad_token_id=0,
                )
        tokens = tokens[rows].cpu()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    peaks = [None] * size
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        gen = statistics.median(seconds[args.warmup :])
        result = {
            "tensor_parallel_size": size,
            "gen_s": round(gen, 4),
            "first_gen_s": round(seconds[0], 2),
            "new_tokens_per_s": round(ROWS * RESPONSE_LEN / gen, 1),
            "peak_gpu_memory_gib": [round(p, 2) for p in peaks],
            "steps_s": [round(x, 4) for x in seconds],
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="7b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--decoding", choices=["static", "generate"], default="static")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {"scale": args.scale, "decoding": args.decoding, "rows": ROWS, "prompt_len": PROMPT_LEN}
    results["response_len"] = RESPONSE_LEN
    for size in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            out = f"{tmp}/result.json"
            mp.start_processes(time_generation, args=(size, free_port(), args, out), nprocs=size, start_method="spawn")
            results[f"tp{size}"] = json.loads(Path(out).read_text())
        print(json.dumps(results[f"tp{size}"]), flush=True)
    if "tp1" in results and "tp2" in results:
        results["tp2_speedup"] = round(results["tp1"]["gen_s"] / results["tp2"]["gen_s"], 3)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
