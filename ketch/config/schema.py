"""The typed configuration schema: one frozen dataclass per section, every field documented.

Sizes follow one convention: `*_batch_size` without a suffix counts prompts, `*_per_device` counts
sequences (prompt + response) on one device. A prompt expands to `rollout.n` sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

BUILTIN_TASK = "builtin:arithmetic"
BUILTIN_MODEL = "builtin:tiny-arithmetic"
BUILTIN_CALCULATOR_MODEL = "builtin:tiny-calculator"
BUILTIN_CALLER_MODEL = "builtin:tiny-calculator-calls"
BUILTIN_PREFERENCE_TASK = "builtin:arithmetic-preference"

COMMAND_DEFAULTS: dict[str, tuple[str, ...]] = {
    "sft": ("trainer.experiment_name=arithmetic-sft", "data.train_batch_size=128"),
    "rm": (
        f"data.train_files=[{BUILTIN_PREFERENCE_TASK}/train]",
        f"data.val_files=[{BUILTIN_PREFERENCE_TASK}/val]",
        "data.train_batch_size=128",
        "trainer.experiment_name=arithmetic-rm",
        "trainer.total_steps=1000",
        "trainer.test_freq=250",
        "reward.model.optim.lr=5e-4",
    ),
}
"""Where `ketch sft` and `ketch rm` differ from the defaults below (those of `ketch train`): with no
arguments, `ketch rm` trains a reward model on the built-in preference pairs. A YAML file and overrides
still win."""

BUILTIN_RUN_DEFAULTS: tuple[str, ...] = (
    "rollout.n=16",
    "trainer.total_steps=190",
    "actor.optim.lr=1.5e-4",
    "actor.optim.lr_scheduler=cosine",
    "actor.optim.min_lr_ratio=0.1",
    "actor.old_log_prob_from_rollout=true",
)
"""The built-in demo's settings: where `ketch train` with no YAML file, on the built-in task and model (the
overrides leave data.train_files and model.path as they are), differs from the defaults below. From its
warm-up, the tiny model gained more per CPU-second with 16 samples per prompt than with 8; the learning rate
decays to a tenth over the run (with a constant one, greedy accuracy jumps by ±0.05 between validations at
the end); the rollout's log-probs serve as `old_log_prob` (the hf rollout on the CPU gives the training
engine's to 1e-5), which saves 15% of a step, so 190 steps fit the demo's 3 minutes on a 2-core CPU. Real
models are usually trained with fewer samples per prompt. Overrides still win."""


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: [f"{BUILTIN_TASK}/train"])
    """Parquet files (local paths or fsspec URLs) of training prompts; `builtin:arithmetic/train` is generated."""
    val_files: list[str] = field(default_factory=lambda: [f"{BUILTIN_TASK}/val"])
    """Parquet files of validation prompts; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a chat message list [{role, content}, ...]."""
    response_key: str = "response"
    """Column holding the target response (SFT only)."""
    chosen_key: str = "chosen"
    """Column holding the preferred response of a pair (`ketch rm` only): a string or a chat message list."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response of a pair (`ketch rm` only): a string or a chat message list."""
    max_prompt_length: int = 32
    """Prompts are left-padded to this many tokens; longer ones are handled per `truncation`."""
    max_response_length: int = 12
    """The most tokens the rollout generates per response (the built-in task's longest answer, `#### 198`, and
    its end token take 9)."""
    train_batch_size: int = 32
    """Prompts per training step."""
    val_batch_size: int | None = None
    """Prompts per validation generation call; None = the whole validation set at once."""
    truncation: Literal["left", "right", "error"] = "error"
    """What to do with a prompt longer than max_prompt_length: keep its end, keep its start, or stop."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length up front (the count is reported)."""
    chat_template: str | None = None
    """A built-in chat template (`chatml`, `zephyr`, `llama-3`) used instead of the tokenizer's own."""
    apply_chat_template: bool = True
    """Format chat-list prompts with a chat template; plain string prompts are always used as they are."""
    shuffle: bool = True
    """Shuffle training prompts every epoch (seeded by trainer.seed)."""
    max_samples: int | None = None
    """Use at most this many rows of each split (for quick experiments)."""


@dataclass(frozen=True)
class ModelConfig:
    path: str = BUILTIN_MODEL
    """A Hugging Face model directory or hub id; `builtin:tiny-arithmetic` is the built-in warm-started model."""
    tokenizer_path: str | None = None
    """Tokenizer directory or hub id; None = model.path."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype for the rollout and frozen models; auto = bfloat16 on GPU, float32 on CPU."""
    attn_implementation: str = "auto"
    """Attention kernel passed to transformers (`eager`, `sdpa`, `flash_attention_2`); auto = transformers' choice
    (sdpa where the model has it, else eager: GPT-OSS), but eager for a model that soft-caps its attention logits
    (Gemma 2: SDPA would leave the cap out). Packed training forwards and the static decoder use ketch's own
    attention wherever a model takes them (`ketch doctor` says which)."""
    trust_remote_code: bool = False
    """Allow model code from the model directory (needed by some hub models)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    activation_offload: bool = False
    """Keep what the training forwards (actor, critic) save for their backward pass in host memory (pinned on GPUs)
    and copy it back when the backward pass needs it. With gradient_checkpointing that is each transformer block's
    input, layers x tokens x hidden numbers per micro-batch, so the GPU holds one block's activations at a time and
    no checkpoint (long responses); without it, every activation (slow). FSDP engine only; nothing is gained on
    CPUs."""
    use_remove_padding: bool | None = None
    """Padding-free training forwards (actor, reference, critic, reward model): the real tokens of a micro-batch
    run as one packed row with attention kept per sequence (variable-length flash attention on GPUs), so padding
    costs nothing. None = on GPUs; off on CPUs, where per-sequence attention is slower than padded batches. FSDP
    engine only; a model that cannot be packed (`ketch doctor` says which path it takes) trains padded."""
    use_liger: bool = False
    """Liger-Kernel's fused RMSNorm and SwiGLU in the training forwards (actor, reference, critic) on CUDA, when
    `liger-kernel` is installed (pip install liger-kernel); otherwise a warning and the plain modules."""
    use_torch_compile: bool | None = None
    """torch.compile each transformer block of the training forwards (actor, reference, critic; FSDP engine),
    forward and backward: fused kernels for the work around the matmuls. Compiled once per shape family and
    kept in the compiler cache (under the ketch cache directory) for later runs. None = on GPUs."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries written over the model's config.json before loading (e.g. {attention_dropout: 0.0})."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up length in optimizer steps."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of lr."""
    offload: bool = False
    """Keep AdamW's two moments (8 of the training state's 16 bytes per parameter) in host memory, pinned on GPU
    machines, and stream them through the device in chunks at each step (verl's optimizer_offload, OpenRLHF's
    adam_offload): the GPU holds weights and gradients only, at the cost of a copy of the moments each way per
    optimizer step, overlapped with the step's kernels. strategy=fsdp only."""


@dataclass(frozen=True)
class MegatronConfig:
    """Model parallelism of a role trained with `strategy=megatron` (Megatron-Core, GPUs only). The processes of
    a run form a grid: data-parallel size = GPUs / (tensor_model_parallel_size x pipeline_model_parallel_size)."""

    tensor_model_parallel_size: int = 1
    """GPUs one layer is split over (Shoeybi et al. 2019); must divide the attention heads, the key/value heads,
    the vocabulary and the GPU count. Keep it within one node (NVLink)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are split over (GPipe / 1F1B schedules of Narayanan et al. 2021); at most the
    number of layers. Micro-batches are those of the batch plan."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage for the interleaved 1F1B schedule (smaller pipeline bubble); None = one.
    Needs pipeline_model_parallel_size > 1 and layers divisible by pipeline x virtual size."""
    sequence_parallel: bool = False
    """Split the activations of norms and dropout over the sequence within a tensor-parallel group (Korthikanti
    et al. 2022): less activation memory. Needs tensor_model_parallel_size > 1."""
    use_distributed_optimizer: bool = False
    """Split AdamW's state over the data-parallel ranks (ZeRO stage 1, Rajbhandari et al. 2020): each keeps the
    moments of its share of the parameters (8 bytes per parameter, divided by the data-parallel size), steps them
    and broadcasts them. Checkpoints then hold each rank's share and resume on the same grid."""

    @property
    def model_parallel_size(self) -> int:
        """GPUs that hold one copy of the model (tensor x pipeline)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021, https://arxiv.org/abs/2106.09685) through PEFT: the model's weights
    stay frozen and each chosen linear layer learns a product B x A of rank `rank` added to its output, scaled by
    alpha / rank. Only the adapters take gradients and AdamW's moments; the reference policy is the same model with
    its adapters turned off; exports are the merged model plus the adapter directory (`model/adapter`)."""

    rank: int = 0
    """Rank of each adapter (PEFT's r); 0 trains every weight of the model (no adapters)."""
    alpha: float = 32.0
    """Scale of the adapters' output, alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in training forwards (PEFT's lora_dropout); the reference and the rollout
    never see it. In RL it makes the update's log-probs differ from the rollout's; 0 keeps them equal."""
    target_modules: str | list[str] = "all-linear"
    """The linear layers that get adapters: `all-linear` (every linear layer but the output layer and a value or
    score head), or a list of names (`[q_proj, v_proj]`; a name matches a layer whose path ends with it)."""
    adapter_path: str | None = None
    """A PEFT adapter directory (a run's `model/adapter`, or any LoRA adapter of this base model) to start from;
    its own rank, alpha and target modules apply. Setting it turns LoRA on."""

    @property
    def enabled(self) -> bool:
        """Whether the model trains adapters (a rank, or an adapter to start from)."""
        return self.rank > 0 or self.adapter_path is not None


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
    token ratios); None disables. Forces the old-log-prob pass (actor.recompute_old_log_prob)."""
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


@dataclass(frozen=True)
class ValSamplingConfig:
    n: int = 1
    """Samples per validation prompt (pass@k and maj@k are logged when > 1)."""
    do_sample: bool = False
    """Sample in validation (False = greedy)."""
    temperature: float = 1.0
    """Sampling temperature in validation when do_sample."""


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts: the model's turns alternate with tool results (or an environment's answers)."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: registered names (`calculate`, `python`) and `path/to/tools.py` files."""
    environment: str | None = None
    """`path/to/env.py:ClassName`, a class with reset(row) and step(messages), instead of the tool environment."""
    format: str = "auto"
    """Tool-call format: `hermes` (`<tool_call>{...}</tool_call>`), `llama3` (a JSON object), or auto (from the
    chat template)."""
    max_turns: int = 4
    """Model turns per trajectory at most."""
    max_tokens_per_turn: int | None = None
    """Tokens one model turn may sample at most; the whole trajectory (turns, tool results and template glue)
    stays within data.max_response_length. None = a turn may use all that is left of it."""
    tool_timeout: float = 10.0
    """Seconds a tool call may take before its reply is a timeout error."""


@dataclass(frozen=True)
class PartialRolloutConfig:
    """Partial rollouts (as slime, AReaL and Kimi k1.5 cut the long tail): a step's generation stops once
    data.train_batch_size prompts have every sample finished; the other trajectories keep their tokens and rollout
    log-probs and continue in the next step under the new weights. Their earlier tokens are off-policy, which
    truncated importance sampling against the rollout's log-probs (actor.rollout_is) corrects."""

    enable: bool = False
    """Partial rollouts (needs actor.rollout_is; single-turn rollouts of the hf backend)."""
    over_sample: float = 1.5
    """Prompts in flight per step, as a multiple of data.train_batch_size (rounded up): the groups beyond the first
    data.train_batch_size finished ones are carried to the next step, finished or not."""
    round_tokens: int | None = None
    """Tokens an unfinished trajectory generates per round: a step's generation stops at the end of the first round
    after which data.train_batch_size prompts have every sample finished, so a round is the token budget of a step
    when it finishes enough prompts. None = data.max_response_length / (max_staleness + 1), rounded up."""
    max_staleness: int = 1
    """Steps a trajectory may span after the one that began it: one begun more than this many steps before the
    current one is dropped (its tokens counted in partial/tokens_dropped) and sampled again from its prompt.
    (max_staleness + 1) x round_tokens must reach data.max_response_length, so that every trajectory can finish."""


@dataclass(frozen=True)
class RolloutConfig:
    name: Literal["hf", "vllm"] = "hf"
    """Generation backend."""
    n: int = 8
    """Responses sampled per prompt (GRPO/RLOO need n > 1)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in training use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    do_sample: bool = True
    """Sample (True) or decode greedily (False)."""
    ignore_eos: bool = False
    """Keep generating past EOS up to max_response_length (benchmarks)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the tokenizer's EOS and every EOS id of the model's generation config
    always do)."""
    log_prob_micro_batch_size_per_device: int | None = None
    """Sequences per old-log-prob forward on one device; None = all at once."""
    hf_decoding: Literal["auto", "generate", "static"] = "auto"
    """hf backend: transformers' `generate`, or `static` decoding (preallocated KV cache, the decode step compiled
    into a CUDA graph on GPUs); auto = static on GPU, generate on CPU. A model the static decoder does not cover
    decodes with `generate` (`ketch doctor` says which path it takes)."""
    tensor_parallel_size: int = 1
    """Processes (GPUs) one rollout model spans: vLLM's engine size (also written to the export's
    vllm_engine_config.json); hf: the heads and MLP width split over groups of this many consecutive processes,
    which decode their prompts together (`ketch.rollout.tensor_parallel`)."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights and KV cache (the actor's training shares the GPU)."""
    max_model_len: int | None = None
    """vLLM: longest sequence; None = data.max_prompt_length + data.max_response_length."""
    max_num_seqs: int = 256
    """vLLM: sequences decoded together."""
    max_num_batched_tokens: int | None = None
    """vLLM: tokens per engine step (None = vLLM's default). hf: the most prompt + response tokens decoded together,
    which bounds the KV cache: a call's prompts are decoded in sub-batches of this // (prompt width +
    data.max_response_length) rows, at least one (None = all at once)."""
    enforce_eager: bool = True
    """vLLM: skip CUDA graphs (faster start, slower decoding)."""
    enable_prefix_caching: bool = True
    """vLLM: reuse the KV cache of shared prompt prefixes (the n samples of a prompt)."""
    check_weight_sync: bool = False
    """Debug: after each weight hand-off, compare one weight's norm in the rollout engine with the actor's."""
    free_memory_while_training: bool = False
    """hf rollout in the hybrid placement: drop the rollout's copy of the weights and its KV caches after each
    generation, so that training has that memory (2 bytes per parameter in bf16, plus the cache), and take the
    weights again at the next hand-off (each decode shape's CUDA graph is captured again). vLLM frees its memory
    between generations by itself where it can (sleep mode)."""
    placement: Literal["hybrid", "standalone"] = "hybrid"
    """hybrid: the rollout engine lives in the actor's processes and takes its weights in memory; standalone: it
    gets processes (devices) of its own, `rollout.n_workers_per_node` per node (Ray), and the actor's rank 0
    broadcasts the weights to them after each update (`ketch.workers.weight_bridge`)."""
    n_workers_per_node: int = 1
    """Processes per node of a standalone rollout (one device each on GPUs)."""
    staleness: int = 0
    """Standalone rollout: 1 generates the next step's responses while this step trains, from the weights before
    this step's update (one step off-policy; `actor.rollout_is` corrects for the lag), so generation and training
    overlap; 0 generates each step's responses from the newest weights."""
    val: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    """Sampling used for validation."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using rollouts."""
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    """Partial rollouts: unfinished trajectories carried over to the next step."""


@dataclass(frozen=True)
class RewardModelConfig:
    path: str | None = None
    """A reward model directory or hub id (`ketch rm` output, or any HF `*ForSequenceClassification` with one
    label) that scores each PPO response at its last valid token; None = no reward model."""
    tokenizer_path: str | None = None
    """The reward model's tokenizer; None = reward.model.path."""
    retokenize: Literal["auto", "always", "never"] = "auto"
    """Re-encode prompt + response for the reward model (decode with the actor's tokenizer, format with the
    reward model's chat template, encode with its tokenizer); auto = when the tokenizers or templates differ."""
    chat_template: str | None = None
    """A built-in chat template (`chatml`, ...) for chat prompts when re-encoding; None = the reward model's own."""
    micro_batch_size_per_device: int | None = None
    """Sequences per reward-model forward on one device (in `ketch rm` a pair is two sequences, so it must be
    even); None = all at once."""
    placement: Literal["colocate", "split"] = "colocate"
    """Ray: the reward model in the actor's processes (colocate), or on a resource pool of its own (split)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Optimizer of `ketch rm` (the default suits the built-in tiny model; use ~1e-5 for large models)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`ketch rm`: train LoRA adapters on the backbone, with the score head trained whole (a frozen PPO reward
    model takes none: give reward.model.path the merged `model/` that `ketch rm` writes)."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13): a response longer than
    data.max_response_length - len loses up to penalty_factor, linearly over the last `len` tokens."""

    enable: bool = False
    """Add the length penalty to every training score (validation accuracy is not changed)."""
    len: int = 4
    """The buffer: tokens before data.max_response_length where the penalty grows from 0 to penalty_factor."""
    penalty_factor: float = 1.0
    """The penalty of a response that uses every allowed token."""


@dataclass(frozen=True)
class RewardConfig:
    function: str | None = None
    """A user scorer `path/to/file.py:fn` with signature fn(data_source, solution_str, ground_truth, extra_info)."""
    on_error: Literal["raise", "zero"] = "raise"
    """When a scorer raises on a sample: stop the run, or log it and score the sample 0."""
    scorer_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments, per data source, of the function that scores its samples (reward.function or the
    registered scorer), in training and validation, e.g. {ketch/arithmetic: {digit_credit: 0.5}}: partial credit
    for the right digits of a wrong answer, while validation accuracy stays exact match (the scorer's `acc`)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The reward model that scores PPO responses, and the settings of `ketch rm`."""
    weights: dict[str, float] | None = None
    """Weights of the score sources `rule` (reward.function or the scorer of each data_source) and `model`
    (reward.model.path), e.g. {rule: 1.0, model: 0.5}; a missing source weighs 0. None = the reward model
    alone when reward.model.path is set, else the rule-based scorers alone. Validation always uses the rules."""
    clip: float | None = None
    """Clip reward-model scores to [-clip, clip] (after normalisation); None disables."""
    normalize: bool = False
    """Normalise reward-model scores by their running mean and std over the run (kept in checkpoints)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping."""

    @property
    def source_weights(self) -> dict[str, float]:
        """`weights` resolved: {"rule": w, "model": w}, with the default described there."""
        if self.weights is None:
            return {"rule": 0.0, "model": 1.0} if self.model.path else {"rule": 1.0, "model": 0.0}
        return {"rule": 0.0, "model": 0.0} | {k: float(v) for k, v in self.weights.items()}


@dataclass(frozen=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient or the adaptive controller of Ziegler et al. 2019."""
    kl_coef: float = 0.001
    """KL coefficient (initial value for adaptive)."""
    target_kl: float = 0.1
    """Adaptive controller target KL per token."""
    horizon: int = 10000
    """Adaptive controller horizon in samples."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476): drop the groups whose samples all have the same
    `metric` (their group advantages are all zero) and generate more prompts until data.train_batch_size
    informative groups are collected."""

    enable: bool = False
    """Filter groups (needs rollout.n >= 2 and sampling)."""
    metric: str = "seq_reward"
    """What must differ within a group: seq_reward (each sample's summed score, overlong penalty included) or a
    field of the dict the reward function returns (e.g. acc)."""
    gen_batch_size: int | None = None
    """Prompts generated per round; None = data.train_batch_size. Larger rounds (verl's gen_batch_size) fill a
    batch in fewer rounds when some groups are dropped; the informative groups beyond the batch are discarded."""
    max_num_gen_batches: int = 10
    """Generation rounds one step may use before it stops with an error; 0 = no limit."""

    def round_size(self, train_batch_size: int) -> int:
        """Prompts per generation round: gen_batch_size when filtering, else data.train_batch_size."""
        return self.gen_batch_size if self.enable and self.gen_batch_size is not None else train_batch_size


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, gae (PPO with a critic), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
    remax (or any registered one)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda (Schulman et al. 2016)."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (False = Dr. GRPO)."""
    normalize_advantage: bool = True
    """Whiten advantages over the batch's valid tokens (GAE and REINFORCE++)."""
    clip_advantage: float | None = None
    """Clip advantages to [-clip, clip] after whitening; None disables."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || reference) from the token-level reward (InstructGPT style)."""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    """KL estimator used in the reward."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL coefficient controller for the in-reward penalty."""
    non_finite: Literal["raise", "zero"] = "raise"
    """A NaN/inf in rewards, values or advantages: stop with a message, or zero those entries and count them."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    overlong_filtering: bool = False
    """Leave the responses that used every allowed token (cut off by data.max_response_length, not stopped) out of
    the actor's loss (DAPO's overlong filtering): their rewards still enter their groups' advantages;
    `response_length/clip_ratio` logs their share."""


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "ketch"
    """Project name used by trackers."""
    experiment_name: str = "arithmetic-grpo"
    """Run name; the run directory is default_local_dir/experiment_name."""
    default_local_dir: str = "runs"
    """Where run directories (metrics, checkpoints, exports) are written."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_steps: int | None = 100
    """Stop after this many steps (overrides total_epochs when set)."""
    log_interval: int = 10
    """Print one summary line every this many steps."""
    test_freq: int = 25
    """Validate every this many steps (and at the end); 0 disables periodic validation."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_samples_to_log: int = 4
    """Validation prompts whose responses (all rollout.val.n of them) are written to `<run dir>/samples.jsonl` with
    their scores at every validation; 0 writes none."""
    save_freq: int = 0
    """Save a checkpoint every this many steps (and at the end); 0 = only at the end."""
    max_checkpoints_to_keep: int | None = None
    """Keep only this many newest checkpoints (older ones are deleted); None keeps all."""
    checkpoint_remote_dir: str | None = None
    """An fsspec URL (s3://..., gs://..., file://...) that receives a copy of every saved checkpoint."""
    resume_mode: str = "auto"
    """`auto`: continue from the newest complete checkpoint of the run directory (else start fresh);
    `disable`: start fresh; or the path of a checkpoint directory (`.../checkpoints/global_step_N`)."""
    max_retries: int = 0
    """Failed steps (a worker raising, out of memory, a worker process dying) recovered from per run."""
    oom_retry_delay: float = 10.0
    """Seconds to wait after an out-of-memory failure before restarting the workers."""
    checkpoint_on_failure: bool = True
    """On a failed step, save a checkpoint first when the workers are still alive."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Trackers: any of console, jsonl (always on), tensorboard (`<run dir>/tensorboard`), wandb (honours WANDB_MODE;
    files under the run dir), mlflow (MLFLOW_TRACKING_URI, else a file store `<run dir>/mlruns`). The last three
    need their extra: pip install 'ketch[tensorboard]' (or wandb, mlflow)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers; auto = cuda when available."""
    seed: int = 1
    """Seed of data order, sampling and initialisation."""
    n_gpus_per_node: int = 1
    """GPUs per node used by the workers (when the workers run on GPUs)."""
    n_cpu_workers: int = 1
    """Worker processes per node when the workers run on CPUs (FSDP over gloo when > 1)."""
    nnodes: int = 1
    """Nodes used by the workers."""
    backend: Literal["auto", "local", "ray"] = "auto"
    """Where workers run: in this process (local), in Ray actors (ray); auto = ray when more than one
    worker process, more than one node, a standalone rollout or a trainer.ray_address is asked for."""
    placement: Literal["colocate", "split"] = "colocate"
    """Ray: all roles of a rank in one process per device (colocate), or the critic on a pool of its own (split)."""
    ray_address: str | None = None
    """Ray cluster to join: None starts a local Ray instance; `auto` or HOST:PORT joins a running cluster."""
    worker_timeout: float | None = 3600.0
    """Seconds a worker call may take before the run stops with an error naming the rank; None waits forever."""


@dataclass(frozen=True)
class KetchConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts: files, columns, lengths, batch size, chat template."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model: where it loads from, its dtype, and how its training forwards run."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy's training: engine, optimizer, mini- and micro-batches, clipping, policy loss, KL loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO with a critic (algorithm.adv_estimator=gae)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy, loaded when a KL term needs it."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: backend, sampling, placement, validation sampling and multi-turn tool use."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring: a reward function, scorer arguments, a reward model, and how their scores mix."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The advantage estimator, the KL penalty in the reward, and DAPO's dynamic sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run: steps, validation, checkpoints, resume, retries, trackers, devices and processes."""

    @property
    def use_critic(self) -> bool:
        """Whether a value model is trained (explicit critic.enable, else only for GAE)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def uses_gpu(self, gpu_visible: bool) -> bool:
        """Whether the workers run on GPUs (`gpu_visible`: does this machine see one, for device=auto)."""
        return self.trainer.device == "cuda" or (self.trainer.device == "auto" and gpu_visible)

    def num_processes(self, gpu_visible: bool) -> int:
        """Worker processes over all nodes (one per device)."""
        t = self.trainer
        return t.nnodes * (t.n_gpus_per_node if self.uses_gpu(gpu_visible) else t.n_cpu_workers)

    @property
    def model_parallel_size(self) -> int:
        """Processes that share one data-parallel rank's micro-batches: the Megatron tensor x pipeline size, else
        actor.ulysses_sequence_parallel_size (1 without sequence parallelism)."""
        roles = [self.actor] + ([self.critic] if self.use_critic else [])
        sequence_parallel = self.actor.ulysses_sequence_parallel_size
        return max(r.megatron.model_parallel_size if r.strategy == "megatron" else sequence_parallel for r in roles)

    def world_size(self, gpu_visible: bool) -> int:
        """Data-parallel ranks over all nodes: processes / model_parallel_size (rounded down; validation
        requires that it divides)."""
        return max(1, self.num_processes(gpu_visible) // self.model_parallel_size)

    def rollout_processes(self, gpu_visible: bool) -> int:
        """Processes that run the rollout engine: a standalone rollout's over all nodes, else the workers'."""
        if self.rollout.placement == "standalone":
            return self.trainer.nnodes * self.rollout.n_workers_per_node
        return self.num_processes(gpu_visible)

    def uses_ray(self, gpu_visible: bool) -> bool:
        """The backend that `trainer.backend` resolves to (see its documentation)."""
        if self.trainer.backend != "auto":
            return self.trainer.backend == "ray"
        t = self.trainer
        many = self.num_processes(gpu_visible) > 1 or t.nnodes > 1 or self.rollout.placement == "standalone"
        return many or t.ray_address is not None

    @property
    def use_reference(self) -> bool:
        """Whether reference log-probs are needed (KL in the reward or in the loss)."""
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss
