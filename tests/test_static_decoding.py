"""The static decoder: its paged grouped-query attention for one new token gives what transformers' SDPA path gives;
its decoding gives what a fresh forward gives, in every shape and path."""

from __future__ import annotations

import torch
from greedy import generate_greedy
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ketch.rollout.decode_attention import grouped_decode_attention
from ketch.rollout.kv_pages import as_pages


def test_grouped_decode_attention_over_pages_matches_sdpa_with_repeated_kv_heads_under_a_padding_mask():
    """3 rows of 200 cache slots (two pages of 128, the rows' pages out of order in the pool) against transformers'
    SDPA path over the contiguous cache."""
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, head_dim = 3, 6, 2, 200, 8
    query = torch.randn(batch, heads, 1, head_dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, length, head_dim, generator=g) for _ in range(2))
    # row 0 sees slots 0-149, row 1 slots 130-199 (left padding into the second page), row 2 only slot 3
    visible = torch.zeros(batch, length, dtype=torch.bool)
    visible[0, :150], visible[1, 130:], visible[2, 3] = True, True, True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = heads // kv_heads, True, False
    expected, _ = sdpa_attention_forward(module, query, key, value, visible[:, None, None, :], scaling=0.3)
    (key_pool, table), (value_pool, _) = as_pages(key), as_pages(value)
    assert key_pool.shape == (7, kv_heads, 128, head_dim) and table.tolist() == [[6, 5], [4, 3], [2, 1]]
    got = grouped_decode_attention(query, key_pool, value_pool, table, visible, torch.tensor([199]), scaling=0.3)
    assert got.shape == (batch, 1, heads, head_dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    # row 2 sees one slot: its output is that slot's value, for each query head of the kv head
    torch.testing.assert_close(got[2, 0, 3], value[2, 1, 3], atol=1e-6, rtol=0)


def test_shape_buckets_give_the_same_greedy_tokens_and_log_probs(tiny_model_dir):
    """3 ragged prompts of 5 tokens decode padded to 4 rows x 64 prompt tokens exactly as unpadded."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

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


def test_long_prompts_prefill_in_groups_of_rows_as_in_one_forward(tiny_model_dir, monkeypatch):
    """With room for 1 or 2 prompts of 5 tokens a prefill forward (`PREFILL_TOKENS` 5 or 10: groups of 1, or of
    2 then 1, from the longest prompt down, each from its longest prompt's first column), 3 ragged prompts decode
    the greedy tokens and log-probs of one prefill over all 3 rows."""
    from ketch.models import load_causal_lm
    from ketch.rollout import static_decoding
    from ketch.rollout.sampling import Sampling

    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    input_ids = torch.randint(4, 40, (3, 5), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    out = {}
    groups = {15: [([0, 2, 1], 0)], 10: [([0, 2], 0), ([1], 2)], 5: [([0], 0), ([2], 1), ([1], 2)]}
    for tokens in (15, 10, 5):
        monkeypatch.setattr(static_decoding, "PREFILL_TOKENS", tokens)
        found = static_decoding.prefill_groups(attention_mask)
        assert [(rows.tolist(), first) for rows, first in found] == groups[tokens]
        decoder = static_decoding.StaticDecoder(model, compile_step=False, buckets=False)
        out[tokens] = decoder.generate(input_ids * attention_mask, attention_mask, 6, Sampling(False), [8], 0)
    for tokens in (10, 5):
        assert torch.equal(out[tokens][0], out[15][0])
        torch.testing.assert_close(out[tokens][1], out[15][1], atol=1e-6, rtol=0)
    assert out[15][1].min() < -1  # real log-probs


def test_rows_left_unfinished_move_into_a_smaller_shape_and_keep_their_log_probs(tiny_model_dir):
    """8 sampled rows that stop on 3 of 100 tokens: with 16 or more tokens to go, once half the rows have finished
    the others move into the first 4 (then 2) rows of the same memory; each row's tokens up to its stop token keep the
    log-probs a fresh forward of the whole sequence gives them, and the pad token follows. With the default
    (`COMPACT_REMAINING`, 512 tokens) 64-token responses never compact."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model, reference = (load_causal_lm(str(tiny_model_dir), torch.float32).eval() for _ in range(2))
    input_ids = torch.randint(4, 60, (8, 6), generator=torch.Generator().manual_seed(0))
    args = (input_ids, torch.ones_like(input_ids), 64, Sampling(do_sample=True), [5, 9, 17])
    torch.manual_seed(0)
    decoder = StaticDecoder(model, compile_step=False, buckets=True, compact_remaining=16)
    tokens, log_probs = decoder.generate(*args, pad_token_id=0)
    assert sorted(decoder.caches[(8, 128)].fronts) == [2, 4]
    lengths = (log_probs != 0).sum(1)
    assert lengths.tolist() == [6, 35, 14, 52, 42, 7, 64, 18]
    with torch.no_grad():
        logits = reference(torch.cat([input_ids, tokens], 1)).logits[:, 5:-1].log_softmax(-1)
    expected = logits.gather(-1, tokens[:, :, None]).squeeze(-1)
    filled = torch.arange(64) < lengths[:, None]
    torch.testing.assert_close(log_probs[filled], expected[filled], atol=1e-5, rtol=0)
    stopped = tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert all(s in (5, 9, 17) for s, n in zip(stopped.tolist(), lengths.tolist(), strict=True) if n < 64)
    assert not tokens[~filled].any()
    default = StaticDecoder(model, compile_step=False, buckets=True)
    default.generate(*args, pad_token_id=0)
    assert default.caches[(8, 128)].fronts == {}


def test_a_group_stop_cuts_the_rows_still_going_where_they_are_after_a_compaction(tiny_model_dir):
    """The 8 rows of the test above in 4 groups of 2 (ending at 35, 52, 42 and 64 tokens), half the groups needed:
    the batch moves into 4 rows at the check after 32 tokens, and at the check after 48 two groups are finished, so
    decoding stops there; the two rows still going (the 52 and 64 tokens) are cut at 48, their tokens and log-probs
    so far those of the decoding without the stop."""
    from ketch.models import load_causal_lm
    from ketch.rollout.group_stop import GroupStop
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    input_ids = torch.randint(4, 60, (8, 6), generator=torch.Generator().manual_seed(0))
    args = (input_ids, torch.ones_like(input_ids), 64, Sampling(do_sample=True), [5, 9, 17])
    decoder = StaticDecoder(model, compile_step=False, buckets=True, compact_remaining=16)
    torch.manual_seed(0)
    whole = decoder.generate(*args, pad_token_id=0)
    assert decoder.cut_at.tolist() == [64] * 8
    decoder = StaticDecoder(model, compile_step=False, buckets=True, compact_remaining=16)
    torch.manual_seed(0)
    stop = GroupStop(torch.arange(8) // 2, needed=2, count=4, must_finish=torch.zeros(8, dtype=torch.bool))
    tokens, log_probs = decoder.generate(*args, pad_token_id=0, group_stop=stop)
    assert decoder.cut_at.tolist() == [64, 64, 64, 48, 64, 64, 48, 64]
    assert sorted(decoder.caches[(8, 128)].fronts) == [4]
    assert torch.equal(tokens[:, :48], whole[0][:, :48]) and torch.equal(log_probs[:, :48], whole[1][:, :48])
    assert torch.equal(tokens[[0, 1, 2, 4, 5, 7]], whole[0][[0, 1, 2, 4, 5, 7]])
    assert not tokens[[3, 6], 48:].any() and not log_probs[[3, 6], 48:].any()


def test_a_partial_rollouts_rounds_decode_in_the_runs_one_shape_as_one_call_would(tiny_model_dir):
    """Partial rollouts continue a trajectory from its prompt and response so far: with `longest_prompt=60` (a
    cache of 64 prompt slots and 64 new tokens), 64 greedy tokens decoded in rounds of 24, 24 and 16 from prompts of
    20, 44 and 68 tokens (longer than the longest prompt, padded only as far as the shape holds) all run in the one
    shape of 4 rows x 128 slots, and give the tokens and log-probs of one call of 64."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    input_ids = torch.randint(4, 40, (3, 20), generator=torch.Generator().manual_seed(5))
    greedy = (Sampling(do_sample=False), None)
    decoder = StaticDecoder(model, compile_step=False, buckets=True, longest_prompt=60)
    whole, whole_log_probs = decoder.generate(input_ids, torch.ones_like(input_ids), 64, *greedy, pad_token_id=0)
    prompt, rounds = input_ids, []
    for tokens in (24, 24, 16):
        out, log_probs = decoder.generate(
            prompt, torch.ones_like(prompt), 64, *greedy, pad_token_id=0, stop_after=tokens
        )
        assert (out[:, tokens:] == 0).all() and (log_probs[:, tokens:] == 0).all()
        rounds.append((out[:, :tokens], log_probs[:, :tokens]))
        prompt = torch.cat([prompt, out[:, :tokens]], 1)
    assert list(decoder.caches) == [(4, 128)]
    assert torch.equal(torch.cat([r[0] for r in rounds], 1), whole)
    torch.testing.assert_close(torch.cat([r[1] for r in rounds], 1), whole_log_probs, atol=1e-5, rtol=0)


def greedy_case(tiny_model_dir):
    from ketch.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    return model, torch.randint(4, 40, (3, 5), generator=g) * attention_mask, attention_mask


def test_compiled_decode_step_gives_the_eager_greedy_tokens_and_log_probs(tiny_model_dir):
    """Each block of the decode step through torch.compile (dynamo and AOTAutograd, with the in-place writes into
    the KV cache; `aot_eager` keeps the test fast on a CPU) against the eager step, on ragged left-padded prompts
    with a stop token. Dynamo traces one graph for the model's 2 blocks, once per shape: a second batch of the
    same shape compiles nothing, one of another shape once more."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model, input_ids, attention_mask = greedy_case(tiny_model_dir)
    assert model.config.num_hidden_layers == 2
    counter = CompileCounterWithBackend("aot_eager")
    out = {}
    for compiled in (False, True):
        decoder = StaticDecoder(model, compile_step=compiled, buckets=False, backend=counter)
        out[compiled] = decoder.generate(input_ids, attention_mask, 6, Sampling(do_sample=False), [8], pad_token_id=0)
    assert torch.equal(out[True][0], out[False][0])
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-5, rtol=0)
    assert out[False][1].min() < -1
    assert counter.frame_count == 1
    again = decoder.generate(input_ids, attention_mask, 6, Sampling(do_sample=False), [8], pad_token_id=0)
    assert counter.frame_count == 1 and torch.equal(again[0], out[True][0])
    decoder.generate(input_ids[:2], attention_mask[:2], 6, Sampling(do_sample=False), [8], pad_token_id=0)
    assert counter.frame_count == 2


def test_prompts_of_any_length_up_to_the_longest_decode_in_the_shape_a_warm_up_compiled(tiny_model_dir):
    """With buckets and `longest_prompt=100` every KV cache has room for 128 prompt tokens (two buckets) and
    the response: a warm-up (`stop_after=2`: two real tokens, then pad) on prompts of 5 tokens compiles the one
    decode shape (4 rows x 134 slots), and batches with prompts of 5 and of 70 tokens then decode in it with no
    new compile, giving the unbucketed eager decoder's greedy tokens and log-probs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model, short_ids, short_mask = greedy_case(tiny_model_dir)
    g = torch.Generator().manual_seed(4)
    long_mask = torch.ones(3, 70, dtype=torch.long)
    long_mask[1, :30] = 0
    long_ids = torch.randint(4, 40, (3, 70), generator=g) * long_mask
    args = (6, Sampling(do_sample=False), [8])
    batches = ((short_ids, short_mask), (long_ids, long_mask))
    eager = StaticDecoder(model, compile_step=False, buckets=False)  # before the compiled decoder patches the blocks
    expected = [eager.generate(ids, mask, *args, pad_token_id=0) for ids, mask in batches]
    counter = CompileCounterWithBackend("aot_eager")
    decoder = StaticDecoder(model, compile_step=True, buckets=True, backend=counter, longest_prompt=100)
    warm_tokens, _ = decoder.generate(short_ids, short_mask, *args, pad_token_id=0, stop_after=2)
    assert counter.frame_count == 1 and list(decoder.caches) == [(4, 134)]
    assert torch.equal(warm_tokens[:, :2], expected[0][0][:, :2]) and (warm_tokens[:, 2:] == 0).all()
    for (ids, mask), (tokens, log_probs) in zip(batches, expected, strict=True):
        got_tokens, got_log_probs = decoder.generate(ids, mask, *args, pad_token_id=0)
        assert torch.equal(got_tokens, tokens)
        torch.testing.assert_close(got_log_probs, log_probs, atol=1e-5, rtol=0)
        assert log_probs.min() < -1
    assert counter.frame_count == 1 and list(decoder.caches) == [(4, 134)]


def test_a_later_decoder_loads_the_saved_decode_block_and_decodes_as_eager(tiny_model_dir, tmp_path, monkeypatch):
    """The decode block saved by one compiled decoder (`ketch.compiled`, `aot_eager` backend) is loaded by the
    next (as in a later run): no new form is compiled, and both give eager decoding's greedy tokens."""
    from ketch.compiled import _shared
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    monkeypatch.setenv("KETCH_CACHE_DIR", str(tmp_path))
    model, input_ids, attention_mask = greedy_case(tiny_model_dir)
    args = (input_ids, attention_mask, 6, Sampling(do_sample=False), [8])
    eager_tokens, eager_log_probs = StaticDecoder(model, compile_step=False).generate(*args, pad_token_id=0)
    forms = []
    for _ in range(2):
        _shared.cache_clear()  # each decoder as in a process of its own: no compiled function to share
        decoder = StaticDecoder(model, compile_step=True, buckets=False, backend="aot_eager")
        saved = decoder.blocks[0].forward.func
        loaded = len(saved.forms)
        tokens, log_probs = decoder.generate(*args, pad_token_id=0)
        assert torch.equal(tokens, eager_tokens)
        torch.testing.assert_close(log_probs, eager_log_probs, atol=1e-5, rtol=0)
        forms.append((loaded, len(saved.forms), len(list(saved.directory.glob("*.form")))))
    assert forms == [(0, 1, 1), (1, 1, 1)]


def test_decoding_stops_once_every_row_has_finished(tiny_model_dir):
    """With every token a stop token all rows finish at the first token, and the loop stops at the first check
    (`CHECK_EVERY` = 16: decode steps for tokens 2..16, 15 in all) instead of running 63 steps for 64 tokens."""
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import CHECK_EVERY, StaticDecoder

    model, input_ids, attention_mask = greedy_case(tiny_model_dir)
    calls, tokens = {}, {}
    for name, stops in (("all stop", list(range(model.config.vocab_size))), ("no stop", None)):
        decoder = StaticDecoder(model, compile_step=False)
        iterate, calls[name] = decoder._iterate, 0

        def counted(*args, iterate=iterate, name=name):  # one decode step each
            calls[name] += 1
            return iterate(*args)

        decoder._iterate = counted
        tokens[name], _ = decoder.generate(input_ids, attention_mask, 64, Sampling(False), stops, pad_token_id=0)
    assert CHECK_EVERY == 16 and calls == {"all stop": 15, "no stop": 63}
    assert (tokens["all stop"][:, 1:] == 0).all() and (tokens["all stop"][:, 0] != 0).all()  # pad after the stop
    assert (tokens["no stop"] != 0).all()  # without stops every token is real


def test_static_decoding_keeps_a_sliding_window_as_generate_does():
    """A Qwen2 whose second layer attends over a window of 3 tokens: the decoder's own mask for the new token
    leaves out the slots the window has passed, so greedy tokens and log-probs match transformers' `generate`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    config = Qwen2Config(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    input_ids = torch.randint(4, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    expected, expected_log_probs = generate_greedy(model, input_ids, attention_mask, 8, pad_token_id=0)
    tokens, log_probs = StaticDecoder(model, compile_step=False).generate(
        input_ids, attention_mask, 8, Sampling(do_sample=False), None, pad_token_id=0
    )
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)


def test_decode_shapes_leave_the_training_blocks_compile_static(tiny_model_dir):
    """Dynamo makes a dimension dynamic once a compiled function has seen it change, per function: the decoder
    compiles a function of its own, so a training forward compiled after decoding (`engine.compile_blocks`
    compiles another) still gets a graph of fixed shapes, no size among its inputs."""
    from ketch.engine.engine import compile_blocks
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    torch._dynamo.reset()  # forget the shapes that earlier tests of this process compiled the blocks for
    model, input_ids, attention_mask = greedy_case(tiny_model_dir)
    StaticDecoder(model, compile_step=True, buckets=False, backend="eager").generate(
        input_ids, attention_mask, 3, Sampling(do_sample=False), None, pad_token_id=0
    )
    policy, _, _ = greedy_case(tiny_model_dir)
    sizes_as_inputs = []

    def backend(graph, inputs):
        sizes_as_inputs.append(sum(isinstance(x, torch.SymInt) for x in inputs))
        return graph.forward

    assert compile_blocks(policy, backend=backend) is not None
    policy(input_ids=torch.randint(4, 40, (2, 7)), use_cache=False)
    assert sizes_as_inputs == [0]
