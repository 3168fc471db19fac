"""A batch-invariant matmul on GPUs (`rollout.exact_log_probs`): `rows @ weight.T` in one Triton kernel of fixed
tiles, so that a row gets the same bits alone (a decode step's) as among thousands (a training forward's).

cuBLAS picks its kernel, and with it the order in which a row's products are summed, by the shapes it is given.
Here every call runs the same compiled kernel: a program multiplies `BLOCK_M` rows by `BLOCK_N` output channels,
summing the inputs in blocks of `BLOCK_K` from the first, each block one `tl.dot` into a float32 accumulator, the
result rounded once. A row's sums depend only on the row and the weight: the tile's other rows (or the zeros that
mask a tile's missing rows) do not enter them, and no call splits the inputs. A bias is added to the float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
"""The tiles of every call: rows, output channels and inputs a program takes at a time."""


def invariant_matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`rows @ weight.T + bias`: `rows` `[n, in]`, `weight` `[out, in]` (each contiguous along its inputs), `bias`
    `[out]` or None -> `[n, out]` in the rows' dtype, the bias added to the float32 sums before the one rounding."""
    n, inputs = rows.shape
    outputs = weight.shape[0]
    out = rows.new_empty(n, outputs)
    if n == 0:  # an expert no token chose
        return out
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(outputs, BLOCK_N))
    _matmul[grid](
        rows, weight, weight if bias is None else bias, out, n, outputs, inputs, rows.stride(0), weight.stride(0),
        PRECISION="ieee" if rows.dtype == torch.float32 else None,  # float32 without TF32's rounding
        BIASED=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


@triton.jit
def _matmul(
    x_ptr, w_ptr, bias_ptr, out_ptr, n, outputs, inputs, x_row, w_row,
    PRECISION: tl.constexpr, BIASED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (i, j): rows `i * BLOCK_M` on times output channels `j * BLOCK_N` on."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * x_row + k[None, :], (m[:, None] < n) & (k[None, :] < inputs), 0.0)
        w = tl.load(w_ptr + c[:, None] * w_row + k[None, :], (c[:, None] < outputs) & (k[None, :] < inputs), 0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if BIASED:
        acc += tl.load(bias_ptr + c, c < outputs, 0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None] * outputs + c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), (m[:, None] < n) & (c[None, :] < outputs))
