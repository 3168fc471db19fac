"""On one GPU: the multi-turn parity checks of tests/test_path_parity.py on CUDA. The GPU's default paths (bfloat16,
packed training forwards through variable-length flash attention, compiled training blocks, the compiled static
decoder with its Triton kernels and CUDA graphs) against a float32 reference on the CPU's paths (padded forwards,
transformers' `generate`, nothing compiled), on trajectories with two calls of the `calculate` tool.

Tolerances for bfloat16 (8 bits of mantissa): logits of size 10 to 20 round by up to ~0.05, so a sampled token's
probability may move by a few hundredths where the policy hesitates and by far less where it is sure (most tokens of
the memorised conversations); a path that scores a token in a wrong context (positions, masks, a turn's prompt, a
sequence's boundaries) moves probabilities by tenths and changes what greedy decoding writes. Hence: greedy
trajectories identical; |p_gpu - p_reference| of the sampled tokens at most 0.05, on average at most 0.005;
gradients of the same update in the same direction (cosine > 0.98); the SFT loss within 0.005 nats per token.
The same checks in bfloat16 on the CPU (packed, static decoder) gave |p| differences up to 6e-4 (greedy) and 1e-4
(sampled), cosines 0.995 (GRPO) and 0.992 (SFT), the SFT loss within 1e-5; with a packed attention that lets each
token see the next one, the sampled tokens' probabilities differed by up to 0.97 and the cosines fell to 0.06."""

from __future__ import annotations

import pytest
import torch
from path_parity import (
    CPU_PATHS,
    PROMPT_LEN,
    answers,
    cosine,
    expected_layout,
    for_update,
    prompts,
    save_tool_policy,
    sft_batch,
    sft_gradients,
    tool_calls,
    tool_config,
    update_gradients,
    worker_group,
    write_rows,
)

from ketch.engine.packing import VARLEN_PARAMETERS, packed_attention

MAX_P_DIFF, MEAN_P_DIFF = 0.05, 0.005
MIN_COSINE = 0.98
SFT_LOSS_DIFF = 0.005


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """`gpu`: the defaults on CUDA; `reference`: float32, padded, `generate`, nothing compiled."""
    root = tmp_path_factory.mktemp("path-parity-gpu")
    policy = save_tool_policy(root / "policy"), write_rows(root / "rows.parquet"), root / "runs"
    reference = ("model.dtype=float32", "model.use_torch_compile=false", *CPU_PATHS)
    configs = {
        "gpu": tool_config(*policy, "trainer.device=cuda"),
        "reference": tool_config(*policy, "trainer.device=cuda", *reference),
    }
    groups = {name: (worker_group(config), config) for name, config in configs.items()}
    assert groups["gpu"][0].worker.actor.module.packed and groups["gpu"][0].worker.rollout.backend.decoder.compiled
    yield groups
    for group, _ in groups.values():
        group.shutdown()


def p_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Max and mean of |exp(a) - exp(b)| over `mask`."""
    diff = (a.exp() - b.exp()).abs()[mask]
    return diff.max().item(), diff.mean().item()


def test_the_gpu_paths_decode_the_reference_trajectories(groups):
    out = {name: group.generate_sequences(prompts(config)) for name, (group, config) in groups.items()}
    responses, response_mask, real = expected_layout()
    for data in out.values():
        b = data.batch
        assert tool_calls(data).tolist() == [2.0] * 3
        assert answers(data) == ["#### 13", "#### 61", "#### 5536"]
        assert torch.equal(b["responses"] * real, responses) and torch.equal(b["response_mask"], response_mask)
        assert torch.equal(b["attention_mask"][:, PROMPT_LEN:], real)
    gpu, reference = out["gpu"].batch, out["reference"].batch
    maximum, mean = p_diff(gpu["rollout_log_probs"], reference["rollout_log_probs"], response_mask.bool())
    assert maximum <= MAX_P_DIFF and mean <= MEAN_P_DIFF, (maximum, mean)


def test_sampled_trajectories_score_alike_in_the_bf16_rollout_and_both_training_forwards(groups):
    gpu, config = groups["gpu"]
    torch.manual_seed(0)
    data = gpu.generate_sequences(prompts(config, repeat=2, do_sample=True))
    mask = data.batch["response_mask"].bool()
    assert (tool_calls(data) >= 1).all()
    rollout = data.batch["rollout_log_probs"]
    for name, (group, _) in groups.items():
        log_prob = group.compute_log_prob(data).batch["old_log_prob"]
        maximum, mean = p_diff(log_prob, rollout, mask)
        assert maximum <= MAX_P_DIFF and mean <= MEAN_P_DIFF, (name, maximum, mean)


def test_a_grpo_update_on_multi_turn_rows_points_the_same_way_on_both_paths(groups):
    """The GPU's update as the tool example makes it (pi_old from its bfloat16 rollout) against the exact one (the
    float32 reference's, pi_old from its own forward: ratio 1)."""
    (gpu, config), (reference, _) = groups["gpu"], groups["reference"]
    torch.manual_seed(1)
    data = gpu.generate_sequences(prompts(config, repeat=2, do_sample=True))
    exact = for_update(data, reference.compute_log_prob(data).batch["old_log_prob"])
    grads = {"gpu": update_gradients(gpu, for_update(data)), "reference": update_gradients(reference, exact)}
    assert cosine(grads["gpu"], grads["reference"]) > MIN_COSINE


def test_the_sft_of_multi_turn_demonstrations_has_the_same_loss_and_gradient_direction(groups):
    data = sft_batch(groups["reference"][1])
    (gpu_loss, gpu_grads), (reference_loss, reference_grads) = (
        sft_gradients(group, data) for group, _ in groups.values()
    )
    assert gpu_loss == pytest.approx(reference_loss, abs=SFT_LOSS_DIFF)
    assert cosine(gpu_grads, reference_grads) > MIN_COSINE


@pytest.mark.skipif(not VARLEN_PARAMETERS, reason="this torch has no variable-length attention")
def test_packed_flash_attention_and_its_gradients_match_causal_attention_per_sequence():
    """The packed attention's CUDA path (`varlen_attn`, bfloat16) against float64 causal attention of each sequence
    on its own, forward and backward, at the built-in model's head shape (4 query heads on 2 key/value heads of 32)
    and lengths like the tool example's rows (a lone token to 200 tokens)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [23, 1, 160, 97, 200, 54]
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, heads, total, 32, device="cuda", generator=g).bfloat16().requires_grad_() for heads in (4, 2, 2)
    )
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    packed, _ = packed_attention(None, q, k, v, None, cu_seq_lens_q=offsets, max_length_q=max(lengths))
    expected = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        qs, ks, vs = (t[0, :, start:end].double() for t in (q, k, v))
        ks, vs = (t.repeat_interleave(2, dim=0) for t in (ks, vs))
        expected.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    expected = torch.cat(expected)[None]
    grad_out = torch.randn(expected.shape, device="cuda", generator=g, dtype=torch.float64)
    (packed.double() * grad_out).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (expected * grad_out).sum().backward()
    assert (packed.double() - expected).abs().max().item() < 2e-2
    for name, got, want in zip("qkv", grads, (t.grad for t in (q, k, v)), strict=True):
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < 2e-2, (name, error.item())
