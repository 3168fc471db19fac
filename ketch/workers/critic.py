"""`CriticWorker`: the value model (FSDP2 or Megatron engine): per-token values and the clipped value-loss update."""

from __future__ import annotations

from pathlib import Path

import torch

from ketch.algorithms import value_loss
from ketch.config.batch import BatchPlan
from ketch.config.schema import KetchConfig
from ketch.controller import DP_COMPUTE_PROTO, ONE_TO_ALL, Worker, register
from ketch.engine.checkpoint import HF_DIR, load_engine, save_engine
from ketch.engine.engine import TrainEngine, compile_enabled
from ketch.engine.export import gather_hf_state, gather_trained_state, write_hf_directory
from ketch.engine.fused import fuse_kernels
from ketch.engine.heads import ValueModel
from ketch.engine.lora import ADAPTER_DIR, add_lora, peft_config, write_adapter, write_adapter_config
from ketch.engine.packing import packing_enabled
from ketch.models import load_critic
from ketch.models.vision import freeze_vision_tower, is_vision_model
from ketch.protocol import DataProto
from ketch.workers.common import (
    DeviceMemory,
    mean_over_steps,
    mini_batches,
    role_dispatch_rank,
    setup_process,
    shuffle_seed,
    token_budget,
    token_share,
)


class CriticWorker(DeviceMemory, Worker):
    """Holds the value model; its backbone starts from `critic.model_path` or the actor's `model_path`."""

    def __init__(self, config: KetchConfig, model_path: str, plan: BatchPlan, total_updates: int):
        super().__init__()
        self.config, self.model_path, self.plan, self.total_updates = config, model_path, plan, total_updates
        self.update_count = 0
        self.head: str | None = None  # the value head's name, when it trains beside LoRA adapters (critic.lora)

    @register(ONE_TO_ALL)
    def init_model(self) -> None:
        c, m = self.config, self.config.model
        self.device = setup_process(c.trainer.device, c.trainer.seed + 104729)
        mixed = torch.bfloat16 if self.device.type == "cuda" and m.dtype in ("auto", "bfloat16") else None
        dtype = (mixed or torch.float32) if c.critic.lora.enabled else torch.float32  # a frozen base: no master copy
        critic = load_critic(self.base_path, dtype, m.attn_implementation, m.trust_remote_code)
        self.hf_config = critic.config
        if m.freeze_vision_tower and is_vision_model(critic.config):
            freeze_vision_tower(critic)
        if m.use_liger:
            fuse_kernels(critic, self.device)
        if c.critic.strategy == "megatron":
            from ketch.engine.megatron.engine import MegatronEngine

            state = critic.state_dict()  # the backbone and the same freshly initialised head as with FSDP
            args = (critic.config, state.__getitem__, c.critic.megatron, self.device, c.critic.optim)
            dtype = mixed or torch.float32
            self.critic = MegatronEngine(
                *args, self.total_updates, dtype, m.gradient_checkpointing, c.trainer.seed, value_head=True
            )
        else:
            value_model = ValueModel(critic, packing_enabled(m.use_remove_padding, self.device))
            if c.critic.lora.enabled:  # the value head trains whole beside the adapters
                self.head = value_model.head_name
                add_lora(critic, c.critic.lora, self.head, c.trainer.seed)
            self.critic = TrainEngine(
                value_model,
                self.device,
                c.critic.optim,
                self.total_updates,
                mixed,
                m.gradient_checkpointing,
                compile_enabled(m.use_torch_compile, self.device),
                activation_offload=m.activation_offload,
                sequence_parallel=c.actor.ulysses_sequence_parallel_size,
            )

    @property
    def base_path(self) -> str:
        """Where the value model's backbone comes from."""
        return self.config.critic.model_path or self.model_path

    def dispatch_rank(self) -> tuple[int, bool]:
        c = self.config
        return role_dispatch_rank(self.rank, self.world_size, c.critic, c.actor.ulysses_sequence_parallel_size)

    @register(DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """`values` `[batch, response_len]`, zero outside the response mask."""
        budget = token_budget(self.config.actor)
        out = self.critic.infer(data, self.config.critic.ppo_micro_batch_size_per_device, budget)
        return DataProto.from_dict({"values": out["values"].cpu() * data.batch["response_mask"]})

    @register(DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Value-loss epochs over this rank's share; returns metrics."""
        c, seed = self.config, shuffle_seed(self, self.update_count)
        steps = [
            self.critic.train_mini_batch(micros, self._loss)
            for micros in mini_batches(data, self.plan.critic, self.config.actor.shuffle, seed, token_budget(c.actor))
        ]
        self.update_count += 1
        return DataProto(meta_info={"metrics": mean_over_steps(steps, "critic")})

    @register(ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Sharded critic model/optimizer/schedule, this rank's RNG and the HF config; with `critic.lora` the
        adapters and the head, and their settings beside the HF config."""
        save_engine(self.critic, Path(directory), {"update_count": self.update_count}, self.hf_config)
        if self.config.critic.lora.enabled and self.rank == 0:
            config = peft_config(self.config.critic.lora, self.head)
            write_adapter_config(config, Path(directory) / HF_DIR, self.base_path, self.head)

    @register(ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        self.update_count = load_engine(self.critic, Path(directory))["update_count"]

    @register(ONE_TO_ALL)
    def save_pretrained(self, out_dir: str) -> None:
        """Write the value model as a Hugging Face directory (`*ForTokenClassification`, one label); with
        `critic.lora`, merged, and the adapter with its head in `out_dir/adapter`."""
        lora = self.config.critic.lora
        state = gather_hf_state(self.critic, keep=self.rank == 0)
        adapter = gather_trained_state(self.critic, keep=self.rank == 0) if lora.enabled else {}
        if self.rank == 0:
            write_hf_directory(state, self.hf_config, out_dir)
            if lora.enabled:
                config = peft_config(lora, self.head)
                write_adapter(adapter, config, Path(out_dir) / ADAPTER_DIR, self.base_path, self.head)

    def _loss(self, out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
        c, b = self.config.critic, micro.batch
        vpreds = out["values"]
        loss, info = value_loss(
            vpreds,
            b["returns"],
            b["values"],
            b["response_mask"],
            c.cliprange_value,
            c.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        share = token_share(micro, num_tokens)
        # a product, not boolean indexing: indexing by a mask on the GPU waits for the work queued before it
        vpred_mean = (vpreds.detach() * b["response_mask"]).sum() / num_tokens.clamp(min=1)
        return loss, {"vf_loss": loss.detach(), "vpred_mean": vpred_mean} | {
            k: v.detach() * share for k, v in info.items()
        }
