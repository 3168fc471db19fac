"""AdamW (fused on local shards; its moments optionally in host memory) and the learning-rate schedule (linear
warm-up, then constant or cosine)."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from ketch.config.schema import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


def build_optimizer(params, config: OptimConfig, device: torch.device, shard_group=None) -> torch.optim.Optimizer:
    """AdamW over `params` (fused kernels on the local shards on GPU: `ShardedFusedAdamW`). With `shard_group`
    (a process group of ranks that hold the same parameters), its state is split over those ranks (ZeRO stage 1,
    torch's `ZeroRedundancyOptimizer`): each rank keeps and steps the moments of its share of the parameters,
    then broadcasts its share to the others."""
    kind = ShardedFusedAdamW if device.type == "cuda" else torch.optim.AdamW
    if config.offload:
        kind = OffloadedAdamW
    settings = {"lr": config.lr, "betas": tuple(config.betas), "weight_decay": config.weight_decay}
    if shard_group is None:
        return kind(params, **settings)
    return ZeroRedundancyOptimizer(params, optimizer_class=kind, process_group=shard_group, **settings)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """What this rank checkpoints of `optimizer`: the whole state, or a ZeRO optimizer's own share with the
    settings of the optimizer's groups (the share's are those of its last step; the schedule has moved on)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    state = optimizer.optim.state_dict()
    for share, group in zip(state["param_groups"], optimizer.param_groups, strict=True):
        share.update(_settings(group))
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore what `optimizer_state` gave (a ZeRO optimizer: on the same ranks, so the same shares)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_state_dict(state)
        return
    optimizer.optim.load_state_dict(state)
    for group, share in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update(_settings(share))


def _settings(group: dict) -> dict:
    """A parameter group's settings (lr, betas, ...) without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


class ShardedFusedAdamW(torch.optim.AdamW):
    """AdamW whose step runs the fused kernel on each rank's local shards of the parameters, their gradients and
    moments (`DTensor.to_local`; plain tensors as they are). AdamW works element by element, so this is the
    sharded update itself, with the state (`step`, `exp_avg`, `exp_avg_sq`) laid out as torch's fused AdamW lays
    it out (checkpoints are interchangeable). torch's own AdamW hands the DTensors to the fused kernel, and
    DTensor's first sharding propagation over that many-tensor call is slow (torch 2.13 on a CPU: 1.3 s for
    the 291 tensors of a 24-block model in the first step, 13 ms in a later one)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, eps: float = 1e-8):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, fused=True)

    @torch.no_grad()
    def step(self, closure=None, skip: torch.Tensor | None = None):
        """One AdamW step; with `skip` (a bool scalar on the parameters' device) set, the kernels leave the
        parameters, moments and step counts as they were: the flag is read on the device, not by the host."""
        if closure is not None:
            raise ValueError("ShardedFusedAdamW.step takes no closure")
        found_inf = None if skip is None else skip.float()
        for group in self.param_groups:
            for tensors in self._local_groups(group):
                torch._foreach_add_(tensors[4], 1.0)
                _fused_adamw(group, tensors, found_inf)
                if found_inf is not None:
                    torch._foreach_sub_(tensors[4], [found_inf] * len(tensors[4]))

    def _local_groups(self, group: dict) -> list[list[list[torch.Tensor]]]:
        """Per (device, dtype): local [params, grads, exp_avgs, exp_avg_sqs, steps] of the parameters with a
        gradient, their state created on first use."""
        lists = defaultdict(lambda: [[] for _ in range(5)])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            local = _local(p)
            tensors = (local, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]), state["step"])
            for into, tensor in zip(lists[(local.device, local.dtype)], tensors, strict=True):
                into.append(tensor)
        return list(lists.values())


class OffloadedAdamW(ShardedFusedAdamW):
    """`ShardedFusedAdamW` with the moments in host memory (pinned on a GPU machine). Each dtype's moments lie in
    one host buffer `[2, elements]` (`exp_avg` in row 0, `exp_avg_sq` in row 1, parameter after parameter). A step
    copies `chunk_elements` columns at a time into one of two device buffers, steps the slices of the parameters
    that lie in the chunk, and copies the chunk back. On a GPU the copies run on two streams of their own, so the
    next chunk comes in and the last goes out while the kernels step this one, and the device holds two chunks
    of moments (512 MiB of float32 by default) instead of all of them. The state has torch's layout (moments
    shaped and sharded as their parameters: DTensors over host shards, as FSDP2's own CPU offload makes them), so
    checkpoints are interchangeable with torch's AdamW and `ShardedFusedAdamW`."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float, chunk_elements=1 << 25):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.chunk_elements = chunk_elements
        columns: dict[torch.dtype, int] = defaultdict(int)
        self.offsets = {}  # parameter -> (dtype of its host buffer, its first column there)
        self.layout = defaultdict(list)  # dtype -> (first column, parameter, its group), by column
        for group in self.param_groups:
            for p in group["params"]:
                self.offsets[p] = (p.dtype, columns[p.dtype])
                self.layout[p.dtype].append((columns[p.dtype], p, group))
                columns[p.dtype] += _local(p).numel()
        device = _local(self.param_groups[0]["params"][0]).device
        cuda = device.type == "cuda"
        self.host = {dtype: torch.zeros(2, n, dtype=dtype, pin_memory=cuda) for dtype, n in columns.items()}
        self.work = {
            dtype: torch.empty(2, 2, min(n, chunk_elements), dtype=dtype, device=device) for dtype, n in columns.items()
        }
        self.streams = {"in": torch.cuda.Stream(device), "out": torch.cuda.Stream(device)} if cuda else None
        self.events = defaultdict(torch.cuda.Event) if cuda else None  # (direction, buffer) -> its last copy

    def _state_of(self, p: torch.Tensor) -> dict:
        """`p`'s state, filled in on first use: the step count on the device, the moments views of the host buffer."""
        state = self.state[p]
        local = _local(p)
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        if MOMENTS[0] not in state:
            dtype, start = self.offsets[p]
            host = self.host[dtype][:, start : start + local.numel()]
            for row, key in enumerate(MOMENTS):
                view = host[row].view(local.shape)
                state[key] = DTensor(view, p._spec, requires_grad=False) if isinstance(p, DTensor) else view
        return state

    @torch.no_grad()
    def step(self, closure=None, skip: torch.Tensor | None = None):
        """One AdamW step, chunk by chunk; `skip` as in `ShardedFusedAdamW.step`."""
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        found_inf = None if skip is None else skip.float()
        steps = [self._state_of(p)["step"] for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not steps:
            return
        torch._foreach_add_(steps, 1.0)
        for dtype, host in self.host.items():
            for i, start in enumerate(range(0, host.shape[1], self.chunk_elements)):
                end = min(start + self.chunk_elements, host.shape[1])
                work = self.work[dtype][i % 2][:, : end - start]
                self._copy(work, host[:, start:end], into_device=True, buffer=i % 2)
                for group, tensors in self._pieces(dtype, start, end, work):
                    _fused_adamw(group, tensors, found_inf)
                self._copy(host[:, start:end], work, into_device=False, buffer=i % 2)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _pieces(self, dtype: torch.dtype, start: int, end: int, work: torch.Tensor) -> list:
        """(group, local [params, grads, exp_avgs, exp_avg_sqs, steps]) per parameter group, of the parts of the
        parameters with a gradient in host columns [start, end); the moments are views of `work` `[2, end - start]`."""
        layout = self.layout[dtype]
        first_in_chunk = bisect.bisect_right(layout, start, key=lambda entry: entry[0]) - 1
        lists = {}
        for first, p, group in layout[first_in_chunk:]:
            if first >= end:
                break
            lo, hi = max(start, first), min(end, first + _local(p).numel())
            if p.grad is None or lo >= hi:
                continue
            part = slice(lo - first, hi - first)
            tensors = (_local(p).view(-1)[part], _local(p.grad).view(-1)[part], *work[:, lo - start : hi - start])
            _, into = lists.setdefault(id(group), (group, [[] for _ in range(5)]))
            for tensor_list, tensor in zip(into, (*tensors, self.state[p]["step"]), strict=True):
                tensor_list.append(tensor)
        return list(lists.values())

    def _copy(self, into: torch.Tensor, source: torch.Tensor, into_device: bool, buffer: int) -> None:
        """Copy a chunk between the host and device buffer `buffer`. On a GPU, on the copy stream of its direction:
        a copy in waits for the last copy out of the buffer, and the step's stream waits for it; a copy out waits
        for the step's kernels queued so far."""
        if self.streams is None:
            into.copy_(source)
            return
        direction, compute = "in" if into_device else "out", torch.cuda.current_stream()
        stream = self.streams[direction]
        stream.wait_event(self.events[("out", buffer)] if into_device else compute.record_event())
        with torch.cuda.stream(stream):
            for row in range(2):  # contiguous rows: direct copies from and to the pinned buffer
                into[row].copy_(source[row], non_blocking=True)
            self.events[(direction, buffer)].record(stream)
        if into_device:
            compute.wait_event(self.events[("in", buffer)])

    def _synchronize(self) -> None:
        """Wait for the copies out (before the host reads or writes the moments)."""
        if self.streams is not None:
            self.streams["out"].synchronize()

    def state_dict(self) -> dict:
        self._synchronize()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, with the moments copied into the host buffers instead of onto the parameters' device."""
        self._synchronize()
        entries = state_dict["state"]
        steps = {i: {k: v for k, v in entry.items() if k not in MOMENTS} for i, entry in entries.items()}
        super().load_state_dict({**state_dict, "state": steps})
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]  # indices or names
        params = dict(zip(saved, (p for group in self.param_groups for p in group["params"]), strict=True))
        for key, entry in entries.items():
            state = self._state_of(params[key])
            for moment in MOMENTS:
                _local(state[moment]).copy_(_local(entry[moment]))


def _fused_adamw(group: dict, tensors: list[list[torch.Tensor]], found_inf: torch.Tensor | None) -> None:
    """torch's fused AdamW kernel with `group`'s settings over [params, grads, exp_avgs, exp_avg_sqs, steps]
    (the step counts are read, already counted)."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        *tensors[:4],
        [],
        tensors[4],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        amsgrad=False,
        maximize=False,
        found_inf=found_inf,
    )


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Step `optimizer` unless `skip` (a bool scalar on the device) is set. `ShardedFusedAdamW` reads the flag in
    its kernels, so the host launches the step while the GPU still runs the backward pass; other optimizers
    wait for it."""
    if isinstance(optimizer, ShardedFusedAdamW):
        optimizer.step(skip=skip)
    elif not skip.item():
        optimizer.step()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def lr_factor(step: int, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based) of `total_steps`."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_scheduler == "constant":
        return 1.0
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total_steps))
