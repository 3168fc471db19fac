"""`SFTTrainer`: supervised fine-tuning on prompt/response pairs with the actor's engine (`ketch sft`)."""

from __future__ import annotations

import math
from pathlib import Path

from ketch.config import KetchConfig
from ketch.controller import LocalWorkerGroup
from ketch.data import SFTDataset, resolve_data_files
from ketch.data.loader import PromptLoader
from ketch.models import load_tokenizer
from ketch.protocol import DataProto
from ketch.tracking import Tracker, info
from ketch.workers.sft import SFTWorker


class SFTTrainer:
    """Trains `model_path` on `data.train_files` (columns `data.prompt_key`, `data.response_key`) and
    writes the result as a Hugging Face directory `<run dir>/model`."""

    def __init__(self, config: KetchConfig, model_path: str | None = None):
        self.config = c = config
        self.model_path = model_path or c.model.path
        self.run_dir = Path(c.trainer.default_local_dir) / c.trainer.experiment_name
        tokenizer = load_tokenizer(c.model.tokenizer_path or self.model_path, c.model.trust_remote_code)
        self.train_set = SFTDataset(resolve_data_files(c.data.train_files), tokenizer, c.data)
        val_files = resolve_data_files(c.data.val_files)
        self.val_set = SFTDataset(val_files, tokenizer, c.data) if val_files else None
        self.loader = PromptLoader(self.train_set, c.data.train_batch_size, c.data.shuffle, c.trainer.seed)
        self.total_steps = c.trainer.total_steps or c.trainer.total_epochs * self.loader.batches_per_epoch

    def fit(self) -> dict[str, float]:
        """Train, validate every `trainer.test_freq` steps, save; returns the last metrics."""
        tracker = Tracker(self.run_dir, self.config.trainer.logger, self.total_steps, self.config.trainer.log_interval)
        group = LocalWorkerGroup(SFTWorker, self.config, self.model_path, self.total_steps, role="sft")
        group.init_model()
        metrics: dict[str, float] = {}
        for step in range(1, self.total_steps + 1):
            metrics = group.train_step(self.loader.next_batch()).meta_info["metrics"]
            if self.val_set is not None and self._due(step):
                metrics["val/loss"] = self._val_loss(group)
            tracker.log(metrics, step)
            if step % self.config.trainer.log_interval == 0:
                shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k in ("sft/loss", "val/loss"))
                info(f"SFT step {step}/{self.total_steps}: {shown}", tracker.bar)
        group.save_pretrained(str(self.run_dir / "model"))
        tracker.close()
        info(f"SFT finished: model saved to {self.run_dir / 'model'}")
        return metrics

    def _due(self, step: int) -> bool:
        freq = self.config.trainer.test_freq
        return freq > 0 and (step % freq == 0 or step == self.total_steps)

    def _val_loss(self, group) -> float:
        """Mean negative log-likelihood per target token over the validation set."""
        data = DataProto.from_single_dict(self.val_set.collate([self.val_set[i] for i in range(len(self.val_set))]))
        out = group.token_log_probs(data)
        mask = out.batch["response_mask"]
        nll = -(out.batch["log_prob"] * mask).sum() / mask.sum().clamp(min=1)
        return nll.item() if math.isfinite(nll.item()) else float("nan")
