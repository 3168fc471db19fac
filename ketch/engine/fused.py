"""Fused Triton kernels (Liger-Kernel) for the training forward of HF decoder models, where they are installed.

`model.use_liger=true` swaps, on the given model instance only, every RMSNorm and every SwiGLU MLP
(`gate_proj`/`up_proj`/`down_proj` with a SiLU activation) for Liger's fused kernels: one kernel each instead of
several elementwise passes over the activations, forward and backward. The rollout's copy of the model and the
modules' classes are left alone. Without CUDA or without `liger-kernel` the model stays as it is, with a warning.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

logger = logging.getLogger("ketch.engine")


def fuse_kernels(model: nn.Module, device: torch.device) -> int:
    """Patch `model`'s RMSNorms and SwiGLU MLPs with Liger kernels; returns how many modules were patched."""
    if device.type != "cuda":
        logger.warning("model.use_liger: Liger kernels need a CUDA device; training on %s without them", device)
        return 0
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        logger.warning("model.use_liger: liger-kernel is not installed (pip install liger-kernel); training without it")
        return 0

    def rms_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return LigerRMSNormFunction.apply(hidden, self.weight, self.variance_epsilon, 0.0, "llama", False, None)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))

    patched = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_norm, module)
            patched += 1
        elif _is_swiglu(module):
            module.forward = types.MethodType(swiglu, module)
            patched += 1
    logger.info("model.use_liger: %d modules of %s use Liger kernels", patched, type(model).__name__)
    return patched


def _is_swiglu(module: nn.Module) -> bool:
    silu = type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    return silu and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
