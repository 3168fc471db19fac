"""Routing replay (`actor.router_replay`, `ketch.models.router_replay`) on tiny random mixtures of experts of three
families (float32, routers scaled to be peaky): the rollout records each token's experts, a training forward that
replays them routes every token to exactly those, its log-probs then match the rollout's closer than without, and
the router still gets gradients."""

from __future__ import annotations

import pytest
import torch
import transformers
from families import save_tiny_family_model, tiny_family_config
from transformers import AutoModelForCausalLM

from ketch.architecture import unrecorded_router
from ketch.config import ConfigError
from ketch.config.parallel import check_rollout_start
from ketch.data import build_char_tokenizer
from ketch.engine.heads import PolicyModel
from ketch.models.router_replay import ExpertRouting, differing
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder
from ketch.trainer.ppo import PPOTrainer

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3"]
RESPONSE = 4


def _model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of `model_type` whose routers' weights are scaled up (peaky routing)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_family_config(model_type, build_char_tokenizer())).eval()
    with torch.no_grad():
        for module in ExpertRouting(model).modules:
            module.weight.mul_(20.0)
    return model


def _batch() -> dict[str, torch.Tensor]:
    """Two rows `[2, 10]`: prompts of 6 and 3 tokens (left-padded), responses of 4 and 2 (right-padded)."""
    mask = torch.tensor([[1] * 10, [0, 0, 0] + [1] * 5 + [0, 0]])
    ids = torch.randint(4, 40, (2, 10), generator=torch.Generator().manual_seed(1)) * mask
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A copy of `model` whose routers' weights carry noise of `scale` (a rollout that routes a little otherwise)."""
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for module in ExpertRouting(other).modules:
            module.weight.add_(scale * torch.randn(module.weight.shape, generator=generator))
    return other


def _recorded(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`model`'s log-probs of the responses `[2, RESPONSE]` and its experts `[2, 10, layers, top_k]` (padded)."""
    policy = PolicyModel(model, route_experts=True)
    with torch.no_grad():
        out = policy(**batch, response_len=RESPONSE, return_experts=True)
    policy.routing.detach()
    return out["log_prob"], out["routed_experts"]


def _experts_seen(model: torch.nn.Module) -> list[torch.Tensor]:
    """Hooks that keep the expert indices each MoE layer's experts module is called with, `[tokens, top_k]`."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda _m, args: seen.append(args[1]))
    return seen


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_routes_to_the_recorded_experts_and_trains_the_router(model_type, packed):
    model, batch = _model(model_type), _batch()
    rollout_log_prob, rollout_experts = _recorded(_perturbed(model, 2.0), batch)
    policy = PolicyModel(model, packed=packed, route_experts=True)
    seen = _experts_seen(model)
    with torch.no_grad():
        plain = policy(**batch, response_len=RESPONSE, given_experts=rollout_experts)
    seen.clear()
    replayed = policy(**batch, response_len=RESPONSE, given_experts=rollout_experts, replay=True)
    mask = batch["attention_mask"][:, -RESPONSE:].bool()
    real = batch["attention_mask"].flatten().bool()
    fed = batch["attention_mask"].clone()
    fed[[0, 1], [9, 7]] = 0  # each row's last real token routes by its own choice
    fed = fed.flatten().bool()[real] if packed else fed.flatten().bool()
    for layer, indices in enumerate(seen):  # every other real token goes to exactly the rollout's experts
        given = rollout_experts[..., layer, :].flatten(0, 1)
        given = given[real] if packed else given
        assert torch.equal(indices[fed].long(), given[fed].long())
    assert plain["router_mismatch"].sum() > 0  # the perturbed rollout routed some tokens otherwise
    assert replayed["router_mismatch"].sum() == plain["router_mismatch"].sum()  # the router's own choice, compared
    gap = {
        name: (out["log_prob"] - rollout_log_prob)[mask].abs().max()
        for name, out in (("plain", plain), ("replay", replayed))
    }
    assert gap["replay"] < gap["plain"]
    replayed["log_prob"].sum().backward()
    for module in policy.routing.modules:
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replaying_other_experts_changes_the_output(model_type):
    model, batch = _model(model_type), _batch()
    expected, own = _recorded(model, batch)
    policy = PolicyModel(model, route_experts=True)
    with torch.no_grad():
        same = policy(**batch, response_len=RESPONSE, given_experts=own.flip(-1), replay=True)["log_prob"]
        other = policy(**batch, response_len=RESPONSE, given_experts=(own + 1) % policy.routing.experts, replay=True)
    torch.testing.assert_close(same, expected, atol=1e-6, rtol=0)  # the same set of experts, in another order
    assert (other["log_prob"] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_rows_last_token_routes_by_its_own_choice(model_type, packed):
    """The rollout never feeds a row's last token to the model and leaves zeros for its experts: replayed, that
    token routes by the router's own choice, so that the load-balancing loss is the one of the forward that
    routes every token by its own choice."""
    model, batch = _model(model_type), _batch()
    _, own = _recorded(model, batch)
    given = own.clone()
    given[[0, 1], [9, 7]] = 0  # each row's last real token
    assert differing(given, own).sum() == 2
    policy = PolicyModel(model, packed=packed, route_experts=True)
    plain = policy(**batch, response_len=RESPONSE)
    replayed = policy(**batch, response_len=RESPONSE, given_experts=given, replay=True)
    assert torch.equal(replayed["router_aux_loss"], plain["router_aux_loss"])
    assert torch.equal(replayed["log_prob"], plain["log_prob"])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_static_decoder_records_the_experts_a_training_forward_chooses(model_type):
    """Every token the decoder fed to the model (prompt and response but the last) has the experts that a padded
    training forward over the whole sequence chooses."""
    model = _model(model_type)  # the decoder's copy: its attention becomes the decoder's
    decoder = StaticDecoder(model, compile_step=False)
    decoder.routing = ExpertRouting(model).attach()
    prompt = _batch()
    ids, mask = prompt["input_ids"][:, :6], prompt["attention_mask"][:, 3:9]
    ids = ids * mask
    tokens, _ = decoder.generate(ids, mask, RESPONSE, Sampling(do_sample=False), None, 0)
    recorded = decoder.routed_experts
    decoder.routing.detach()
    full = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    batch = {"input_ids": torch.cat([ids, tokens], 1), "attention_mask": full, "position_ids": full.cumsum(-1) - 1}
    _, chosen = _recorded(_model(model_type), batch)
    fed = full.clone()
    fed[:, -1] = 0
    assert recorded.shape == chosen.shape
    assert not differing(recorded, chosen)[fed.bool()].any()


def test_router_replay_is_refused_on_a_dense_model_and_on_vllm(tiny_config):
    config = tiny_config("actor.router_replay=rollout")
    with pytest.raises(ConfigError, match=r"actor.router_replay=rollout .* has no router"):
        check_rollout_start(config, tiny_family_config("qwen2", build_char_tokenizer()))
    with pytest.raises(ConfigError, match=r"actor.router_replay=rollout .* not with rollout.name=vllm"):
        tiny_config("actor.router_replay=rollout", "rollout.name=vllm")


@pytest.mark.parametrize(("mode", "decoding"), [("rollout", "static"), ("old", "generate")])
def test_two_grpo_steps_with_router_replay(tiny_config, tmp_path, mode, decoding):
    """R3 on the static decoder, R2 (with an old-log-prob pass: two mini-batches) on `generate`: the runs train and
    log how many tokens the training forward would route otherwise."""
    path = save_tiny_family_model(tmp_path / "moe", "qwen3_moe", build_char_tokenizer())
    config = tiny_config(
        f"model.path={path}",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        f"actor.router_replay={mode}",
        f"rollout.hf_decoding={decoding}",
    )
    trainer = PPOTrainer(config)
    trainer._open()
    steps = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    trainer.groups.shutdown()
    for metrics in steps:
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        assert 0.0 <= metrics["actor/router_mismatch"] <= 1e-6  # float32: the training forward routes as the rollout


def test_a_mixture_whose_router_logits_transformers_does_not_record_says_so(caplog):
    """transformers 5.17 records no router logits of DeepSeek-V3 and GraniteMoE (5.19 does): such a model trains
    without the router's auxiliary loss, said once as a warning, and routing replay refuses it with the reason."""
    model = _model("qwen3_moe")
    for module in (model, model.model):  # as an older transformers declares them: no router_logits to record
        recorded = {k: v for k, v in type(module)._can_record_outputs.items() if k != "router_logits"}
        module.__class__ = type(f"Older{type(module).__name__}", (type(module),), {"_can_record_outputs": recorded})
    version = transformers.__version__
    expected = f"transformers {version} records no router logits of OlderQwen3MoeForCausalLM (5.19 records them)"
    assert unrecorded_router(model) == expected
    assert unrecorded_router(_model("qwen3_moe")) is None
    with caplog.at_level("WARNING", logger="ketch.engine"):
        assert PolicyModel(model).router is None and PolicyModel(model).router is None
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{expected}: it trains without the router's auxiliary loss"]
    with pytest.raises(ValueError, match=r"routing replay: transformers .* records them\): upgrade transformers"):
        ExpertRouting(model)
