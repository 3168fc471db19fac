"""Activations kept in host memory between a training forward and its backward pass (`model.activation_offload`).

Under `HostActivations`, every tensor that autograd saves for the backward pass is copied to host memory when it
is saved and back to the device when the backward pass needs it (saved-tensor hooks, as
`torch.autograd.graph.save_on_cpu`). With `model.gradient_checkpointing` the tensors saved are the checkpoints,
each transformer block's input (`torch.utils.checkpoint` saves a block's inputs under the hooks in force around
it, and nothing from inside the block), so the device keeps one block's activations at a time and no checkpoint:
long sequences then cost host memory, `layers x tokens x hidden` numbers, instead of device memory. Parameters are
left where they are: they outlive the step anyway. On GPUs the host copies are pinned and the copies are queued on
the current stream without waiting for them; on the CPU they are plain copies (nothing is gained there).
"""

from __future__ import annotations

import torch
from torch import nn


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep what autograd saves in host memory; `moved_bytes` counts what was copied."""

    def __init__(self):
        self.moved_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor] | torch.Tensor:
        if isinstance(tensor, nn.Parameter):
            return tensor
        pinned = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        self.moved_bytes += host.numel() * host.element_size()
        return tensor.device, host

    @staticmethod
    def _unpack(packed: tuple[torch.device, torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())
