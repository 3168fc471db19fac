"""The Triton sampling kernel (`ketch/rollout/sample_kernel.py`), run by Triton's interpreter on the CPU: greedy
tokens and log-probs as torch computes them, draws with the softmax's frequencies, noise keyed on the seed."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

CASE = textwrap.dedent(
    """
    import json, math, torch
    from ketch.rollout.sample_kernel import sample

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 9000, generator=g) * 3).to(torch.bfloat16)  # three chunks of 4096 logits
    logits[3, 8999] = 40.0                 # the best token is the vocabulary's last
    logits[4, :4096] = float("-inf")       # a chunk with nothing to draw
    logits[5, 100] = logits[5, 5000] = 50  # equal best tokens in two chunks: the first wins
    token, log_prob = sample(logits, 1.0, False, torch.tensor([5]))
    expected = logits.float().log_softmax(-1)
    greedy = {"tokens": token.tolist(), "argmax": logits.float().argmax(-1).tolist(),
              "log_prob_diff": (log_prob - expected.gather(-1, token[:, None]).squeeze(-1)).abs().max().item()}

    # tokens 10, 4100 and 4199 with probabilities 0.5, 0.3 and 0.2 at temperature 2; 100 tokens nearly never drawn
    logits = torch.full((300, 4200), float("-inf"))
    logits[:, [10, 4100, 4199]] = 2 * torch.tensor([0.5, 0.3, 0.2]).log()
    logits[:, 4150:4170] = -30.0
    token, log_prob = sample(logits, 2.0, True, torch.tensor([123]))
    expected = (logits / 2).log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    again, _ = sample(logits[:100], 2.0, True, torch.tensor([123]))
    other, _ = sample(logits[:100], 2.0, True, torch.tensor([124]))
    sampled = {"frequencies": [(token == i).float().mean().item() for i in (10, 4100, 4199)],
               "log_prob_diff": (log_prob - expected).abs().max().item(),
               "same_seed_agrees": (again == token[:100]).float().mean().item(),
               "next_seed_agrees": (other == token[:100]).float().mean().item()}
    print(json.dumps({"greedy": greedy, "sampled": sampled}))
    """
)


def test_kernel_takes_the_argmax_or_draws_from_the_softmax_by_seed():
    """Greedy on 6 rows of 9000 bf16 logits (three chunks): torch's argmax, the last token, a chunk of -inf,
    a tie across chunks; sampled on 300 rows at temperature 2: frequencies 0.5/0.3/0.2 within 0.07 (the draws
    are fixed by the seed: a row's draw depends on the seed and the row only; measured 0.470/0.337/0.193), log-probs
    under the scaled softmax."""
    result = interpreted(CASE, timeout=300)
    greedy, sampled = result["greedy"], result["sampled"]
    assert greedy["tokens"] == greedy["argmax"]
    assert greedy["tokens"][3] == 8999 and greedy["tokens"][5] == 100
    assert greedy["log_prob_diff"] < 1e-5
    for frequency, probability in zip(sampled["frequencies"], [0.5, 0.3, 0.2], strict=True):
        assert abs(frequency - probability) < 0.07
    assert abs(sum(sampled["frequencies"]) - 1.0) < 1e-6  # no draw of the nearly impossible tokens
    assert sampled["log_prob_diff"] < 1e-6
    assert sampled["same_seed_agrees"] == 1.0 and sampled["next_seed_agrees"] < 0.7
