"""On one GPU: the Triton decode-attention kernel over a paged cache against PyTorch's attention at the head sizes
of the benchmark models (64: Qwen2.5-0.5B, 128: Qwen2.5-7B) and Phi-3's 96 (masked to 128 lanes), and the compiled
static decoder (fused projections, the kernel, one CUDA graph per token) against transformers' `generate` on a
random Qwen2 and Qwen3 in float32, its compaction of the unfinished rows against a fresh forward, and a pool of pages
that grows while it decodes."""

from __future__ import annotations

import pytest
import torch
from gpu_models import tiny_decoder
from greedy import generate_greedy

from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_attention_over_the_filled_slots(head_dim, dtype):
    from ketch.rollout.decode_kernel import decode_attention, fits
    from ketch.rollout.kv_pages import as_pages

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, kv_heads, group, length, slot = 16, 2, 7, 384, 300
    q = torch.randn(rows, kv_heads, group, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(rows, kv_heads, length, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    filled = torch.zeros(rows, length, dtype=torch.bool, device="cuda")
    for row in range(rows):
        filled[row, 9 * row : slot + 1] = True  # left padding of 0 to 135 slots
    (k_pool, table), (v_pool, _) = as_pages(k), as_pages(v)  # 3 pages of 128 slots a row, in reverse order
    assert fits(q, k_pool, v_pool)
    out = decode_attention(q, k_pool, v_pool, table, filled, torch.tensor([slot], device="cuda"), head_dim**-0.5)
    seen = filled[:, None, None, : slot + 1]
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k[:, :, : slot + 1].double(), v[:, :, : slot + 1].double(), attn_mask=seen
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, : slot + 1], v[:, :, : slot + 1], attn_mask=seen)
    error, sdpa_error = ((x.double() - exact).abs().max().item() for x in (out, sdpa))
    if dtype == torch.float32:
        assert error < 1e-5
    else:
        assert error <= 2 * sdpa_error + 1e-3, (error, sdpa_error)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compiled_static_decoding_gives_generates_greedy_tokens(family):
    """A 2-layer Qwen2 or Qwen3 (fused projections, head norms) with head size 64 (so the kernel runs), left-padded
    prompts, 24 new tokens; float32."""
    model = tiny_decoder(family)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 512, (4, 20), generator=g).cuda()
    mask = torch.ones_like(input_ids)
    mask[1, :5], mask[2, :13] = 0, 0
    expected, expected_log_probs = generate_greedy(model, input_ids, mask, 24, pad_token_id=0)
    decoder = StaticDecoder(model, compile_step=True)
    for _ in range(2):  # the second call replays the captured graphs
        tokens, log_probs = decoder.generate(input_ids, mask, 24, Sampling(do_sample=False), None, pad_token_id=0)
        assert torch.equal(tokens, expected)
        torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-4, rtol=0)
    assert len(next(iter(decoder.caches.values())).graphs) == 1


def test_prompts_of_two_lengths_decode_in_the_graph_a_warm_up_captured():
    """With `longest_prompt=100` the KV cache holds 128 prompt slots and 24 new tokens whatever the batch's prompt
    length: a warm-up (two tokens) on prompts of 20 tokens captures the one graph, and prompts of 20 and of 90
    tokens then replay it, with generate's greedy tokens; float32."""
    model = tiny_decoder("qwen2")
    g = torch.Generator().manual_seed(2)
    batches = []
    for length, padded in ((20, 7), (90, 40)):
        input_ids = torch.randint(4, 512, (4, length), generator=g).cuda()
        mask = torch.ones_like(input_ids)
        mask[1, :padded] = 0
        batches.append((input_ids, mask, *generate_greedy(model, input_ids, mask, 24, pad_token_id=0)))
    decoder = StaticDecoder(model, compile_step=True, longest_prompt=100)
    greedy = (24, Sampling(do_sample=False), None)
    decoder.generate(batches[0][0], batches[0][1], *greedy, pad_token_id=0, stop_after=2)
    for input_ids, mask, expected, expected_log_probs in batches:
        tokens, log_probs = decoder.generate(input_ids, mask, *greedy, pad_token_id=0)
        assert torch.equal(tokens, expected)
        torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-4, rtol=0)
    assert list(decoder.caches) == [(4, 152)] and len(decoder.caches[4, 152].graphs) == 1


def test_a_released_decoder_captures_again_where_its_weights_come_back():
    """The hf rollout's `sleep` with `rollout.free_memory_while_training`: the KV caches and graphs released, the
    weights' storages resized to nothing, then given memory again (elsewhere: another tensor took their place)
    and refilled; the next generation captures a new graph on the new addresses and gives the same greedy tokens
    as before; float32."""
    model = tiny_decoder("qwen2")
    input_ids = torch.randint(4, 512, (4, 20), generator=torch.Generator().manual_seed(3)).cuda()
    mask = torch.ones_like(input_ids)
    greedy = (input_ids, mask, 24, Sampling(do_sample=False), None)
    decoder = StaticDecoder(model, compile_step=True)
    expected, _ = decoder.generate(*greedy, pad_token_id=0)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
    sizes = [(storage, storage.nbytes()) for storage in storages.values()]
    decoder.release()
    for storage, _ in sizes:
        storage.resize_(0)
    squatters = [torch.empty(size, dtype=torch.uint8, device="cuda") for _, size in sizes]  # the freed blocks
    for storage, size in sizes:
        storage.resize_(size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    assert [storage.data_ptr() for storage, _ in sizes] != list(storages), "the weights moved"
    del squatters
    tokens, _ = decoder.generate(*greedy, pad_token_id=0)
    assert torch.equal(tokens, expected)
    assert len(next(iter(decoder.caches.values())).graphs) == 1


def test_unfinished_rows_compact_into_graphs_of_their_own_and_keep_their_log_probs():
    """8 sampled rows of 96 tokens that stop on 16 of the 512 ids (about 3% a token on the random model): with 16
    or more tokens to go, once half the rows have finished the others move into the first 4 (then maybe 2) rows of
    the same memory, each shape with its CUDA graph; a second call replays them. Each row's log-probs up to its
    stop token are those of a fresh forward of the whole sequence (float32, to 1e-4), the pad token after it."""
    model, reference = tiny_decoder("qwen2"), tiny_decoder("qwen2")  # the decoder switches its model's attention
    input_ids = torch.randint(4, 512, (8, 6), generator=torch.Generator().manual_seed(0)).cuda()
    stops = list(range(5, 512, 32))
    args = (input_ids, torch.ones_like(input_ids), 96, Sampling(do_sample=True), stops)
    decoder = StaticDecoder(model, compile_step=True, compact_remaining=16)
    torch.manual_seed(0)
    for _ in range(2):
        tokens, log_probs = decoder.generate(*args, pad_token_id=0)
        lengths = (log_probs != 0).sum(1)
        with torch.no_grad():
            logits = reference(torch.cat([input_ids, tokens], 1)).logits[:, 5:-1].float().log_softmax(-1)
        expected = logits.gather(-1, tokens[:, :, None]).squeeze(-1)
        filled = torch.arange(96, device="cuda") < lengths[:, None]
        torch.testing.assert_close(log_probs[filled], expected[filled], atol=1e-4, rtol=0)
        stopped = tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
        assert all(s in stops for s, n in zip(stopped.tolist(), lengths.tolist(), strict=True) if n < 96)
        assert not tokens[~filled].any()
    root = next(iter(decoder.caches.values()))
    assert 4 in root.fronts and all(len(front.graphs) == 1 for front in root.fronts.values())
    assert len(root.graphs) == 1


def test_a_pool_that_grows_under_cuda_graphs_decodes_as_one_that_never_does(monkeypatch):
    """8 sampled rows of up to 300 tokens after 64 prompt slots (3 pages of 128 each) that stop on 2 of the 512
    ids: a pool of one page a row, which grows while the batch decodes (its CUDA graphs captured again on the new
    pool), against a pool with room for every row's whole length; compacting from 16 tokens to go. The same
    tokens, log-probs within 1e-5, and those of a fresh forward to 1e-4 (float32)."""
    from ketch.rollout import kv_pages

    model, reference = tiny_decoder("qwen2"), tiny_decoder("qwen2")
    input_ids = torch.randint(4, 512, (8, 6), generator=torch.Generator().manual_seed(0)).cuda()
    args = (input_ids, torch.ones_like(input_ids), 300, Sampling(do_sample=True), [5, 261])
    out, pages = {}, {}
    for per_row in (kv_pages.PAGE, 4096):
        monkeypatch.setattr(kv_pages, "POOL_SLOTS_PER_ROW", per_row)
        decoder = StaticDecoder(model, compile_step=True, compact_remaining=16)
        torch.manual_seed(0)
        out[per_row] = decoder.generate(*args, pad_token_id=0)
        pages[per_row] = decoder.caches[(8, 364)].pages.pages
    assert pages[4096] == 25 and pages[kv_pages.PAGE] > 9, pages  # 1 + 8 x 3 pages; 1 + 8 x 1, grown
    (tokens, log_probs), (full_tokens, full_log_probs) = out[kv_pages.PAGE], out[4096]
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(log_probs, full_log_probs, atol=1e-5, rtol=0)
    lengths = (log_probs != 0).sum(1)
    with torch.no_grad():
        logits = reference(torch.cat([input_ids, tokens], 1)).logits[:, 5:-1].float().log_softmax(-1)
    expected = logits.gather(-1, tokens[:, :, None]).squeeze(-1)
    filled = torch.arange(300, device="cuda") < lengths[:, None]
    torch.testing.assert_close(log_probs[filled], expected[filled], atol=1e-4, rtol=0)
