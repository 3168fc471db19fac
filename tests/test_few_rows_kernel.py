"""The Triton kernel of a weight times a few rows (`ketch/rollout/few_rows_kernel.py`), run by Triton's interpreter
on the CPU in float32, against the float32 product with the dequantized FP8 weight, or with the weight itself."""

from __future__ import annotations

import json
import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

CASES = textwrap.dedent(
    """
    import json, sys, torch
    from ketch.rollout.fp8 import dequantize, quantize_per_channel
    from ketch.rollout.few_rows_kernel import launch, weight_matmul

    def case(rows, out, inputs, sms, fp8=True, biased=False):
        g = torch.Generator().manual_seed(rows + out)
        plain = torch.randn(out, inputs, generator=g)
        weight = quantize_per_channel(plain)
        x = torch.randn(rows, inputs, generator=g)
        bias = torch.randn(out, generator=g) * 10 if biased else None
        scale = weight.scale if fp8 else None
        got = weight_matmul(x, weight.data if fp8 else plain, scale, bias, sms=sms)
        expected = x @ (dequantize(weight) if fp8 else plain).T + (0 if bias is None else bias)
        return {"launch": launch(out, inputs, sms), "shape": list(got.shape), "dtype": str(got.dtype),
                "max_diff": (got - expected).abs().max().item(), "scale": expected.abs().max().item()}

    print(json.dumps([case(*args) for args in json.loads(sys.argv[1])]))
    """
)


def run_cases(cases: list[tuple]) -> list[dict]:
    """The kernel on each `(rows, out, inputs, sms[, fp8])` in one interpreted process (imports once)."""
    return interpreted(CASES, json.dumps(cases))


def test_the_kernel_multiplies_the_rows_by_the_dequantized_weight():
    """1, 3, 4 and 16 rows; output channels a multiple of the program's 32 and not (48: the last block masked);
    input channels a multiple of the 256 a program reads at a time and not (300). With 8 SMs, 48 output channels
    take blocks of 16; 1,024 inputs for 40 outputs are split over 4 programs whose partial sums the second pass adds.
    Then a float32 weight, no scale (as a bf16 weight runs), in one pass and split; a bias (of magnitude 10)
    added in the kernel (one pass) and after the partial sums (split); and 20, 64 and 150 rows, in tiles of 32, 64
    and three programs of 64 rows (the last masked), with a bias."""
    cases = [(1, 64, 512, 1), (3, 48, 300, 8), (4, 128, 256, 1), (16, 40, 1024, 8)]
    plain = [(3, 48, 300, 8, False), (16, 40, 1024, 8, False)]
    biased = [(3, 48, 300, 8, True, True), (16, 40, 1024, 8, True, True)]
    wide = [(20, 48, 300, 8), (64, 40, 1024, 8, True, True), (150, 48, 300, 8, True, True)]  # tiles of 32, 64, 3 x 64
    results = run_cases([*cases, *plain, *biased, *wide])
    one, split = [16, 1], [32, 4]
    launches = [[32, 1], one, [32, 1], split, one, split, one, split, one, split, one]
    assert [r["launch"] for r in results] == launches
    shapes = [[1, 64], [3, 48], [4, 128], [16, 40], [3, 48], [16, 40], [3, 48], [16, 40], [20, 48], [64, 40], [150, 48]]
    assert [r["shape"] for r in results] == shapes
    for result in results:
        assert result["dtype"] == "torch.float32"
        assert result["max_diff"] < 1e-5 * result["scale"], result


def test_launch_splits_the_down_projections_and_widens_the_blocks_of_wide_weights():
    """On an H100's 132 SMs: the 7B shape's gate/up (37,888 channels), q/k/v (4,608) and o (3,584) whole in blocks
    of 32; its down (3,584 x 18,944) and the 0.5B shape's (896 x 4,864) split in 4, blocks of 32; the 0.5B shape's o
    (896: 28 blocks of 32, fewer than half the SMs) and the 1.5B shape's q/k/v (2,048) whole in blocks of 16."""
    from ketch.rollout.few_rows_kernel import launch

    assert launch(37888, 3584, 132) == launch(4608, 3584, 132) == launch(3584, 3584, 132) == (32, 1)
    assert launch(3584, 18944, 132) == launch(896, 4864, 132) == (32, 4)
    assert launch(896, 896, 132) == launch(2048, 1536, 132) == (16, 1)
