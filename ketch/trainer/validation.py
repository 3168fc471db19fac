"""Validation by generation: sample (or decode greedily) on the validation prompts and score the answers."""

from __future__ import annotations

import time

from ketch.config.schema import ValSamplingConfig
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.trainer.metrics import validation_metrics


def generate_and_score(
    actor_rollout, dataset, reward: RewardScorer, sampling: ValSamplingConfig, batch_size: int | None
) -> dict[str, float]:
    """`val/<data_source>/acc`, `val/response_length/mean` and `timing_s/testing` over the whole `dataset`
    (`sampling.n` samples per prompt; `batch_size` prompts per generation call, None = all at once)."""
    start = time.perf_counter()
    data = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(len(dataset))]))
    data = data.repeat(sampling.n, interleave=True)
    prompts = data.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
    prompts.meta_info = {"do_sample": sampling.do_sample, "temperature": sampling.temperature}
    parts = prompts.split((batch_size or len(dataset)) * sampling.n)
    data = data.union(DataProto.concat([actor_rollout.generate_sequences(p) for p in parts]))
    scores, _ = reward(data)
    lengths = data.batch["response_mask"].sum(-1).numpy()
    metrics = validation_metrics(data.non_tensor_batch["data_source"], scores.sum(-1).numpy(), lengths)
    metrics["timing_s/testing"] = time.perf_counter() - start
    return metrics
