"""The static decoder's fused q/k/v and gate/up projections decode as the unfused model, also after the rollout's
weight update copies new weights into the projections by name."""

from __future__ import annotations

import copy

import pytest
import torch
from greedy import generate_greedy
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ketch.architecture import decoder_blocks
from ketch.rollout.fused_projections import fuse_projections
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8
)


def tiny(kind: str) -> torch.nn.Module:
    """A random 2-layer model with 2 key/value heads: Qwen2 (q/k/v biases) or Qwen3 (query/key norms), each with a
    sliding window of 3 tokens in its second layer, Llama (no biases) or Gemma (an architecture not fused)."""
    torch.manual_seed(0)
    window = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}
    if kind in ("qwen2", "qwen3"):
        config = (Qwen2Config if kind == "qwen2" else Qwen3Config)(**SIZES, num_key_value_heads=2, **window)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        return (Qwen2ForCausalLM if kind == "qwen2" else Qwen3ForCausalLM)(config).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2)).eval()
    return GemmaForCausalLM(GemmaConfig(**SIZES, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_fused_decoding_matches_generate_after_a_weight_update(kind):
    model = tiny(kind)
    reference = copy.deepcopy(model)
    decoder = StaticDecoder(model, compile_step=False)
    attention, mlp = decoder.blocks[0].self_attn, decoder.blocks[0].mlp
    assert type(attention).__name__.startswith("Fused") and type(mlp).__name__.startswith("Fused")
    assert attention.qkv_sizes == [32, 16, 16] and mlp.gate_up_weight.shape == (96, 32)
    assert (attention.qkv_bias is not None) == (kind == "qwen2")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # the rollout's weight update: a copy into each parameter by name
        params = dict(model.named_parameters())
        for name, same in reference.named_parameters():
            new = torch.randn(same.shape, generator=g) * 0.3
            params[name].copy_(new)
            same.copy_(new)
    torch.testing.assert_close(attention.qkv_weight[32:48], reference.model.layers[0].self_attn.k_proj.weight)
    torch.testing.assert_close(mlp.gate_up_weight[48:], reference.model.layers[0].mlp.up_proj.weight)
    input_ids = torch.randint(4, 64, (2, 5), generator=g)
    mask = torch.ones_like(input_ids)
    expected, expected_log_probs = generate_greedy(reference, input_ids, mask, 8, pad_token_id=0)
    tokens, log_probs = decoder.generate(input_ids, mask, 8, Sampling(do_sample=False), None, pad_token_id=0)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)


def test_fusing_twice_or_an_unknown_architecture_changes_nothing():
    """Two groups per known layer, fused once (a second decoder on the same model finds them fused); Gemma's
    attention and MLP are not known classes: left as they are."""
    model = tiny("llama")
    assert fuse_projections(decoder_blocks(model)) == 4
    assert fuse_projections(decoder_blocks(model)) == 0
    gemma = tiny("gemma")
    assert fuse_projections(decoder_blocks(gemma)) == 0
    assert type(gemma.model.layers[0].self_attn).__name__ == "GemmaAttention"
