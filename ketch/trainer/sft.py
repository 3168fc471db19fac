"""`SFTTrainer`: supervised fine-tuning on prompt/response pairs with the actor's engine (`ketch sft`), on the
`TrainingLoop` that PPO runs on: checkpoints, resume, recovery from failed steps, trackers and the run report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ketch.config import KetchConfig, derive_batch_plan
from ketch.data import RLHFDataset, SFTDataset, resolve_data_files
from ketch.data.prompt_loader import PromptLoader
from ketch.models import local_or_hub
from ketch.models.vision import image_processor_for
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.rollout.multi_turn import tool_schemas, turn_stop_strings
from ketch.trainer.groups import WorkerGroups, build_worker_groups
from ketch.trainer.loop import TrainingLoop
from ketch.trainer.startup import check_start
from ketch.trainer.validation import generate_and_score

Metrics = dict[str, float]


class SFTTrainer(TrainingLoop):
    """Trains `model.path` on `data.train_files` (columns `data.prompt_key`, `data.response_key`) and writes
    the result as a Hugging Face directory `<run dir>/model`, `data.train_batch_size` rows per step.

    Validation every `trainer.test_freq` steps reports `val/loss` and, when the validation rows carry a
    ground truth (`answer` or `reward_model.ground_truth`), the greedy accuracy `val/<data_source>/acc`. It
    checkpoints every `trainer.save_freq` steps and at the end, resumes per `trainer.resume_mode` and recovers
    from `trainer.max_retries` failed steps, as `ketch train` does.

    `model_path` is `model.path` resolved, or a function that resolves it, called after the start-up checks: a
    built-in model is resolved (warmed up with this trainer) by `ketch.trainer.builtin.resolve_model_path`, which
    `ketch sft` passes, so it must be given for `model.path=builtin:tiny-arithmetic`."""

    tracker_step_lines = False

    def __init__(self, config: KetchConfig, model_path: str | Callable[[KetchConfig], str] | None = None):
        """Run the start-up checks, resolve the model and load the data; no worker starts before `fit`.

        Args:
            config: The run's config (`load_config(..., command="sft")`).
            model_path: The model's directory or hub id, or a function of the config that resolves it (None:
                `model.path` as it is, which must not be a built-in model).

        Raises:
            ValueError: If `model.path` is a built-in model and `model_path` is not given.
            StartupError: If a start-up check fails; the checks' other errors propagate as they are.
        """
        # SFT generates only to validate, in the actor's processes: a standalone rollout is an RL placement
        self.config = c = replace(config, rollout=replace(config.rollout, placement="hybrid", staleness=0))
        if model_path is None and c.model.path.startswith("builtin:"):
            raise ValueError(
                f"SFTTrainer: model.path={c.model.path} must be resolved first; pass "
                "model_path=ketch.trainer.builtin.resolve_model_path (as `ketch sft` does)"
            )
        resolve = model_path if callable(model_path) else lambda c: model_path or local_or_hub(c.model.path)
        model = check_start(c, SFTDataset.required_columns(c.data), resolve, settings=self._check_settings)
        self.model_path, self.tokenizer = model.path, model.tokenizer
        self.reward.tokenizer = model.tokenizer
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        self._load_data(c, image_processor_for(model.config, model.path, model.tokenizer))
        self.loader = PromptLoader(self.train_set, c.data.train_batch_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch
        self.step_size = f"{c.data.train_batch_size} rows"
        self.stop_when: Callable[[Metrics], bool] | None = None
        self.keep_when: Callable[[Metrics], bool] | None = None
        self.kept: int | None = None

    def _check_settings(self) -> None:
        """The reward function that scores validation exists (before the model is resolved, `check_start`)."""
        c = self.config
        self.reward = RewardScorer(None, c.reward.function, c.reward.on_error, c.reward.scorer_kwargs)

    def _load_data(self, c: KetchConfig, processor: Any | None) -> None:
        """The training and validation rows (tokenized as the rollout renders a conversation; with a vision-language
        model's `processor`, with their images), and the validation prompts to generate on when they carry a ground
        truth."""
        demo = {"turn_stop": turn_stop_strings(c, self.tokenizer), "tools": tool_schemas(c), "processor": processor}
        self.train_set = SFTDataset(resolve_data_files(c.data.train_files), self.tokenizer, c.data, **demo)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = SFTDataset(val_files, self.tokenizer, c.data, **demo) if val_files else None
        self.val_prompts = RLHFDataset(val_files, self.tokenizer, c.data, processor) if val_files else None
        if self.val_prompts is not None and self.val_prompts[0]["ground_truth"] is None:
            self.val_prompts = None

    def fit(
        self, stop_when: Callable[[Metrics], bool] | None = None, keep_when: Callable[[Metrics], bool] | None = None
    ) -> Metrics:
        """Train, validate every `trainer.test_freq` steps, checkpoint and write the model (`TrainingLoop.fit`).

        Args:
            stop_when: Given the metrics of a validated step, ends training early when it returns True.
            keep_when: Given the same, writes that step's model when it returns True; the model written last is
                the result (the last step's model is not written then). None: the last step's model.

        Returns:
            The last step's metrics.

        Raises:
            RunDirBusyError: If another run holds the run directory.
            RunFailedError: If more steps failed than `trainer.max_retries` allows.
        """
        self.stop_when, self.keep_when, self.kept = stop_when, keep_when, None
        return super().fit()

    def _build_groups(self) -> WorkerGroups:
        plan = derive_batch_plan(self.config, world_size=self.config.world_size(torch.cuda.is_available()))
        return build_worker_groups(self.config, self.model_path, plan, self.total_steps)

    def _trained_roles(self) -> dict:
        return {"actor": self.groups.actor_rollout}

    def _train_step(self, batch: DataProto, step: int) -> Metrics:
        """One optimizer step on `batch` (`input_ids`, `attention_mask`, `position_ids`, `loss_mask`
        `[rows, seq]`): `sft/loss`, `sft/grad_norm`, `sft/lr`."""
        return self.groups.actor_rollout.sft_step(batch).meta_info["metrics"]

    def _validate(self, step: int) -> Metrics:
        """`val/loss` (mean NLL per target token) and, where ground truth exists, the greedy accuracy; writes the
        model when `keep_when` holds."""
        group = self.groups.actor_rollout
        data = DataProto.from_single_dict(self.val_set.collate([self.val_set[i] for i in range(len(self.val_set))]))
        out = group.sft_log_prob(data).batch  # log_prob, response_mask [rows, seq - 1]
        metrics = {"val/loss": (-(out["log_prob"] * out["response_mask"]).sum() / out["response_mask"].sum()).item()}
        if self.val_prompts is not None:
            group.sync_rollout()
            c = self.config
            metrics |= generate_and_score(group, self.val_prompts, self.reward, c.rollout.val, c.data.val_batch_size)
        if self.keep_when is not None and self.keep_when(metrics):
            super()._write_model((self.run_dir / "model").resolve())
            self.kept = step
        return metrics

    def _stop_after(self, metrics: Metrics) -> bool:
        return self.stop_when is not None and self.stop_when(metrics)

    def _write_model(self, model_dir: Path) -> None:
        """The last step's model; with `keep_when`, the kept one is written already (`_validate`)."""
        if self.keep_when is None:
            super()._write_model(model_dir)

    def _model_line(self, model_dir: Path) -> str:
        if self.keep_when is None:
            return super()._model_line(model_dir)
        if self.kept is None:
            return "keep_when held at no validation, so no model was written"
        return f"the model of step {self.kept} (keep_when): " + super()._model_line(model_dir)

    def _console_line(self, step: int, metrics: Metrics) -> str:
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k == "sft/loss" or k.startswith("val/"))
        return f"SFT step {step}/{self.total_steps}: {shown}"
