"""The batch-invariant attention kernel (`ketch/models/invariant_attention.py`), run by Triton's interpreter on the
CPU in float32: the training forward against SDPA, each decode step's query against the same query in the training
forward (bit for bit), and the backward against SDPA's."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from torch.nn import functional as F
    from ketch.models.invariant_attention import TrainingAttention, as_pool, invariant_attention, training_mask

    def case(window):
        g = torch.Generator().manual_seed(0)
        batch, heads, kv_heads, length, head_dim = 3, 6, 2, 150, 16  # 3 query heads a key head; 3 blocks of keys
        real = torch.zeros(batch, length, dtype=torch.bool)
        real[0, :] = True  # no padding
        real[1, 100:] = True  # left padding: 50 real tokens
        real[2, 5:120] = True  # both sides
        q = torch.randn(batch, heads, length, head_dim, generator=g, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=g, requires_grad=True) for _ in range(2))
        out = TrainingAttention.apply(q, k, v, real, 0.25, window)  # [batch, length, heads, head_dim]
        mask = training_mask(real, length, window)
        some = mask.any(-1, keepdim=True)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~some, scale=0.25, enable_gqa=True)
        expected = (expected * some).transpose(1, 2)
        grad = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad * some.transpose(1, 2))
        # each real token's query decoded alone over its row's keys so far, at other slots of a paged cache
        # (3 pages a row, in reverse order, the row's run moved to begin at slot 7) against the training forward
        decoded, generated = [], []
        pool_k, table = as_pool(F.pad(k.detach(), (0, 0, 7, 0)))
        pool_v, _ = as_pool(F.pad(v.detach(), (0, 0, 7, 0)))
        first = real.long().argmax(-1)
        for row in range(batch):
            count = int(real[row].sum())
            for t in sorted({0, 1, 63, 64, 65, count - 1} & set(range(count))):
                slot = int(first[row]) + t
                step = invariant_attention(
                    q.detach()[row : row + 1, :, slot : slot + 1], (pool_k, pool_v), table[row : row + 1],
                    first[row : row + 1] + 7, torch.tensor([t + 1]), torch.tensor([t]), 0.25, window,
                )
                decoded.append(bool(torch.equal(step[0, 0], out.detach()[row, slot])))
                # as `generate` calls it: the new token's query after a cache of the keys before it
                cached = TrainingAttention.apply(
                    q.detach()[row : row + 1, :, slot : slot + 1], k.detach()[row : row + 1, :, : slot + 1],
                    v.detach()[row : row + 1, :, : slot + 1], real[row : row + 1, : slot + 1], 0.25, window,
                )
                generated.append(bool(torch.equal(cached[0, 0], out.detach()[row, slot])))
        return {
            "max_diff": (out - expected).abs().max().item(),
            "padding_zero": out[1, :100].abs().max().item() + out[2, 120:].abs().max().item(),
            "grad_diffs": [(a - b).abs().max().item() for a, b in zip(grads, expected_grads)],
            "decoded_equal": decoded,
            "generated_equal": generated,
        }

    print(json.dumps([case(None), case(40)]))
    """
)


def test_the_kernel_attends_as_sdpa_and_a_decode_step_gets_the_training_forwards_bits():
    """3 rows of 150 slots (no padding, 100 slots of left padding, padding on both sides), 6 query heads over 2 key
    heads, head size 16, with and without a sliding window of 40: the training forward equals SDPA over the real
    keys up to each query (1e-5), padding queries give zeros, the backward (SDPA's, recomputed) equals SDPA's own
    gradients; and the query of each real token at 0, 1, 63, 64, 65 and its row's last (those a row has: 15),
    decoded alone over a paged cache where the row's tokens begin at another slot, and as `generate` calls it (the
    one query after the keys before it), gives the training forward's bits."""
    for result in interpreted(SCRIPT):
        assert result["max_diff"] < 1e-5 and result["padding_zero"] == 0.0, result
        assert max(result["grad_diffs"]) < 1e-5, result
        assert result["decoded_equal"] == result["generated_equal"] == [True] * 15, result
