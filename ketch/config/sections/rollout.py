"""The `rollout` section and its subsections: validation sampling, multi-turn tool use, partial rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
    """Partial rollouts (needs actor.rollout_is; single- or multi-turn rollouts of the hf or vLLM backend)."""
    over_sample: float = 1.5
    """Prompts in flight per step, as a multiple of data.train_batch_size (rounded up): the groups beyond the first
    data.train_batch_size finished ones are carried to the next step, finished or not."""
    round_tokens: int | None = None
    """A token budget: tokens an unfinished trajectory generates per round at most. A step's generation stops once
    data.train_batch_size prompts have every sample finished, within the round (the rows still going are cut there;
    a trajectory in its last step before max_staleness goes on to its end); a round that spends its budget first is
    followed by another, which prefills the trajectories' tokens so far again. Multi-turn: tokens the model samples,
    over as many turns as fit (environment answers are not counted); a turn the round cuts goes on at the next
    round, and a round runs its turns to their ends. None = no budget (data.max_response_length): one round a step,
    ended by the prompts finished; multi-turn, whose rounds do not end early, data.max_response_length /
    (max_staleness + 1), rounded up."""
    max_staleness: int = 1
    """Steps a trajectory may span after the one that began it: one begun more than this many steps before the
    current one is dropped (its tokens counted in partial/tokens_dropped) and sampled again from its prompt. With
    round_tokens set, (max_staleness + 1) x round_tokens must reach data.max_response_length, so that every
    trajectory can finish."""


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
    quantization: Literal["none", "fp8"] = "none"
    """fp8: the rollout decodes with its projections' weights in float8 e4m3 (one scale per output channel, made
    again at each hand-off; the lm head and norms stay bf16), which halves the weight traffic of a decode step on
    GPUs with FP8 matmuls (compute capability 8.9 or newer); the trained weights stay bf16. The rollout's log-probs
    then differ from the trained model's: set actor.rollout_is=token to correct for it. vLLM: its own
    quantization="fp8"."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """fp8: the KV cache in float8 e4m3 (half of a bf16 cache: twice the rows or the context in the same memory, half
    the bytes a long decode step reads), keys and values clamped to +-448 with no scale; the prompt attends among its
    own tokens unrounded. hf rollout: the static decoder's cache; vLLM: its own kv_cache_dtype="fp8". The rollout's
    log-probs then differ from the trained model's: set actor.rollout_is=token to correct for it."""
    exact_log_probs: bool = False
    """hf rollout: the rollout and the actor compute batch-invariantly (`ketch.models.batch_invariant`: matmuls in
    blocks of 16 rows, attention over keys in blocks of 64 in one order, one log-softmax per row), so the rollout's
    log-probs of the sampled tokens equal the actor's training forward's bit for bit; they serve as old_log_prob
    (as with actor.old_log_prob_from_rollout) and the old-log-prob pass is skipped. Decodes with the static
    decoder in its exact mode (the training forward's ops, the eager step captured into CUDA graphs on GPUs) or
    with `generate` (rollout.hf_decoding), and trains on padded batches, eagerly; Llama, Qwen2, Qwen3 and Qwen3-MoE
    models, single-turn, without tensor or sequence parallelism, LoRA or FP8 (start-up says which setting stops
    it)."""
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
