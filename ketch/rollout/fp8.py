"""FP8 rollout weights (`rollout.quantization=fp8`): the decoder's projections multiply in float8 e4m3.

A decode step at the long tail of a batch reads every weight for a few rows, so its time is the weights' bytes.
`FP8Projections` gives each projection of the decoder blocks (the fused q/k/v and gate/up of
`fused_projections.py` included, o_proj and down_proj; the lm head, the embeddings, the norms and a mixture's
router stay as they are) an FP8 copy with one float32 scale per output channel, made again from the bf16 weights
at each hand-off: the bf16 weights stay, untouched, for `weight_norm` and the next copy. On CUDA the FP8 matmul is
`torch._scaled_mm` with the activations quantized per token on the fly; elsewhere (the CPU tests) the same
arithmetic runs in float32; a decode step of at most `WEIGHT_ONLY_ROWS` rows (the long tail) multiplies the FP8
weights with the rows unquantized instead, in a Triton kernel (`few_rows_kernel.py`). 128 x 128 block scales (as
DeepSeek-V3's checkpoints) are here for comparing the rounding error; the decoder uses per-channel scales, which
`_scaled_mm` takes as its row-wise scaling.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

logger = logging.getLogger("ketch.rollout")

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
"""448: the largest e4m3 value; a scale maps each channel's (or block's) largest magnitude onto it."""
BLOCK = 128
"""The side of a block of `quantize_blocks`."""
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The names of the nn.Linear projections of a decoder block that run in FP8."""
FUSED = {"qkv_weight": ("q_proj", "k_proj", "v_proj"), "gate_up_weight": ("gate_proj", "up_proj")}
"""The fused weights of `fuse_projections` and the projections whose rows they hold (and which they replace)."""


class FP8Weight(NamedTuple):
    """A weight `[out, in]` as `data` `[out, in]` (float8 e4m3, row-major) times `scale` (float32): `[out, 1]` per
    output channel, or `[ceil(out / 128), ceil(in / 128)]` per 128 x 128 block."""

    data: torch.Tensor
    scale: torch.Tensor


def _scaled(weight: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale `amax / 448` (at least a tiny positive number: an all-zero row keeps zeros) broadcastable to
    `weight`, and `weight / scale` rounded to e4m3."""
    scale = amax.float().clamp(min=1e-12) / FP8_MAX
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_channel(weight: torch.Tensor) -> FP8Weight:
    """`weight` `[out, in]` with one scale per row, `[out, 1]`: also the per-token quantization of activations
    `[tokens, in]`."""
    return FP8Weight(*_scaled(weight, weight.abs().amax(dim=1, keepdim=True)))


def quantize_blocks(weight: torch.Tensor) -> FP8Weight:
    """`weight` `[out, in]` with one scale per 128 x 128 block, `[ceil(out / 128), ceil(in / 128)]` (the last
    blocks of a side that is not a multiple of 128 are partial)."""
    out, inputs = weight.shape
    padded = nn.functional.pad(weight.abs(), (0, -inputs % BLOCK, 0, -out % BLOCK))
    amax = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK)).amax(dim=(1, 3))
    data, scale = _scaled(weight, _per_element(amax, weight.shape))
    return FP8Weight(data, scale[::BLOCK, ::BLOCK].contiguous())


def _per_element(blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Block values `[ceil(out / 128), ceil(in / 128)]` repeated over their blocks' elements, `shape`."""
    return blocks.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]


def dequantize(weight: FP8Weight) -> torch.Tensor:
    """The float32 weight `[out, in]` that `weight` stands for (either scale layout)."""
    data, scale = weight
    per_element = scale if scale.shape[1] == 1 else _per_element(scale, data.shape)
    return data.float() * per_element


def fp8_linear(x: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for `x` `[..., in]` and a per-channel `weight` (`[out, in]`, both sides multiples of
    16), in `x`'s dtype. Up to `WEIGHT_ONLY_ROWS` rows (a decode step at the long tail) multiply the weight
    unquantized (`fp8_weight_matmul`); more rows are quantized to e4m3 per token for `torch._scaled_mm` on CUDA
    (`scaled_mm_linear`), elsewhere the same arithmetic in float32."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= WEIGHT_ONLY_ROWS:
        out = fp8_weight_matmul(rows, weight.data, weight.scale, bias)
    elif x.is_cuda:
        out = scaled_mm_linear(rows, weight, bias)
    else:
        bias = None if bias is None else bias.float()
        out = nn.functional.linear(dequantize(quantize_per_channel(rows)), dequantize(weight), bias)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def scaled_mm_linear(rows: torch.Tensor, weight: FP8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`rows @ weight.T + bias` on CUDA, `rows` `[n, in]` quantized to e4m3 per token for `torch._scaled_mm` (its
    second operand column-major: the transposed row-major data; its scales `[n, 1]` and `[1, out]`), in `rows`'
    dtype."""
    quantized = quantize_per_channel(rows)
    scale_b = weight.scale.view(1, -1)
    return torch._scaled_mm(quantized.data, weight.data.t(), quantized.scale, scale_b, bias=bias, out_dtype=rows.dtype)


WEIGHT_ONLY_ROWS = 16
"""The most rows `fp8_linear` multiplies with the FP8 weight unquantized (`few_rows_kernel.py`): the long tail's
steps, whose time is the weights' bytes. Wider steps round the activations per token for `_scaled_mm`, which
moves a small model further (SmolLM2-135M's next-token distributions by 0.108 nats a token against 0.049 for the
weights alone, `benchmarks/fp8_scales.py`, CPU) but decodes faster: on an H100 the 7B shape's captured step at 64
rows took 5.40 ms this way against 6.98 ms with the kernel at every step up to 256 rows (bf16: 6.23 ms). SmolLM2
runs with the kernel up to 256 rows learned 0.07 and 0.11 below bf16 in 40 GRPO steps, against 0.12 this way
(2026-12-07, `benchmarks/results/2026-12-07_h100_night.md`)."""


@torch.library.custom_op("ketch::fp8_weight_matmul", mutates_args=())
def fp8_weight_matmul(
    rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`rows @ (data * scale).T + bias`: `rows` `[n, in]`, `data` `[out, in]` e4m3, `scale` `[out, 1]`, `bias` `[out]`
    or None -> `[n, out]` in `rows`' dtype, rounded once (on CUDA the Triton kernel of `few_rows_kernel.py`;
    elsewhere in float32). An op of its own, so that compiled blocks and CUDA graphs hold it as one call."""
    bias = None if bias is None else bias.float()
    return nn.functional.linear(rows.float(), dequantize(FP8Weight(data, scale)), bias).to(rows.dtype)


@fp8_weight_matmul.register_kernel("cuda")
def _fp8_weight_matmul_cuda(rows, data, scale, bias):
    from ketch.rollout.few_rows_kernel import weight_matmul

    return weight_matmul(rows.contiguous(), data, scale, bias)


@fp8_weight_matmul.register_fake
def _fp8_weight_matmul_fake(rows, data, scale, bias):
    return rows.new_empty(rows.shape[0], data.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: FP8Weight | None) -> torch.Tensor:
    """`x @ weight.T + bias`, through `fp8` (the weight's FP8 copy) where there is one."""
    return nn.functional.linear(x, weight, bias) if fp8 is None else fp8_linear(x, fp8, bias)


class FP8Linear(nn.Linear):
    """An nn.Linear whose forward multiplies by `fp8`, the FP8 copy of its weight (its parameters stay, so the
    weight hand-off still finds them by name)."""

    fp8: FP8Weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8, self.bias)


class FP8Projections:
    """The FP8 copies of the projections of `blocks` (decoder layers, after `fuse_projections`): a fused weight's
    copy is `qkv_fp8` / `gate_up_fp8` on its module, an unfused projection becomes an `FP8Linear`. A weight whose
    sides are not both multiples of 16 (`_scaled_mm`'s rule) stays in bf16, named in `kept`."""

    def __init__(self, blocks: list[nn.Module]):
        self.copies: list[tuple[torch.Tensor, FP8Weight]] = []
        self.kept: list[str] = []
        for block in blocks:
            for name, module in block.named_modules():
                self._swap(name, module)
        if self.kept:
            logger.info("FP8 rollout: %d projections stay in bf16 (sides not multiples of 16)", len(self.kept))

    def _swap(self, name: str, module: nn.Module) -> None:
        fused = [key for key in FUSED if isinstance(getattr(module, key, None), torch.Tensor)]
        for key in fused:
            setattr(module, key.replace("weight", "fp8"), self._copy(f"{name}.{key}", getattr(module, key)))
        replaced = {part for key in fused for part in FUSED[key]}
        for child_name, child in module.named_children():
            projection = child_name in PROJECTIONS and child_name not in replaced and type(child) is nn.Linear
            if projection and (copy := self._copy(f"{name}.{child_name}", child.weight)) is not None:
                child.fp8, child.__class__ = copy, FP8Linear

    def _copy(self, name: str, weight: torch.Tensor) -> FP8Weight | None:
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            self.kept.append(name)
            return None
        copy = quantize_per_channel(weight.detach())
        self.copies.append((weight, copy))
        return copy

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize the bf16 weights again (after a hand-off), into the same FP8 tensors: a CUDA graph captured on
        them stays valid."""
        for weight, copy in self.copies:
            data, scale = quantize_per_channel(weight)
            copy.data.copy_(data)
            copy.scale.copy_(scale)
