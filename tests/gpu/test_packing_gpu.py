"""The packed attention on CUDA in bf16 (variable-length flash attention) against float32 causal attention of each
sequence on its own, forward and backward, beside what bf16 SDPA of the padded batch gets: the packed kernel must
be as close to float32 as the padded one (within 1.5 times its error, and under 0.02 in the mean), with and without
a sliding window. SmolLM2's shape: 9 query heads over 3 key/value heads of 64; sequences of 37, 5, 120, 64 tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ketch.engine.packing import packed_attention

LENGTHS = [37, 5, 120, 64]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _mask(length: int, window: int | None) -> torch.Tensor:
    """`[length, length]`: causal, and within `window` tokens (the query's own included)."""
    distance = torch.arange(length, device="cuda")[:, None] - torch.arange(length, device="cuda")
    return (distance >= 0) & (distance < (window or length))


def _per_sequence(q, k, v, window: int | None) -> torch.Tensor:
    """SDPA `[T, heads, head_dim]` of each sequence on its own."""
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    outs = []
    for qs, ks, vs in zip(*(t.split(LENGTHS) for t in (q, k, v)), strict=True):
        mask = _mask(len(qs), window)
        out = nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)), attn_mask=mask)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def _padded(q, k, v, window: int | None) -> torch.Tensor:
    """SDPA of the sequences as one left-padded batch under its mask, as transformers runs a padded batch."""
    longest = max(LENGTHS)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    batch = [
        torch.stack([nn.functional.pad(p, (0, 0, 0, 0, longest - len(p), 0)) for p in t.split(LENGTHS)])
        for t in (q, k, v)
    ]
    filled = torch.arange(longest, device="cuda") >= longest - torch.tensor(LENGTHS, device="cuda")[:, None]
    mask = filled[:, None, None, :] & _mask(longest, window)
    out = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in batch), attn_mask=mask)
    out = out.transpose(1, 2)
    return torch.cat([out[i, longest - n :] for i, n in enumerate(LENGTHS)])


def _packed(q, k, v, window: int | None) -> torch.Tensor:
    offsets = nn.functional.pad(torch.tensor(LENGTHS, device="cuda").cumsum(0), (1, 0)).int()
    query, key, value = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, T, head_dim]
    out, _ = packed_attention(
        nn.Module(), query, key, value, None, scaling=HEAD_DIM**-0.5, sliding_window=window,
        cu_seq_lens_q=offsets, max_length_q=max(LENGTHS),
    )  # fmt: skip
    return out[0]


@pytest.mark.parametrize("window", [None, 16])
def test_the_packed_bf16_attention_is_as_close_to_float32_as_padded_sdpa(window):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, h, HEAD_DIM, device="cuda", generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    grad_out = torch.randn(total, HEADS, HEAD_DIM, device="cuda", generator=g)

    def run(fn, dtype):
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs, window)
        out.backward(grad_out.to(dtype))
        return [out.float(), *(t.grad.float() for t in inputs)]

    reference = run(_per_sequence, torch.float32)
    results = {"packed": run(_packed, torch.bfloat16), "padded": run(_padded, torch.bfloat16)}
    for i, name in enumerate(("output", "grad q", "grad k", "grad v")):
        errors = {kind: (r[i] - reference[i]).abs().mean().item() for kind, r in results.items()}
        print(f"window {window} {name}: mean abs error against float32 {errors}")
        assert errors["packed"] <= 1.5 * errors["padded"] and errors["packed"] < 0.02, (name, errors)
