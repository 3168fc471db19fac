"""A Triton kernel for a weight times the rows of a decode step, few at the long tail of a batch (FP8 weights:
`fp8.fp8_linear` with at most `fp8.WEIGHT_ONLY_ROWS` rows).

At the long tail a decode step multiplies a few rows by every weight, so its time is the weights' bytes.
`torch._scaled_mm` at 4 rows spent as long on the 7B shape's FP8 weights as cuBLAS on its bf16 ones (6.0 against
6.7 ms a step on an H100, 2026-12-07), and cuBLAS at one row spent 4 µs on the 0.5B shape's q/k/v projection, whose
2 MB take under 1 µs to read. This kernel reads the weight `[out, in]` in its own dtype (e4m3 bytes, or bf16),
converts each tile to the activations' dtype in registers and multiplies it with the rows, accumulating in
float32; a per-output-channel scale and a bias, where given, are applied once at the end. Programs take `BLOCK_N`
output channels of a tile of at most `ROWS` rows each; a weight much wider in its inputs has each channel's inputs
split over programs whose partial sums a second kernel adds, with the bias, rounding once (`launch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ketch.rollout.decode_kernel import sm_count

ROWS = 64
"""The most rows a program takes: one tile of `tl.dot` of 16, 32 or 64 rows (its side is at least 16); more rows
are tiles of 64 in programs of their own. `benchmarks/fp8_matmul.py` times the kernel against `torch._scaled_mm`,
whose per-token quantization of the activations costs about 20 µs a call on an H100 (2026-12-07)."""
ADD_BLOCK = 1024
"""Outputs a program of the second kernel adds the split partial sums of: one launch where torch's sum, bias and
rounding took two or three (1.4 µs for the 7B shape's down projection at 4 rows on an H100, 2026-12-08)."""
BLOCK_K = 256
"""Input channels a program reads per iteration (a 16-channel tile of weights is 4 KiB), halved for each doubling
of the rows' tile past 16 (their tile in shared memory stays 8 KiB in bf16)."""


def launch(out_channels: int, in_channels: int, sms: int) -> tuple[int, int]:
    """`(BLOCK_N, splits)` for a weight `[out_channels, in_channels]` on `sms` SMs, as `benchmarks/fp8_matmul.py
    --sweep` found fastest at 4 rows on an H100 (2026-12-07): a weight at least 4 times wider in its inputs than its
    outputs (a down projection) split in 4 over its inputs (the 7B shape's down: 34 against 58 µs whole), in blocks
    of 32 output channels; any other whole (the pass that adds split partial sums costs about 3 µs, which small
    weights do not repay), in blocks of 32 channels where that gives at least half the SMs a program, else 16."""
    splits = 4 if in_channels >= 4 * max(out_channels, BLOCK_K) else 1
    return (32 if splits > 1 or triton.cdiv(out_channels, 32) >= sms // 2 else 16), splits


def weight_matmul(
    rows: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sms: int | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """`rows @ (data * scale).T + bias`: `rows` `[n, in]`, `data` `[out, in]` (float8 e4m3, or the
    rows' dtype), `scale` `[out, 1]` float32 or None (1), `bias` `[out]` or None -> `[n, out]` in `rows`' dtype, the
    bias added in float32 before the one rounding. `sms` overrides the SM count
    (CPU tensors, under Triton's interpreter, count as one SM); `tuning` the launch (`BLOCK_N`, `splits`,
    `BLOCK_K`, `num_warps`, `num_stages`: what `benchmarks/fp8_matmul.py --sweep` tries)."""
    n, in_channels = rows.shape
    if rows.stride(-1) != 1 or data.stride(-1) != 1:
        raise ValueError("weight matmul: each operand must be contiguous along its inputs")
    out_channels, tile = data.shape[0], min(ROWS, max(16, triton.next_power_of_2(n)))
    block_n, splits = launch(out_channels, in_channels, sm_count(rows) if sms is None else sms)
    defaults = {"BLOCK_N": block_n, "splits": splits, "BLOCK_K": BLOCK_K * 16 // tile, "num_warps": 4, "num_stages": 4}
    tuning = defaults | (tuning or {})
    block_n, splits = tuning.pop("BLOCK_N"), tuning.pop("splits")
    span = triton.cdiv(triton.cdiv(in_channels, splits), tuning["BLOCK_K"]) * tuning["BLOCK_K"]  # one split's inputs
    dtype = rows.dtype if splits == 1 else torch.float32
    partial = rows.new_empty(splits, n, out_channels, dtype=dtype)
    in_kernel = splits == 1 and bias is not None  # the kernel adds the bias; with splits, the sum of the parts does
    grid = (triton.cdiv(out_channels, block_n), splits, triton.cdiv(n, tile))
    _weight_matmul[grid](
        rows,
        data,
        data if scale is None else scale,  # unread without a scale
        bias if in_kernel else data,  # unread without
        partial,
        n,
        out_channels,
        in_channels,
        span,
        rows.stride(0),
        data.stride(0),
        PRECISION="ieee" if rows.dtype == torch.float32 else None,  # float32 without TF32's rounding
        SCALED=scale is not None,
        BIASED=in_kernel,
        BLOCK_N=block_n,
        ROWS=tile,
        **tuning,
    )
    if splits == 1:
        return partial[0]
    out, size = rows.new_empty(n, out_channels), n * out_channels
    block = min(ADD_BLOCK, triton.next_power_of_2(size))
    _add_splits[(triton.cdiv(size, block),)](
        partial, data if bias is None else bias, out, size, out_channels, SPLITS=splits, BIASED=bias is not None,
        BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _weight_matmul(
    rows_ptr,
    data_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    n,
    out_channels,
    in_channels,
    span,
    rows_stride,
    data_stride,
    PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
    BIASED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Program (j, s, m): output channels `j * BLOCK_N` on, input channels `s * span` to `(s + 1) * span`, rows
    `m * ROWS` on; writes `[ROWS, BLOCK_N]` of the partial sums `[splits, n, out_channels]`, scaled where `SCALED`,
    the bias added where `BIASED` (one split)."""
    block, split = tl.program_id(0), tl.program_id(1)
    row = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    channel = block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for start in range(split * span, tl.minimum((split + 1) * span, in_channels), BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(
            rows_ptr + row[:, None] * rows_stride + k[None, :], (row[:, None] < n) & (k[None, :] < in_channels), 0.0
        )
        w_mask = (channel[:, None] < out_channels) & (k[None, :] < in_channels)
        w = tl.load(data_ptr + channel[:, None] * data_stride + k[None, :], w_mask, 0.0).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if SCALED:
        acc *= tl.load(scale_ptr + channel, channel < out_channels, 0.0)[None, :]
    if BIASED:
        acc += tl.load(bias_ptr + channel, channel < out_channels, 0.0).to(tl.float32)[None, :]
    out = out_ptr + split * n * out_channels + row[:, None] * out_channels + channel[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), (row[:, None] < n) & (channel[None, :] < out_channels))


@triton.jit
def _add_splits(partial_ptr, bias_ptr, out_ptr, size, out_channels, SPLITS: tl.constexpr, BIASED: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """Program i: outputs `i * BLOCK` on of `[n, out_channels]` (`size` of them), the `SPLITS` partial sums `[SPLITS,
    n, out_channels]` (float32) added in split order, then the bias where `BIASED`, rounded once to the output's
    dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < size
    total = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + split * size + offsets, inside, 0.0)
    if BIASED:
        total += tl.load(bias_ptr + offsets % out_channels, inside, 0.0).to(tl.float32)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), inside)
