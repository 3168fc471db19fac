"""The rotary embedding in one launch on GPUs (`rollout.exact_log_probs`): transformers' `apply_rotary_pos_emb` for
one of the query or the key, `x * cos + rotate_half(x) * sin`, takes five eager launches; here one Triton program a
(row, position) rotates every head of it in float32 and rounds once. Each element's arithmetic is its own, so a
token gets the same bits in a decode step as in a training forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class Rotary(torch.autograd.Function):
    """`x` `[batch, heads, length, head_dim]` rotated by `cos`, `sin` `[batch, length, head_dim]` (transformers'
    position embeddings, the halves' angles repeated) -> a contiguous tensor like `x`. The backward is the
    rotation's transpose, in torch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        batch, heads, length, head_dim = x.shape
        out = x.new_empty(x.shape)
        cos, sin = cos.expand(batch, length, head_dim).contiguous(), sin.expand(batch, length, head_dim).contiguous()
        if out.numel():
            _rotate[(batch * length,)](
                x, cos, sin, out, heads, length, *x.stride()[:3],
                HALF=head_dim // 2, HEADS=triton.next_power_of_2(heads), BLOCK=triton.next_power_of_2(head_dim // 2),
            )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = (t.unsqueeze(1) for t in ctx.saved_tensors)
        half = grad.shape[-1] // 2
        (g1, g2), (c1, c2), (s1, s2) = (t.split(half, -1) for t in (grad, cos, sin))
        return torch.cat([g1 * c1 + g2 * s2, g2 * c2 - g1 * s1], -1), None, None


@triton.jit
def _rotate(
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads, length, x_row, x_head, x_pos,
    HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program p: row p // length, position p % length, every head."""
    row, position = tl.program_id(0) // length, tl.program_id(0) % length
    h, d = tl.arange(0, HEADS)[:, None], tl.arange(0, BLOCK)[None, :]
    inside = (h < heads) & (d < HALF)
    x_at = x_ptr + row * x_row + h * x_head + position * x_pos + d
    x1, x2 = tl.load(x_at, inside, 0.0), tl.load(x_at + HALF, inside, 0.0)
    angle = (row * length + position) * 2 * HALF + d
    c1, c2 = tl.load(cos_ptr + angle, d < HALF, 0.0), tl.load(cos_ptr + angle + HALF, d < HALF, 0.0)
    s1, s2 = tl.load(sin_ptr + angle, d < HALF, 0.0), tl.load(sin_ptr + angle + HALF, d < HALF, 0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    first = a * c1.to(tl.float32) - b * s1.to(tl.float32)
    second = b * c2.to(tl.float32) + a * s2.to(tl.float32)
    out_at = out_ptr + ((row * heads + h) * length + position) * 2 * HALF + d
    tl.store(out_at, first.to(out_ptr.dtype.element_ty), inside)
    tl.store(out_at + HALF, second.to(out_ptr.dtype.element_ty), inside)
