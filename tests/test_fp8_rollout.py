"""FP8 rollout weights (`ketch.rollout.fp8`, `rollout.quantization=fp8`) on the CPU: the round trip within e4m3's
rounding, the scales' layouts, the swap covers every projection the static decoder runs and leaves the bf16 weights
alone, a decode through the float32 reference of the FP8 matmul stays close to the unquantized one, and the
start-up errors; an FP8 KV cache (`rollout.kv_cache_dtype=fp8`) likewise."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ketch.config import ConfigError, load_config
from ketch.config.memory import gpu_memory_parts
from ketch.config.parallel import fp8_cache_problem, fp8_rollout_problem
from ketch.models import load_model_config
from ketch.rollout import fp8
from ketch.rollout.fp8 import FP8, FP8Linear, FP8Projections, dequantize, quantize_blocks, quantize_per_channel
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def within_e4m3_rounding(weight: torch.Tensor, scale_per_element: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: a value scaled into its normal range (magnitude >= 2^-6) rounds to the nearest of
    steps 2^-3 of its power of two, an error of at most half a step, 2^-4 of the value; below 2^-6 (subnormals, steps
    of 2^-9) at most 2^-10. Unscaled: |error| <= 2^-4 |w| + 2^-10 scale, per element."""
    error = (dequantize_as(weight, scale_per_element) - weight).abs()
    assert (error <= 2**-4 * weight.abs() + 2**-10 * scale_per_element).all()


def dequantize_as(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight / scale).to(FP8).float() * scale


def test_per_channel_scales_one_per_output_row_and_the_round_trip_stays_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=g) * torch.logspace(-3, 2, 96)[:, None]  # rows 5 decades apart
    q = quantize_per_channel(weight)
    assert q.data.dtype == FP8 and q.data.shape == (96, 80) and q.data.stride() == (80, 1)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (96, 1)
    torch.testing.assert_close(q.scale, weight.abs().amax(1, keepdim=True) / 448)
    assert (q.data.float().abs().amax(1) == 448).all()  # each row's largest magnitude lands on e4m3's largest
    within_e4m3_rounding(weight, q.scale.expand_as(weight))
    assert torch.equal(dequantize(q), q.data.float() * q.scale)


def test_block_scales_one_per_128_by_128_block_partial_blocks_included_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 300, generator=g)
    weight[130:, 260:] *= 100  # the last, partial block is much larger than the others
    q = quantize_blocks(weight)
    assert q.data.dtype == FP8 and q.data.shape == (200, 300) and q.scale.shape == (2, 3)
    assert q.scale[1, 2] == weight[128:, 256:].abs().max() / 448
    assert q.scale[0, 1] == weight[:128, 128:256].abs().max() / 448
    per_element = q.scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    within_e4m3_rounding(weight, per_element)
    torch.testing.assert_close(dequantize(q), q.data.float() * per_element, atol=0, rtol=0)


def tiny(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random 2-layer Llama (no biases) or Qwen2 (q/k/v biases), 2 key/value heads: every projection's sides are
    multiples of 16 (q/k/v fused: 32 + 16 + 16 rows)."""
    torch.manual_seed(0)
    config = (LlamaConfig if kind == "llama" else Qwen2Config)(**SIZES, num_key_value_heads=2)
    return (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config).to(dtype).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_swap_covers_every_projection_the_decoder_runs_and_leaves_the_bf16_weights_alone(kind):
    """After the static decoder fuses q/k/v and gate/up, the swap gives the fused weights, o_proj and down_proj FP8
    copies; NaN in every projection's bf16 weight then changes no log-prob of a decode (none reads them), while the
    lm head, embeddings and norms keep their dtype and every parameter its value."""
    model = tiny(kind, torch.bfloat16)
    before = {name: p.clone() for name, p in model.named_parameters()}
    decoder = StaticDecoder(model, compile_step=False)
    fp8 = FP8Projections(decoder.blocks)
    assert fp8.kept == [] and len(fp8.copies) == 2 * 4  # per layer: qkv, o_proj, gate_up, down_proj
    for block in decoder.blocks:
        assert block.self_attn.qkv_fp8.data.shape == (64, 32) and block.mlp.gate_up_fp8.data.shape == (128, 32)
        assert type(block.self_attn.o_proj) is FP8Linear and type(block.mlp.down_proj) is FP8Linear
        assert type(block.self_attn.q_proj) is torch.nn.Linear  # fused: its rows are in qkv_fp8
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for name, p in model.named_parameters() if "norm" in name)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    prompts, mask = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(0)), torch.ones(2, 5)
    decode = [decoder.generate(prompts, mask, 6, Sampling(do_sample=False), [63], pad_token_id=0)]
    with torch.no_grad():
        for block in decoder.blocks:
            for module in (block.self_attn, block.mlp):
                for name in PROJECTIONS:
                    if hasattr(module, name):
                        getattr(module, name).weight.fill_(float("nan"))
    decode.append(decoder.generate(prompts, mask, 6, Sampling(do_sample=False), [63], pad_token_id=0))
    assert torch.equal(decode[0][0], decode[1][0]) and torch.equal(decode[0][1], decode[1][1])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("weight_only_rows", [16, 64])
def test_a_decode_in_fp8_gives_log_probs_close_to_the_unquantized_models(kind, weight_only_rows, monkeypatch):
    """Greedy decoding of 3 prompts x 12 tokens in float32 through the float32 reference of the FP8 matmul (the
    3-row steps with the rows unquantized as the FP8 weight kernel takes them; the prefill's 21 rows quantized per
    token as `_scaled_mm` takes them, or, with `WEIGHT_ONLY_ROWS` at 64, unquantized too): each token's log-prob
    within 0.02 nats of the unquantized model's for the same tokens (the tiny random model's log-probs are about
    -3.9, and the bf16 model differs from float32 by 0.0015-0.016). The sampled tokens are scored, not compared: a
    near-tie may go either way."""
    monkeypatch.setattr(fp8, "WEIGHT_ONLY_ROWS", weight_only_rows)
    prompts = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    decoder = StaticDecoder(tiny(kind, torch.float32), compile_step=False)
    FP8Projections(decoder.blocks)
    tokens, log_probs = decoder.generate(prompts, torch.ones(3, 7), 12, Sampling(do_sample=False), [63], pad_token_id=0)
    with torch.no_grad():  # the same random weights (tiny seeds them), unquantized
        logits = tiny(kind, torch.float32)(torch.cat([prompts, tokens], 1)).logits[:, 6:-1].log_softmax(-1)
    expected = logits.gather(-1, tokens[..., None]).squeeze(-1)
    difference = (log_probs - expected).abs().max()
    assert 0 < difference < 0.02, difference


def test_a_compiled_decode_step_holds_the_fp8_ops():
    """The decode step compiled as on GPUs (`compile_step`), through the FP8 op of the 3-row steps and the float32
    reference of the 21-row prefill: the eager decode's greedy tokens, log-probs within 1e-6."""
    prompts = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    out = {}
    for compiled in (False, True):
        decoder = StaticDecoder(tiny("qwen2", torch.float32), compile_step=compiled)
        FP8Projections(decoder.blocks)
        out[compiled] = decoder.generate(prompts, torch.ones(3, 7), 8, Sampling(do_sample=False), [63], pad_token_id=0)
    assert torch.equal(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-6, rtol=0)


def test_the_hand_off_quantizes_the_new_weights_into_the_same_tensors(tiny_model_dir):
    """`HFRollout.update_weights` with `rollout.quantization=fp8`: the rollout's bf16 weights are the sent ones
    exactly, the sent tensors unchanged, and the FP8 copies hold the new weights at their old addresses."""
    from ketch.data import build_char_tokenizer
    from ketch.rollout.hf import HFRollout

    overrides = [
        "trainer.device=cpu",
        "rollout.hf_decoding=static",
        "rollout.quantization=fp8",
        "actor.rollout_is=token",
    ]
    config = load_config(overrides=[f"model.path={tiny_model_dir}", *overrides])
    rollout = HFRollout(config, str(tiny_model_dir), build_char_tokenizer(), torch.bfloat16, torch.device("cpu"), 0)
    attention = rollout.model.model.layers[0].self_attn
    sent = {n: p.detach() + 1 for n, p in rollout.model.named_parameters() if "layers.0.self_attn.o_proj" in n}
    kept = {n: t.clone() for n, t in sent.items()}
    address = attention.o_proj.fp8.data.data_ptr()
    rollout.update_weights(sent.items())
    for name, tensor in sent.items():
        assert torch.equal(tensor, kept[name]) and torch.equal(rollout.model.get_parameter(name), tensor)
    assert attention.o_proj.fp8.data.data_ptr() == address
    expected = quantize_per_channel(attention.o_proj.weight)
    assert torch.equal(attention.o_proj.fp8.data.float(), expected.data.float())
    assert torch.equal(attention.o_proj.fp8.scale, expected.scale)


def test_fp8_corrects_with_token_level_rollout_is_by_default_and_needs_a_gpu_with_fp8_matmuls(
    tiny_model_dir, monkeypatch
):
    base = [f"model.path={tiny_model_dir}", "rollout.quantization=fp8"]
    assert load_config(overrides=base).actor.rollout_is == "token"
    assert load_config(overrides=[*base, "actor.rollout_is=sequence"]).actor.rollout_is == "sequence"
    with pytest.raises(ConfigError, match=r"rollout\.quantization=fp8 .* set actor\.rollout_is=token"):
        load_config(overrides=[*base, "actor.rollout_is=null"])
    config = load_config(overrides=[*base, "actor.rollout_is=token", "trainer.device=cpu"])
    assert "this run decodes on the CPU (trainer.device)" in fp8_rollout_problem(config, gpu_visible=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    on_gpu = load_config(overrides=[*base, "actor.rollout_is=token", "trainer.device=auto"])
    problem = fp8_rollout_problem(on_gpu, gpu_visible=True)
    assert "this GPU, NVIDIA A100-SXM4-80GB, has compute capability 8.0" in problem
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert fp8_rollout_problem(on_gpu, gpu_visible=True) is None
    assert fp8_rollout_problem(load_config(overrides=[f"model.path={tiny_model_dir}"]), gpu_visible=False) is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_an_fp8_kv_cache_decodes_close_to_the_full_precision_cache(kind):
    """`rollout.kv_cache_dtype=fp8`: the static decoder's pools are float8 e4m3; greedy decoding of 3 prompts x 12
    tokens in float32 gives the same tokens, the first token's log-prob equal (the prompt attends among its own
    tokens unrounded) and the later ones within 0.02 nats (measured: at most 0.003)."""
    prompts = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7)
    out = {}
    for dtype in (None, torch.float8_e4m3fn):
        decoder = StaticDecoder(tiny(kind, torch.float32), compile_step=False, kv_dtype=dtype)
        out[dtype] = decoder.generate(prompts, mask, 12, Sampling(do_sample=False), [63], pad_token_id=0)
        assert {pool.dtype for pair in next(iter(decoder.caches.values())).pages.pools for pool in pair} == {
            dtype or torch.float32
        }
    fp8, full = out[torch.float8_e4m3fn], out[None]
    assert torch.equal(fp8[0], full[0])
    assert torch.equal(fp8[1][:, 0], full[1][:, 0])
    difference = (fp8[1] - full[1]).abs().max()
    assert 0 < difference < 0.02, difference


def test_an_fp8_kv_cache_needs_rollout_is_and_the_static_decoder_and_halves_the_estimate(tiny_model_dir):
    base = [f"model.path={tiny_model_dir}", "rollout.kv_cache_dtype=fp8"]
    assert load_config(overrides=base).actor.rollout_is == "token"
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_dtype=fp8 samples with FP8-rounded keys and values"):
        load_config(overrides=[*base, "actor.rollout_is=null"])
    with pytest.raises(ConfigError, match=r"set rollout\.hf_decoding=static \(or auto, on GPUs\)"):
        load_config(overrides=[*base, "actor.rollout_is=token", "rollout.hf_decoding=generate"])
    on_cpu = load_config(overrides=[*base, "actor.rollout_is=token", "trainer.device=cpu"])
    assert "decodes with generate on the CPU" in fp8_cache_problem(on_cpu, gpu_visible=False)
    static = load_config(
        overrides=[*base, "actor.rollout_is=token", "trainer.device=cpu", "rollout.hf_decoding=static"]
    )
    assert fp8_cache_problem(static, gpu_visible=False) is None
    vllm = load_config(overrides=[*base, "actor.rollout_is=token", "rollout.name=vllm"])
    assert fp8_cache_problem(vllm, gpu_visible=False) is None
    on_gpu = load_config(overrides=[*base, "actor.rollout_is=token", "trainer.device=cuda", "model.dtype=bfloat16"])
    bf16 = load_config(overrides=[f"model.path={tiny_model_dir}", "trainer.device=cuda", "model.dtype=bfloat16"])
    model = load_model_config(str(tiny_model_dir))
    kv = [gpu_memory_parts(c, model, 10**6, 2**30)["generation"]["KV cache"] for c in (bf16, on_gpu)]
    assert kv[0] == 2 * kv[1] > 0
