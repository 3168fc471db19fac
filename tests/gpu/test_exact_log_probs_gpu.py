"""On one GPU: `rollout.exact_log_probs` on CUDA, as `tests/test_exact_log_probs.py` checks it on the CPU: the
batch-invariant ops give a row the same bits alone as in a batch, and a 2-step GRPO run's rollout log-probs are the
update's first forward's, bit for bit, in bfloat16 (not in float32, measured); the GPU's default paths (packed,
compiled, the static decoder) are shown against it. First run on an H100, 2026-12-06: bfloat16 0.0 at both steps, the
default paths 6.5e-5 and 1.1e-5; float32 6.5e-9 (`benchmarks/results/2026-12-06_h100_gpu_tests.md`); those runs
decoded with `generate`. The static decoder's exact mode (`ketch.rollout.exact_decoding`, as
`tests/test_exact_decoding.py` checks it on the CPU) is checked here under CUDA graphs in bfloat16: ragged prompts
against the padded training forward, one prompt alone and in a batch of 128, a 2-step GRPO run (not yet run on a
GPU)."""

from __future__ import annotations

import pytest
import torch
from gpu_models import tiny_decoder
from test_exact_decoding import LENGTHS, _decode, _model, _prompts, _training_log_probs
from test_exact_log_probs import _grpo_run, _mask
from torch import nn

from ketch.models.batch_invariant import attention, label_log_probs, linear
from ketch.rollout.exact_decoding import ExactDecoder
from ketch.rollout.sampling import Sampling


def test_the_ops_give_a_row_the_same_bits_alone_as_in_a_batch_on_cuda():
    torch.manual_seed(0)
    x, weight = torch.randn(37, 896, device="cuda", dtype=torch.bfloat16), torch.randn(4864, 896, device="cuda")
    weight = weight.bfloat16()
    batch = linear(x, weight)
    assert all(torch.equal(linear(x[i : i + 1], weight)[0], batch[i]) for i in range(37))
    logits, labels = torch.randn(6, 151936, device="cuda") * 3, torch.arange(6, device="cuda") * 1000
    rows = label_log_probs(logits, labels, 0.7)[0]
    assert all(torch.equal(label_log_probs(logits[i : i + 1], labels[i : i + 1], 0.7)[0][0], rows[i]) for i in range(6))
    q, k, v = (torch.randn(3, h, 150, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    real = torch.ones(3, 150, device="cuda")
    real[1, :5], real[2, :70] = 0, 0
    forward, _ = attention(nn.Module(), q, k, v, _mask(real, 150), scaling=0.125)
    for t in (70, 127, 149):
        step, _ = attention(
            nn.Module(),
            q[:, :, t : t + 1],
            k[:, :, : t + 1],
            v[:, :, : t + 1],
            _mask(real[:, : t + 1], 1),
            scaling=0.125,
        )
        assert torch.equal(step[:, 0], forward[:, t]), t


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_rollouts_log_probs_are_the_training_forwards_bit_for_bit_on_cuda(tiny_config, monkeypatch, dtype):
    settings = ("trainer.device=cuda", "rollout.exact_log_probs=true", f"model.dtype={dtype}")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings, "rollout.hf_decoding=generate")
    assert [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)


def test_the_gpus_default_paths_differ(tiny_config, monkeypatch):
    settings = ("trainer.device=cuda", "actor.old_log_prob_from_rollout=true", "model.dtype=bfloat16")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings)
    print("default paths, bfloat16:", [s["training/rollout_probs_diff_max"] for s in steps])
    assert not all(torch.equal(train, rollout) for train, rollout in pairs)


def _cuda_model(family: str) -> nn.Module:
    """A random Qwen2 of width 256 with heads of 64 (`gpu_models.tiny_decoder`) or the tests' tiny Qwen3-MoE, in
    bfloat16 on the GPU."""
    model = tiny_decoder("qwen2") if family == "qwen2" else _model(family, torch.float32)
    return model.to("cuda", torch.bfloat16)


def _captured(decoder: ExactDecoder) -> bool:
    return any(buffers.graphs for buffers in decoder.caches.values())


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_the_exact_static_decoder_gives_the_training_forwards_bits_under_cuda_graphs(family):
    """Rows of 70, 3, 130 and 64 prompt tokens (padded to 16 rows and 192 prompt slots), 12 sampled tokens, decode
    steps replayed from a CUDA graph: the log-probs are the padded training forward's on the GPU."""
    model, (ids, mask) = _cuda_model(family), _prompts(LENGTHS)
    ids, mask = ids.cuda(), mask.cuda()
    responses, log_probs, decoder = _decode(model, ids, mask, 12, Sampling(True, 0.9), capture=True)
    expected = _training_log_probs(model, ids, mask, responses, 0.9)
    assert _captured(decoder) and list(decoder.caches) == [(16, 204)]
    assert (log_probs - expected).abs().max().item() == 0.0


def test_a_prompt_decodes_the_same_bits_alone_as_in_a_batch_of_128_under_cuda_graphs():
    """A prompt of 100 tokens decoded greedily alone (in 16 rows, the decoder's fewest on CUDA) and as row 77 of
    128 prompts of 1 to 150 tokens: the same tokens and log-probs."""
    model = _cuda_model("qwen2")
    lengths = tuple(int(n) for n in torch.randint(1, 151, (128,), generator=torch.Generator().manual_seed(2)))
    ids, mask = (t.cuda() for t in _prompts((*lengths[:77], 100, *lengths[78:])))
    alone = _decode(model, ids[77:78, -100:], mask[77:78, -100:], 16, Sampling(do_sample=False), capture=True)
    batch = _decode(model, ids, mask, 16, Sampling(do_sample=False), capture=True)
    assert _captured(alone[2]) and _captured(batch[2])
    assert torch.equal(alone[0][0], batch[0][77]) and torch.equal(alone[1][0], batch[1][77])


def test_grpo_with_the_exact_static_decoder_has_no_gap_on_cuda(tiny_config, monkeypatch):
    """Two GRPO steps in bfloat16 on the GPU with `rollout.hf_decoding=static`: the exact decoder decodes (its
    steps captured), and the rollout's log-probs are the update's first forward's."""
    decoded = []
    iterate = ExactDecoder._iterate
    monkeypatch.setattr(ExactDecoder, "_iterate", lambda *args: decoded.append(1) or iterate(*args))
    settings = ("trainer.device=cuda", "rollout.exact_log_probs=true", "model.dtype=bfloat16")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings, "rollout.hf_decoding=static")
    assert decoded and [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)
