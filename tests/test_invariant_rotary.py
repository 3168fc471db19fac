"""The rotary embedding's kernel (`ketch/models/invariant_rotary.py`), run by Triton's interpreter on the CPU in
float32: transformers' `apply_rotary_pos_emb`, forward and backward."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb
    from transformers import Qwen2Config
    from ketch.models.invariant_rotary import Rotary

    g = torch.Generator().manual_seed(0)
    config = Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)  # heads of 16
    positions = torch.stack([torch.arange(11), torch.arange(5, 16)])
    q = torch.randn(2, 6, 11, 16, generator=g).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 11, 16, generator=g, requires_grad=True)
    cos, sin = Qwen2RotaryEmbedding(config)(q, positions)
    got = (Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin))
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    grads = [torch.randn(t.shape, generator=g) for t in got]
    got_grads = torch.autograd.grad(got, (q, k), grads)
    expected_grads = torch.autograd.grad(expected, (q, k), grads)
    print(json.dumps({
        "diffs": [(a - b).abs().max().item() for a, b in zip(got + got_grads, expected + expected_grads)],
        "contiguous": all(t.is_contiguous() for t in got),
    }))
    """
)


def test_the_kernel_rotates_as_transformers_does():
    """Two rows of 11 positions (the second from position 5), 6 query heads (strided: a transposed layout) and 2 key
    heads of 16: the rotated query and key and their gradients equal transformers' to 1e-6, contiguous."""
    result = interpreted(SCRIPT)
    assert result["contiguous"] and max(result["diffs"]) < 1e-6, result
