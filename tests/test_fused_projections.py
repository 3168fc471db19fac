"""The static decoder's fused q/k/v and gate/up projections decode as the unfused model, also after the rollout's
weight update copies new weights into the projections by name."""

from __future__ import annotations

import copy

import pytest
import torch
from greedy import generate_greedy
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ketch.rollout.fused_projections import fuse_projections
from ketch.rollout.static_decoding import Sampling, StaticDecoder, transformer_blocks

SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8
)


def tiny(kind: str) -> torch.nn.Module:
    """A random 2-layer model with 2 key/value heads: Qwen2 (q/k/v biases, a sliding window of 3 tokens in its
    second layer), Llama (no biases) or Qwen3 (query/key norms)."""
    torch.manual_seed(0)
    if kind == "qwen2":
        config = Qwen2Config(
            **SIZES, num_key_value_heads=2, use_sliding_window=True, sliding_window=3, max_window_layers=1
        )
        assert config.layer_types == ["full_attention", "sliding_attention"]
        return Qwen2ForCausalLM(config).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**SIZES, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
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
    """Two groups per known layer, fused once (a second decoder on the same model finds them fused); Qwen3's
    attention (query/key norms) is not a known class, its MLP is not either: left as they are."""
    model = tiny("llama")
    assert fuse_projections(transformer_blocks(model)) == 4
    assert fuse_projections(transformer_blocks(model)) == 0
    qwen3 = tiny("qwen3")
    assert fuse_projections(transformer_blocks(qwen3)) == 0
    assert type(qwen3.model.layers[0].self_attn).__name__ == "Qwen3Attention"
