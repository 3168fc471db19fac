"""On one GPU: the Triton sampling kernel against torch (argmax, log-softmax, the softmax's frequencies over
100,000 draws), and sampled decoding through the compiled static decoder, whose captured graphs replay the
kernel with a seed that moves on every token."""

from __future__ import annotations

import copy

import torch

from ketch.rollout.sample_kernel import sample
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder


def test_greedy_tokens_and_log_probs_match_torch_at_a_real_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(128, 151936, device="cuda", generator=g) * 4).to(torch.bfloat16)
    token, log_prob = sample(logits, 1.0, False, torch.zeros(1, dtype=torch.long, device="cuda"))
    assert torch.equal(token, logits.float().argmax(-1))
    expected = logits.float().log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    torch.testing.assert_close(log_prob, expected, atol=1e-5, rtol=0)


def test_draws_have_the_softmaxs_frequencies():
    """Tokens 3, 5000 and 9999 (three chunks) with probabilities 0.5, 0.3, 0.2 at temperature 0.7: within 0.006
    of them over 100,000 rows (4 standard deviations)."""
    logits = torch.full((100_000, 10_000), -40.0, device="cuda")
    logits[:, [3, 5000, 9999]] = 0.7 * torch.tensor([0.5, 0.3, 0.2], device="cuda").log()
    token, log_prob = sample(logits, 0.7, True, torch.tensor([11], device="cuda"))
    frequencies = [(token == i).float().mean().item() for i in (3, 5000, 9999)]
    assert max(abs(f - p) for f, p in zip(frequencies, [0.5, 0.3, 0.2], strict=True)) < 0.006, frequencies
    expected = (logits / 0.7).log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    torch.testing.assert_close(log_prob, expected, atol=1e-5, rtol=0)


def test_sampled_static_decoding_is_seeded_and_scores_its_tokens(tiny_qwen2):
    """A random 2-layer Qwen2 in float32, 8 rows x 32 sampled tokens, twice per seed (the second replays the
    graphs): the same seed gives the same tokens, another seed others; each token's log-prob is the model's."""
    model = tiny_qwen2
    input_ids = torch.randint(4, 512, (8, 16), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(input_ids)
    reference = copy.deepcopy(model)  # the decoder rebuilds the model's attention and compiles its blocks
    decoder = StaticDecoder(model, compile_step=True)
    runs = {}
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.setdefault(seed, []).append(decoder.generate(input_ids, mask, 32, Sampling(True), None, pad_token_id=0))
    (tokens, log_probs), (again, _) = runs[0]
    assert torch.equal(tokens, again) and (runs[1][0][0] != tokens).float().mean() > 0.5
    with torch.no_grad():
        logits = reference(torch.cat([input_ids, tokens], 1)).logits[:, input_ids.shape[1] - 1 : -1]
    expected = logits.float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)
