"""The static decoder's grouped-query attention for one new token gives what transformers' SDPA path gives."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ketch.rollout.static_decoding import grouped_decode_attention


def test_grouped_decode_attention_matches_sdpa_with_repeated_kv_heads_under_a_padding_mask():
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 3, 6, 2, 7, 8
    query = torch.randn(batch, heads, 1, head_dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2))
    # row 0 sees slots 0-4, row 1 slots 2-6 (left padding), row 2 only slot 3
    visible = torch.zeros(batch, length, dtype=torch.bool)
    visible[0, :5], visible[1, 2:], visible[2, 3] = True, True, True
    mask = visible[:, None, None, :]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = heads // kv_heads, True, False
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.3)
    assert got.shape == (batch, 1, heads, head_dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # row 2 sees one slot: its output is that slot's value, for each query head of the kv head
    torch.testing.assert_close(got[2, 0, 3], value[2, 1, 3], atol=1e-6, rtol=0)


def test_shape_buckets_give_the_same_greedy_tokens_and_log_probs(tiny_model_dir):
    """3 ragged prompts of 5 tokens decode padded to 4 rows x 64 prompt tokens exactly as unpadded."""
    from ketch.models import load_causal_lm
    from ketch.rollout.static_decoding import Sampling, StaticDecoder

    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(4, 40, (3, 5), generator=g)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    input_ids = input_ids * attention_mask
    out = {}
    for buckets in (False, True):
        decoder = StaticDecoder(model, compile_step=False, buckets=buckets)
        out[buckets] = decoder.generate(input_ids, attention_mask, 6, Sampling(do_sample=False), [8], pad_token_id=0)
        assert list(decoder.caches) == [(4, 70) if buckets else (3, 11)]
    assert torch.equal(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    assert out[False][1].min() < -1  # real log-probs
