"""Write MATH as Parquet in the row layout ketch reads (needs network and `pip install datasets`).

    python examples/math/prepare.py --out data/math

train.parquet: the 7,500 training problems of MATH (DigitalLearningGmbH/MATH-lighteval), the ground truth the
boxed answer of each reference solution; test.parquet: MATH-500 (HuggingFaceH4/MATH-500), 500 of MATH's test
problems, with their answers. Each row: data_source (the dataset's name, which ketch's `\\boxed{}` scorer is
registered under), prompt=[{"role": "user", "content": problem + instruction}], ability="math",
reward_model={"style": "rule", "ground_truth": answer}, extra_info={split, index, level}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ketch.rewards.math import last_boxed

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SOURCES = {"train": ("DigitalLearningGmbH/MATH-lighteval", "train"), "test": ("HuggingFaceH4/MATH-500", "test")}


def to_row(example: dict, data_source: str, split: str, index: int) -> dict | None:
    """One problem as a ketch row; the answer is the example's `answer`, else its solution's last boxed answer
    (None, the row left out, where there is neither)."""
    answer = example.get("answer") or last_boxed(example["solution"])
    if answer is None:
        return None
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{example['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "level": str(example.get("level", ""))},
    }


def main() -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="data/math")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (data_source, split) in SOURCES.items():
        source = datasets.load_dataset(data_source, split=split)
        rows = [to_row(example, data_source, name, i) for i, example in enumerate(source)]
        kept = [row for row in rows if row is not None]
        pq.write_table(pa.Table.from_pylist(kept), out / f"{name}.parquet")
        left_out = len(rows) - len(kept)
        print(f"wrote {len(kept)} rows to {out / f'{name}.parquet'} ({left_out} without an answer left out)")


if __name__ == "__main__":
    main()
