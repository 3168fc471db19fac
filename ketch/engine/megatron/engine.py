"""The Megatron-Core training engine: the FSDP2 `TrainEngine`'s interface (`infer`, `train_mini_batch`,
`full_parameters`, checkpoints) on a tensor/pipeline-parallel GPTModel.

Processes form Megatron's grid (`grid.py`); the data-parallel dispatch gives every tensor/pipeline peer the
same rows. Micro-batches are ketch's; Megatron's schedule (`get_forward_backward_func`: no pipelining, 1F1B or
interleaved 1F1B) runs them. Log-probs come from vocabulary-parallel logits, a chunk of tokens at a time
(`vocab_parallel_log_probs.py`). Parameters are float32 and the forward runs under autocast in `dtype`; gradients are
summed over data-parallel ranks (the loss is already each rank's share of the global mean, as in the FSDP engine)
and clipped by the global norm over the whole model.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors import safe_open
from torch.distributed.optim import ZeroRedundancyOptimizer

from ketch.config.schema import MegatronConfig, OptimConfig
from ketch.engine.checkpoint import rng_state, set_rng_state
from ketch.engine.engine import LossFn
from ketch.engine.megatron.grid import RankGrid
from ketch.engine.megatron.model import build_chunks, recompute_layers, transformer_config
from ketch.engine.megatron.vocab_parallel_log_probs import chunked_vocab_parallel_log_probs
from ketch.engine.megatron.weights import (
    ModelShape,
    Parallel,
    chunk_names,
    hf_to_megatron_chunk,
    to_hf,
    unshard,
)
from ketch.engine.micro import split_micro_batches
from ketch.engine.optim import build_optimizer, build_scheduler, load_optimizer_state, optimizer_state
from ketch.protocol import DataProto

logger = logging.getLogger("ketch.engine")


def init_model_parallel(megatron: MegatronConfig, seed: int) -> None:
    """Megatron's process groups over the default group (once per process), checked against `RankGrid`."""
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            megatron.tensor_model_parallel_size,
            megatron.pipeline_model_parallel_size,
            megatron.virtual_pipeline_model_parallel_size,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    grid = RankGrid(
        dist.get_rank(),
        dist.get_world_size(),
        megatron.tensor_model_parallel_size,
        megatron.pipeline_model_parallel_size,
    )
    got = (mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(), mpu.get_pipeline_model_parallel_rank())
    if got != (grid.tp_rank, grid.dp_rank, grid.pp_rank):
        raise RuntimeError(f"Megatron placed rank {grid.rank} at (tp, dp, pp) = {got}, the dispatch expects {grid}")


def hf_reader(model_path: str):
    """A function name -> tensor over the safetensors files of an HF directory (each tensor read on demand)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"strategy=megatron loads *.safetensors weights, and {model_path} has none")
    where = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            where.update(dict.fromkeys(handle.keys(), file))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as handle:
            return handle.get_tensor(name)

    return read


class MegatronEngine:
    """This rank's GPTModel chunks with (optionally) AdamW: a policy (outputs `log_prob`, `entropy`) or, with
    `value_head`, a critic (`values`). `read(name)` gives the HF tensor `name` (see `hf_reader`)."""

    def __init__(
        self,
        hf_config: Any,
        read: Callable[[str], torch.Tensor],
        megatron: MegatronConfig,
        device: torch.device,
        optim: OptimConfig | None = None,
        total_steps: int = 1,
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        value_head: bool = False,
    ):
        init_model_parallel(megatron, seed)
        self.hf_config, self.device, self.optim_config = hf_config, device, optim
        self.shape = ModelShape.from_hf(hf_config, value_head)
        self.parallel = Parallel(
            megatron.tensor_model_parallel_size,
            megatron.pipeline_model_parallel_size,
            megatron.virtual_pipeline_model_parallel_size,
        )
        self.config = transformer_config(hf_config, megatron, dtype)
        self.pp_rank, self.tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        self.chunks = build_chunks(hf_config, self.config, self.pp_rank, value_head)
        if gradient_checkpointing:
            for chunk in self.chunks:
                recompute_layers(chunk)
        for vp_stage, chunk in enumerate(self.chunks):
            state = hf_to_megatron_chunk(read, self.shape, self.parallel, (self.pp_rank, vp_stage, self.tp_rank))
            missing, unexpected = chunk.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.endswith("_extra_state")]:
                raise RuntimeError(f"weights do not fit the Megatron model: missing {missing}, unexpected {unexpected}")
            chunk.to(device)
        self.params = [p for chunk in self.chunks for p in chunk.parameters()]
        if optim is None:
            for p in self.params:
                p.requires_grad_(False)
            self.optimizer = self.scheduler = None
        else:
            shard = megatron.use_distributed_optimizer and mpu.get_data_parallel_world_size() > 1
            self.optimizer = build_optimizer(
                self.params, optim, device, mpu.get_data_parallel_group() if shard else None
            )
            self.scheduler = build_scheduler(self.optimizer, optim, total_steps)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    # ----------------------------------------------------------------- forward
    def _run(self, micros: list[DataProto], step_fn, forward_only: bool) -> list[dict]:
        """Megatron's schedule over `micros` (equal row counts); `step_fn(output, micro)` on the last stage
        returns (loss, metrics or outputs). Returns the last stage's per-micro-batch dicts ([] elsewhere)."""
        rows, seq = micros[0].batch["input_ids"].shape
        if self.config.sequence_parallel and seq % self.parallel.tp:
            raise ValueError(
                f"sequence_parallel splits the {seq} positions (data.max_prompt_length + data.max_response_length) "
                f"over {self.parallel.tp} tensor ranks; make the sum a multiple of tensor_model_parallel_size"
            )
        data = [iter(micros) for _ in self.chunks]
        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=partial(self._forward_step, step_fn),
            data_iterator=data if len(self.chunks) > 1 else data[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micros),
            seq_length=seq,
            micro_batch_size=rows,
            forward_only=forward_only,
        )

    def _forward_step(self, step_fn, data_iterator, model):
        micro = next(data_iterator).to(self.device)
        ids, attention = micro.batch["input_ids"], micro.batch["attention_mask"].bool()
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        masked = ~(causal[None, None] & attention[:, None, None, :])  # Megatron: True = not attended
        out = model(input_ids=ids, position_ids=micro.batch["position_ids"], attention_mask=masked)
        if not model.post_process:
            return out.float(), None  # activations travel to the next stage in pipeline_dtype (float32)
        return out, partial(self._last_stage, step_fn, micro, model)

    def _last_stage(self, step_fn, micro: DataProto, model, out: torch.Tensor):
        """The loss of the last stage's output `out`: values `[batch, seq, 1]` of a critic, hidden states
        `[batch, seq, hidden]` of a policy (its `VocabParallelHead`)."""
        if self.shape.value_head:  # the value of each response token from the state before it
            response_len = micro.batch["responses"].shape[-1]
            outputs = {"values": out[:, -response_len - 1 : -1, 0].float()}
        else:
            tied = model.share_embeddings_and_output_weights
            weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
            outputs = self._policy_outputs(out, weight, micro)
        loss, info = step_fn(outputs, micro)
        return loss, torch.ones((), dtype=torch.int, device=out.device), info

    def _policy_outputs(self, hidden: torch.Tensor, weight: torch.Tensor, micro: DataProto) -> dict[str, torch.Tensor]:
        """`log_prob` (and `entropy`) `[batch, response_len]` float32 from `hidden` `[batch, seq, hidden]` and this
        rank's output weight `[vocab / tp, hidden]`; the hidden state before each response token scores it, and
        only real response tokens are scored (0 at padding, as the FSDP engine)."""
        response_len = micro.batch["responses"].shape[-1]
        valid = micro.batch["attention_mask"][:, -response_len:].bool()
        states = hidden[:, -response_len - 1 : -1][valid]
        labels = micro.batch["input_ids"][:, -response_len:][valid]
        dtype = self.config.autocast_dtype if self.config.enable_autocast else None
        log_prob, entropy = chunked_vocab_parallel_log_probs(
            states,
            labels,
            weight,
            self.tp_rank * weight.shape[0],
            mpu.get_tensor_model_parallel_group(),
            self.temperature,
            self.calc_entropy,
            dtype,
        )
        zeros = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        outputs = {"log_prob": zeros.masked_scatter(valid, log_prob)}
        return outputs | ({"entropy": zeros.masked_scatter(valid, entropy)} if entropy is not None else {})

    def _forward_kwargs(self, temperature: float = 1.0, calc_entropy: bool = False) -> None:
        self.temperature, self.calc_entropy = temperature, calc_entropy

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
        """Outputs `[batch, response_len]` of the module over `data` in micro-batches of `micro_batch_size` rows
        (eval mode, or with `train` the update's training mode; no grad), on every rank of the model (the last
        pipeline stage broadcasts them)."""
        self._forward_kwargs(**kwargs)
        for chunk in self.chunks:
            chunk.train(train)
        micros = split_micro_batches(data, micro_batch_size, max_tokens)
        real = [len(m) for m in micros]
        store = self._run(self._schedulable(micros), self._outputs_only, forward_only=True)
        keys = ["values"] if self.shape.value_head else ["log_prob"] + (["entropy"] if self.calc_entropy else [])
        outputs = {}
        for key in keys:
            kept = [s[key][:n] for s, n in zip(store, real, strict=False)]  # fillers come after the real rows
            value = torch.cat(kept) if self.is_last_stage else None
            outputs[key] = self._from_last_stage(value, (len(data), data.batch["responses"].shape[-1]))
        return outputs

    def _schedulable(self, micros: list[DataProto]) -> list[DataProto]:
        """What Megatron's schedules need: pipeline stages exchange fixed-shape activations, so every micro-batch
        gets the largest one's row count; the interleaved schedule also needs a multiple of the pipeline size
        of micro-batches. The padding is rows (and micro-batches) without loss, in order after the real ones."""
        if self.parallel.pp == 1:
            return micros
        rows = max(len(m) for m in micros)
        micros = [DataProto.concat([m, _no_loss(m, rows - len(m))]) if len(m) < rows else m for m in micros]
        if self.parallel.vpp:
            micros += [_no_loss(micros[0], rows)] * (-len(micros) % self.parallel.pp)
        return micros

    def _outputs_only(self, outputs: dict[str, torch.Tensor], micro: DataProto):
        return torch.zeros((), device=self.device), outputs

    def _from_last_stage(self, value: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        if self.parallel.pp == 1:
            return value
        if value is None:
            value = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.broadcast(
            value, mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
        )
        return value

    # ----------------------------------------------------------------- training
    def train_mini_batch(self, micro_batches: list[DataProto], loss_fn: LossFn, **kwargs) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches, as `TrainEngine.train_mini_batch`: `loss_fn` gets
        the mini-batch's token and sequence counts over the data-parallel ranks; metrics are mini-batch sums."""
        self._forward_kwargs(**kwargs)
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad(set_to_none=True)
        dp = mpu.get_data_parallel_group()
        masks = [m.batch["response_mask"] for m in micro_batches]
        counts = torch.stack([sum(m.sum() for m in masks), sum((m.sum(-1) > 0).sum() for m in masks)])
        counts = counts.to(self.device, torch.float32)
        dist.all_reduce(counts, group=dp)
        num_tokens, num_seqs = counts[0], counts[1]

        def step(out, micro):
            loss, metrics = loss_fn(out, micro, num_tokens, num_seqs)
            metrics = {"loss": loss, **metrics}
            return loss, {
                k: torch.as_tensor(v, dtype=torch.float32, device=self.device).detach() for k, v in metrics.items()
            }

        store = self._run(self._schedulable(micro_batches), step, forward_only=False)
        totals = self._sum_metrics(store)
        return totals | self._step()

    def _sum_metrics(self, store: list[dict]) -> dict[str, float]:
        """Sums over micro-batches (last stage) and data-parallel ranks, known on every rank."""
        keys = [list(store[0])] if self.is_last_stage else [None]
        if self.parallel.pp > 1:
            dist.broadcast_object_list(
                keys, mpu.get_pipeline_model_parallel_last_rank(), group=mpu.get_pipeline_model_parallel_group()
            )
        values = torch.zeros(len(keys[0]), device=self.device)
        if self.is_last_stage:
            values = torch.stack([sum(s[k].float() for s in store) for k in keys[0]])
        dist.all_reduce(values, group=mpu.get_data_parallel_group())
        values = self._from_last_stage(values if self.is_last_stage else None, values.shape)
        return dict(zip(keys[0], values.tolist(), strict=True))

    def _step(self) -> dict[str, float]:
        self._reduce_gradients()
        grad_norm = self._grad_norm()
        lr = self.scheduler.get_last_lr()[0]
        if not math.isfinite(grad_norm):
            logger.warning(
                "non-finite gradient norm (%s): optimizer step skipped; non-finite on rank %d: %s",
                grad_norm,
                dist.get_rank(),
                self._non_finite_gradients(),
            )
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": 1.0}
        clip = self.optim_config.grad_clip
        if clip and grad_norm > clip:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(clip / (grad_norm + 1e-6))
        self.optimizer.step()
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped_steps": 0.0}

    def _non_finite_gradients(self, show: int = 4) -> str:
        """Which of this rank's gradients hold NaN/inf (Megatron names, chunk index first), the first `show`."""
        bad = [
            f"{i}.{name}"
            for i, chunk in enumerate(self.chunks)
            for name, p in chunk.named_parameters()
            if p.grad is not None and not torch.isfinite(p.grad).all()
        ]
        return ", ".join(bad[:show]) + (f" and {len(bad) - show} more" if len(bad) > show else "") or "none"

    def _reduce_gradients(self) -> None:
        """Sum over data-parallel ranks; norms whose gradient each tensor rank has only part of (sequence
        parallelism, Qwen3's head norms) over tensor ranks; tied embedding copies over the first and last pipeline
        stages."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if mpu.get_data_parallel_world_size() > 1 and grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=mpu.get_data_parallel_group())
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(synced)
        if self.parallel.tp > 1:
            for p in self.params:
                if getattr(p, "partial_over_tensor_ranks", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=mpu.get_tensor_model_parallel_group())
        if self.shape.tied and self.parallel.pp > 1 and mpu.is_rank_in_embedding_group():
            chunk = self.chunks[0] if self.pp_rank == 0 else self.chunks[-1]
            weight = chunk.shared_embedding_or_output_weight()
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=mpu.get_embedding_group())

    def _grad_norm(self) -> float:
        """Global L2 norm over the whole model: tensor-parallel pieces once each, replicated parameters once,
        the last stage's copy of a tied embedding not at all."""
        total = torch.zeros((), device=self.device)
        for p in self.params:
            if p.grad is None or (getattr(p, "shared", False) and self.pp_rank != 0):
                continue
            if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0:
                total += p.grad.float().pow(2).sum()
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
        return total.sqrt().item()

    # ----------------------------------------------------------------- weights
    def full_parameters(self, prefix: str = "", dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight, on every rank: tensor-parallel pieces are gathered and each
        pipeline stage broadcasts its layers, one tensor at a time (`prefix` is accepted for the FSDP engine's
        signature; names are already HF names). A tied embedding also comes as `lm_head.weight`. As with the FSDP
        engine, a caller that keeps the tensors clones them: a replicated weight comes as a view of the live one."""
        states = [chunk.state_dict() for chunk in self.chunks]  # views of the live weights, made once
        for pp_rank in range(self.parallel.pp):
            for vp_stage in range(self.parallel.vpp or 1):
                for local, name, layer in chunk_names(self.shape, self.parallel, pp_rank, vp_stage):
                    if name == "output_layer.weight" and self.shape.tied:
                        continue
                    full = self._gather(states, pp_rank, vp_stage, local, name)
                    for hf_name, tensor in to_hf(name, layer, full, self.shape):
                        tensor = tensor.to(dtype or tensor.dtype)
                        yield hf_name, tensor
                        if hf_name == "model.embed_tokens.weight" and self.shape.tied:
                            yield "lm_head.weight", tensor

    def _gather(self, states: list[dict], pp_rank: int, vp_stage: int, local: str, name: str) -> torch.Tensor:
        """The full float32 tensor `name` (`local` in chunk `vp_stage` of stage `pp_rank`) on every rank."""
        shape = self.shape.full_shape(name)
        if self.pp_rank == pp_rank:
            piece = states[vp_stage][local].detach()
            kind = self.shape.kind(name)
            if self.parallel.tp > 1 and kind != "replicated":
                pieces = [torch.empty_like(piece) for _ in range(self.parallel.tp)]
                dist.all_gather(pieces, piece.contiguous(), group=mpu.get_tensor_model_parallel_group())
                piece = unshard(pieces, kind)
            full = piece.float().contiguous()
        else:
            full = torch.empty(shape, dtype=torch.float32, device=self.device)
        if self.parallel.pp > 1:
            source = dist.get_global_rank(mpu.get_pipeline_model_parallel_group(), pp_rank)
            dist.broadcast(full, source, group=mpu.get_pipeline_model_parallel_group())
        return full

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: Path, extra: dict[str, Any]) -> None:
        """Every rank writes its chunks, optimizer, schedule, RNG and `extra` to `megatron_rank{r}.pt`; rank 0 adds
        `manifest.json` (the grid the checkpoint needs to load)."""
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "chunks": [chunk.state_dict() for chunk in self.chunks],
            "optimizer": optimizer_state(self.optimizer) if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "rng": rng_state() | {"megatron": tensor_parallel.get_cuda_rng_tracker().get_states()},
            **extra,
        }
        torch.save(state, directory / f"megatron_rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            manifest = {"format": "megatron", **self._grid()}
            (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))

    def _grid(self) -> dict[str, Any]:
        """What a checkpoint's files depend on: the ranks, the model parallelism, the optimizer's sharding."""
        sharded = isinstance(self.optimizer, ZeroRedundancyOptimizer)
        return {"world_size": dist.get_world_size(), **vars(self.parallel), "distributed_optimizer": sharded}

    def load_checkpoint(self, directory: Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote (same grid only); returns the extra entries."""
        manifest = {"distributed_optimizer": False} | json.loads((directory / "manifest.json").read_text())
        here = self._grid()
        if {k: manifest.get(k) for k in here} != here:
            raise ValueError(f"checkpoint {directory} was written on the grid {manifest}; this run is {here}")
        state = torch.load(directory / f"megatron_rank{dist.get_rank()}.pt", weights_only=False, map_location="cpu")
        for chunk, chunk_state in zip(self.chunks, state.pop("chunks"), strict=True):
            chunk.load_state_dict(chunk_state)
        if self.optimizer is not None:
            load_optimizer_state(self.optimizer, state.pop("optimizer"))
            self.scheduler.load_state_dict(state.pop("scheduler"))
        rng = state.pop("rng")
        tensor_parallel.get_cuda_rng_tracker().set_states(rng.pop("megatron"))
        set_rng_state(rng)
        return state


def _no_loss(micro: DataProto, rows: int) -> DataProto:
    """`rows` copies of the micro-batch's first row with an empty response mask: they carry no loss or metric."""
    filler = micro[:1].reorder(torch.zeros(rows, dtype=torch.long))
    filler.batch["response_mask"] = torch.zeros_like(filler.batch["response_mask"])
    return filler
