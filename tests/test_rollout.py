"""The hf rollout inside the actor worker: stop tokens, log-probs and the in-memory weight hand-off."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch

from ketch.config import derive_batch_plan
from ketch.controller import LocalWorkerGroup
from ketch.data import RLHFDataset, build_char_tokenizer
from ketch.protocol import DataProto
from ketch.rollout import response_mask_from_stops
from ketch.workers import ActorRolloutRefWorker


def test_response_mask_keeps_the_first_stop_token_and_masks_the_rest():
    responses = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [9, 9, 9, 2]])
    mask = response_mask_from_stops(responses, stop_token_ids=[1, 2])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def actor_group(config):
    group = LocalWorkerGroup(ActorRolloutRefWorker, config, config.model.path, derive_batch_plan(config), 10)
    group.init_model()
    return group


def prompts(config, rows: int = 8) -> DataProto:
    dataset = RLHFDataset(config.data.train_files, build_char_tokenizer(), config.data)
    batch = DataProto.from_single_dict(dataset.collate([dataset[i] for i in range(rows)]))
    return batch.select(batch_keys=["input_ids", "attention_mask", "position_ids"], non_tensor_keys=[])


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_responses_end_at_the_first_stop_token(tiny_config, decoding):
    # The random model rarely says EOS, so make '#' (id 8) a stop token: it is common in any output.
    config = tiny_config(
        "rollout.stop_token_ids=[8, 21, 22]", "data.max_response_length=12", f"rollout.hf_decoding={decoding}"
    )
    out = actor_group(config).generate_sequences(prompts(config, rows=16)).batch
    responses, mask = out["responses"], out["response_mask"]
    assert responses.shape == mask.shape == (16, 12)
    stops = torch.isin(responses, torch.tensor([1, 8, 21, 22]))
    stopped = 0
    for row, row_mask, row_stops in zip(responses, mask, stops, strict=True):
        length = int(row_mask.sum())
        if row_stops[:length].any():
            first = int(row_stops.nonzero()[0])
            assert length == first + 1, "the stop token itself is kept"
            stopped += 1
        assert (row[length:] == 0).all(), "tokens after the stop are padding"
    assert stopped > 0
    assert out["input_ids"].shape[-1] == out["prompts"].shape[-1] + 12


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_ignore_eos_decodes_every_response_to_the_limit_past_its_stop_tokens(
    tiny_config, tiny_model_dir, tmp_path, decoding
):
    # the model's generation config names '#' (8), common in any output, an EOS: with rollout.ignore_eos it stops
    # nothing (transformers fills a generation's unset eos_token_id from that file)
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 8]}))
    config = tiny_config(
        f"model.path={model_dir}", "data.max_response_length=12", "rollout.ignore_eos=true",
        f"rollout.hf_decoding={decoding}",
    )  # fmt: skip
    out = actor_group(config).generate_sequences(prompts(config, rows=16)).batch
    assert out["response_mask"].sum(-1).tolist() == [12] * 16
    stops = torch.isin(out["responses"][:, :-1], torch.tensor([1, 8]))
    tails = [row[int(at.nonzero()[0]) + 1 :] for row, at in zip(out["responses"], stops, strict=True) if at.any()]
    assert tails and not any((tail == 0).all() for tail in tails)  # decoding went on: no padding after a stop


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_training_log_probs_match_the_rollouts_in_float32(tiny_config, decoding):
    config = tiny_config("rollout.temperature=0.8", "data.max_response_length=10", f"rollout.hf_decoding={decoding}")
    group = actor_group(config)
    data = group.generate_sequences(prompts(config))
    old = group.compute_log_prob(data).batch["old_log_prob"]
    mask = data.batch["response_mask"].bool()
    # Same weights, float32: the training forward and the cached decoding differ only by rounding.
    torch.testing.assert_close(old[mask], data.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)


def test_weight_hand_off_changes_what_the_rollout_generates(tiny_config):
    config = tiny_config("actor.optim.lr=0.05", "rollout.do_sample=false")
    group = actor_group(config)
    batch = prompts(config)
    batch.meta_info["do_sample"] = False
    before = group.generate_sequences(batch)
    update = before.union(group.compute_log_prob(before))
    update.batch["advantages"] = torch.randn(update.batch["response_mask"].shape)
    metrics = group.update_actor(update).meta_info["metrics"]
    after = group.generate_sequences(batch)
    assert not torch.equal(after.batch["responses"], before.batch["responses"])
    assert metrics["timing_s/weight_sync"] >= 0
    worker = group.worker
    rollout_params = dict(worker.rollout.model.named_parameters(remove_duplicate=False))
    for name, param in worker.actor.module.named_parameters(remove_duplicate=False):  # one process: the FSDP
        assert torch.equal(rollout_params[name.removeprefix("lm.")], param.full_tensor()), name  # units' hand-off


def test_update_actor_reports_its_metrics(tiny_config):
    config = tiny_config()
    group = actor_group(config)
    data = group.generate_sequences(prompts(config))
    data = data.union(group.compute_log_prob(data))
    data.batch["advantages"] = torch.ones(data.batch["response_mask"].shape)
    metrics = group.update_actor(data).meta_info["metrics"]
    expected = {"actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/grad_norm"}
    assert expected | {"actor/lr", "actor/loss", "timing_s/weight_sync"} <= set(metrics)


def test_static_decoding_is_greedy_like_generate(tiny_config):
    config = tiny_config("data.max_response_length=12", "rollout.stop_token_ids=[8]")
    batch = prompts(config, rows=16)
    batch.meta_info["do_sample"] = False
    outputs = {}
    for decoding in ("generate", "static"):
        group = actor_group(
            tiny_config("data.max_response_length=12", "rollout.stop_token_ids=[8]", f"rollout.hf_decoding={decoding}")
        )
        outputs[decoding] = group.generate_sequences(batch).batch
    for key in ("responses", "response_mask", "attention_mask", "position_ids"):
        assert torch.equal(outputs["static"][key], outputs["generate"][key]), key
    mask = outputs["static"]["response_mask"].bool()
    torch.testing.assert_close(
        outputs["static"]["rollout_log_probs"][mask], outputs["generate"]["rollout_log_probs"][mask], atol=1e-5, rtol=0
    )


def weight_bytes(rollout) -> int:
    """Bytes held by the rollout model's weights (each storage once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in rollout.model.parameters()}
    return sum(storage.nbytes() for storage in storages.values())


def kv_cache_bytes(rollout) -> int:
    """Bytes of the static decoder's KV cache pools that the decoder or the model's attention modules still hold."""
    if rollout.decoder is None:
        return 0
    pools = [kv[:2] for a in rollout.decoder.attentions if (kv := getattr(a, "decode_kv", None)) is not None]
    pools += [pair for b in rollout.decoder.caches.values() for pair in b.pages.pools]
    tensors = {t.data_ptr(): t for pair in pools for t in pair}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_a_rollout_that_frees_its_memory_while_training_decodes_as_one_that_keeps_it(tiny_config, decoding):
    """Freed while the actor trains: the weights and (static decoding) the KV cache; the responses stay the same."""
    settings = ("actor.optim.lr=0.05", "rollout.do_sample=false", f"rollout.hf_decoding={decoding}")
    responses, held, kv = {}, {}, {}
    for free in (False, True):
        config = tiny_config(*settings, f"rollout.free_memory_while_training={free}")
        group, batch = actor_group(config), prompts(config)
        batch.meta_info["do_sample"] = False
        first = group.generate_sequences(batch)
        held[free] = weight_bytes(group.worker.rollout)  # while the actor trains
        kv[free] = kv_cache_bytes(group.worker.rollout)
        update = first.union(group.compute_log_prob(first))
        update.batch["advantages"] = torch.randn(
            update.batch["response_mask"].shape, generator=torch.Generator().manual_seed(0)
        )
        group.update_actor(update)  # its hand-off gives the dropped weights back
        second = group.generate_sequences(batch)
        third = group.generate_sequences(batch)  # no update since: the worker hands the weights over first
        responses[free] = [out.batch["responses"] for out in (first, second, third)]
    assert held[False] > 0 and held[True] == 0
    assert kv[True] == 0 and (kv[False] > 0) == (decoding == "static")
    assert not torch.equal(responses[False][0], responses[False][1]), "the update changed the greedy responses"
    for kept, freed in zip(responses[False], responses[True], strict=True):
        assert torch.equal(kept, freed)


@pytest.mark.parametrize("decoding", ["generate", "static"])
def test_a_token_budget_decodes_in_sub_batches_with_the_greedy_outputs_of_one_batch(tiny_config, decoding):
    """A budget of rollout.max_num_batched_tokens that holds two rows of prompt + 12 response tokens (their KV
    cache): 7 prompts decode as 2 + 2 + 2 + 1 rows, with the tokens and log-probs of one batch."""
    settings = ("data.max_response_length=12", f"rollout.hf_decoding={decoding}")
    width = prompts(tiny_config(*settings), rows=7).batch["input_ids"].shape[-1]  # the longest prompt's tokens
    outputs, decoded = {}, []
    for budget in (None, 2 * (width + 12) + 1):
        config = tiny_config(*settings, *([f"rollout.max_num_batched_tokens={budget}"] if budget else []))
        group, batch = actor_group(config), prompts(config, rows=7)
        batch.meta_info["do_sample"] = False
        rollout = group.worker.rollout
        rollout._decode_batch = partial(_counted, rollout._decode_batch, decoded)
        outputs[budget] = group.generate_sequences(batch).batch
    assert decoded == [7, 2, 2, 2, 1]
    if decoding == "static":
        assert max(rows for rows, _ in rollout.decoder.caches) == 2  # no KV cache for more rows than the budget's
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(outputs[budget][key], outputs[None][key]), key
    log_probs = [outputs[key]["rollout_log_probs"] for key in (budget, None)]
    torch.testing.assert_close(*log_probs, atol=1e-6, rtol=0)


def _counted(decode_batch, rows: list[int], part: DataProto, stop_after: int | None):
    """`decode_batch(part, stop_after)`, the rows of `part` appended to `rows`."""
    rows.append(len(part))
    return decode_batch(part, stop_after)
