"""The batch-invariant RMSNorm kernel (`ketch/models/invariant_norm.py`), run by Triton's interpreter on the CPU in
float32: a row's bits the same alone as in a batch, the formula of transformers' RMSNorm, and its gradients."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from ketch.models.invariant_norm import InvariantRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 100, generator=g) * 5).requires_grad_()  # a hidden size of 100: a block of 128, masked
    norm = Qwen2RMSNorm(100, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100, generator=g))
    out = InvariantRMSNorm.apply(x, norm.weight, 1e-5)
    alone = [bool(torch.equal(InvariantRMSNorm.apply(x[i, j : j + 1], norm.weight, 1e-5)[0], out[i, j]))
             for i, j in ((0, 0), (1, 3), (2, 6))]
    grad = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (x, norm.weight), grad)
    expected = norm(x)
    expected_grads = torch.autograd.grad(expected, (x, norm.weight), grad)
    print(json.dumps({
        "alone": alone, "shape": list(out.shape), "max_diff": (out - expected).abs().max().item(),
        "grad_diffs": [(a - b).abs().max().item() for a, b in zip(grads, expected_grads)],
    }))
    """
)


def test_a_row_is_normalised_alone_as_in_a_batch_as_transformers_does():
    """21 rows of a hidden size of 100 (one block of 128, the rest masked): rows alone give the batch's bits; the
    output and the gradients of the input and the weight equal Qwen2RMSNorm's to 1e-5."""
    result = interpreted(SCRIPT)
    assert result["alone"] == [True] * 3 and result["shape"] == [3, 7, 100]
    assert result["max_diff"] < 1e-5 and max(result["grad_diffs"]) < 1e-4, result
