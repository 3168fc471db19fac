"""`RewardModelWorker`: a sequence-level reward model on the FSDP engine. In PPO it is frozen and scores each
sample at its last valid response token; in `ketch rm` it trains on preference pairs (Bradley–Terry)."""

from __future__ import annotations

from pathlib import Path

import torch

from ketch.algorithms import bradley_terry_loss, last_valid_index, pairwise_accuracy
from ketch.config.schema import KetchConfig, LoraConfig
from ketch.controller import DP_COMPUTE_PROTO, ONE_TO_ALL, Worker, register
from ketch.data.batching import position_ids
from ketch.data.retokenize import needs_retokenize, retokenize
from ketch.engine.checkpoint import HF_DIR, load_engine, save_engine
from ketch.engine.engine import TrainEngine, compile_enabled
from ketch.engine.export import gather_hf_state, gather_trained_state, write_hf_directory
from ketch.engine.heads import ScoreModel
from ketch.engine.lora import ADAPTER_DIR, add_lora, peft_config, write_adapter, write_adapter_config
from ketch.engine.packing import packing_enabled
from ketch.models import load_reward_model, load_tokenizer, resolve_dtype, stop_token_ids
from ketch.protocol import DataProto
from ketch.workers.common import DeviceMemory, setup_process

HEAD = "score"
"""The score head of a `*ForSequenceClassification` reward model (`ScoreModel`)."""


class RewardModelWorker(DeviceMemory, Worker):
    """Holds the reward model at `model_path` with its tokenizer at `tokenizer_path`.

    `total_updates` (optimizer steps of `ketch rm`) gives it an optimizer; None keeps it frozen (PPO).
    `actor_model_path`, in PPO, is the actor's model (its tokenizer is `model.tokenizer_path` or that path):
    samples are re-encoded for the reward model when the two tokenizers or chat templates differ
    (`reward.model.retokenize`)."""

    def __init__(
        self,
        config: KetchConfig,
        model_path: str,
        tokenizer_path: str,
        total_updates: int | None = None,
        actor_model_path: str | None = None,
    ):
        super().__init__()
        self.config, self.model_path, self.tokenizer_path = config, model_path, tokenizer_path
        self.total_updates, self.actor_model_path = total_updates, actor_model_path
        self.update_count = 0

    @property
    def lora(self) -> LoraConfig | None:
        """`reward.model.lora` when `ketch rm` trains adapters, else None (a frozen PPO reward model takes none)."""
        lora = self.config.reward.model.lora
        return lora if self.total_updates is not None and lora.enabled else None

    @register(ONE_TO_ALL)
    def init_model(self) -> None:
        c, m, training = self.config, self.config.model, self.total_updates is not None
        self.device = setup_process(c.trainer.device, c.trainer.seed + 15485863)
        mixed = torch.bfloat16 if training and self.device.type == "cuda" and m.dtype in ("auto", "bfloat16") else None
        dtype = torch.float32 if training else resolve_dtype(m.dtype, self.device)
        if self.lora is not None:  # a frozen base needs no float32 master weights
            dtype = mixed or torch.float32
        model = load_reward_model(self.model_path, dtype, m.attn_implementation, m.trust_remote_code)
        self.hf_config = model.config
        self.tokenizer = load_tokenizer(self.tokenizer_path, m.trust_remote_code, self.model_path)
        optim = c.reward.model.optim if training else None
        checkpointing = training and m.gradient_checkpointing
        head = ScoreModel(model, packing_enabled(m.use_remove_padding, self.device))
        if self.lora is not None:  # the score head trains whole beside the adapters
            add_lora(model, self.lora, HEAD, c.trainer.seed)
        compile = compile_enabled(m.use_torch_compile, self.device)
        self.engine = TrainEngine(head, self.device, optim, self.total_updates or 1, mixed, checkpointing, compile)
        self.actor_tokenizer = self._actor_tokenizer_if_needed()

    def _actor_tokenizer_if_needed(self):
        """The actor's tokenizer when samples must be re-encoded for the reward model, else None."""
        r = self.config.reward.model
        if self.actor_model_path is None or r.retokenize == "never":
            return None
        m = self.config.model
        actor = load_tokenizer(m.tokenizer_path or self.actor_model_path, m.trust_remote_code, self.actor_model_path)
        different = needs_retokenize(actor, self.tokenizer, self.config.data.chat_template, r.chat_template)
        return actor if r.retokenize == "always" or different else None

    # ----------------------------------------------------------------- PPO
    @register(DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores` `[batch, response_len]`: each sample's score at its last valid response token, 0 elsewhere.

        `data` is a rollout batch (`input_ids`, `attention_mask`, `position_ids`, `prompts`, `responses`,
        `response_mask`, optional non-tensor `raw_prompt`)."""
        if self.actor_tokenizer is None:
            inputs = data.select(["input_ids", "attention_mask", "position_ids", "responses"], [], [])
            if inputs.batch["position_ids"].dim() == 3:  # a vision-language policy's multimodal ones: not its own
                inputs.batch["position_ids"] = position_ids(inputs.batch["attention_mask"])
        else:
            stops = stop_token_ids(self.actor_tokenizer, self.actor_model_path, self.config.rollout.stop_token_ids)
            chat_template = self.config.reward.model.chat_template
            inputs = as_score_batch(*retokenize(data, self.actor_tokenizer, self.tokenizer, chat_template, stops))
        scores = self.engine.infer(inputs, self.config.reward.model.micro_batch_size_per_device)["scores"].cpu()
        mask = data.batch["response_mask"]
        rm_scores = torch.zeros(mask.shape, dtype=torch.float32)
        rm_scores[torch.arange(len(mask)), last_valid_index(mask)] = scores
        return DataProto.from_dict({"rm_scores": rm_scores})

    # ----------------------------------------------------------------- ketch rm
    @register(DP_COMPUTE_PROTO)
    def rm_step(self, data: DataProto) -> DataProto:
        """One Bradley–Terry optimizer step on this rank's pairs (`PreferenceDataset.collate` rows), micro-batched
        by `reward.model.micro_batch_size_per_device` sequences, the loss normalised by the pairs of the whole
        step over all ranks; returns `rm/bt_loss`, `rm/pairwise_acc`, `rm/margin`, `rm/grad_norm`, `rm/lr`."""
        sequences = self.config.reward.model.micro_batch_size_per_device or 2 * len(data)
        micros = [as_pair_batch(micro) for micro in data.split(max(sequences // 2, 1))]
        metrics = self.engine.train_mini_batch(micros, _bradley_terry_loss)
        self.update_count += 1
        metrics["bt_loss"] = metrics.pop("loss")
        return DataProto(meta_info={"metrics": {f"rm/{k}": v for k, v in metrics.items() if k != "skipped_steps"}})

    @register(DP_COMPUTE_PROTO)
    def pairwise_eval(self, data: DataProto) -> DataProto:
        """`chosen_scores` and `rejected_scores` `[pairs]` of this rank's pairs, without gradients."""
        scores = self.engine.infer(as_pair_batch(data), self.config.reward.model.micro_batch_size_per_device)
        chosen, rejected = scores["scores"].cpu().chunk(2)
        return DataProto.from_dict({"chosen_scores": chosen, "rejected_scores": rejected})

    @register(ONE_TO_ALL)
    def save_pretrained(self, out_dir: str) -> None:
        """Write the reward model as a Hugging Face directory (`*ForSequenceClassification`, one label) with its
        tokenizer (every rank gathers, rank 0 writes); with `reward.model.lora`, merged, and the adapter with its
        score head in `out_dir/adapter`."""
        state = gather_hf_state(self.engine, keep=self.rank == 0)
        adapter = gather_trained_state(self.engine, keep=self.rank == 0) if self.lora else {}
        if self.rank == 0:
            write_hf_directory(state, self.hf_config, out_dir, self.tokenizer)
            if self.lora is not None:
                config = peft_config(self.lora, HEAD)
                write_adapter(adapter, config, Path(out_dir) / ADAPTER_DIR, self.model_path, HEAD)

    @register(ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Sharded model/optimizer/schedule, this rank's RNG, the HF config and tokenizer; with `reward.model.lora`
        the adapters and the head, and their settings beside the HF config."""
        save_engine(self.engine, Path(directory), {"update_count": self.update_count}, self.hf_config, self.tokenizer)
        if self.lora is not None and self.rank == 0:
            write_adapter_config(peft_config(self.lora, HEAD), Path(directory) / HF_DIR, self.model_path, HEAD)

    @register(ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        self.update_count = load_engine(self.engine, Path(directory))["update_count"]


def as_score_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DataProto:
    """Whole sequences `[batch, seq]` in the engine's layout for `ScoreModel`: the sequence is the "response"
    and `response_mask` its attention mask, so the engine's sequence count (`num_seqs`) counts them."""
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask),
            "responses": input_ids,
            "response_mask": attention_mask,
        }
    )


def as_pair_batch(pairs: DataProto) -> DataProto:
    """`[pairs, seq]` chosen and rejected rows stacked into one score batch `[2 * pairs, seq]`: chosen first."""
    b = pairs.batch
    input_ids = torch.cat([b["chosen_input_ids"], b["rejected_input_ids"]])
    return as_score_batch(input_ids, torch.cat([b["chosen_attention_mask"], b["rejected_attention_mask"]]))


def _bradley_terry_loss(out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
    """This micro-batch's share of the step's mean Bradley–Terry loss; `num_seqs` counts two sequences a pair."""
    chosen, rejected = out["scores"].chunk(2)
    num_pairs = num_seqs / 2
    loss = bradley_terry_loss(chosen, rejected, num_pairs)
    chosen, rejected = chosen.detach(), rejected.detach()
    margin = (chosen - rejected).sum() / num_pairs.clamp(min=1)
    return loss, {"pairwise_acc": pairwise_accuracy(chosen, rejected, num_pairs), "margin": margin}
