"""The architecture matrix on one GPU with the defaults (packing, compiled blocks, the static decoder with CUDA
graphs where the family allows them): every family of `families.MATRIX`, as tests/test_architectures.py
runs it on the CPU. Each test prints one `matrix` line of figures (benchmarks/results keeps them).

bf16 tolerances: the packed forward's log-probs are as close to the float32 padded ones as the bf16 padded forward's
(within 0.02 nats more, and under 0.1 at most); two GRPO steps keep the rollout's and the training forward's
probabilities of the sampled tokens within 0.1 (`training/rollout_probs_diff_max`)."""

from __future__ import annotations

import json

import pytest
import torch
from families import MATRIX, save_tiny_family_model
from gpu_models import two_grpo_steps
from greedy import generate_greedy
from test_architectures import NOT_PACKED, NOT_STATIC, ragged_batch

from ketch.data import build_char_tokenizer
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

CUDA = torch.device("cuda")


def _log_probs(path, dtype: torch.dtype, packed: bool, batch) -> torch.Tensor:
    head = PolicyModel(load_causal_lm(str(path), dtype), packed).to(CUDA)
    assert head.packed == (packed and head.lm.config.model_type not in NOT_PACKED)
    input_ids, attention_mask, position_ids, response_len = (t.to(CUDA) if torch.is_tensor(t) else t for t in batch)
    with torch.no_grad():
        out = head(input_ids, attention_mask, position_ids, response_len)["log_prob"]
    return out[attention_mask[:, -response_len:].bool()].float()


@pytest.mark.parametrize("model_type", MATRIX)
def test_family_on_the_gpu_with_the_defaults(model_type, tmp_path, tiny_config):
    path = save_tiny_family_model(tmp_path / model_type, model_type, build_char_tokenizer())
    batch = ragged_batch(len(build_char_tokenizer()))
    reference = _log_probs(path, torch.float32, False, batch)
    bf16 = {packed: _log_probs(path, torch.bfloat16, packed, batch) for packed in (False, True)}
    padded, packed = ((bf16[p] - reference).abs().max().item() for p in (False, True))
    assert packed <= padded + 0.02 and packed < 0.1

    model = load_causal_lm(str(path), torch.float32).to(CUDA).eval()
    attention_mask = (torch.arange(9) >= 9 - torch.tensor([9, 4, 1])[:, None]).long().to(CUDA)
    input_ids = torch.randint(4, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    input_ids = input_ids.to(CUDA) * attention_mask
    expected, _ = generate_greedy(model, input_ids, attention_mask, 12, pad_token_id=0)
    if model_type not in NOT_STATIC:
        decoder = StaticDecoder(model, compile_step=True)
        tokens, _ = decoder.generate(input_ids, attention_mask, 12, Sampling(do_sample=False), None, 0)
        assert torch.equal(tokens, expected)

    config = tiny_config(
        f"model.path={path}", "algorithm.adv_estimator=grpo", "rollout.n=2", "data.train_batch_size=4",
        "trainer.device=cuda",
    )  # fmt: skip
    steps, paths = two_grpo_steps(config)
    assert paths == (model_type not in NOT_PACKED, model_type not in NOT_STATIC)
    diffs = [m["training/rollout_probs_diff_max"] for m in steps]
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in steps) and max(diffs) < 0.1
    figures = {"packed": paths[0], "static": paths[1], "bf16_padded_err": padded, "bf16_packed_err": packed}
    figures["bf16_packed_vs_padded"] = (bf16[True] - bf16[False]).abs().max().item()
    figures |= {"rollout_probs_diff_max": diffs, "router_aux_loss": steps[1].get("actor/router_aux_loss")}
    print("matrix", model_type, json.dumps(figures))
