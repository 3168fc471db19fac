"""FP8 rollout on a GPU with FP8 matmuls (compute capability 8.9 or newer): the FP8 weight kernel and
`torch._scaled_mm` against the float32 arithmetic the CPU tests check, a captured decode in FP8 against the bf16
one, and the hand-off's refresh seen by a CUDA graph captured before it."""

from __future__ import annotations

import pytest
import torch

from ketch.rollout.fp8 import WEIGHT_ONLY_ROWS, FP8Projections, dequantize, fp8_linear, quantize_per_channel
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 matmuls"
)


@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 37, 150])
def test_fp8_linear_equals_the_float32_arithmetic_of_its_operands(tokens):
    """Up to 16 rows the FP8 weights multiply the rows unquantized (the Triton kernel of `few_rows_kernel.py`); more
    rows are quantized per token for `torch._scaled_mm`. Each equals the float32
    arithmetic of the same operands and scales as the CPU reference, bf16 output rounding apart (relative 2^-8)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 512, device="cuda", generator=g).bfloat16()
    weight = quantize_per_channel(torch.randn(384, 512, device="cuda", generator=g) * 0.02)
    bias = torch.randn(384, device="cuda", generator=g).bfloat16()
    out = fp8_linear(x, weight, bias)
    rows = x.float() if tokens <= WEIGHT_ONLY_ROWS else dequantize(quantize_per_channel(x))
    reference = rows @ dequantize(weight).T + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 384)
    assert torch.allclose(out.float(), reference, rtol=2**-7, atol=1e-3)


def test_a_captured_fp8_decode_follows_the_bf16_decode_and_a_refresh_reaches_its_graph(tiny_qwen2):
    """Greedy decoding of 4 prompts x 16 tokens, compiled and captured: in FP8 each token's log-prob within 0.25
    nats of the bf16 decode's (the tiny random model's are about -5; measured on an H100: at most 0.20, about 0.04
    on average, over whole rows); after the weights change and `refresh`, the graphs captured before give what the
    same decoder gives uncaptured."""
    model = tiny_qwen2.bfloat16()
    prompts = torch.randint(1, 512, (4, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = torch.ones_like(prompts)
    greedy = Sampling(do_sample=False)
    decoder = StaticDecoder(model, compile_step=True)
    _, bf16 = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    fp8 = FP8Projections(decoder.blocks)
    assert not fp8.kept and len(fp8.copies) == 2 * 4
    decoder.release()
    _, quantized = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    assert 0 < (quantized - bf16).abs().max() < 0.25
    with torch.no_grad():
        for weight, _ in fp8.copies:
            weight.mul_(1.5)
    fp8.refresh()
    after = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    decoder.capture = False
    expected = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    assert not torch.allclose(after[1], quantized, atol=0.02)
    assert torch.equal(after[0], expected[0]) and torch.allclose(after[1], expected[1], atol=1e-3)


def test_a_captured_decode_with_an_fp8_kv_cache_follows_the_bf16_cache(tiny_qwen2):
    """`rollout.kv_cache_dtype=fp8` compiled and captured: greedy decoding of 4 prompts x 16 tokens, each token's
    log-prob within 0.25 nats of the bf16 cache's (measured on an H100: mostly under 0.01, at most 0.17), the first
    one equal (the prompt attends unrounded)."""
    model = tiny_qwen2.bfloat16()
    prompts = torch.randint(1, 512, (4, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask, greedy = torch.ones_like(prompts), Sampling(do_sample=False)
    decoder = StaticDecoder(model, compile_step=True)
    _, bf16 = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    decoder.release()  # the next shape's cache is allocated in FP8
    decoder.kv_dtype = torch.float8_e4m3fn
    _, fp8 = decoder.generate(prompts, mask, 16, greedy, None, pad_token_id=0)
    assert next(iter(decoder.caches.values())).pages.pools[0][0].dtype == torch.float8_e4m3fn
    assert torch.equal(fp8[:, 0], bf16[:, 0]) and 0 < (fp8 - bf16).abs().max() < 0.25
