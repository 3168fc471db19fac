"""A tiny mixture of experts on the built-in arithmetic task, trained with and without routing replay (issue 52).

A tiny Qwen3-MoE (the built-in model's sizes, 8 experts of which 2 per token) is warmed up with the built-in
warm-up's SFT, then trained with the built-in run's GRPO settings for `--steps` steps once per `--replay` mode
(`actor.router_replay`: off, rollout = R3), from the same warmed-up model and seed, with the old log-probs'
pass on (it measures the rollout/training gap). Prints and writes each run's greedy validation accuracy at every
validation, the mean, max and each step's value of `training/rollout_probs_diff_max`, and of
`actor/router_mismatch` where replay measures it. `--set` adds overrides to every GRPO run.
`actor.mismatch_check=warn`: without replay the gap of a run in bf16 may pass the first step's guard's bound.

    PYTHONPATH=. python3 benchmarks/moe_replay_learning.py --device cuda --steps 100 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from ketch.config import load_config
from ketch.config.schema import BUILTIN_MODEL, BUILTIN_RUN_DEFAULTS
from ketch.data import build_char_tokenizer
from ketch.models import tiny_qwen2_config
from ketch.tracking import read_metrics
from ketch.trainer import builtin
from ketch.trainer.ppo import PPOTrainer
from ketch.trainer.sft import SFTTrainer

ACC = "val/ketch/arithmetic/acc"


def tiny_moe(path: Path) -> Path:
    """The built-in model's sizes (4 layers of width 128) as a Qwen3-MoE of 8 experts of width 128, 2 per token."""
    tokenizer = build_char_tokenizer()
    dense = tiny_qwen2_config(tokenizer).to_dict()
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keep += ("max_position_embeddings", "tie_word_embeddings", "pad_token_id", "eos_token_id", "bos_token_id")
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "head_dim": 32}
    config = Qwen3MoeConfig(**{k: dense[k] for k in keep}, **moe, intermediate_size=512)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def warm_up(init: Path, runs: Path, device: str) -> Path:
    """The built-in warm-up's SFT of `init` (stops above its target, keeps the model of the validation before)."""
    warmup = builtin.WARMUPS[BUILTIN_MODEL]
    SFTTrainer(builtin.warmup_config(warmup, init, runs, device)).fit(stop_when=warmup.reached, keep_when=warmup.kept)
    return runs / "warmup" / "model"


def train(model: Path, runs: Path, device: str, replay: str, steps: int, extra: list[str]) -> dict:
    """GRPO from `model` with the built-in run's settings, `actor.router_replay=replay` and the `extra` overrides."""
    run = [f"model.path={model}", f"trainer.default_local_dir={runs}", f"trainer.experiment_name=replay-{replay}"]
    run += [f"trainer.device={device}", "trainer.logger=[jsonl]", f"actor.router_replay={replay}"]
    run += [*BUILTIN_RUN_DEFAULTS, f"trainer.total_steps={steps}", "actor.mismatch_check=warn"]
    run += ["actor.old_log_prob_from_rollout=false", *extra]  # the old log-probs' pass measures the gap
    trainer = PPOTrainer(load_config(overrides=run))
    start = time.perf_counter()
    trainer.fit()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    result = {"wall_s": round(time.perf_counter() - start, 1)}
    result["val_acc"] = {r["step"]: round(r[ACC], 3) for r in records if ACC in r}
    for key in ("training/rollout_probs_diff_max", "actor/router_mismatch"):
        values = [r[key] for r in records if key in r]
        if values:
            result[key] = {"mean": round(statistics.mean(values), 4), "max": round(max(values), 4), "each": values}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--replay", nargs="+", default=["off", "rollout"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", nargs="*", default=[], help="overrides of every GRPO run, e.g. model.dtype=bfloat16")
    args = parser.parse_args()
    runs = Path(tempfile.mkdtemp(prefix="ketch-moe-replay-"))
    start = time.perf_counter()
    model = warm_up(tiny_moe(runs / "init"), runs, args.device)
    result = {"device": args.device, "steps": args.steps, "warmup_wall_s": round(time.perf_counter() - start, 1)}
    for replay in args.replay:
        result[replay] = train(model, runs, args.device, replay, args.steps, args.set)
        print(json.dumps({replay: result[replay]}), flush=True)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
