"""The static decoder in `rollout.exact_log_probs` mode (`ketch.rollout.exact_decoding`): its paged, lockstep
decoding computes each token with the training forward's ops, so the log-probs it returns equal the actor's padded
training forward's, bit for bit, whatever the rows' prompt lengths and however many rows decode together."""

from __future__ import annotations

import copy

import pytest
import torch
from families import save_tiny_family_model, tiny_family_config
from test_exact_log_probs import _grpo_run, _mask
from torch import nn
from transformers import AutoModelForCausalLM

from ketch.config import load_config
from ketch.data import build_char_tokenizer
from ketch.engine.heads import PolicyModel
from ketch.models.batch_invariant import KEYS, attention, make_batch_invariant
from ketch.models.tiny import build_tiny_model
from ketch.rollout import exact_decoding
from ketch.rollout.base import response_mask_from_stops
from ketch.rollout.exact_decoding import ExactDecoder, _walk_cache
from ketch.rollout.kv_pages import PAGE, as_pages
from ketch.rollout.sampling import Sampling

LENGTHS = (70, 3, 130, 64)
"""Prompt lengths of one batch: real tokens that start at other places of a key block in each row, a prompt of
whole blocks, and one that spans three blocks with its response."""


def _model(family: str, dtype: torch.dtype) -> nn.Module:
    """A tiny random Qwen2 (2 layers, 32 wide) or Qwen3-MoE (2 layers, 4 experts, 2 a token) in `dtype`."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    if family == "qwen2":
        model = build_tiny_model(tokenizer, hidden_size=32, intermediate_size=64, num_layers=2, max_positions=512)
    else:
        model = AutoModelForCausalLM.from_config(tiny_family_config("qwen3_moe", tokenizer))
    return model.to(dtype).eval()


def _prompts(lengths: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` tokens: ids and attention mask `[rows, longest]`."""
    g, longest = torch.Generator().manual_seed(seed), max(lengths)
    ids, mask = (
        torch.zeros(len(lengths), longest, dtype=torch.long),
        torch.zeros(len(lengths), longest, dtype=torch.long),
    )
    for row, n in enumerate(lengths):
        ids[row, longest - n :] = torch.randint(4, 40, (n,), generator=g)
        mask[row, longest - n :] = 1
    return ids, mask


def _decode(model: nn.Module, ids, mask, new: int, sampling: Sampling, capture: bool = False) -> tuple:
    """`new` tokens and their log-probs `[rows, new]` from an exact decoder of a batch-invariant copy of `model`
    (with `capture`, its steps captured into CUDA graphs), and the decoder."""
    decoder = ExactDecoder(make_batch_invariant(copy.deepcopy(model)), compile_step=capture)
    torch.manual_seed(0)
    return *decoder.generate(ids, mask, new, sampling, None, pad_token_id=0), decoder


def _training_log_probs(model: nn.Module, ids, mask, responses, temperature: float) -> torch.Tensor:
    """The actor's padded training forward (`PolicyModel`, batch-invariant) of prompts and responses: the
    responses' log-probs `[rows, new]`."""
    policy = PolicyModel(copy.deepcopy(model), batch_invariant=True).eval()
    full_mask = torch.cat([mask, torch.ones_like(responses)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = policy(torch.cat([ids, responses], 1), full_mask, positions, responses.shape[1], temperature)
    return out["log_prob"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_decoded_log_probs_are_the_training_forwards_bit_for_bit(family, dtype):
    """Four rows of 70, 3, 130 and 64 prompt tokens, 12 sampled tokens each: the decoder's log-probs are the
    padded training forward's (the experts of a mixture run with fixed shapes in the decode steps)."""
    model, (ids, mask) = _model(family, dtype), _prompts(LENGTHS)
    responses, log_probs, _ = _decode(model, ids, mask, 12, Sampling(do_sample=True, temperature=0.9))
    expected = _training_log_probs(model, ids, mask, responses, 0.9)
    assert (log_probs - expected).abs().max().item() == 0.0
    assert log_probs.min() < -1  # real log-probs


def test_blocks_aligned_to_the_caches_slots_instead_of_each_rows_first_token_differ(monkeypatch):
    """The same decoding with each row's keys read from cache slot 0 on (its left padding masked, its tokens in
    other places of the key blocks than the training forward's): the log-probs differ in the last bits."""

    def from_slot_0(mask, table):
        slots = torch.arange(-(-mask.shape[1] // KEYS) * KEYS).clamp(max=mask.shape[1] - 1).expand(len(mask), -1)
        inside = torch.arange(slots.shape[1]) < mask.shape[1]
        return table.gather(1, slots // PAGE), slots % PAGE, mask.gather(1, slots) & inside

    model, (ids, mask) = _model("qwen2", torch.float32), _prompts(LENGTHS)
    monkeypatch.setattr(exact_decoding, "_compacted_slots", from_slot_0)
    responses, log_probs, _ = _decode(model, ids, mask, 12, Sampling(do_sample=True, temperature=0.9))
    assert 0 < (log_probs - _training_log_probs(model, ids, mask, responses, 0.9)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_decodes_the_same_bits_alone_as_in_a_batch_of_8(dtype):
    """A prompt of 100 tokens decoded greedily alone and as row 5 of 8 (prompts of 1 to 150 tokens): the same
    tokens and log-probs."""
    model = _model("qwen2", dtype)
    ids, mask = _prompts((7, 150, 1, 64, 33, 100, 128, 90))
    alone = _decode(model, ids[5:6, -100:], mask[5:6, -100:], 10, Sampling(do_sample=False))
    batch = _decode(model, ids, mask, 10, Sampling(do_sample=False))
    assert torch.equal(alone[0][0], batch[0][5]) and torch.equal(alone[1][0], batch[1][5])


def test_rows_moved_into_a_smaller_shape_keep_the_training_forwards_bits():
    """32 sampled rows of 1 to 40 prompt tokens that stop on 3 of 40 tokens, with shape buckets and compaction
    after 8 tokens: once 16 rows or fewer go on, they move into the first 16 rows (the fewest the exact decoder
    decodes in) and read their keys where their moved mask says; every token up to a row's stop has the padded
    training forward's log-prob."""
    model = _model("qwen2", torch.float32)
    ids, mask = _prompts(tuple(int(n) for n in torch.randint(1, 41, (32,), generator=torch.Generator().manual_seed(4))))
    decoder = ExactDecoder(
        make_batch_invariant(copy.deepcopy(model)), compile_step=False, buckets=True, compact_remaining=8
    )
    torch.manual_seed(0)
    responses, log_probs = decoder.generate(ids, mask, 40, Sampling(do_sample=True), [5, 9, 17], pad_token_id=0)
    assert [sorted(b.fronts) for b in decoder.caches.values()] == [[16]]
    filled = response_mask_from_stops(responses, [5, 9, 17])
    policy = PolicyModel(copy.deepcopy(model), batch_invariant=True).eval()
    full_mask = torch.cat([mask, filled], 1)
    with torch.no_grad():
        out = policy(torch.cat([ids, responses], 1), full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0), 40)
    assert 0 < filled.sum() < filled.numel() and torch.equal(out["log_prob"], log_probs * filled)


@pytest.mark.parametrize("window", [None, 40])
def test_one_tokens_walk_over_the_paged_cache_is_the_sequences_forward_at_that_token(window):
    """Three rows of 200 cache slots (two pages, out of order in the pool), left padding of 0, 5 and 70 slots, 4
    query heads over 2 key heads: the query of each row's last slot over the cache, read where its real tokens
    sit, gives the bits of `batch_invariant.attention` over the whole sequence at that token (a sliding window of
    40 tokens too)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 200, 16), torch.randn(3, 2, 200, 16), torch.randn(3, 2, 200, 16)
    real = torch.ones(3, 200, dtype=torch.bool)
    real[1, :5], real[2, :70] = False, False
    full = _mask(real, 200)
    if window is not None:
        full = full & (torch.arange(200)[None, :] > torch.arange(200)[:, None] - window)
    forward, _ = attention(nn.Module(), q, k, v, full, scaling=0.25)
    (key_pool, table), (value_pool, _) = as_pages(k), as_pages(v)
    keys = exact_decoding._compacted_slots(real, table)
    step = _walk_cache(q[:, :, -1:], (key_pool, value_pool), keys, 0.25, window)
    assert step.shape == (3, 1, 4, 16) and torch.equal(step[:, 0], forward[:, -1])


def test_a_prompt_with_a_gap_is_refused():
    model = _model("qwen2", torch.float32)
    ids, mask = _prompts((5, 5))
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="a prompt's attention mask has a gap"):
        _decode(model, ids, mask, 2, Sampling(do_sample=False))


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "float32"), ("qwen2", "bfloat16"), ("qwen3_moe", "float32")])
def test_grpo_with_the_static_decoder_in_exact_mode_has_no_gap(tiny_config, monkeypatch, tmp_path, family, dtype):
    """A 2-step GRPO run with `rollout.hf_decoding=static` (the tests' tiny Qwen2, or a tiny Qwen3-MoE): the exact
    decoder decodes, and the rollout's log-probs are the update's first forward's (the old-log-prob pass
    skipped)."""
    steps_decoded = []
    iterate = ExactDecoder._iterate
    monkeypatch.setattr(ExactDecoder, "_iterate", lambda *args: steps_decoded.append(1) or iterate(*args))
    settings = ["rollout.exact_log_probs=true", "rollout.hf_decoding=static", f"model.dtype={dtype}"]
    if family == "qwen3_moe":
        settings.append(f"model.path={save_tiny_family_model(tmp_path / 'moe', family, build_char_tokenizer())}")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings)
    assert [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)
    assert steps_decoded and not any("timing_s/old_log_prob" in s for s in steps)


def test_the_static_decoder_is_accepted_in_exact_mode():
    config = load_config(overrides=["rollout.exact_log_probs=true", "rollout.hf_decoding=static"])
    assert config.rollout.hf_decoding == "static"
