"""The batch-invariant Triton kernels of `rollout.exact_log_probs` on a GPU, in bfloat16 at the Qwen2.5-0.5B
layout's sizes: a row's bits alone and in a batch, a decode step's query against the training forward's, and the
training attention's output and gradients against SDPA's."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ketch.models.invariant_attention import PAGE, TrainingAttention, invariant_attention, training_mask
from ketch.models.invariant_matmul import invariant_matmul
from ketch.models.invariant_norm import InvariantRMSNorm
from ketch.models.pages import as_pool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_matmul_and_norm_give_a_row_the_same_bits_alone_as_among_2000():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2000, 896, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(4864, 896, device="cuda", generator=g) * 0.03).bfloat16()
    bias = torch.randn(4864, device="cuda", generator=g).bfloat16()
    batch, normed = invariant_matmul(x, weight, bias), InvariantRMSNorm.apply(x, weight[0], 1e-6)
    for i in (0, 15, 16, 999, 1999):
        assert torch.equal(invariant_matmul(x[i : i + 1], weight, bias)[0], batch[i])
        assert torch.equal(InvariantRMSNorm.apply(x[i : i + 1], weight[0], 1e-6)[0], normed[i])
    expected = x.float() @ weight.float().T + bias.float()
    assert (batch.float() - expected).abs().max() < 0.05 * expected.abs().max()


def test_a_decode_step_gets_the_training_forwards_bits_and_the_backward_is_sdpas():
    """4 rows of 1,000 slots (left and right padding), 14 query heads over 2 key heads of 64: each real token's query
    decoded alone over a paged cache gives the training forward's bits; the output and gradients are SDPA's
    within bf16's rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, length = 4, 1000
    real = torch.zeros(batch, length, dtype=torch.bool, device="cuda")
    real[0], real[1, 300:], real[2, 10:700], real[3, 999:] = True, True, True, True
    q = torch.randn(batch, 14, length, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(batch, 2, length, 64, device="cuda", generator=g).bfloat16().requires_grad_() for _ in "kv")
    out = TrainingAttention.apply(q, k, v, real, 0.125, None)
    pool_k, table = as_pool(F.pad(k.detach(), (0, 0, 5, 0)), PAGE)
    pool_v, _ = as_pool(F.pad(v.detach(), (0, 0, 5, 0)), PAGE)
    first = real.long().argmax(-1)
    for row in range(batch):
        count = int(real[row].sum())
        for t in sorted({0, 63, 64, count // 2, count - 1} & set(range(count))):  # row 3 has one token
            slot = int(first[row]) + t
            step = invariant_attention(
                q.detach()[row : row + 1, :, slot : slot + 1], (pool_k, pool_v), table[row : row + 1],
                first[row : row + 1] + 5, torch.tensor([t + 1], device="cuda"), torch.tensor([t], device="cuda"),
                0.125,
            )  # fmt: skip
            assert torch.equal(step[0, 0], out.detach()[row, slot]), (row, t)
    mask = training_mask(real, length, None)
    some = mask.any(-1, keepdim=True)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(7, 1), v.float().repeat_interleave(7, 1), attn_mask=mask | ~some,
        scale=0.125,
    ) * some  # fmt: skip
    assert (out.float() - expected.transpose(1, 2)).abs().max() < 0.02
    grad = torch.randn(out.shape, device="cuda", generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected_grads = torch.autograd.grad(expected.transpose(1, 2), (q, k, v), grad.float())
    for got, want in zip(grads, expected_grads, strict=True):
        assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
