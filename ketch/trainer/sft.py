"""`SFTTrainer`: supervised fine-tuning on prompt/response pairs with the actor's engine (`ketch sft`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ketch.config import KetchConfig, derive_batch_plan, to_dict
from ketch.config.parallel import check_megatron_start, check_rollout_start, megatron_roles
from ketch.data import RLHFDataset, SFTDataset, resolve_data_files
from ketch.data.loader import PromptLoader
from ketch.engine.lora import check_lora
from ketch.engine.megatron.weights import check_supported
from ketch.models import check_causal_lm, check_tokenizer_fits, load_model_config, load_tokenizer, local_or_hub
from ketch.preflight import preflight
from ketch.protocol import DataProto
from ketch.rewards import RewardScorer
from ketch.rollout.multi_turn import tool_schemas, turn_stop_strings
from ketch.tracking import Tracker, info
from ketch.trainer.checkpoint import due
from ketch.trainer.groups import build_worker_groups
from ketch.trainer.run_dir import owns_run_dir, removed_if_start_fails, warn_if_steps_replaced
from ketch.trainer.validation import generate_and_score


class SFTTrainer:
    """Trains `model.path` on `data.train_files` (columns `data.prompt_key`, `data.response_key`) and writes
    the result as a Hugging Face directory `<run dir>/model`.

    Validation every `trainer.test_freq` steps reports `val/loss` and, when the validation rows carry a
    ground truth (`answer` or `reward_model.ground_truth`), the greedy accuracy `val/<data_source>/acc`.

    `model_path` is `model.path` resolved, or a function that resolves it, called after the start-up checks: a
    built-in model is resolved (warmed up with this trainer) by `ketch.trainer.builtin.resolve_model_path`, which
    `ketch sft` passes, so it must be given for `model.path=builtin:tiny-arithmetic`."""

    def __init__(self, config: KetchConfig, model_path: str | Callable[[KetchConfig], str] | None = None):
        # SFT generates only to validate, in the actor's processes: a standalone rollout is an RL placement
        self.config = c = replace(config, rollout=replace(config.rollout, placement="hybrid", staleness=0))
        preflight(c, SFTDataset.required_columns(c.data))  # what can fail before any model is built
        self.reward = RewardScorer(None, c.reward.function, c.reward.on_error, c.reward.scorer_kwargs)
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        if model_path is None and c.model.path.startswith("builtin:"):
            raise ValueError(
                f"SFTTrainer: model.path={c.model.path} must be resolved first; pass "
                "model_path=ketch.trainer.builtin.resolve_model_path (as `ketch sft` does)"
            )
        self.model_path = model_path(c) if callable(model_path) else model_path or local_or_hub(c.model.path)
        model_config = load_model_config(self.model_path, c.model.trust_remote_code)
        check_causal_lm(model_config, c.model.path)
        check_megatron_start(c, model_config, torch.cuda.is_available())
        check_rollout_start(c, model_config)
        if megatron_roles(c):
            check_supported(model_config)
        if c.actor.lora.enabled:
            check_lora("actor.lora", c.actor.lora, model_config, c.model.trust_remote_code)
        tokenizer = load_tokenizer(
            c.model.tokenizer_path or self.model_path, c.model.trust_remote_code, self.model_path
        )
        check_tokenizer_fits(tokenizer, model_config, self.model_path, c.model.tokenizer_path)
        self.reward.tokenizer = tokenizer
        demo = {"turn_stop": turn_stop_strings(c, tokenizer), "tools": tool_schemas(c)}  # as the rollout renders it
        self.train_set = SFTDataset(resolve_data_files(c.data.train_files), tokenizer, c.data, **demo)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = SFTDataset(val_files, tokenizer, c.data, **demo) if val_files else None
        self.val_prompts = RLHFDataset(val_files, tokenizer, c.data) if val_files else None
        if self.val_prompts is not None and self.val_prompts[0]["ground_truth"] is None:
            self.val_prompts = None
        self.loader = PromptLoader(self.train_set, c.data.train_batch_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch

    @owns_run_dir
    def fit(
        self,
        stop_when: Callable[[dict[str, float]], bool] | None = None,
        keep_when: Callable[[dict[str, float]], bool] | None = None,
    ) -> dict[str, float]:
        """Train, validate every `trainer.test_freq` steps, save; returns the last metrics. `stop_when`, given
        the metrics of a validated step, ends training early when it returns True. `keep_when`, given the same,
        saves that step's model when it returns True, and the model saved last is the result (the last step's
        model is not saved then); without it the result is the last step's model."""
        c = self.config
        with removed_if_start_fails(self.run_dir):
            warn_if_steps_replaced(self.run_dir, "ketch sft does not resume")
            tracker = Tracker.for_run(self.run_dir, to_dict(c), self.total_steps, step_lines=False)
            tracker.truncate_after(-1)
            plan = derive_batch_plan(c, world_size=c.world_size(torch.cuda.is_available()))
            groups = build_worker_groups(c, self.model_path, plan, self.total_steps)
        group = groups.actor_rollout
        model_dir = str((self.run_dir / "model").resolve())
        metrics: dict[str, float] = {}
        kept = None
        for step in range(1, self.total_steps + 1):
            metrics = group.sft_step(self.loader.next_batch()).meta_info["metrics"]
            validated = self.val_set is not None and due(c.trainer.test_freq, step, self.total_steps)
            if validated:
                metrics |= self._validate(group)
            tracker.log(metrics, step)
            if step == 1:
                groups.freeze_long_lived()
            if step % c.trainer.log_interval == 0 or validated:
                shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k == "sft/loss" or k.startswith("val/"))
                info(f"SFT step {step}/{self.total_steps}: {shown}", tracker.bar)
            if validated and keep_when is not None and keep_when(metrics):
                group.save_pretrained(model_dir)
                kept = step
            if validated and stop_when is not None and stop_when(metrics):
                info(f"SFT stopped early at step {step}")
                break
        if keep_when is None:
            group.save_pretrained(model_dir)
        groups.shutdown()
        tracker.close()
        if keep_when is not None and kept is None:
            info("SFT finished: keep_when held at no validation, so no model was saved")
        else:
            which = f" of step {kept}" if kept else ""
            info(f"SFT finished: model{which} saved to {self.run_dir / 'model'}")
        return metrics

    def _validate(self, group) -> dict[str, float]:
        """`val/loss` (mean NLL per target token) and, where ground truth exists, the greedy accuracy."""
        data = DataProto.from_single_dict(self.val_set.collate([self.val_set[i] for i in range(len(self.val_set))]))
        out = group.sft_log_prob(data).batch
        metrics = {"val/loss": (-(out["log_prob"] * out["response_mask"]).sum() / out["response_mask"].sum()).item()}
        if self.val_prompts is not None:
            group.sync_rollout()
            c = self.config
            metrics |= generate_and_score(group, self.val_prompts, self.reward, c.rollout.val, c.data.val_batch_size)
        return metrics
