"""GRPO with the Megatron engine (TP=2 or PP=2 over two GPUs, or TP=1 on one) beside the FSDP engine (one GPU,
or two) on the GPU benchmark workload of `rl_step.py` (Qwen2.5-0.5B shape, random weights, 16 prompts x 8
samples, 128 + 256 tokens, update micro-batches by a budget of 49,152 tokens); `--scale 7b` runs the same
workload on the Qwen2.5-7B shape (untied embeddings, micro-batches of 16 rows or 16,384 tokens), where
`--set model.gradient_checkpointing=true` recomputes activations in both engines.

Each run trains `--steps` steps from the same weights and prompts and records the per-step reward, policy loss,
gradient norm and timings. After the last step the actor's rollout engine decodes greedily for the next batch
of prompts, the run's HF export is loaded in transformers and decodes greedily for the same prompts, and the
two token sequences are compared (the rollout holds the weights handed off from the engine, so this checks
the export and the hand-off against each other; `--no-greedy` skips it).

    PYTHONPATH=. python3 benchmarks/megatron_vs_fsdp.py --steps 30 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from rl_step import PEAK_BF16_FLOPS, SCALES, build_workload, matmul_parameters, overrides
from transformers import AutoModelForCausalLM, GenerationConfig

from ketch.config import load_config
from ketch.protocol import DataProto
from ketch.trainer.ppo import PPOTrainer

MEGATRON = ["actor.strategy=megatron", "trainer.n_gpus_per_node=2"]
RUNS = {
    "fsdp_1gpu": ["trainer.n_gpus_per_node=1"],
    "fsdp_2gpu": ["trainer.n_gpus_per_node=2"],
    "megatron_tp1": ["actor.strategy=megatron", "trainer.n_gpus_per_node=1"],
    "megatron_tp2": [*MEGATRON, "actor.megatron.tensor_model_parallel_size=2"],
    "megatron_pp2": [*MEGATRON, "actor.megatron.pipeline_model_parallel_size=2"],
}
CURVES = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "timing_s/step", "timing_s/gen")
CURVES += ("timing_s/update_actor", "timing_s/weight_sync", "perf/total_num_tokens")


def train(name: str, s: dict, model: Path, data: Path, args, root: Path, device: str) -> dict:
    """`args.steps` GRPO steps of run `name`; its curves and (unless `args.no_greedy`) the greedy comparison of
    rollout and export."""
    workload = argparse.Namespace(variant="grpo", device=device, workload="fixed")
    steps, extra = args.steps, args.set
    settings = overrides(s, model, data, workload, steps, root / name) + RUNS[name] + extra
    config = load_config(overrides=settings)
    trainer = PPOTrainer(config)
    trainer._open()
    curves = []
    for step in range(1, steps + 1):
        metrics = trainer._train_step(trainer.loader.next_batch(), step)
        trainer.step = step
        trainer.tracker.log(metrics, step)
        curves.append({k: metrics[k] for k in CURVES if k in metrics})
        print(f"{name} step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in curves[-1].items()), flush=True)
    timed = curves[2:] or curves  # the first steps compile
    result = {
        "run": name,
        "overrides": RUNS[name] + extra,
        "curves": curves,
        "finite_grad_norm_steps": sum(math.isfinite(c["actor/grad_norm"]) for c in curves),
        "step_s_median": statistics.median(c["timing_s/step"] for c in timed),
        "update_actor_s_median": statistics.median(c["timing_s/update_actor"] for c in timed),
        "peak_gpu_memory_gib_per_process": [m["allocated_gib"] for m in trainer.actor_rollout.peak_device_memory()],
    }
    result["peak_gpu_memory_gib"] = max(result["peak_gpu_memory_gib_per_process"])
    if device == "cuda":
        result["update_mfu"] = update_mfu(timed, matmul_parameters(s), config.num_processes(gpu_visible=True))
    if args.no_greedy:
        return result
    prompts = trainer.loader.next_batch().select(batch_keys=["input_ids", "attention_mask", "position_ids"])
    prompts.meta_info["do_sample"] = False
    rollout_tokens = trainer.actor_rollout.generate_sequences(prompts).batch["responses"]
    trainer._finish(metrics)  # writes the HF export to run_dir/model
    export_tokens = greedy_with_transformers(trainer.run_dir / "model", prompts, s["response_len"], device)
    return result | {"greedy": compare(rollout_tokens, export_tokens)}


def update_mfu(curves: list[dict], parameters: int, gpus: int) -> float:
    """The median over steps of the actor update's model FLOPs (6 x `parameters` x the step's tokens) per
    update second, as a fraction of the bf16 peak of `gpus` H200s (as `rl_step.py` reports it)."""
    rates = [6 * parameters * c["perf/total_num_tokens"] / c["timing_s/update_actor"] for c in curves]
    return statistics.median(rates) / (PEAK_BF16_FLOPS["cuda"] * gpus)


def greedy_with_transformers(model_dir: Path, prompts: DataProto, new_tokens: int, device: str) -> torch.Tensor:
    """Greedy responses `[batch, new_tokens]` of the exported model (bf16 on a GPU), EOS not stopping them."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    b = prompts.to(device).batch
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = lm.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"], generation_config=config)
    return out[:, b["input_ids"].shape[-1] :].cpu()


def compare(rollout: torch.Tensor, export: torch.Tensor) -> dict:
    """How far the export's greedy tokens follow the rollout's, row by row (`[batch, tokens]` each)."""
    same = (rollout == export).int()
    prefix = same.cumprod(-1).sum(-1)
    return {
        "rows": len(rollout),
        "tokens_per_row": rollout.shape[-1],
        "rows_identical": int((prefix == rollout.shape[-1]).sum()),
        "matching_prefix_mean": prefix.float().mean().item(),
        "matching_prefix_min": int(prefix.min()),
        "token_agreement": same.float().mean().item(),
    }


def agreement(a: dict, b: dict) -> dict:
    """Curves of runs `a` and `b` side by side ([a, b]) and their mean absolute difference per step."""
    out = {}
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        xs, ys = [c[key] for c in a["curves"]], [c[key] for c in b["curves"]]
        out[key] = {
            "mean": [statistics.fmean(xs), statistics.fmean(ys)],
            "step1": [xs[0], ys[0]],
            "mean_abs_diff": statistics.fmean(abs(x - y) for x, y in zip(xs, ys, strict=True)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", nargs="+", default=["fsdp_1gpu", "megatron_tp2"], choices=sorted(RUNS))
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy rollout-vs-export comparison")
    parser.add_argument("--out", required=True, help="JSON file; each run is also written beside it when done")
    args = parser.parse_args()
    s = SCALES[args.scale]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(tempfile.mkdtemp(prefix="ketch-megatron-vs-fsdp-"))
    model, data = build_workload(root, s, args.steps + 1, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "steps": args.steps, "runs": {}}
    for name in args.runs:
        results["runs"][name] = train(name, s, model, data, args, root, device)
        out.with_name(f"{out.stem}_{name}.json").write_text(json.dumps(results["runs"][name], indent=1))
    first, *others = args.runs
    results["overrides"] = args.set
    results["agreement"] = {f"{o} vs {first}": agreement(results["runs"][first], results["runs"][o]) for o in others}
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
