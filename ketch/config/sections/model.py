"""The sections of the model and its data: `data`, `model`, and the optimizer, Megatron and LoRA settings that
the roles share; the names of the built-in task and models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

BUILTIN_TASK = "builtin:arithmetic"
BUILTIN_MODEL = "builtin:tiny-arithmetic"
BUILTIN_CALCULATOR_MODEL = "builtin:tiny-calculator"
BUILTIN_CALLER_MODEL = "builtin:tiny-calculator-calls"
BUILTIN_DOTS_MODEL = "builtin:tiny-dots"
BUILTIN_PREFERENCE_TASK = "builtin:arithmetic-preference"


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: [f"{BUILTIN_TASK}/train"])
    """Parquet files (local paths or fsspec URLs) of training prompts; `builtin:arithmetic/train` is generated."""
    val_files: list[str] = field(default_factory=lambda: [f"{BUILTIN_TASK}/val"])
    """Parquet files of validation prompts; empty disables validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a chat message list [{role, content}, ...]."""
    image_key: str = "images"
    """Column holding each prompt's images, for a vision-language model (verl's layout): one image or a list, each
    PNG/JPEG bytes, a file path or a {bytes, path} dict, placed by `<image>` in the prompt text or by
    {"type": "image"} entries in a message's content list. A missing column means no images."""
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
    """Recompute activations in the backward pass to save memory. rollout.exact_log_probs=true sets it to true where
    it is not given (its attention keeps whole score matrices for the backward)."""
    activation_offload: bool = False
    """Keep what the training forwards (actor, critic) save for their backward pass in host memory (pinned on GPUs)
    and copy it back when the backward pass needs it. With gradient_checkpointing that is each transformer block's
    input, layers x tokens x hidden numbers per micro-batch, so the GPU holds one block's activations at a time and
    no checkpoint (long responses); without it, every activation (slow). FSDP engine only; nothing is gained on
    CPUs."""
    freeze_vision_tower: bool = True
    """A vision-language model trains its language model and the projector from its vision encoder into it, not the
    vision encoder itself (no gradients, no optimizer state). Text-only models ignore it."""
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
