"""`RMTrainer`: reward-model training on preference pairs with the Bradley–Terry loss (`ketch rm`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ketch.algorithms import bradley_terry_loss, pairwise_accuracy
from ketch.config import ConfigError, KetchConfig, to_dict
from ketch.data import PreferenceDataset, resolve_data_files
from ketch.data.loader import PromptLoader
from ketch.engine.lora import check_lora
from ketch.models import check_tokenizer_fits, load_model_config, load_tokenizer
from ketch.preflight import preflight
from ketch.protocol import DataProto
from ketch.tracking import Tracker, info
from ketch.trainer.builtin import resolve_model_path
from ketch.trainer.checkpoint import CheckpointManager, due, read_trainer_state
from ketch.trainer.groups import build_reward_model_group
from ketch.trainer.run_dir import owns_run_dir, removed_if_start_fails

ROLE_DIR = "reward_model"
"""The reward model's part of a checkpoint directory."""


class RMTrainer:
    """Trains a reward model that starts from `model.path` (a causal LM gives its backbone and a fresh score
    head; a reward model is trained further) on the pairs of `data.train_files` (columns `data.prompt_key`,
    `data.chosen_key`, `data.rejected_key`): `data.train_batch_size` pairs per optimizer step of
    `reward.model.optim`, for `trainer.total_steps` steps (or `trainer.total_epochs`).

    Every `trainer.test_freq` steps and at the end it reports `val/pairwise_acc`, `val/bt_loss` and
    `val/margin` on `data.val_files`; it checkpoints every `trainer.save_freq` steps and at the end, resumes
    per `trainer.resume_mode`, and writes the reward model as a Hugging Face directory `<run dir>/model`,
    ready for `reward.model.path`."""

    def __init__(self, config: KetchConfig):
        self.config = c = config
        preflight(c, PreferenceDataset.required_columns(c.data))  # what can fail before any model is built
        _check_sizes(c)
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        self.model_path = resolve_model_path(c)
        model_config = load_model_config(self.model_path, c.model.trust_remote_code)
        if c.reward.model.lora.enabled:
            check_lora("reward.model.lora", c.reward.model.lora, model_config, c.model.trust_remote_code)
        tokenizer = load_tokenizer(
            c.model.tokenizer_path or self.model_path, c.model.trust_remote_code, self.model_path
        )
        check_tokenizer_fits(tokenizer, model_config, self.model_path, c.model.tokenizer_path)
        self.train_set = PreferenceDataset(resolve_data_files(c.data.train_files), tokenizer, c.data)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = PreferenceDataset(val_files, tokenizer, c.data) if val_files else None
        self.loader = PromptLoader(self.train_set, c.data.train_batch_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch

    @owns_run_dir
    def fit(self) -> dict[str, float]:
        """Train, validate and checkpoint as described above; returns the last step's metrics. The run directory
        is locked throughout (`owns_run_dir`)."""
        c = self.config
        with removed_if_start_fails(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(c), indent=2))
            tracker = Tracker.for_run(self.run_dir, to_dict(c), self.total_steps, step_lines=False)
            checkpoints = CheckpointManager(
                self.run_dir / "checkpoints", c.trainer.max_checkpoints_to_keep, c.trainer.checkpoint_remote_dir
            )
            groups = build_reward_model_group(c, self.model_path, self.total_steps)
            group = groups.reward_model
            start = self._resume(group, checkpoints, tracker)
        metrics: dict[str, float] = {}
        for step in range(start + 1, self.total_steps + 1):
            metrics = group.rm_step(self.loader.next_batch()).meta_info["metrics"]
            validated = self.val_set is not None and due(c.trainer.test_freq, step, self.total_steps)
            if validated:
                metrics |= self.validate(group)
            tracker.log(metrics, step)
            if step % c.trainer.log_interval == 0 or validated:
                shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if "loss" in k or "acc" in k)
                info(f"RM step {step}/{self.total_steps}: {shown}", tracker.bar)
            if due(c.trainer.save_freq, step, self.total_steps) or step == self.total_steps:
                self._save(group, checkpoints, step)
            if step == start + 1:
                groups.freeze_long_lived()
        group.save_pretrained(str((self.run_dir / "model").resolve()))
        groups.shutdown()
        tracker.close()
        info(
            f"reward model written to {self.run_dir / 'model'}; use it with reward.model.path={self.run_dir / 'model'}"
        )
        return metrics

    def validate(self, group) -> dict[str, float]:
        """Pairwise accuracy, Bradley–Terry loss and mean margin over the validation pairs
        (`data.val_batch_size` pairs per call; None = all at once)."""
        size = self.config.data.val_batch_size or len(self.val_set)
        chosen, rejected = [], []
        for start in range(0, len(self.val_set), size):
            items = [self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))]
            out = group.pairwise_eval(DataProto.from_single_dict(self.val_set.collate(items))).batch
            chosen.append(out["chosen_scores"])
            rejected.append(out["rejected_scores"])
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        return {
            "val/pairwise_acc": pairwise_accuracy(chosen, rejected).item(),
            "val/bt_loss": bradley_terry_loss(chosen, rejected).item(),
            "val/margin": (chosen - rejected).mean().item(),
        }

    def _save(self, group, checkpoints: CheckpointManager, step: int) -> None:
        staging = checkpoints.staging_dir(step)
        try:
            group.save_checkpoint(str(staging / ROLE_DIR))
            state = {"global_step": step, "loader": self.loader.state_dict(), "world_size": group.world_size}
            checkpoints.commit(staging, step, state, to_dict(self.config))
        except BaseException:
            checkpoints.discard(staging)
            raise

    def _resume(self, group, checkpoints: CheckpointManager, tracker: Tracker) -> int:
        """Load the checkpoint `trainer.resume_mode` names, if any; returns the steps already done."""
        checkpoint = checkpoints.to_resume(self.config.trainer.resume_mode)
        if checkpoint is None:
            tracker.truncate_after(-1)
            return 0
        state = read_trainer_state(checkpoint)
        group.load_checkpoint(str(checkpoint.resolve() / ROLE_DIR))
        self.loader.load_state_dict(state["loader"])
        tracker.truncate_after(state["global_step"])
        info(f"resumed from {checkpoint} at step {state['global_step']}")
        return state["global_step"]


def _check_sizes(c: KetchConfig) -> None:
    world = c.world_size(torch.cuda.is_available())
    if c.data.train_batch_size % world:
        raise ConfigError(
            f"data.train_batch_size={c.data.train_batch_size} pairs do not split evenly over {world} ranks; "
            f"make it a multiple of {world}"
        )
    micro = c.reward.model.micro_batch_size_per_device
    if micro is not None and micro % 2:
        raise ConfigError(
            f"reward.model.micro_batch_size_per_device={micro} must be even in ketch rm: a pair is two sequences"
        )
