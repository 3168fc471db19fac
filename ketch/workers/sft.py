"""`SFTWorker`: supervised fine-tuning on the actor's engine (loss on response tokens only)."""

from __future__ import annotations

import torch

from ketch.algorithms import agg_loss
from ketch.config.schema import KetchConfig
from ketch.controller import DP_COMPUTE_PROTO, ONE_TO_ALL, Worker, register
from ketch.engine.engine import TrainEngine
from ketch.engine.export import save_hf_model
from ketch.engine.heads import PolicyModel
from ketch.engine.micro import split_micro_batches
from ketch.models import load_causal_lm, load_tokenizer
from ketch.protocol import DataProto
from ketch.workers.common import setup_process


def as_next_token_batch(data: DataProto) -> DataProto:
    """SFT rows (`input_ids`, `attention_mask`, `position_ids`, `loss_mask` `[batch, seq]`) as the engine's
    response layout: every token after the first is a "response" token, scored where `loss_mask` is 1."""
    b = data.batch
    return DataProto.from_dict(
        {
            "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"],
            "position_ids": b["position_ids"],
            "responses": b["input_ids"][:, 1:],
            "response_mask": b["loss_mask"][:, 1:] * b["attention_mask"][:, 1:],
        }
    )


class SFTWorker(Worker):
    def __init__(self, config: KetchConfig, model_path: str, total_updates: int):
        super().__init__()
        self.config, self.model_path, self.total_updates = config, model_path, total_updates

    @register(ONE_TO_ALL)
    def init_model(self) -> None:
        c, m = self.config, self.config.model
        self.device, self.rank, _ = setup_process(c.trainer.device, c.trainer.seed)
        self.tokenizer = load_tokenizer(m.tokenizer_path or self.model_path, m.trust_remote_code)
        lm = load_causal_lm(
            self.model_path, torch.float32, m.attn_implementation, m.trust_remote_code, m.override_config
        )
        self.hf_config = lm.config
        mixed = torch.bfloat16 if self.device.type == "cuda" and m.dtype in ("auto", "bfloat16") else None
        self.engine = TrainEngine(
            PolicyModel(lm), self.device, c.actor.optim, self.total_updates, mixed, m.gradient_checkpointing
        )

    @register(DP_COMPUTE_PROTO)
    def train_step(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's share of the batch; returns `sft/loss`, `sft/grad_norm`, `sft/lr`."""
        micros = split_micro_batches(as_next_token_batch(data), self.config.actor.ppo_micro_batch_size_per_device)
        metrics = self.engine.train_mini_batch(micros, self._loss)
        return DataProto(meta_info={"metrics": {f"sft/{k}": v for k, v in metrics.items() if k != "skipped_steps"}})

    @register(DP_COMPUTE_PROTO)
    def token_log_probs(self, data: DataProto) -> DataProto:
        """`log_prob` and `response_mask` `[batch, seq - 1]` of the target tokens (for validation loss)."""
        batch = as_next_token_batch(data)
        out = self.engine.infer(batch, self.config.actor.ppo_micro_batch_size_per_device)
        return DataProto.from_dict({"log_prob": out["log_prob"].cpu(), "response_mask": batch.batch["response_mask"]})

    def _loss(self, out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
        nll = agg_loss(-out["log_prob"], micro.batch["response_mask"], "token-mean", num_tokens=num_tokens)
        return nll, {}

    @register(ONE_TO_ALL)
    def save_pretrained(self, out_dir: str) -> None:
        """Write the model and tokenizer as a Hugging Face directory (rank 0 writes)."""
        save_hf_model(self.engine, "lm.", self.hf_config, out_dir, self.rank, self.tokenizer)
