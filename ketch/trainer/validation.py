"""Validation by generation: sample (or decode greedily) on the validation prompts and score the answers."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ketch.config.schema import ValSamplingConfig
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.rewards.scorer import decode_rows
from ketch.rollout.multi_turn.metrics import trajectory_metrics
from ketch.trainer.metrics import validation_metrics


class ValidationResult(dict):
    """The metrics of one validation, a `dict[str, float]` to every caller, with the generated responses on the
    side: `samples` holds one row per response (`prompt_id`, `sample`, `data_source`, `prompt`, `response`,
    `ground_truth`, `score`, `acc` when the scorer returned one, and `pred` when the scorer extracted an answer),
    prompts in dataset order."""

    samples: list[dict[str, Any]]


def generate_and_score(
    actor_rollout, dataset, reward: RewardScorer, sampling: ValSamplingConfig, batch_size: int | None
) -> ValidationResult:
    """`val/<data_source>/acc`, with `sampling.n` > 1 also `pass@k` and `maj@n` (see `validation_metrics`),
    `val/response_length/mean`, with `reward.on_error=zero` `val/reward/num_errors` (the samples whose scorer
    failed, scored 0) and `timing_s/testing` over the whole `dataset` (`sampling.n` samples per prompt;
    `batch_size` prompts per generation call, None = all at once)."""
    start = time.perf_counter()
    data = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(len(dataset))]))
    data = data.repeat(sampling.n, interleave=True)
    prompts = generation_inputs(data)
    prompts.meta_info = {"do_sample": sampling.do_sample, "temperature": sampling.temperature}
    parts = prompts.split((batch_size or len(dataset)) * sampling.n)
    data = data.union(DataProto.concat([actor_rollout.generate_sequences(p) for p in parts]))
    _, info = reward(data)
    answers = extracted_answers(info)
    lengths = data.batch["response_mask"].sum(-1).numpy()
    sources = data.non_tensor_batch["data_source"]
    result = ValidationResult(validation_metrics(sources, accuracies(info), lengths, answers, sampling.n))
    if reward.on_error == "zero":  # with "raise" a scorer's error stops the run
        result["val/reward/num_errors"] = float(info["num_errors"])
    result.samples = _sample_rows(data, info, _prompt_texts(prompts[:: sampling.n], reward.tokenizer), sampling.n)
    result |= trajectory_metrics(data.non_tensor_batch, lengths, "val/multi_turn")
    result["timing_s/testing"] = time.perf_counter() - start
    return result


def generation_inputs(batch: DataProto) -> DataProto:
    """What `generate_sequences` reads, taken out of `batch`: the prompt tensors and a vision-language model's
    `multi_modal_inputs` (popped: the rollout returns the rows' images, a multi-turn rollout's with its environment's
    after the prompt's) and the rows' other non-tensor columns (copied; a multi-turn rollout reads `raw_prompt` and
    what its environment needs)."""
    images = [k for k in ("multi_modal_inputs",) if k in batch.non_tensor_batch]
    prompts = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_keys=images)
    return prompts.union(batch.select(batch_keys=[], meta_keys=[]))


def accuracies(info: dict[str, Any]) -> np.ndarray:
    """`[batch]` correctness of each response: the scorer's `acc` field where it returns one (a scorer that gives
    partial credit as its score, e.g. `ketch/arithmetic` with `digit_credit`), else the score."""
    acc = info["extra"].get("acc")
    if acc is None or acc.dtype == object:
        return info["scores"]
    return np.where(np.isnan(acc), info["scores"], acc)


def extracted_answers(info: dict[str, Any]) -> list[Any]:
    """The answer of each response that maj@k votes on: the scorer's `pred` field (None = no answer, abstains);
    where a scorer gives no `pred`, the stripped response text."""
    texts = info["response_texts"]
    preds = info["extra"].get("pred")
    if preds is None:
        return [text.strip() for text in texts]
    return [text.strip() if _missing(pred) else pred for pred, text in zip(preds, texts, strict=True)]


def _missing(pred: Any) -> bool:
    """`RewardScorer` fills a field that a scorer left out with NaN."""
    return isinstance(pred, float) and math.isnan(pred)


def _prompt_texts(prompts: DataProto, tokenizer) -> list[str]:
    """The prompts as the model saw them (special tokens dropped), padding removed."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    rows = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
    return decode_rows(tokenizer, rows)


def _sample_rows(data: DataProto, info: dict[str, Any], prompts: list[str], n: int) -> list[dict[str, Any]]:
    """One JSON-ready row per response (see `ValidationResult`)."""
    preds, acc = info["extra"].get("pred"), info["extra"].get("acc")
    rows = []
    for i, response in enumerate(info["response_texts"]):
        row = {
            "prompt_id": i // n,
            "sample": i % n,
            "data_source": str(data.non_tensor_batch["data_source"][i]),
            "prompt": prompts[i // n],
            "response": response,
            "ground_truth": _jsonable(data.non_tensor_batch["ground_truth"][i]),
            "score": float(info["scores"][i]),
        }
        if acc is not None and not _missing(acc[i]):
            row["acc"] = _jsonable(acc[i])
        if preds is not None and not _missing(preds[i]):
            row["pred"] = _jsonable(preds[i])
        rows.append(row)
    return rows


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: numpy scalars as Python numbers, anything else unusual as its text."""
    if isinstance(value, np.generic):
        value = value.item()
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)
