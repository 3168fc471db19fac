"""The FSDP2 training engine: shard a model, run micro-batched forwards, and take optimizer steps.

One engine per model per process. It knows nothing about RL: the actor and critic workers give it a
loss function. Losses are normalised by the whole mini-batch's valid tokens over all ranks, so the
gradient does not depend on how the mini-batch is split into micro-batches or over ranks.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ketch.architecture import compile_problem, decoder_blocks
from ketch.compiled import SavedCompile, saved_compile
from ketch.config.parallel import sequence_parallel_problem
from ketch.config.schema import OptimConfig
from ketch.engine.activations import HostActivations
from ketch.engine.distributed import all_reduce_sum
from ketch.engine.fused_log_probs import load_kernels
from ketch.engine.lora import lora_layers, merged
from ketch.engine.micro import split_micro_batches
from ketch.engine.optim import build_optimizer, build_scheduler, step_unless
from ketch.engine.sequence_parallel import sequence_parallel_group
from ketch.models.vision import image_model_inputs
from ketch.protocol import DataProto

logger = logging.getLogger("ketch.engine")

LossFn = Callable[[dict[str, torch.Tensor], DataProto, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]
"""loss_fn(outputs, micro_batch, num_tokens, num_seqs) -> (loss, metrics); counts are mini-batch totals."""

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
GIVEN_INPUTS = ("given_experts",)
"""Inputs passed on to the module where a micro-batch holds them: the experts each token of a mixture of experts is
routed to or compared with, `[batch, seq, moe_layers, top_k]` (`ketch.models.router_replay`)."""


def shard(
    module: nn.Module, device: torch.device, param_dtype: torch.dtype | None = None, save_memory: bool = False
) -> nn.Module:
    """Move `module` to `device` and apply FSDP2: each transformer block, then the root. In a world of one
    process the blocks keep their gathered (cast) parameters from the forward to the backward pass, unless
    `save_memory` (a model recomputing its activations): freeing them saves a copy of the weights in
    `param_dtype` (14 GiB at 7B), and casting them again in the backward pass costs a copy per block."""
    module.to(device)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": policy} if policy else {}
    if not save_memory and (not dist.is_initialized() or dist.get_world_size() == 1):
        kwargs["reshard_after_forward"] = False
    for block in transformer_blocks(module):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks (decoder layers) of the HF model inside `module`."""
    return decoder_blocks(_hf_model(module))


def compile_enabled(use_torch_compile: bool | None, device: torch.device) -> bool:
    """`model.use_torch_compile`, where None means: on CUDA devices only."""
    return device.type == "cuda" if use_torch_compile is None else use_torch_compile


def compiles(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the blocks of the HF `model` compile when they compute in `dtype` (`architecture.compile_problem`);
    those that do not run eagerly, said once per model class in an INFO line."""
    problem = compile_problem(model.config, dtype)
    if problem and type(model).__name__ not in _EAGER:
        _EAGER.add(type(model).__name__)
        logger.info("%s trains with eager blocks, not compiled ones: %s", type(model).__name__, problem)
    return problem is None


_EAGER: set[str] = set()
"""The model classes whose eager blocks have been logged in this process."""


def _block_forward(block: nn.Module, *args, **kwargs):
    """`block`'s own forward, with the block an input: one compiled graph serves every block."""
    return type(block).forward(block, *args, **kwargs)


def compile_blocks(module: nn.Module, backend: str = "inductor") -> SavedCompile | None:
    """Compile each transformer block's forward (and with it, through AOTAutograd, its backward): the
    elementwise work around the matmuls (norms, rotary embeddings, activations, residual adds, casts) becomes a
    few fused kernels. The blocks share one compiled graph (the block's parameters are inputs), saved for later
    runs (`ketch.compiled`); FSDP's hooks stay outside it, on the module call. Returns the compiled function
    (None without blocks)."""
    blocks = transformer_blocks(module)
    if not blocks:
        return None
    name = type(blocks[0]).__name__
    compiled = saved_compile(_block_forward, f"train_block-{name}", backend=backend)
    for block in blocks:
        block.forward = partial(compiled, block)
    logger.info(
        "compiling the %d %s blocks of the training forward on first use, or loading them (cache %s)",
        len(blocks),
        name,
        compiled.directory,
    )
    return compiled


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most `max_norm` (as `clip_grad_norm_`); returns
    the norm before clipping. Works on each rank's local shards (`DTensor.to_local`) with one fused norm and
    one all-reduce of the squared norms, instead of a DTensor operation per parameter."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = torch.stack(torch._foreach_norm(grads, 2.0)).float().square().sum()
    norm = all_reduce_sum(squares).sqrt()
    if math.isfinite(max_norm):
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm


def use_sequence_parallel(module: nn.Module, size: int) -> None:
    """Give the packed head `module` its group of `size` sequence-parallel ranks; a head that runs padded, or a
    mixture of experts (its router loss is over each rank's tokens), is refused."""
    name = type(_hf_model(module)).__name__
    if not getattr(module, "packed", False) or not hasattr(module, "sequence_parallel"):
        raise ValueError(
            f"actor.ulysses_sequence_parallel_size={size}: {name} ({type(module).__name__}) does not train packed; "
            "sequence parallelism needs model.use_remove_padding=true and a model that packs (ketch doctor)"
        )
    if getattr(module, "router", None) is not None:
        raise ValueError(f"actor.ulysses_sequence_parallel_size={size}: not for mixtures of experts ({name})")
    problem = sequence_parallel_problem(size, _hf_model(module).config)
    if problem:
        raise ValueError(problem)
    module.sequence_parallel = sequence_parallel_group(size)


def _hf_model(module: nn.Module) -> nn.Module:
    return next((m for m in module.modules() if hasattr(m, "_no_split_modules")), module)


class TrainEngine:
    """An FSDP2-sharded module with (optionally) AdamW and an lr schedule. `gradient_checkpointing` recomputes each
    block's activations in the backward pass; `activation_offload` keeps what a training forward saves for the
    backward (with recomputation: the checkpoints) in host memory (`ketch.engine.activations`); `sequence_parallel`
    ranks share each micro-batch's tokens (`ketch.engine.sequence_parallel`: they get the same micro-batches). AdamW
    trains the parameters that take gradients: all of them, or a model's LoRA adapters (`ketch.engine.lora`) and
    whatever else is left trainable."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        optim: OptimConfig | None = None,
        total_steps: int = 1,
        param_dtype: torch.dtype | None = None,
        gradient_checkpointing: bool = False,
        compile: bool = False,
        activation_offload: bool = False,
        sequence_parallel: int = 1,
    ):
        if gradient_checkpointing:
            _hf_model(module).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        dtype = param_dtype or next(module.parameters()).dtype
        compiled = compile_blocks(module) if compile and compiles(_hf_model(module), dtype) else None
        self.device, self.param_dtype = device, param_dtype
        self.module = shard(module, device, param_dtype, save_memory=gradient_checkpointing)
        if compiled is not None:
            compiled.load()  # after sharding: the saved guards name FSDP's class of the blocks
        load_kernels(device)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.sequence_parallel = sequence_parallel
        if sequence_parallel > 1:
            use_sequence_parallel(self.module, sequence_parallel)
        self.host_activations = HostActivations() if activation_offload else None
        self.optim_config = optim
        self.lora_layers = lora_layers(self.module)
        if optim is None:
            self.module.requires_grad_(False)
            self.optimizer = self.scheduler = None
        else:
            trained = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer = build_optimizer(trained, optim, device)
            self.scheduler = build_scheduler(self.optimizer, optim, total_steps)

    # ----------------------------------------------------------------- inference
    @torch.no_grad()
    def infer(
        self,
        data: DataProto,
        micro_batch_size: int | None,
        max_tokens: int | None = None,
        train: bool = False,
        **kwargs,
    ) -> dict[str, torch.Tensor]:
        """Run the module over `data` in micro-batches (eval mode, or with `train` the update's training mode; no
        grad); outputs concatenated `[batch, ...]`."""
        self.module.train(train)
        outputs = defaultdict(list)
        for micro, host_mask in self._on_device(split_micro_batches(data, micro_batch_size, max_tokens)):
            for key, value in self._forward(micro, host_mask, **kwargs).items():
                outputs[key].append(value)
        return {key: torch.cat(values) for key, values in outputs.items()}

    def _on_device(self, micro_batches: list[DataProto]) -> list[tuple[DataProto, torch.Tensor]]:
        """Each micro-batch moved to the device (in place), with its attention mask as it was on the host. All
        are moved before the first forward: a copy from pageable host memory waits for the GPU's queued work,
        and the GPU then idles while the host launches the next forward."""
        host_masks = [micro.batch["attention_mask"] for micro in micro_batches]
        return [(micro.to(self.device), mask) for micro, mask in zip(micro_batches, host_masks, strict=True)]

    def _forward(self, micro: DataProto, host_mask: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        inputs = {k: micro.batch[k] for k in MODEL_INPUTS} | {
            k: micro.batch[k] for k in GIVEN_INPUTS if k in micro.batch
        }
        if "multi_modal_inputs" in micro.non_tensor_batch:
            images = micro.non_tensor_batch["multi_modal_inputs"]
            kwargs["image_inputs"] = image_model_inputs(_hf_model(self.module).config, inputs["input_ids"], images)
        response_len = micro.batch["responses"].shape[-1]
        return self.module(**inputs, response_len=response_len, host_attention_mask=host_mask, **kwargs)

    # ----------------------------------------------------------------- training
    def train_mini_batch(self, micro_batches: list[DataProto], loss_fn: LossFn, **kwargs) -> dict[str, float]:
        """One optimizer step over the micro-batches of one mini-batch on this rank.

        `loss_fn` returns its loss and metrics as shares of the whole mini-batch (normalised by the global
        counts it is given), so sums over micro-batches and ranks are exact mini-batch values: that is what
        is returned, with `loss`, `grad_norm` and `lr`. A non-finite gradient norm skips the step."""
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        masks = [m.batch["response_mask"] for m in micro_batches]
        # the ranks of a sequence-parallel group hold the same sequences: each counted once
        num_tokens = all_reduce_sum(sum(m.sum() for m in masks).to(self.device, torch.float32)) / self.sequence_parallel
        num_seqs = all_reduce_sum(sum((m.sum(-1) > 0).sum() for m in masks).to(self.device, torch.float32))
        num_seqs = num_seqs / self.sequence_parallel
        totals: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        for i, (micro, host_mask) in enumerate(self._on_device(micro_batches)):
            self.module.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with self.host_activations or nullcontext():
                outputs = self._forward(micro, host_mask, **kwargs)
            loss, metrics = loss_fn(outputs, micro, num_tokens, num_seqs)
            # FSDP averages gradients over ranks; each rank's loss is already its share of the global mean.
            (loss * self.world_size).backward()
            for key, value in {"loss": loss.detach(), **metrics}.items():
                totals[key] += value
        summed = all_reduce_sum(torch.stack(list(totals.values()))) / self.sequence_parallel
        stepped = self._step()  # launched before the metrics are read, so the GPU need not wait for the host
        return dict(zip(totals, summed.tolist(), strict=True)) | stepped

    def _step(self) -> dict[str, float]:
        norm = clip_grad_norm(self.module.parameters(), self.optim_config.grad_clip or math.inf)
        step_unless(self.optimizer, ~torch.isfinite(norm))
        self.optimizer.zero_grad(set_to_none=True)  # the gradients' memory is free until the next backward pass
        grad_norm, lr = norm.item(), self.scheduler.get_last_lr()[0]
        if not math.isfinite(grad_norm):
            logger.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
            return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": 1.0}
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": 0.0}

    # ----------------------------------------------------------------- weights
    def full_parameters(self, prefix: str = "", dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, names relative to the submodule `prefix` (e.g. `lm.` for the
        wrapped HF model). Tied parameters come under each of their names (some engines, like vLLM's CPU build,
        need `lm_head.weight` spelled out). LoRA adapters come merged into their layers' weights, under the plain
        model's names (`ketch.engine.lora.merged`).

        Without mixed precision, or in its `param_dtype` (the rollout's dtype), the weights come one FSDP unit (a
        transformer block, then the root's own parameters) at a time, with one all-gather per unit in the dtype
        the forward uses: each tensor stays valid only until the next unit is gathered, so a caller that keeps
        them clones them. The float32 master weights of a mixed-precision engine (`dtype` None or float32) are
        gathered one parameter at a time."""
        if self.param_dtype is not None and dtype != self.param_dtype:
            named = self._gathered_one_by_one(dtype)
        else:
            named = self._gathered_by_unit(dtype)
        for name, tensor in merged(named, self.lora_layers):
            yield name.removeprefix(prefix), tensor

    def frozen_whole_parameters(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The parameters that take no gradient, are of `dtype` and lie whole on this rank (a world of one), as
        the tensors the engine keeps (no copy), by name relative to the submodule `prefix`, tied ones under each
        name: a rollout on the same device may read them in place of weights of its own. A LoRA layer's base weight
        is left out (the rollout gets it merged with the adapter, `full_parameters`)."""
        out = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            local = param.to_local() if isinstance(param, DTensor) else param
            adapted = ".base_layer." in name or ".lora_" in name
            if param.requires_grad or adapted or local.dtype != dtype or local.shape != param.shape:
                continue
            if name.startswith(prefix):
                out[name.removeprefix(prefix)] = local.detach()
        return out

    def trained_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of each parameter that takes gradients (a model's LoRA adapters and a head trained
        with them), one `full_tensor()` each: every rank must draw them all."""
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield name, (param.full_tensor() if isinstance(param, DTensor) else param).detach()

    def _gathered_by_unit(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        for unit, names in self._fsdp_units():
            unit.unshard()
            try:
                for name in names:
                    tensor = self.module.get_parameter(name).detach()
                    yield name, tensor.to(dtype or tensor.dtype)
            finally:
                unit.reshard()

    def _fsdp_units(self) -> list[tuple[FSDPModule, list[str]]]:
        """Each FSDP unit (fully_shard module) with the names of the parameters it gathers, tied ones repeated."""
        units = {path: module for path, module in self.module.named_modules() if isinstance(module, FSDPModule)}
        names: dict[str, list[str]] = {path: [] for path in units}
        for name, _ in self.module.named_parameters(remove_duplicate=False):
            owner = max((p for p in units if p == "" or name.startswith(f"{p}.")), key=len)
            names[owner].append(name)
        return [(units[path], names[path]) for path in units if names[path]]

    def _gathered_one_by_one(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """`full_parameters` one `full_tensor()` per parameter, cast to `dtype`: tensors of their own."""
        named = list(self.module.named_parameters(remove_duplicate=False))
        counts = Counter(id(param) for _, param in named)
        tied: dict[int, torch.Tensor] = {}
        for name, param in named:
            tensor = tied.get(id(param))
            if tensor is None:
                full = param.full_tensor() if isinstance(param, DTensor) else param
                tensor = full.detach().to(dtype or full.dtype)
                if counts[id(param)] > 1:
                    tied[id(param)] = tensor
            yield name, tensor
