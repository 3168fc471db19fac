"""`ActorRolloutRefWorker`: the hybrid engine. One process holds the actor (FSDP2 or Megatron engine), the
rollout engine and, when KL is used, the frozen reference policy (with `actor.lora`, the actor's own base model:
its adapters turned off); after each update the actor's weights go to the rollout in memory."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ketch.algorithms import (
    TURN_KINDS,
    agg_loss,
    get_policy_loss,
    kl_penalty,
    masked_mean,
    rollout_is_weights,
    rollout_mismatch_terms,
    turn_masks,
)
from ketch.config.batch import BatchPlan
from ketch.config.schema import KetchConfig
from ketch.controller import DP_COMPUTE_PROTO, ONE_TO_ALL, PROCESS_COMPUTE_PROTO, Worker, register
from ketch.engine.checkpoint import HF_DIR, load_engine, save_engine
from ketch.engine.distributed import all_reduce_max, all_reduce_sum
from ketch.engine.engine import TrainEngine, compile_enabled
from ketch.engine.export import gather_hf_state, gather_trained_state, write_hf_directory
from ketch.engine.fused import fuse_kernels
from ketch.engine.heads import PolicyModel
from ketch.engine.lora import ADAPTER_DIR, adapters_disabled, add_lora, peft_config, write_adapter, write_adapter_config
from ketch.engine.micro import split_micro_batches
from ketch.engine.packing import packing_enabled
from ketch.models import load_causal_lm, load_model_config, load_tokenizer, resolve_dtype, stop_token_ids
from ketch.models.vision import copy_processor_files, freeze_vision_tower, is_vision_model
from ketch.protocol import DataProto
from ketch.workers.common import (
    DeviceMemory,
    mean_over_steps,
    mini_batches,
    role_dispatch_rank,
    rollout_engine,
    setup_process,
    shuffle_seed,
    token_budget,
    token_share,
)
from ketch.workers.weight_bridge import BridgeSender


class ActorRolloutRefWorker(DeviceMemory, BridgeSender, Worker):
    """Generates, scores log-probs and trains the policy; `model_path` is a resolved HF directory or hub id."""

    def __init__(self, config: KetchConfig, model_path: str, plan: BatchPlan, total_updates: int):
        super().__init__()
        self.config, self.model_path, self.plan, self.total_updates = config, model_path, plan, total_updates
        self.update_count = 0
        # the constant of seq-mean-token-sum-norm (Dr. GRPO): the same for every micro-batch of the run
        self.norm_constant = config.actor.loss_scale_factor or config.data.max_response_length
        self.router_mismatch: torch.Tensor | None = None  # routed otherwise than the rollout, compared tokens

    @register(ONE_TO_ALL)
    def init_model(self) -> None:
        c = self.config
        self.device = setup_process(c.trainer.device, c.trainer.seed)
        self.dtype = resolve_dtype(c.model.dtype, self.device)
        self.tokenizer = load_tokenizer(
            c.model.tokenizer_path or self.model_path, c.model.trust_remote_code, self.model_path
        )
        if c.actor.strategy == "megatron":
            self._build_megatron_engines()
        else:
            lora = c.actor.lora
            mixed = self.dtype if self.dtype != torch.float32 else None
            exact = c.rollout.exact_log_probs  # padded and eager: the forward the rollout's decoding matches
            packed = packing_enabled(c.model.use_remove_padding, self.device) and not exact
            compile = compile_enabled(c.model.use_torch_compile, self.device) and not exact
            # a frozen base stays in model.dtype: it needs no float32 master weights
            route = c.actor.router_replay != "off"
            policy = PolicyModel(self._load(self.dtype if lora.enabled else torch.float32), packed, route, exact)
            if lora.enabled:  # after the head turned the model's dropout off: the adapters' own stays
                add_lora(policy.lm, lora, seed=c.trainer.seed)
            self.actor = TrainEngine(
                policy,
                self.device,
                c.actor.optim,
                self.total_updates,
                param_dtype=mixed,
                gradient_checkpointing=c.model.gradient_checkpointing,
                compile=compile,
                activation_offload=c.model.activation_offload,
                sequence_parallel=c.actor.ulysses_sequence_parallel_size,
            )
            self.ref = (
                TrainEngine(
                    PolicyModel(self._load(self.dtype), packed, route),
                    self.device,
                    compile=compile,
                    sequence_parallel=c.actor.ulysses_sequence_parallel_size,
                )
                if c.use_reference and not lora.enabled
                else None
            )
            self.hf_config = self.actor.module.lm.config
        self.rollout, self.bridge = None, None
        if c.rollout.placement == "hybrid":
            seed = c.trainer.seed + self.rank
            self.rollout = rollout_engine(c, self.model_path, self.tokenizer, self.dtype, self.device, seed)
            if c.actor.strategy != "megatron":  # a LoRA run's frozen base, read by the rollout in place
                self.rollout.share_weights(self.actor.frozen_whole_parameters("lm.", self.dtype))
            self._sync_rollout()

    def _build_megatron_engines(self) -> None:
        """Actor (and reference) as Megatron-Core engines (`actor.strategy=megatron`; the reference follows)."""
        from ketch.engine.megatron.engine import MegatronEngine, hf_reader

        c = self.config
        self.hf_config = load_model_config(self.model_path, c.model.trust_remote_code, c.model.override_config)
        args = (self.hf_config, hf_reader(self.model_path), c.actor.megatron, self.device)
        self.actor = MegatronEngine(
            *args, c.actor.optim, self.total_updates, self.dtype, c.model.gradient_checkpointing, c.trainer.seed
        )
        self.ref = MegatronEngine(*args, dtype=self.dtype, seed=c.trainer.seed) if c.use_reference else None

    def dispatch_rank(self) -> tuple[int, bool]:
        a = self.config.actor
        return role_dispatch_rank(self.rank, self.world_size, a, a.ulysses_sequence_parallel_size)

    def _load(self, dtype: torch.dtype) -> torch.nn.Module:
        m = self.config.model
        lm = load_causal_lm(self.model_path, dtype, m.attn_implementation, m.trust_remote_code, m.override_config)
        if m.use_liger:
            fuse_kernels(lm, self.device)
        if m.freeze_vision_tower and is_vision_model(lm.config):
            freeze_vision_tower(lm)
        return lm

    @register(PROCESS_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this process's prompts (see `Rollout.generate` for the fields); the rollout
        engine's memory is given back to training afterwards. The prompts are split over all processes:
        Megatron's tensor/pipeline peers each generate their own share instead of the same one, and the ranks of
        a tensor-parallel hf rollout (`rollout.tensor_parallel_size`) decode their shares together, each getting
        its own back."""
        self._wake_rollout()
        out = self.rollout.generate(prompts).to("cpu")
        self.rollout.sleep()
        return out

    @register(PROCESS_COMPUTE_PROTO)
    def warm_up_rollout(self, prompts: DataProto) -> None:
        """`Rollout.warm_up` on this process's share of `prompts`, split as `generate_sequences` splits them."""
        self._wake_rollout()
        self.rollout.warm_up(prompts)
        self.rollout.sleep()

    def _wake_rollout(self) -> None:
        """Wake the rollout engine; one that dropped its weights while asleep (`rollout.free_memory_while_training`)
        and has had no hand-off since (a second generation in a step, validation) gets them first."""
        if self.rollout.dropped_weights:
            self._sync_rollout()
        self.rollout.wake_up()

    @register(DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_prob` and `entropy` `[batch, response_len]` under the current actor; with `actor.router_replay=old`
        also its experts, `old_routed_experts` `[batch, seq, moe_layers, top_k]`."""
        micro, old = self.config.rollout.log_prob_micro_batch_size_per_device, self.config.actor.router_replay == "old"
        data, routing = self._given_experts(data, replayed=not old)
        kwargs = self._forward_kwargs(True) | routing | ({"return_experts": True} if old else {})
        out = self.actor.infer(data, micro, self._token_budget(), **kwargs)
        self._count_router_mismatch(out, data.batch["response_mask"])
        result = {"old_log_prob": out["log_prob"].cpu(), "entropy": out["entropy"].cpu()}
        return DataProto.from_dict(result | ({"old_routed_experts": out["routed_experts"].cpu()} if old else {}))

    def _given_experts(self, data: DataProto, replayed: bool = True) -> tuple[DataProto, dict]:
        """`data` with `given_experts` for a mixture of experts under `actor.router_replay`, and the forward's
        keyword for it: with `replayed`, the experts to route by where `data` holds them (the rollout's for
        `rollout`, the old-log-prob pass's for `old`), else the rollout's to compare with."""
        mode, b = self.config.actor.router_replay, data.batch
        source = {"rollout": "routed_experts", "old": "old_routed_experts"}.get(mode)
        replay = replayed and source in b
        given = source if replay else "routed_experts"
        if mode == "off" or given not in b:
            return data, {}
        return DataProto(b | {"given_experts": b[given]}, data.non_tensor_batch, data.meta_info), {"replay": replay}

    def _count_router_mismatch(self, out: dict, response_mask: torch.Tensor) -> None:
        """Keep the tokens of a forward on the rollout's weights that routed otherwise than the rollout
        (`router_mismatch`), for the update's `actor/router_mismatch`."""
        if "router_mismatch" in out:
            compared = torch.stack([out["router_mismatch"].sum(), response_mask.sum().to(out["router_mismatch"])])
            self.router_mismatch = compared.to(self.device, torch.float32)

    @register(DP_COMPUTE_PROTO)
    def compute_mismatch_log_probs(self, data: DataProto) -> DataProto:
        """`train_log_prob` and `eval_log_prob` `[batch, response_len]`: the actor's forward in training mode (the
        update's, no gradients) and in eval mode, for the first step's check against the rollout's log-probs; in
        `meta_info["fast_paths"]`, ketch's own code paths that computed them and the rollout's (`mismatch_guard.PLAIN`
        names them)."""
        micro, kwargs = self.config.rollout.log_prob_micro_batch_size_per_device, self._forward_kwargs(False)
        data, routing = self._given_experts(data)
        kwargs |= routing
        out = {}
        for name, train in (("train_log_prob", True), ("eval_log_prob", False)):
            out[name] = self.actor.infer(data, micro, self._token_budget(), train=train, **kwargs)["log_prob"].cpu()
        taken = {
            "packed training forwards": getattr(getattr(self.actor, "module", None), "packed", False),
            "compiled training blocks": isinstance(self.actor, TrainEngine)
            and compile_enabled(self.config.model.use_torch_compile, self.device),
            "the static decoder": getattr(self.rollout, "decoder", None) is not None,
            "vLLM": self.config.rollout.name == "vllm",
        }
        return DataProto.from_dict(out, meta_info={"fast_paths": [path for path, on in taken.items() if on]})

    @register(DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_prob` `[batch, response_len]` under the frozen reference policy: with `actor.lora`, the actor's
        base model (its adapters turned off for these forwards)."""
        if not self.config.use_reference:
            raise RuntimeError("compute_ref_log_prob called, but no reference policy was built (KL is not used)")
        micro = self.config.ref.log_prob_micro_batch_size_per_device
        engine = self.actor if self.ref is None else self.ref
        data, routing = self._given_experts(data)
        with adapters_disabled(self.actor.module) if self.ref is None else nullcontext():
            out = engine.infer(data, micro, self._token_budget(), **self._forward_kwargs(False), **routing)
        return DataProto.from_dict({"ref_log_prob": out["log_prob"].cpu()})

    def _token_budget(self) -> int | None:
        """Tokens per micro-batch (`actor.use_dynamic_bsz`) for the update and the log-prob passes, else None."""
        return token_budget(self.config.actor)

    def _forward_kwargs(self, calc_entropy: bool) -> dict:
        return {"temperature": self.config.rollout.temperature, "calc_entropy": calc_entropy}

    @register(DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over this rank's share, then the weight hand-off to the rollout; returns metrics."""
        a = self.config.actor
        seed = shuffle_seed(self, self.update_count)
        # Without a separate old-log-prob pass, the update's forward also gives the entropy metric.
        entropy = a.entropy_coeff != 0 or "old_log_prob" not in data.batch
        self.mismatch_max = torch.zeros(1 + len(TURN_KINDS), device=self.device)
        self.mismatch_with = self._rollout_column(data)
        data, routing = self._given_experts(data)
        steps = []
        for micros in mini_batches(data, self.plan.actor, a.shuffle, seed, self._token_budget()):
            steps.append(self.actor.train_mini_batch(micros, self._loss, **self._forward_kwargs(entropy), **routing))
            self.mismatch_with = None  # the next mini-batch's forward runs on weights the rollout did not sample with
        self.update_count += 1
        metrics = mean_over_steps(steps, "actor")
        metrics |= self._mismatch_metrics(metrics) | self._router_mismatch_metric()
        if self.rollout is not None:  # a standalone rollout gets the weights when the driver sends them
            metrics["timing_s/weight_sync"] = self._sync_rollout()
        return DataProto(meta_info={"metrics": metrics})

    def _loss(self, out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
        a, b = self.config.actor, micro.batch
        mask = b["response_mask"]
        counts = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_constant": self.norm_constant}
        pg_loss, pg = self._policy_loss(out, b, counts)
        share = token_share(micro, num_tokens)
        metrics = {"pg_loss": pg_loss.detach()} | {k: v.detach() * share for k, v in pg.items()}
        if "old_log_prob" not in b:
            metrics["entropy"] = (out["entropy"].detach() * mask).sum() / num_tokens.clamp(min=1)
        if self.mismatch_with is not None:
            metrics |= self._rollout_mismatch(out["log_prob"].detach(), b, num_tokens)
        if "router_mismatch" in out and self.mismatch_with is not None and self.router_mismatch is None:
            metrics["router_mismatch"] = (out["router_mismatch"] * mask).sum() / num_tokens.clamp(min=1)
        loss = pg_loss
        if a.entropy_coeff:
            entropy = agg_loss(out["entropy"], mask, a.loss_agg_mode, **counts)
            loss = loss - a.entropy_coeff * entropy
            metrics["entropy_loss"] = entropy.detach()
        if "router_aux_loss" in out:
            coef = a.router_aux_loss_coef
            coef = self.actor.module.router.aux_loss_coef if coef is None else coef
            loss = loss + coef * share * out["router_aux_loss"]
            metrics["router_aux_loss"] = out["router_aux_loss"].detach() * share
        if a.use_kl_loss:
            kl = agg_loss(
                kl_penalty(out["log_prob"], b["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode, **counts
            )
            loss = loss + a.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics

    def _rollout_column(self, data: DataProto) -> str | None:
        """The rollout's log-probs that the update's first forward (on the weights the rollout sampled with) is
        measured against: `rollout_log_probs` where that forward is the training engine's π_old (no old-log-prob
        pass), `old_log_prob` where it came from the rollout (`KetchConfig.old_log_prob_from_rollout`), else None."""
        if "old_log_prob" not in data.batch:
            return "rollout_log_probs" if "rollout_log_probs" in data.batch else None
        return "old_log_prob" if self.config.old_log_prob_from_rollout else None

    def _rollout_mismatch(self, log_prob: torch.Tensor, b: dict, num_tokens: torch.Tensor) -> dict:
        """The rollout mismatch (`rollout_mismatch_terms`) of the update's first forward, as shares that sum over
        micro-batches and ranks to the means, and per kind of turn (`turn_masks`) as sums and token counts; the
        maxima (overall, then per kind) are kept in `self.mismatch_max` for `_mismatch_metrics`."""
        diff, kl = rollout_mismatch_terms(log_prob, b[self.mismatch_with], b["response_mask"])
        turns = turn_masks(b["response_mask"], b["attention_mask"][:, -diff.shape[-1] :])
        maxima = [diff.max()] + [torch.where(turns[kind], diff, 0).max() for kind in TURN_KINDS]
        self.mismatch_max = torch.maximum(self.mismatch_max, torch.stack(maxima))
        n = num_tokens.clamp(min=1)
        metrics = {"rollout_probs_diff_mean": diff.sum() / n, "rollout_kl": kl.sum() / n}
        for kind in TURN_KINDS:
            metrics[f"rollout_probs_diff_sum/{kind}"] = torch.where(turns[kind], diff, 0).sum()
            metrics[f"rollout_tokens/{kind}"] = turns[kind].sum().float()
        return metrics

    def _router_mismatch_metric(self) -> dict[str, float]:
        """`actor/router_mismatch`: the share of response tokens whose hidden state (the token before them) chose
        other experts, in some MoE layer, than the rollout did, over all ranks, as the old-log-prob pass measured it
        (without that pass, `_loss` measures it in the update's first mini-batch)."""
        if self.router_mismatch is None:
            return {}
        differing, compared = all_reduce_sum(self.router_mismatch).tolist()
        self.router_mismatch = None
        return {"actor/router_mismatch": differing / max(compared, 1.0)}

    def _mismatch_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`training/rollout_*` from `_rollout_mismatch`'s terms in the update's `metrics` (popped); per kind of
        turn only where a turn was answered by the environment (multi-turn)."""
        if "actor/rollout_kl" not in metrics:
            return {}
        maxima = all_reduce_max(self.mismatch_max).tolist()
        out = {
            "training/rollout_kl": metrics.pop("actor/rollout_kl"),
            "training/rollout_probs_diff_mean": metrics.pop("actor/rollout_probs_diff_mean"),
            "training/rollout_probs_diff_max": maxima[0],
        }
        sums = {kind: metrics.pop(f"actor/rollout_probs_diff_sum/{kind}") for kind in TURN_KINDS}
        tokens = {kind: metrics.pop(f"actor/rollout_tokens/{kind}") for kind in TURN_KINDS}
        if tokens["tool_turns"] > 0:
            for kind, maximum in zip(TURN_KINDS, maxima[1:], strict=True):
                if tokens[kind] > 0:
                    out[f"training/rollout_probs_diff_mean/{kind}"] = sums[kind] / tokens[kind]
                    out[f"training/rollout_probs_diff_max/{kind}"] = maximum
        return out

    def _policy_loss(self, out: dict, b: dict, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The registered `actor.policy_loss`, with truncated importance weights when `actor.rollout_is` is set."""
        a, mask = self.config.actor, b["response_mask"]
        old_log_prob = b["old_log_prob"] if "old_log_prob" in b else out["log_prob"].detach()  # on-policy: ratio 1
        weights = None
        if a.rollout_is is not None:
            weights = rollout_is_weights(
                old_log_prob, b["rollout_log_probs"], mask, a.rollout_is, a.rollout_is_threshold
            )
        loss, metrics = get_policy_loss(a.policy_loss)(
            old_log_prob,
            out["log_prob"],
            b["advantages"],
            mask,
            clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c,
            gspo_clip_ratio_low=a.gspo_clip_ratio_low,
            gspo_clip_ratio_high=a.gspo_clip_ratio_high,
            loss_agg_mode=a.loss_agg_mode,
            rollout_is_weights=weights,
            **counts,
        )
        if weights is not None:
            metrics["rollout_is_weight_mean"] = masked_mean(weights, mask)
        return loss, metrics

    def _sync_rollout(self) -> float:
        """Hand the actor's weights to the rollout engine in memory; returns the seconds it took."""
        start = time.perf_counter()
        self.rollout.update_weights(self.actor.full_parameters(prefix="lm.", dtype=self.dtype))
        seconds = time.perf_counter() - start
        if self.config.rollout.check_weight_sync:
            self._check_weight_sync()
        return seconds

    def _check_weight_sync(self) -> None:
        """Compare one weight's norm in the rollout engine with the actor's (rollout.check_weight_sync)."""
        check_weight_norms(self.rollout.weight_norm(CHECKED_WEIGHT), self.weight_norm(CHECKED_WEIGHT), CHECKED_WEIGHT)

    @register(ONE_TO_ALL)
    def weight_norm(self, name: str) -> float:
        """The norm of one parameter of the actor (an HF name), as the rollout gets it: every engine's weights are
        walked as for a hand-off, so it costs one (debugging only)."""
        norms = [tensor.float().norm().item() for hf_name, tensor in self._rollout_weights() if hf_name == name]
        if not norms:
            raise KeyError(f"the actor has no weight {name!r} to check")
        return norms[0]

    # ----------------------------------------------------------------- a standalone rollout's weights (BridgeSender)
    def _rollout_weights(self):
        return self.actor.full_parameters(prefix="lm.", dtype=self.dtype)

    # ----------------------------------------------------------------- supervised fine-tuning
    @register(DP_COMPUTE_PROTO)
    def sft_step(self, data: DataProto) -> DataProto:
        """One maximum-likelihood optimizer step on SFT rows (`input_ids`, `attention_mask`, `position_ids`,
        `loss_mask` `[batch, seq]`), micro-batched like the actor update; returns `sft/loss`, `sft/grad_norm`,
        `sft/lr`. The rollout engine is not updated (call `sync_rollout` before generating)."""
        batch = as_next_token_batch(data)
        micros = split_micro_batches(batch, self.config.actor.ppo_micro_batch_size_per_device)
        metrics = self.actor.train_mini_batch(micros, _nll_loss)
        return DataProto(meta_info={"metrics": {f"sft/{k}": v for k, v in metrics.items() if k != "skipped_steps"}})

    @register(DP_COMPUTE_PROTO)
    def sft_log_prob(self, data: DataProto) -> DataProto:
        """`log_prob` and `response_mask` `[batch, seq - 1]` of SFT rows' target tokens (validation loss)."""
        batch = as_next_token_batch(data)
        out = self.actor.infer(batch, self.config.actor.ppo_micro_batch_size_per_device)
        return DataProto.from_dict({"log_prob": out["log_prob"].cpu(), "response_mask": batch.batch["response_mask"]})

    @register(ONE_TO_ALL)
    def sync_rollout(self) -> float:
        return self._sync_rollout()

    @register(ONE_TO_ALL)
    def save_pretrained(self, out_dir: str, engine_config: dict | None = None) -> None:
        """Write the actor as a Hugging Face directory with its tokenizer, the run's stop tokens as EOS
        and `vllm_engine_config.json` (every rank gathers, rank 0 writes). With `actor.lora` the weights are merged
        and `out_dir/adapter` is the PEFT adapter directory."""
        lora = self.config.actor.lora
        state = gather_hf_state(self.actor, keep=self.rank == 0)
        adapter = gather_trained_state(self.actor, keep=self.rank == 0) if lora.enabled else {}
        if self.rank == 0:
            stops = stop_token_ids(self.tokenizer, self.model_path, self.config.rollout.stop_token_ids)
            write_hf_directory(state, self.hf_config, out_dir, self.tokenizer, stops, engine_config)
            if is_vision_model(self.hf_config):
                copy_processor_files(self.model_path, out_dir)
            if lora.enabled:
                vision = is_vision_model(self.hf_config)
                write_adapter(
                    adapter, peft_config(lora, vision=vision), Path(out_dir) / ADAPTER_DIR, self.model_path, None
                )

    # ----------------------------------------------------------------- checkpoints
    @register(ONE_TO_ALL)
    def save_checkpoint(self, directory: str) -> None:
        """Sharded actor model/optimizer/schedule, this rank's RNG, the HF config and tokenizer; with `actor.lora`
        the adapters, and their settings beside the HF config (`ketch export` merges them into the base)."""
        save_engine(self.actor, Path(directory), {"update_count": self.update_count}, self.hf_config, self.tokenizer)
        lora = self.config.actor.lora
        if lora.enabled and self.rank == 0:
            config = peft_config(lora, vision=is_vision_model(self.hf_config))
            write_adapter_config(config, Path(directory) / HF_DIR, self.model_path, None)

    @register(ONE_TO_ALL)
    def load_checkpoint(self, directory: str) -> None:
        """Restore what `save_checkpoint` wrote, then hand the weights to the rollout engine."""
        self.update_count = load_engine(self.actor, Path(directory))["update_count"]
        if self.rollout is not None:
            self._sync_rollout()


CHECKED_WEIGHT = "model.embed_tokens.weight"
"""The weight whose norm `rollout.check_weight_sync` compares between the actor and the rollout."""


def check_weight_norms(rollout_norm: float, actor_norm: float, name: str) -> None:
    """Raise when the rollout's norm of weight `name` is not the actor's (to 1e-3, relative above 1)."""
    if abs(rollout_norm - actor_norm) > 1e-3 * max(1.0, abs(actor_norm)):
        raise RuntimeError(
            f"weight hand-off check failed: |{name}| is {rollout_norm} in the rollout, {actor_norm} in the actor"
        )


def as_next_token_batch(data: DataProto) -> DataProto:
    """SFT rows as the engine's response layout: every token after the first is a "response" token,
    scored where `loss_mask` (and the attention mask) is 1; shapes `[batch, seq - 1]`. A vision-language model's
    rows keep their images (`multi_modal_inputs`)."""
    b = data.batch
    images = {k: v for k, v in data.non_tensor_batch.items() if k == "multi_modal_inputs"}
    return DataProto.from_dict(
        {
            "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"],
            "position_ids": b["position_ids"],
            "responses": b["input_ids"][:, 1:],
            "response_mask": b["loss_mask"][:, 1:] * b["attention_mask"][:, 1:],
        },
        images,
    )


def _nll_loss(out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
    return agg_loss(-out["log_prob"], micro.batch["response_mask"], "token-mean", num_tokens=num_tokens), {}
