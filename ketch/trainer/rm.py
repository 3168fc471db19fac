"""`RMTrainer`: reward-model training on preference pairs with the Bradley–Terry loss (`ketch rm`), on the
`TrainingLoop` that PPO runs on: checkpoints, resume, recovery from failed steps, trackers and the run report."""

from __future__ import annotations

from pathlib import Path

import torch

from ketch.algorithms import bradley_terry_loss, pairwise_accuracy
from ketch.config import ConfigError, KetchConfig
from ketch.data import PreferenceDataset, resolve_data_files
from ketch.data.prompt_loader import PromptLoader
from ketch.protocol import DataProto
from ketch.trainer.builtin import resolve_model_path
from ketch.trainer.groups import WorkerGroups, build_reward_model_group
from ketch.trainer.loop import TrainingLoop
from ketch.trainer.startup import check_start

ROLE_DIR = "reward_model"
"""The reward model's part of a checkpoint directory."""


class RMTrainer(TrainingLoop):
    """Trains a reward model that starts from `model.path` (a causal LM gives its backbone and a fresh score
    head; a reward model is trained further) on the pairs of `data.train_files` (columns `data.prompt_key`,
    `data.chosen_key`, `data.rejected_key`): `data.train_batch_size` pairs per optimizer step of
    `reward.model.optim`, for `trainer.total_steps` steps (or `trainer.total_epochs`).

    Every `trainer.test_freq` steps and at the end it reports `val/pairwise_acc`, `val/bt_loss` and
    `val/margin` on `data.val_files`; it checkpoints every `trainer.save_freq` steps and at the end, resumes
    per `trainer.resume_mode`, recovers from `trainer.max_retries` failed steps, and writes the reward model as
    a Hugging Face directory `<run dir>/model`, ready for `reward.model.path`."""

    tracker_step_lines = False

    def __init__(self, config: KetchConfig):
        """Run the start-up checks, resolve the model and load the pairs; no worker starts before `fit` (from
        `TrainingLoop`).

        Args:
            config: The run's config (`load_config(..., command="rm")`).

        Raises:
            StartupError: If a start-up check fails (directories, vLLM, the attention kernel, the data); the
                checks' other errors (`ConfigError`, `DatasetError`, `ModelLoadError`) propagate as they are.
        """
        self.config = c = config
        columns = PreferenceDataset.required_columns(c.data)
        model = check_start(c, columns, resolve_model_path, trains="reward_model", settings=self._check_sizes)
        self.model_path = model.path
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        self.train_set = PreferenceDataset(resolve_data_files(c.data.train_files), model.tokenizer, c.data)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = PreferenceDataset(val_files, model.tokenizer, c.data) if val_files else None
        self.loader = PromptLoader(self.train_set, c.data.train_batch_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch
        self.step_size = f"{c.data.train_batch_size} pairs"

    def _check_sizes(self) -> None:
        """A step's pairs split evenly over the ranks, and a micro-batch holds whole pairs."""
        c = self.config
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

    def _build_groups(self) -> WorkerGroups:
        return build_reward_model_group(self.config, self.model_path, self.total_steps)

    def _trained_roles(self) -> dict:
        return {ROLE_DIR: self.groups.reward_model}

    def _train_step(self, batch: DataProto, step: int) -> dict[str, float]:
        """One Bradley–Terry optimizer step on `batch` (`PreferenceDataset.collate` pairs): `rm/bt_loss`,
        `rm/pairwise_acc`, `rm/margin`, `rm/grad_norm`, `rm/lr`."""
        return self.groups.reward_model.rm_step(batch).meta_info["metrics"]

    def _validate(self, step: int) -> dict[str, float]:
        """Pairwise accuracy, Bradley–Terry loss and mean margin over the validation pairs
        (`data.val_batch_size` pairs per call; None = all at once)."""
        size = self.config.data.val_batch_size or len(self.val_set)
        chosen, rejected = [], []  # [pairs] each
        for start in range(0, len(self.val_set), size):
            items = [self.val_set[i] for i in range(start, min(start + size, len(self.val_set)))]
            out = self.groups.reward_model.pairwise_eval(DataProto.from_single_dict(self.val_set.collate(items)))
            chosen.append(out.batch["chosen_scores"])
            rejected.append(out.batch["rejected_scores"])
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        return {
            "val/pairwise_acc": pairwise_accuracy(chosen, rejected).item(),
            "val/bt_loss": bradley_terry_loss(chosen, rejected).item(),
            "val/margin": (chosen - rejected).mean().item(),
        }

    def _write_model(self, model_dir: Path) -> None:
        self.groups.reward_model.save_pretrained(str(model_dir))

    def _model_line(self, model_dir: Path) -> str:
        return f"reward model: {model_dir} (use it with reward.model.path={model_dir})"

    def _console_line(self, step: int, metrics: dict[str, float]) -> str:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if "loss" in k or "acc" in k)
        return f"RM step {step}/{self.total_steps}: {shown}"
