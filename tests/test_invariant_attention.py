"""The batch-invariant attention kernel (`ketch/models/invariant_attention.py`), run by Triton's interpreter on the
CPU in float32: the training forward against SDPA, each decode step's query against the same query in the training
forward (bit for bit), and the backward against SDPA's."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from torch.nn import functional as F
    from ketch.models.invariant_attention import PAGE, TrainingAttention, invariant_attention, training_mask
    from ketch.models.pages import as_pool

    def case(window):
        g = torch.Generator().manual_seed(0)
        batch, heads, kv_heads, length, head_dim = 3, 6, 2, 150, 16  # 3 query heads a key head; 3 blocks of keys
        real = torch.zeros(batch, length, dtype=torch.bool)
        real[0, :] = True  # no padding
        real[1, 100:] = True  # left padding: 50 real tokens
        real[2, 5:120] = True  # both sides
        q = torch.randn(batch, heads, length, head_dim, generator=g, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=g, requires_grad=True) for _ in range(2))
        out = TrainingAttention.apply(q, k, v, real, 0.25, window)  # [batch, length, heads, head_dim]
        mask = training_mask(real, length, window)
        some = mask.any(-1, keepdim=True)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~some, scale=0.25, enable_gqa=True)
        expected = (expected * some).transpose(1, 2)
        grad = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad * some.transpose(1, 2))
        # each real token's query decoded alone over its row's keys so far, at other slots of a paged cache
        # (3 pages a row, in reverse order, the row's run moved to begin at slot 7) against the training forward
        decoded, generated = [], []
        pool_k, table = as_pool(F.pad(k.detach(), (0, 0, 7, 0)), PAGE)
        pool_v, _ = as_pool(F.pad(v.detach(), (0, 0, 7, 0)), PAGE)
        first = real.long().argmax(-1)
        for row in range(batch):
            count = int(real[row].sum())
            for t in sorted({0, 1, 63, 64, 65, count - 1} & set(range(count))):
                slot = int(first[row]) + t
                step = invariant_attention(
                    q.detach()[row : row + 1, :, slot : slot + 1], (pool_k, pool_v), table[row : row + 1],
                    first[row : row + 1] + 7, torch.tensor([t + 1]), torch.tensor([t]), 0.25, window,
                )
                decoded.append(bool(torch.equal(step[0, 0], out.detach()[row, slot])))
                # as `generate` calls it: the new token's query after a cache of the keys before it
                cached = TrainingAttention.apply(
                    q.detach()[row : row + 1, :, slot : slot + 1], k.detach()[row : row + 1, :, : slot + 1],
                    v.detach()[row : row + 1, :, : slot + 1], real[row : row + 1, : slot + 1], 0.25, window,
                )
                generated.append(bool(torch.equal(cached[0, 0], out.detach()[row, slot])))
        return {
            "max_diff": (out - expected).abs().max().item(),
            "padding_zero": out[1, :100].abs().max().item() + out[2, 120:].abs().max().item(),
            "grad_diffs": [(a - b).abs().max().item() for a, b in zip(grads, expected_grads)],
            "decoded_equal": decoded,
            "generated_equal": generated,
        }

    print(json.dumps([case(None), case(40)]))
    """
)


def test_the_kernel_attends_as_sdpa_and_a_decode_step_gets_the_training_forwards_bits():
    """3 rows of 150 slots (no padding, 100 slots of left padding, padding on both sides), 6 query heads over 2 key
    heads, head size 16, with and without a sliding window of 40: the training forward equals SDPA over the real
    keys up to each query (1e-5), padding queries give zeros, the backward (SDPA's, recomputed) equals SDPA's own
    gradients; and the query of each real token at 0, 1, 63, 64, 65 and its row's last (those a row has: 15),
    decoded alone over a paged cache where the row's tokens begin at another slot, and as `generate` calls it (the
    one query after the keys before it), gives the training forward's bits."""
    for result in interpreted(SCRIPT):
        assert result["max_diff"] < 1e-5 and result["padding_zero"] == 0.0, result
        assert max(result["grad_diffs"]) < 1e-5, result
        assert result["decoded_equal"] == result["generated_equal"] == [True] * 15, result


END_TO_END = textwrap.dedent(
    """
    import copy, json, torch
    from ketch.data import build_char_tokenizer
    from ketch.engine.heads import PolicyModel
    from ketch.models import invariant_attention, invariant_matmul, invariant_norm, invariant_rotary
    from ketch.models.batch_invariant import make_batch_invariant
    from ketch.models.tiny import build_tiny_model
    from ketch.rollout.exact_decoding import ExactDecoder
    from ketch.rollout.sampling import Sampling

    calls = {"attention": 0, "matmul": 0, "norm": 0, "rotary": 0}
    for module, name, key in ((invariant_attention, "invariant_attention", "attention"),
                              (invariant_matmul, "invariant_matmul", "matmul")):
        def counted(*args, _f=getattr(module, name), _k=key, **kwargs):
            calls[_k] += 1
            return _f(*args, **kwargs)
        setattr(module, name, counted)
    for function, key in ((invariant_norm.InvariantRMSNorm, "norm"), (invariant_rotary.Rotary, "rotary")):
        def counted_forward(*args, _f=function.forward, _k=key):
            calls[_k] += 1
            return _f(*args)
        function.forward = staticmethod(counted_forward)
    import ketch.models.batch_invariant  # noqa: the kernels are looked up at call time

    model = build_tiny_model(build_char_tokenizer(), hidden_size=64, intermediate_size=96, num_layers=2,
                             num_heads=4, num_kv_heads=2, max_positions=512).eval()
    g = torch.Generator().manual_seed(1)
    lengths, longest = (70, 3, 66), 70
    ids, mask = torch.zeros(3, longest, dtype=torch.long), torch.zeros(3, longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, longest - n :] = torch.randint(4, 40, (n,), generator=g)
        mask[row, longest - n :] = 1
    decoder = ExactDecoder(make_batch_invariant(copy.deepcopy(model)), compile_step=False)
    torch.manual_seed(0)
    responses, log_probs = decoder.generate(ids, mask, 6, Sampling(True, 0.9), None, pad_token_id=0)
    policy = PolicyModel(make_batch_invariant(copy.deepcopy(model)), batch_invariant=True).eval()
    full = torch.cat([mask, torch.ones_like(responses)], 1)
    with torch.no_grad():
        out = policy(torch.cat([ids, responses], 1), full, (full.cumsum(-1) - 1).clamp(min=0), 6, 0.9)
    print(json.dumps({"diff": (out["log_prob"] - log_probs).abs().max().item(), "calls": calls,
                      "real": bool((log_probs < 0).all())}))
    """
)


def test_the_exact_decoder_and_the_training_forward_through_the_kernels_agree_bit_for_bit():
    """The GPU's path of `rollout.exact_log_probs` run by the interpreter on the CPU (float32): a tiny Qwen2 (heads
    of 16) decodes 6 sampled tokens after prompts of 70, 3 and 66 tokens through the kernels (attention, matmul,
    RMSNorm, rotary embedding, each called), and the padded training forward through the same kernels gives its
    log-probs, bit for bit."""
    result = interpreted(END_TO_END)
    assert result["diff"] == 0.0 and result["real"], result
    assert min(result["calls"].values()) > 0, result
