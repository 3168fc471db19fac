"""On one GPU: `rollout.exact_log_probs` on CUDA, as `tests/test_exact_log_probs.py` checks it on the CPU: the
batch-invariant ops give a row the same bits alone as in a batch, and a 2-step GRPO run's rollout log-probs are the
update's first forward's, bit for bit, in bfloat16 (not in float32, measured); the GPU's default paths (packed,
compiled, the static decoder) are shown against it. First run on an H100, 2026-12-06: bfloat16 0.0 at both steps, the
default paths 6.5e-5 and 1.1e-5; float32 6.5e-9 (`benchmarks/results/2026-12-06_h100_gpu_tests.md`)."""

from __future__ import annotations

import pytest
import torch
from test_exact_log_probs import _grpo_run, _mask
from torch import nn

from ketch.models.batch_invariant import attention, label_log_probs, linear


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


FLOAT32 = pytest.mark.xfail(
    strict=True, reason="on an H100 in float32 the gap was 6.5e-9, not 0 (TF32 off changed nothing): not yet found why"
)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=FLOAT32)])
def test_the_rollouts_log_probs_are_the_training_forwards_bit_for_bit_on_cuda(tiny_config, monkeypatch, dtype):
    settings = ("trainer.device=cuda", "rollout.exact_log_probs=true", f"model.dtype={dtype}")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings)
    assert [s["training/rollout_probs_diff_max"] for s in steps] == [0.0, 0.0]
    assert len(pairs) == 2 and all(torch.equal(train, rollout) for train, rollout in pairs)


def test_the_gpus_default_paths_differ(tiny_config, monkeypatch):
    settings = ("trainer.device=cuda", "actor.old_log_prob_from_rollout=true", "model.dtype=bfloat16")
    steps, pairs = _grpo_run(tiny_config, monkeypatch, *settings)
    print("default paths, bfloat16:", [s["training/rollout_probs_diff_max"] for s in steps])
    assert not all(torch.equal(train, rollout) for train, rollout in pairs)
