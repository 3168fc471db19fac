"""The sections of the trained and frozen roles: `actor`, `critic`, `ref`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ketch.config.sections.model import LoraConfig, MegatronConfig, OptimConfig


@dataclass(frozen=True)
class ActorConfig:
    strategy: Literal["fsdp", "megatron"] = "fsdp"
    """Training engine of the actor (and of the reference, which follows it): `fsdp` (FSDP2, CPU or GPU) or
    `megatron` (Megatron-Core tensor/pipeline parallelism, GPUs only; pip install 'ketch[megatron]')."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Model parallelism when strategy=megatron."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimizer of the policy (the default suits the built-in tiny model; use ~1e-6 for billion-parameter models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters instead of the whole policy (also in `ketch sft`); strategy=fsdp only."""
    ppo_mini_batch_size: int | None = 8
    """Prompts per optimizer step (x rollout.n sequences); None = the whole batch, one step per epoch. The default
    takes four optimizer steps per batch of 32 prompts, which learns the built-in task fastest per second."""
    ppo_micro_batch_size_per_device: int | None = None
    """Sequences per forward/backward on one device; None = the whole per-device mini-batch."""
    use_dynamic_bsz: bool = False
    """Split micro-batches by a token budget (ppo_max_token_len_per_device) instead of a sequence count, in the
    update and in the old-log-prob and reference passes, and in the critic's (values and update)."""
    ppo_max_token_len_per_device: int = 16384
    """Token budget of one micro-batch when use_dynamic_bsz is on: as many sequences as fit in that many real
    (prompt + response) tokens; a longer sequence gets a micro-batch alone."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    ulysses_sequence_parallel_size: int = 1
    """Ranks that share each micro-batch's tokens (Ulysses sequence parallelism, Jacobs et al. 2023, as verl's key):
    each runs the packed row's slice of 1/size of the tokens, with all-to-alls around attention so that each
    attends over every token with 1/size of the heads; one long response then spreads over several GPUs of a node.
    The reference and the critic follow it. It must divide the worker processes (data-parallel ranks = processes /
    size, which the batch sizes count) and the model's attention and key/value heads; needs packed training forwards
    (model.use_remove_padding), strategy=fsdp and a dense model."""
    recompute_old_log_prob: bool | None = None
    """Run a forward pass for `old_log_prob` before the update. None = only when needed (more than one epoch or
    mini-batch, or KL in the reward); otherwise the update's own forward gives it (ratio 1): one forward saved."""
    old_log_prob_from_rollout: bool = False
    """Take `old_log_prob` from the rollout's log-probs of the sampled tokens (`rollout_log_probs`) instead of a
    forward pass of the training engine: the same PPO ratio where the two agree (the hf rollout with float32
    weights; within 1e-5 on CPU), one forward pass saved. Where they differ (vLLM, bfloat16) the ratio then also
    holds that mismatch, which clipping bounds. Not with actor.rollout_is or actor.recompute_old_log_prob=true."""
    mismatch_check: Literal["error", "warn", "off"] = "error"
    """At the run's first step, compare the rollout's log-probs of the sampled tokens with the training forward's
    (training mode, the update's): a gap beyond the dtype's rounding (`ketch.trainer.mismatch_guard`) stops the run
    (`error`) naming the family, the gap, the token and which side differs, or is logged (`warn`); `off` skips it."""
    shuffle: bool = True
    """Shuffle sequences between mini-batches."""
    clip_ratio_low: float = 0.2
    """PPO clip range below 1 (Schulman et al. 2017)."""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1 (DAPO's clip-higher when larger than clip_ratio_low)."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (Ye et al. 2020); None disables dual clip."""
    policy_loss: str = "vanilla"
    """Policy loss: vanilla (PPO clip), gspo (sequence-level ratio, https://arxiv.org/abs/2507.18071), gspo_token,
    cispo (clipped, detached importance weight, https://arxiv.org/abs/2506.13585), or any registered one."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO's clip range below 1 of the length-normalised sequence ratio (the paper's 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO's clip range above 1 of the length-normalised sequence ratio (the paper's 4e-4)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced (token-mean is global over the mini-batch's valid tokens);
    seq-mean-token-sum-norm is Dr. GRPO's: each sequence's token sum / loss_scale_factor, mean over sequences."""
    loss_scale_factor: int | None = None
    """The constant of seq-mean-token-sum-norm (Dr. GRPO, https://arxiv.org/abs/2503.20783); None =
    data.max_response_length, the generation budget, so the normalisation never changes during a run."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance sampling against the rollout engine's own log-probs (rollout_log_probs): weight each
    token's loss by min(pi_old / pi_rollout, rollout_is_threshold) per token, or per sequence (product of the
    token ratios); None disables. Forces the old-log-prob pass (actor.recompute_old_log_prob). An FP8 rollout
    (rollout.quantization or rollout.kv_cache_dtype fp8) and partial rollouts set it to token where it is not
    given."""
    rollout_is_threshold: float = 2.0
    """Upper bound of the truncated importance weights of actor.rollout_is."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: weight of the router's load-balancing loss in the actor loss (logged as
    actor/router_aux_loss); None = the model config's router_aux_loss_coef, 0 = off."""
    router_replay: Literal["off", "rollout", "old"] = "off"
    """Mixture-of-experts models on the hf rollout: route each token of the training forwards (old log-probs, update,
    reference) to given experts instead of the router's own choice: `rollout` (R3) the experts the rollout chose,
    `old` (R2) those of the old-log-prob pass; the gate values stay the router's, so it still trains. Logs
    actor/router_mismatch, the share of response tokens routed otherwise without replay. See docs/algorithms.md."""
    use_kl_loss: bool = False
    """Add KL(actor || reference) to the loss (GRPO style) instead of to the reward."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss when use_kl_loss."""
    kl_loss_type: Literal[
        "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"
    ] = "low_var_kl"
    """KL estimator of the KL loss; a `+` kind keeps its value with the unbiased gradient of k2 (straight-through)."""


@dataclass(frozen=True)
class CriticConfig:
    enable: bool | None = None
    """Train a value model; None = only when algorithm.adv_estimator needs one (gae)."""
    strategy: Literal["fsdp", "megatron"] = "fsdp"
    """Training engine of the critic: `fsdp` or `megatron` (as actor.strategy)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Model parallelism when strategy=megatron; its tensor x pipeline size must equal the actor's (one batch
    plan serves both roles, so they need the same data-parallel size)."""
    model_path: str | None = None
    """Backbone of the critic; None = the actor's initial weights with a fresh value head."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """Optimizer of the value model (the default suits the built-in tiny model; use ~1e-5 for large models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train LoRA adapters on the value model's backbone, with its value head trained whole; strategy=fsdp only."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic optimizer step; None = the whole batch."""
    ppo_micro_batch_size_per_device: int | None = None
    """Sequences per critic forward/backward on one device; None = no split."""
    ppo_epochs: int = 1
    """Passes of the critic over each rollout batch."""
    cliprange_value: float = 0.5
    """Clip of the value prediction around the old value (PPO value clipping)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """Reduction of the per-token value loss."""


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_device: int | None = None
    """Sequences per reference forward on one device; None = all at once."""
