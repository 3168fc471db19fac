"""The first step's check that the rollout sampled from the model the update trains (`actor.mismatch_check`).

The rollout's log-probs of the sampled tokens are compared with the actor's forward over the same tokens in
training mode (the update's forward, which dropout or router noise left on would change) and in eval mode. A gap
beyond what the dtype's rounding explains stops the run, or is logged with `warn`, with the model family, the gap,
the token where it is largest, and which side differs."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ketch.config.schema import KetchConfig
from ketch.models import resolve_dtype
from ketch.protocol import DataProto

logger = logging.getLogger("ketch")

TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (0.5, 1e-2), torch.float16: (0.5, 1e-2)}
"""(largest, mean) |p_train − p_rollout| over the sampled tokens that rounding explains, per compute dtype. In float32
the rollout and the training forward agree to 1e-5 on every family of the architecture matrix, while OPT's dropout of
0.1 moves a tiny model's probabilities by 4e-3. In bfloat16 a single token's probability moves by up to 0.41 between
kernels (the H200 tool-task run's largest `training/rollout_probs_diff_max` over 100 steps) while the mean stays
below 7e-4: the mean is the sharper test there, dropout moving it by an order of magnitude above 1e-2."""


class RolloutMismatchError(RuntimeError):
    """The rollout's log-probs and the training forward's differ beyond rounding at the first step."""


@dataclass(frozen=True)
class Mismatch:
    """|p_train − p_rollout| over the sampled tokens: largest and mean, and where it is largest (row of the step's
    batch, token of its response) with the three probabilities there."""

    largest: float
    mean: float
    row: int
    token: int
    rollout: float
    train: float
    eval: float


def measure(
    rollout_log_probs: torch.Tensor, train_log_prob: torch.Tensor, eval_log_prob: torch.Tensor, mask: torch.Tensor
) -> Mismatch:
    """The mismatch of the rollout's log-probs with the training-mode forward's, all `[batch, response_len]`, over
    the tokens of `mask` (the sampled ones: `response_mask`)."""
    valid = mask.bool()
    rollout, train, evaluated = rollout_log_probs.exp(), train_log_prob.exp(), eval_log_prob.exp()
    gap = torch.where(valid, (train - rollout).abs(), 0)
    row, token = divmod(int(gap.argmax()), gap.shape[-1])
    mean = gap.sum().item() / max(int(valid.sum()), 1)
    at = (row, token)
    return Mismatch(gap.max().item(), mean, row, token, rollout[at].item(), train[at].item(), evaluated[at].item())


def measure_forwards(batch: DataProto, forwards: DataProto, fp8: bool = False) -> Mismatch:
    """`measure` of a generated `batch` (`rollout_log_probs`, `response_mask`) against the actor's forwards over it
    (`compute_mismatch_log_probs`: `train_log_prob`, `eval_log_prob`). With an FP8 rollout (`fp8`) the rollout
    samples from FP8-rounded weights by design, a gap that truncated importance sampling corrects: the training
    forward is measured against its eval mode instead, which dropout or noise left on still moves."""
    b, f = batch.batch, forwards.batch
    reference = f["eval_log_prob"] if fp8 else b["rollout_log_probs"]
    return measure(reference, f["train_log_prob"], f["eval_log_prob"], b["response_mask"])


def verdict(batch: DataProto, forwards: DataProto, family: str, config: KetchConfig) -> tuple[Mismatch, str | None]:
    """The first step's mismatch of `batch` with the actor's `forwards`, and the message the run stops with (None
    within the rounding of the run's dtype)."""
    fp8, dtype = fp8_setting(config), compute_dtype(config)
    mismatch = measure_forwards(batch, forwards, fp8 is not None)
    if not beyond_rounding(mismatch, dtype):
        return mismatch, None
    return mismatch, describe(mismatch, family, forwards.meta_info["fast_paths"], dtype, fp8)


def fp8_setting(config: KetchConfig) -> str | None:
    """The setting by which the rollout samples from FP8-rounded weights or keys and values, or None."""
    r = config.rollout
    settings = {"rollout.quantization=fp8": r.quantization, "rollout.kv_cache_dtype=fp8": r.kv_cache_dtype}
    return next((key for key, value in settings.items() if value == "fp8"), None)


def beyond_rounding(mismatch: Mismatch, dtype: torch.dtype) -> bool:
    """Whether `mismatch` is more than the rounding of `dtype` explains (`TOLERANCE`)."""
    largest, mean = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    return mismatch.largest > largest or mismatch.mean > mean


def describe(mismatch: Mismatch, family: str, fast_paths: list[str], dtype: torch.dtype, fp8: str | None = None) -> str:
    """One message: the family, the gap against the dtype's tolerance, the token, and which side differs (`fast_paths`:
    ketch's own code paths that computed the two sides, keys of `PLAIN`; with an FP8 rollout, `fp8` its setting,
    the gap is the training forward's against its eval mode: the model itself)."""
    m, (largest, mean) = mismatch, TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    name, side = str(dtype).removeprefix("torch."), MODEL_ITSELF if fp8 else _side(mismatch, fast_paths, largest)
    lead = f"with {fp8} (whose gap actor.rollout_is corrects) the eval mode's" if fp8 else "the rollout's"
    probabilities = ("" if fp8 else f"rollout {m.rollout:.4f}, ") + f"training forward {m.train:.4f}"
    return (
        f"{lead} probabilities of the sampled tokens differ from the training forward's at the first step: "
        f"{family}, largest gap {m.largest:.3g} (mean {m.mean:.3g}; rounding in {name} explains up to {largest:g}, "
        f"mean {mean:g}), at row {m.row}, response token {m.token} ({probabilities}, its eval mode {m.eval:.4f}); "
        f"{side}; actor.mismatch_check=warn logs this and trains on"
    )


def _side(m: Mismatch, fast: list[str], largest: float) -> str:
    """Which side differs: the model itself (its training mode computes otherwise than its eval mode: dropout or noise
    that ketch did not turn off), else the two code paths, of which the fast ones are named with the way to turn them
    off; where both are already plain, the model's own decoding and its padded forward."""
    if abs(m.train - m.eval) > largest:
        return MODEL_ITSELF
    if not fast:
        return (
            "the training forward is deterministic and both sides run plain (a padded forward, transformers' "
            "generate): the model's own decoding with its cache differs from its forward over the whole sequence"
        )
    return (
        f"the training forward is deterministic, so ketch's code paths differ ({', '.join(fast)}): run again with "
        f"{' '.join(PLAIN[path] for path in fast)} to find which one"
    )


MODEL_ITSELF = (
    "the model itself differs: its training-mode forward computes otherwise than its eval mode (dropout or noise that "
    "ketch did not turn off; set it to 0 with model.override_config)"
)

PLAIN = {
    "packed training forwards": "model.use_remove_padding=false",
    "compiled training blocks": "model.use_torch_compile=false",
    "the static decoder": "rollout.hf_decoding=generate",
    "vLLM": "rollout.name=hf",
}
"""Each fast path and the override that turns it off."""


def compute_dtype(config: KetchConfig) -> torch.dtype:
    """The dtype the rollout and the training forwards compute in (`model.dtype`, `auto` resolved for the device)."""
    return resolve_dtype(config.model.dtype, "cuda" if config.uses_gpu(torch.cuda.is_available()) else "cpu")


def family_name(model_config) -> str:
    """The model family as the message names it: `GPTBigCodeForCausalLM (model_type='gpt_bigcode')`."""
    return f"{', '.join(model_config.architectures or []) or 'the model'} (model_type={model_config.model_type!r})"


def check(batch: DataProto, forwards: DataProto, family: str, config: KetchConfig) -> None:
    """Stop (`actor.mismatch_check=error`, `RolloutMismatchError`) or warn (`warn`) when the first step's mismatch
    (`verdict`) is beyond the rounding of the run's dtype."""
    if config.actor.mismatch_check == "off":
        return
    _, message = verdict(batch, forwards, family, config)
    if message is None:
        return
    if config.actor.mismatch_check == "error":
        raise RolloutMismatchError(message)
    logger.warning(message)


def check_two_prompts(config: KetchConfig) -> tuple[Mismatch, str | None]:
    """The first step's check on the first two prompts of `data.train_files`, for `ketch doctor`: the actor and its
    rollout built in this process as a run builds them (`model.path` resolved, a built-in model warmed up first),
    two responses sampled, both forwards of the actor over them. Returns the mismatch and the message that the run
    would stop with (None within the rounding of the run's dtype)."""
    from ketch.config import derive_batch_plan
    from ketch.controller import LocalWorkerGroup
    from ketch.data import RLHFDataset, resolve_data_files
    from ketch.models import load_model_config, load_tokenizer
    from ketch.models.vision import image_processor_for
    from ketch.trainer.builtin import resolve_model_path
    from ketch.trainer.validation import generation_inputs
    from ketch.workers import ActorRolloutRefWorker

    path = resolve_model_path(config)
    tokenizer = load_tokenizer(config.model.tokenizer_path or path, config.model.trust_remote_code, path)
    processor = image_processor_for(load_model_config(path, config.model.trust_remote_code), path, tokenizer)
    dataset = RLHFDataset(resolve_data_files(config.data.train_files), tokenizer, config.data, processor)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(2)]))
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, path, derive_batch_plan(config), 1)
    try:
        group.init_model()
        prompts = generation_inputs(batch)
        prompts.meta_info = {"do_sample": True, "temperature": config.rollout.temperature}
        batch = batch.union(group.generate_sequences(prompts))
        forwards = group.compute_mismatch_log_probs(batch)
        family = family_name(group.worker.hf_config)
    finally:
        group.shutdown()
    return verdict(batch, forwards, family, config)
