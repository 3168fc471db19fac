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

    def case(rows, out, inputs, sms, fp8=True):
        g = torch.Generator().manual_seed(rows + out)
        plain = torch.randn(out, inputs, generator=g)
        weight = quantize_per_channel(plain)
        x = torch.randn(rows, inputs, generator=g)
        got = weight_matmul(x, weight.data, weight.scale, sms=sms) if fp8 else weight_matmul(x, plain, sms=sms)
        expected = x @ (dequantize(weight) if fp8 else plain).T
        return {"launch": launch(out, inputs, sms), "shape": list(got.shape), "dtype": str(got.dtype),
                "max_diff": (got - expected).abs().max().item(), "scale": expected.abs().max().item()}

    print(json.dumps([case(*args) for args in json.loads(sys.argv[1])]))
    """
)


def run_cases(cases: list[tuple]) -> list[dict]:
    """The kernel on each `(rows, out, inputs, sms[, fp8])` in one interpreted process (imports once)."""
    return interpreted(CASES, json.dumps(cases))


def test_the_kernel_multiplies_the_rows_by_the_dequantized_weight():
    """1, 3, 4 and 16 rows; output channels a multiple of the program's 64 and not (48: the last block masked);
    input channels a multiple of the 256 a program reads at a time and not (300). With 8 SMs and 40 output channels
    the inputs are split over 3 programs whose partial sums the second pass adds; 16-channel blocks cover 40
    channels in 3. The last two: a float32 weight, no scale (as a bf16 weight runs), in one pass and split."""
    cases = [(1, 64, 512, 1), (3, 48, 300, 1), (4, 128, 256, 1), (16, 40, 1024, 8)]
    results = run_cases([*cases, (3, 48, 300, 1, False), (16, 40, 1024, 8, False)])
    assert [r["launch"] for r in results] == [[64, 1], [64, 1], [64, 1], [16, 3], [64, 1], [16, 3]]
    assert [r["shape"] for r in results] == [[1, 64], [3, 48], [4, 128], [16, 40], [3, 48], [16, 40]]
    for result in results:
        assert result["dtype"] == "torch.float32"
        assert result["max_diff"] < 1e-5 * result["scale"], result


def test_launch_fills_the_sms_with_output_channels_before_splitting_the_inputs():
    """On an H100's 132 SMs: the 7B shape's gate/up (37,888 channels) in blocks of 64, its q/k/v (4,608) of 32 and
    its down (3,584) of 16, one program per block; the 0.5B shape's o (896 x 896) needs splits: 56 blocks of 16,
    so 3 splits of its 896 inputs."""
    from ketch.rollout.few_rows_kernel import launch

    assert launch(37888, 3584, 132) == (64, 1)
    assert launch(4608, 3584, 132) == (32, 1)
    assert launch(3584, 18944, 132) == (16, 1)
    assert launch(896, 896, 132) == (16, 3)
