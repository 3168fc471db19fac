"""A batch-invariant RMSNorm on GPUs (`rollout.exact_log_probs`): one Triton program per row, so that a row gets the
same bits alone (a decode step's) as among thousands (a training forward's), in one launch instead of eager's
seven.

torch reduces a row's squares with more threads, in another order, when fewer rows share the reduction; here a row's
sum of squares is always one `tl.sum` over a block of the hidden size. The formula is Llama's, Qwen2's and Qwen3's
`RMSNorm` (`rms_norm`): `weight * (x * rsqrt(mean(x^2) + eps)).to(x's dtype)`, the normalised row rounded to the
input's dtype before the weight multiplies it, that product rounded once; its bits need not be eager's, only the
same on both sides. The backward differentiates the same formula in torch: gradients need no batch invariance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class InvariantRMSNorm(torch.autograd.Function):
    """`x` `[..., hidden]`, `weight` `[hidden]` -> `[..., hidden]` in the dtype of `weight * x` (eager's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden).contiguous()
        out = rows.new_empty(rows.shape, dtype=torch.result_type(weight, rows))
        if len(rows):
            _rms_norm[(len(rows),)](rows, weight, out, hidden, eps, BLOCK=triton.next_power_of_2(hidden))
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
            out = rms_norm(*inputs, ctx.eps)
            grads = torch.autograd.grad(out, inputs, grad)
        return *grads, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager formula the kernel computes (transformers' Llama/Qwen RMSNorm)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, hidden, eps, BLOCK: tl.constexpr):
    """Program i: row i."""
    row = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    inside = h < hidden
    x = tl.load(x_ptr + row * hidden + h, inside, 0.0)
    values = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(values * values) / hidden + eps)
    normed = (values * scale).to(x.dtype)
    w = tl.load(w_ptr + h, inside, 0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + h, out.to(out_ptr.dtype.element_ty), inside)
