"""Write GSM8K as Parquet in the row layout ketch reads (needs network and `pip install datasets`).

    python examples/gsm8k/prepare.py --out data/gsm8k

Each row: data_source="openai/gsm8k", prompt=[{"role": "user", "content": question + instruction}],
ability="math", reward_model={"style": "rule", "ground_truth": "<final number>"}, extra_info={split, index}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def to_row(example: dict, split: str, index: int) -> dict:
    answer = example["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def main() -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="data/gsm8k")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    source = datasets.load_dataset("openai/gsm8k", "main")
    for split in ("train", "test"):
        rows = [to_row(example, split, i) for i, example in enumerate(source[split])]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
