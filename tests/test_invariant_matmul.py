"""The batch-invariant matmul kernel (`ketch/models/invariant_matmul.py`), run by Triton's interpreter on the CPU:
each row's bits the same alone as in a batch, and the product within float32's rounding."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from ketch.models.invariant_matmul import invariant_matmul

    g = torch.Generator().manual_seed(0)
    rows, weight = torch.randn(100, 200, generator=g), torch.randn(70, 200, generator=g)
    batch = invariant_matmul(rows, weight)
    alone = [bool(torch.equal(invariant_matmul(rows[i : i + 1], weight)[0], batch[i])) for i in (0, 37, 63, 64, 99)]
    diff = (batch - rows @ weight.T).abs().max().item()
    bias = torch.randn(70, generator=g) * 10
    biased = invariant_matmul(rows, weight, bias)
    bias_diff = (biased - (rows @ weight.T + bias)).abs().max().item()
    print(json.dumps({"shape": list(batch.shape), "alone": alone, "max_diff": diff, "bias_diff": bias_diff}))
    """
)


def test_a_row_gets_the_same_bits_alone_as_in_a_batch():
    """100 rows (two tiles of 64, the second partly masked) x 200 inputs (seven blocks of 32, the last masked) x 70
    output channels (two blocks of 64), in float32 (the interpreter's bfloat16 dot is not the GPU's): rows 0, 37, 63,
    64 and 99 alone give the batch's bits, and the product equals torch's to 1e-4, with a bias (of magnitude 10)
    too."""
    result = interpreted(SCRIPT)
    assert result["shape"] == [100, 70] and result["alone"] == [True] * 5
    assert result["max_diff"] < 1e-4 and result["bias_diff"] < 1e-4
