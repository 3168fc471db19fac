"""`PPOTrainer`: the driver's loop. `fit` reads as the list of stages; each stage is one short method.

The driver never touches a model: every model call goes through a worker group; advantages are
computed here because they are cheap and need all samples of a prompt.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ketch.algorithms import (
    RewardMixer,
    apply_kl_penalty,
    build_kl_controller,
    filter_overlong,
    get_adv_estimator,
    last_valid_index,
    overlong_penalty,
    robust_compute_advantage,
    rollout_mismatch_metrics,
)
from ketch.config import ConfigError, KetchConfig, derive_batch_plan
from ketch.config.batch import recompute_old_log_prob
from ketch.data import RLHFDataset, resolve_data_files
from ketch.data.batching import pad_token_id
from ketch.data.prompt_loader import PromptLoader
from ketch.engine.lora import check_lora
from ketch.models import check_value_head, load_model_config
from ketch.models.vision import image_processor_for, is_vision_model
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.rollout.multi_turn.metrics import ToolFailureWatch
from ketch.trainer.balance import balance_tokens
from ketch.trainer.builtin import local_or_hub, resolve_model_path
from ketch.trainer.dynamic_sampling import EXTRA_PREFIX, fill_with_informative_groups
from ketch.trainer.groups import WorkerGroups, build_worker_groups
from ketch.trainer.loop import TrainingLoop
from ketch.trainer.metrics import data_metrics, throughput_metrics, truncated_fraction
from ketch.trainer.mismatch_guard import check, family_name
from ketch.trainer.partial import PARTIAL_FILE, PartialRollouts
from ketch.trainer.standalone_rollout import StandaloneRollout
from ketch.trainer.startup import check_start
from ketch.trainer.validation import generate_and_score, generation_inputs

logger = logging.getLogger("ketch")


class PPOTrainer(TrainingLoop):
    """PPO (actor + critic + GAE) or a critic-free estimator (GRPO, RLOO, REINFORCE++, ReMax), per config: what
    `ketch train` runs. `fit` (from `TrainingLoop`) trains, validates, checkpoints and writes the model."""

    def __init__(self, config: KetchConfig):
        """Run the start-up checks, resolve the model (a built-in one is warmed up here) and load the data; no
        worker starts before `fit`.

        Args:
            config: The run's config (`load_config`).

        Raises:
            StartupError: If a start-up check fails (directories, vLLM, the attention kernel, the data); the
                checks' other errors (`ConfigError`, `DatasetError`, `ModelLoadError`) propagate as they are.
        """
        self.config = c = config
        columns = RLHFDataset.required_columns(c.data)
        model = check_start(c, columns, resolve_model_path, scored=True, settings=self._check_settings)
        self.model_path, self.tokenizer = model.path, model.tokenizer
        self.family, self.mismatch_checked = family_name(model.config), False
        self._check_critic(model.config)
        self.reward.tokenizer = self.tokenizer
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        self.step_size = f"{self.plan.sequences_per_step} samples"
        processor = image_processor_for(model.config, model.path, self.tokenizer)
        self.train_set = RLHFDataset(resolve_data_files(c.data.train_files), self.tokenizer, c.data, processor)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = RLHFDataset(val_files, self.tokenizer, c.data, processor) if val_files else None
        round_size = c.algorithm.filter_groups.round_size(c.data.train_batch_size)
        self.loader = PromptLoader(self.train_set, round_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch
        self.kl_ctrl = build_kl_controller(**vars(c.algorithm.kl_ctrl)) if c.algorithm.use_kl_in_reward else None
        self.warned_truncation = False
        self.tool_failures = ToolFailureWatch()
        self.standalone: StandaloneRollout | None = None
        partial = c.rollout.partial.enable
        self.partial = PartialRollouts(c, pad_token_id(self.tokenizer)) if partial else None

    def _check_settings(self) -> None:
        """PPO's own start-up checks of the config, before the model is resolved (`check_start`): the reward
        function and the estimator exist, the batch sizes divide, the reward model's path holds a model (and
        takes no LoRA: it is frozen)."""
        c = self.config
        if c.reward.model.lora.enabled:
            raise ConfigError(
                "reward.model.lora trains a reward model's adapters in `ketch rm`; PPO's reward model is frozen: give "
                "reward.model.path the merged model/ that `ketch rm` wrote"
            )
        self.reward = RewardScorer(None, c.reward.function, c.reward.on_error, c.reward.scorer_kwargs)
        get_adv_estimator(c.algorithm.adv_estimator)
        self.mixer = RewardMixer(c.reward.source_weights, c.reward.clip, c.reward.normalize)
        self.plan = derive_batch_plan(c, world_size=c.world_size(torch.cuda.is_available()))
        self.reward_model_path = local_or_hub(c.reward.model.path) if c.reward.model.path else None
        if self.reward_model_path is not None:
            load_model_config(self.reward_model_path, c.model.trust_remote_code)

    def _check_critic(self, model_config) -> None:
        """A critic needs a value head and LoRA settings that apply to it: else the run stops here
        (`check_value_head`, `check_lora`), before any worker."""
        c = self.config
        if c.use_critic:
            key = "critic.model_path" if c.critic.model_path else "model.path"
            path = c.critic.model_path or self.model_path
            critic_config = load_model_config(path, c.model.trust_remote_code)
            check_value_head(critic_config, f"{key}={path}")
            if is_vision_model(critic_config) != is_vision_model(model_config):
                raise ConfigError(
                    f"{key}={path} is {'a vision-language' if is_vision_model(critic_config) else 'a text-only'} "
                    f"model and the policy (model.path={self.model_path}) is not: the critic reads the policy's "
                    "batches, images included where there are any; give the critic a model of the policy's kind"
                )
        if c.use_critic and c.critic.lora.enabled:
            critic_path = c.critic.model_path and local_or_hub(c.critic.model_path)
            critic_config = load_model_config(critic_path, c.model.trust_remote_code) if critic_path else model_config
            check_lora("critic.lora", c.critic.lora, critic_config, c.model.trust_remote_code)

    def _build_groups(self) -> WorkerGroups:
        p, steps = self.plan, self.total_steps
        critic_updates = steps * p.critic.num_mini_batches * p.critic.epochs if p.critic else None
        actor_updates = steps * p.actor.num_mini_batches * p.actor.epochs
        groups = build_worker_groups(
            self.config, self.model_path, p, actor_updates, critic_updates, self.reward_model_path
        )
        self.actor_rollout, self.critic, self.reward_model = groups.actor_rollout, groups.critic, groups.reward_model
        self.generator = groups.rollout or groups.actor_rollout
        if self.standalone is not None:  # the last groups' (a recovery builds new ones)
            self.standalone.close()
        check = self.config.rollout.check_weight_sync
        self.standalone = StandaloneRollout(groups.actor_rollout, groups.rollout, check) if groups.rollout else None
        return groups

    def _warm_up(self) -> None:
        """The generating group gets ready for the next step's batch (`Rollout.warm_up`): on GPUs the decode step
        of its shape is loaded and captured at start-up, not inside the first step; ReMax's greedy decode too."""
        prompts = generation_inputs(self._expand(self.loader.peek()))
        self.generator.warm_up_rollout(prompts)
        if self.config.algorithm.adv_estimator == "remax":
            prompts.meta_info["do_sample"] = False
            self.generator.warm_up_rollout(prompts)

    def _train_step(self, batch: DataProto, step: int) -> dict[str, float]:
        timings: dict[str, float] = {}
        step_start = time.perf_counter()
        batch, metrics = self._generated(batch, step, timings)
        if self.config.old_log_prob_from_rollout:
            batch.batch["old_log_prob"] = batch.batch["rollout_log_probs"]
        elif recompute_old_log_prob(self.config, self.plan):
            with _timed(timings, "old_log_prob"):
                batch = batch.union(self.actor_rollout.compute_log_prob(batch))
            metrics |= self._rollout_mismatch(batch)
        if not self.mismatch_checked:  # the first step this trainer runs (a resumed run's too)
            self._check_mismatch(batch)
        if self.config.use_reference:
            with _timed(timings, "ref"):
                batch = batch.union(self.actor_rollout.compute_ref_log_prob(batch))
        if self.config.use_critic:
            with _timed(timings, "values"):
                batch = batch.union(self.critic.compute_values(batch))
        with _timed(timings, "adv"):
            batch, kl_metrics = self._advantages(batch)
        if self.config.use_critic:
            with _timed(timings, "update_critic"):
                metrics |= self.critic.update_critic(batch).meta_info["metrics"]
        with _timed(timings, "update_actor"):
            metrics |= self.actor_rollout.update_actor(self._for_update(batch)).meta_info["metrics"]
        if self.standalone is not None:
            timings |= self.standalone.send_weights()
        timings["step"] = time.perf_counter() - step_start
        metrics |= kl_metrics | data_metrics(batch, self.config.data.max_response_length)
        self.tool_failures(batch.non_tensor_batch, step)
        metrics |= {f"timing_s/{k}": v for k, v in timings.items()}
        metrics |= throughput_metrics(batch, timings["step"], self._devices())
        metrics["training/epoch"] = batch.meta_info["epoch"]
        return metrics

    # ----------------------------------------------------------------- stages
    def _generated(self, prompts: DataProto, step: int, timings: dict[str, float]) -> tuple[DataProto, dict]:
        """This step's responses, scored. With `rollout.staleness=1` they were generated while the last step trained
        (or are generated now, at the first step), and the next step's generation starts before this one trains."""
        if not self.config.rollout.staleness:
            return self._rollout(prompts, step, timings)
        batch, metrics, produced = self.standalone.take(step, self._rollout_timed, prompts, step)
        if step < self.total_steps:
            self.standalone.start(step + 1, self._rollout_timed, self.loader.peek(), step + 1)
        timings |= produced
        return batch, metrics

    def _rollout_timed(self, prompts: DataProto, step: int) -> tuple[DataProto, dict[str, float], dict[str, float]]:
        """`_rollout` with its own timings, for a generation that runs while the driver does other work."""
        timings: dict[str, float] = {}
        return *self._rollout(prompts, step, timings), timings

    def _rollout(self, prompts: DataProto, step: int, timings: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        """Generate and score; with `algorithm.filter_groups`, rounds of prompts until the batch is informative;
        with `rollout.partial`, the groups that finish first, trajectories carried over between steps."""
        c = self.config
        if self.partial is not None:
            return self._partial_rollout(prompts, step, timings)

        def generate_and_score(prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
            batch = self._expand(prompts)
            with _timed(timings, "gen"):
                batch = self._generate(batch, step)
            with _timed(timings, "reward"):
                return self._score(batch)

        if not c.algorithm.filter_groups.enable:
            return generate_and_score(prompts)
        return fill_with_informative_groups(
            prompts,
            generate_and_score,
            self.loader.next_batch,
            c.algorithm.filter_groups,
            c.data.train_batch_size,
            c.rollout.n,
            pad_token_id(self.tokenizer),
        )

    def _partial_rollout(
        self, prompts: DataProto, step: int, timings: dict[str, float]
    ) -> tuple[DataProto, dict[str, float]]:
        """`data.train_batch_size` finished groups of the trajectories in flight, `prompts`' among them
        (`PartialRollouts`), scored."""

        def generate(rows: DataProto) -> DataProto:
            with _timed(timings, "gen"):
                return self.generator.generate_sequences(rows)

        more = lambda: self._expand(self.loader.next_batch())  # noqa: E731
        batch, metrics = self.partial.next_batch(self._expand(prompts), step, generate, more)
        self._warn_if_all_truncated(batch, step)
        with _timed(timings, "reward"):
            batch, reward_metrics = self._score(batch)
        return batch, metrics | reward_metrics

    def _expand(self, batch: DataProto) -> DataProto:
        """Give each prompt a group id (`uid`) and repeat it `rollout.n` times, samples of a prompt adjacent."""
        batch.non_tensor_batch["uid"] = np.array([uuid.uuid4().hex for _ in range(len(batch))], dtype=object)
        return batch.repeat(self.config.rollout.n, interleave=True)

    def _generate(self, batch: DataProto, step: int) -> DataProto:
        """Sample responses; for ReMax also the greedy response of each prompt, whose score is the baseline."""
        prompts = generation_inputs(batch)
        batch = batch.union(self.generator.generate_sequences(prompts))
        if self.config.algorithm.adv_estimator == "remax":
            prompts.meta_info["do_sample"] = False
            columns = [k for k in batch.non_tensor_batch if k != "multi_modal_inputs"]  # the greedy rows' own
            greedy = batch.select(batch_keys=[], non_tensor_keys=columns).union(
                self.generator.generate_sequences(prompts)
            )
            scores, _, _ = self._scores(greedy, update_stats=False)
            batch.batch["reward_baselines"] = scores.sum(-1)
        self._warn_if_all_truncated(batch, step)
        return batch

    def _score(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """`token_level_scores`; the numeric fields of the reward function's dicts as `reward_extra/<field>`."""
        batch.batch["token_level_scores"], metrics, extra = self._scores(batch)
        batch.non_tensor_batch |= {EXTRA_PREFIX + k: v for k, v in extra.items() if v.dtype != object}
        return batch, metrics

    def _scores(self, batch: DataProto, update_stats: bool = True) -> tuple[torch.Tensor, dict[str, float], dict]:
        """`token_level_scores` `[batch, response_len]`: rule-based scores (when weighted) and reward-model scores
        (when there is a reward model; also kept in the batch as `rm_scores`) mixed per `reward.weights`, plus
        DAPO's overlong penalty (`reward.overlong_buffer`); metrics; the reward function's extra fields."""
        rule, metrics, extra = None, {}, {}
        if self.mixer.weights["rule"]:
            rule, details = self.reward(batch)
            metrics["reward/num_errors"] = float(details["num_errors"])
            extra = details["extra"]
            metrics |= {f"reward/{k}/mean": float(np.nanmean(v)) for k, v in extra.items() if v.dtype != object}
        if self.reward_model is not None:
            keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask"]
            inputs = batch.select(keys, [k for k in ("raw_prompt",) if k in batch.non_tensor_batch], [])
            batch.batch["rm_scores"] = self.reward_model.compute_rm_score(inputs).batch["rm_scores"]
        mask = batch.batch["response_mask"]
        scores, mixed = self.mixer(mask, rule, batch.batch.get("rm_scores"), update_stats)
        if self.config.reward.overlong_buffer.enable:
            metrics |= self._penalise_overlong(scores, mask)
        return scores, metrics | mixed, extra

    def _penalise_overlong(self, scores: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
        """Add DAPO's overlong penalty to `scores` `[batch, response_len]` at each last response token."""
        o = self.config.reward.overlong_buffer
        penalty = overlong_penalty(response_mask.sum(-1), self.config.data.max_response_length, o.len, o.penalty_factor)
        scores[torch.arange(len(penalty)), last_valid_index(response_mask)] += penalty.to(scores.dtype)
        return {
            "reward/overlong_penalty/mean": penalty.mean().item(),
            "reward/overlong_fraction": (penalty < 0).float().mean().item(),
        }

    def _rollout_mismatch(self, batch: DataProto) -> dict[str, float]:
        """How far the rollout engine's log-probs are from the training engine's (`training/rollout_*`; per kind of
        turn too, in multi-turn batches)."""
        b = batch.batch
        if "rollout_log_probs" not in b:
            return {}
        real = b["attention_mask"][:, -b["response_mask"].shape[-1] :]
        return rollout_mismatch_metrics(b["old_log_prob"], b["rollout_log_probs"], b["response_mask"], real)

    def _check_mismatch(self, batch: DataProto) -> None:
        """At the first step: the rollout's log-probs against the actor's forward in training and eval mode
        (`actor.mismatch_check`, `trainer/mismatch_guard.py`)."""
        self.mismatch_checked = True
        if self.config.actor.mismatch_check == "off" or "rollout_log_probs" not in batch.batch:
            return
        if self.partial is not None:  # carried trajectories hold older weights' tokens: only those begun now count
            batch = batch[batch.batch["first_step"] == self.step + 1]
            if len(batch) == 0:  # every one carried (a resumed run's first step): the next step's are checked
                self.mismatch_checked = False
                return
        forwards = self.actor_rollout.compute_mismatch_log_probs(batch)
        check(batch, forwards, self.family, self.config)

    def _advantages(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        a = self.config.algorithm
        metrics: dict[str, float] = {}
        if self.kl_ctrl is not None:
            batch, metrics = apply_kl_penalty(batch, self.kl_ctrl, a.kl_penalty)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        batch = robust_compute_advantage(
            batch,
            gamma=a.gamma,
            lam=a.lam,
            clip_advantage=a.clip_advantage,
            normalize_advantage=a.normalize_advantage,
            estimator=a.adv_estimator,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
            non_finite=a.non_finite,
        )
        metrics["algorithm/non_finite_zeroed"] = float(batch.meta_info.pop("non_finite_zeroed", 0))
        return batch, metrics

    def _for_update(self, batch: DataProto) -> DataProto:
        """Only what the actor update reads travels to the workers, rows spread so that every data-parallel rank
        gets about the same number of real tokens; with `algorithm.overlong_filtering` the cut-off responses' tokens
        are out of its `response_mask`."""
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"]
        a = self.config.actor
        optional = ["old_log_prob"] + (["ref_log_prob"] if a.use_kl_loss else [])
        optional += ["routed_experts", "old_routed_experts"]  # actor.router_replay's (ketch.models.router_replay)
        # the rollout log-probs serve truncated IS, and the mismatch metrics when the update's forward is π_old
        optional += ["rollout_log_probs"] if a.rollout_is is not None or "old_log_prob" not in batch.batch else []
        keys += [k for k in optional if k in batch.batch]
        images = [k for k in ("multi_modal_inputs",) if k in batch.non_tensor_batch]  # a vision-language model's
        update = batch.select(batch_keys=keys, non_tensor_keys=images, meta_keys=[])
        if self.config.algorithm.overlong_filtering:
            b = update.batch
            b["response_mask"] = filter_overlong(
                b["response_mask"], b["attention_mask"], self.config.data.max_response_length
            )
        return balance_tokens(update, self.plan.world_size)

    def _validate(self, step: int) -> dict[str, float]:
        """Generate on the validation set (greedy unless rollout.val.do_sample) and score it."""
        c = self.config
        return generate_and_score(self.generator, self.val_set, self.reward, c.rollout.val, c.data.val_batch_size)

    def _resume(self, checkpoint: Path | None) -> None:
        """Restore the run from `checkpoint` (see `TrainingLoop`); a standalone rollout then gets the weights."""
        super()._resume(checkpoint)
        if checkpoint is None and self.partial is not None:
            self.partial.load(None)
        if checkpoint is not None and self.standalone is not None:
            self.standalone.send_weights()

    def _trained_roles(self) -> dict:
        return {"actor": self.groups.actor_rollout} | ({"critic": self.groups.critic} if self.config.use_critic else {})

    def _extra_state(self, directory: Path) -> dict:
        if self.partial is not None:
            self.partial.save(directory / PARTIAL_FILE, self.step)
        kl_ctrl = self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None
        return {"kl_ctrl": kl_ctrl, "reward_mixer": self.mixer.state_dict()}

    def _load_extra_state(self, state: dict, checkpoint: Path) -> None:
        if self.kl_ctrl is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.mixer.load_state_dict(state.get("reward_mixer") or {})
        if self.partial is not None:
            self.partial.load(checkpoint / PARTIAL_FILE)
        elif (checkpoint / PARTIAL_FILE).is_file():
            logger.warning(
                "%s holds the trajectories of partial rollouts in flight, which this run (rollout.partial.enable="
                "false) does not continue: their prompts are skipped; set rollout.partial.enable=true to continue "
                "them",
                checkpoint,
            )

    # ----------------------------------------------------------------- helpers
    def _devices(self) -> int:
        """The actor's processes, and a standalone rollout's: what per-device throughput divides by."""
        gpu, c = torch.cuda.is_available(), self.config
        return c.num_processes(gpu) + (c.rollout_processes(gpu) if self.standalone is not None else 0)

    def _warn_if_all_truncated(self, batch: DataProto, step: int) -> None:
        if self.warned_truncation or self.config.rollout.ignore_eos:
            return
        if truncated_fraction(batch, self.config.data.max_response_length) == 1.0:
            self.warned_truncation = True
            logger.warning(
                "every response of step %d reached data.max_response_length=%d without a stop token, so rewards "
                "see cut-off answers; raise data.max_response_length, or check the stop tokens (the tokenizer's "
                "EOS, the EOS ids of the model's generation_config.json and rollout.stop_token_ids)",
                step,
                self.config.data.max_response_length,
            )


@contextmanager
def _timed(timings: dict[str, float], stage: str):
    start = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start
