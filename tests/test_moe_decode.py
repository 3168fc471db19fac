"""The static decoder's fixed-shape experts (`ketch.rollout.moe_decode`) on tiny random mixtures of experts (float32,
routers scaled to be peaky): both ways of computing them give transformers' experts output, and decoding with them
(eager and compiled) gives `generate`'s greedy tokens, computing them in the decode steps only, while routing
replay still records every layer's choice."""

from __future__ import annotations

import pickle

import pytest
import torch
from families import tiny_family_config
from greedy import generate_greedy
from transformers import AutoModelForCausalLM

from ketch.architecture import FAMILIES, cuda_graph_problem, decoder_blocks, router_outputs
from ketch.data import build_char_tokenizer
from ketch.models.router_replay import ExpertRouting, differing
from ketch.rollout import moe_decode
from ketch.rollout.moe_decode import FixedShapeExperts, dense, gathered, reads_every_expert, use_fixed_shape_experts
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

FIXED = [name for name, family in FAMILIES.items() if family.fixed_shape_experts]
DECODED = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]  # DeepSeek-V3 and GPT-OSS decode with `generate`
NEW_TOKENS = 6


def _model(model_type: str) -> torch.nn.Module:
    """A tiny model of `model_type` (seed 0) whose routers' weights are scaled up (peaky routing)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_family_config(model_type, build_char_tokenizer())).eval()
    with torch.no_grad():
        for module, _ in router_outputs(model):
            module.weight.mul_(20.0)
    return model


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts `[3, 5]` of 5, 3 and 4 tokens."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    return torch.randint(4, 40, (3, 5), generator=torch.Generator().manual_seed(3)) * mask, mask


def test_a_step_gathers_while_that_reads_less_than_every_expert_once():
    assert not reads_every_expert(5, 8, 128) and reads_every_expert(6, 8, 128)  # Qwen3-30B-A3B
    assert not reads_every_expert(1, 2, 8) and reads_every_expert(2, 2, 8)  # Mixtral


@pytest.mark.parametrize("model_type", FIXED)
def test_gathered_and_dense_experts_give_transformers_experts_output(model_type):
    """On 7 tokens of random hidden states and random routing (each token's 2 experts of 4, random weights), for
    transformers' loop over the experts (`eager`) and its grouped matmul alike; the family's blocks all get the
    fixed-shape experts."""
    model = _model(model_type)
    blocks = decoder_blocks(model)
    assert use_fixed_shape_experts(blocks) == [] and cuda_graph_problem(model.config) is None
    experts = [b.mlp.experts for b in blocks if isinstance(getattr(b.mlp, "experts", None), FixedShapeExperts)]
    assert experts, model_type
    g = torch.Generator().manual_seed(1)
    hidden = 50 * torch.randn(7, model.config.hidden_size, generator=g)  # outputs of about 1 (weights of std 0.02)
    index = torch.stack([torch.randperm(experts[0].num_experts, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)
    for implementation in ("eager", "grouped_mm"):
        experts[0].config._experts_implementation = implementation
        expected = experts[0](hidden, index, weights)  # outside `decoding()`: transformers' forward
        for compute in (gathered, dense):
            torch.testing.assert_close(compute(experts[0], hidden, index, weights), expected, atol=1e-5, rtol=1e-5)
        assert expected.abs().max() > 0.1


def test_fixed_shape_classes_pickle_by_name():
    """The compiler cache saves a compiled decode block by its classes' names: each fixed-shape experts class is a
    name of `moe_decode` and comes back from pickle as itself (a class made by `type` alone did not: the 30B-A3B
    shape's block compiled afresh at every start on an H100)."""
    assert len(moe_decode.EXPERTS) == 6
    for cls in moe_decode.EXPERTS.values():
        assert getattr(moe_decode, cls.__name__) is cls and pickle.loads(pickle.dumps(cls)) is cls


def test_other_mixtures_of_experts_keep_their_step_out_of_cuda_graphs():
    """Other families by their config; experts of another class (say, a model's own code) in a family that has
    fixed-shape experts by the decoder, which names them."""
    for model_type in ("granitemoe", "phimoe", "jamba"):
        assert "host synchronisation" in cuda_graph_problem(tiny_family_config(model_type, build_char_tokenizer()))
    phimoe = AutoModelForCausalLM.from_config(tiny_family_config("phimoe", build_char_tokenizer()))
    assert use_fixed_shape_experts(decoder_blocks(phimoe)) == ["PhimoeExperts"]
    model = _model("qwen3_moe")
    experts = decoder_blocks(model)[1].mlp.experts
    experts.__class__ = type("RemoteExperts", (type(experts),), {})
    assert not StaticDecoder(model, compile_step=True, buckets=False, backend="aot_eager").capture
    assert StaticDecoder(_model("qwen3_moe"), compile_step=True, buckets=False, backend="aot_eager").capture


def _counted(monkeypatch, dense_steps: bool) -> dict[str, int]:
    """Calls of `gathered` and `dense` counted, the step's choice between them forced to `dense_steps`."""
    calls = {"gathered": 0, "dense": 0}

    def counting(name, compute):
        def count(*args):
            calls[name] += 1
            return compute(*args)

        return count

    monkeypatch.setattr(moe_decode, "gathered", counting("gathered", gathered))
    monkeypatch.setattr(moe_decode, "dense", counting("dense", dense))
    monkeypatch.setattr(moe_decode, "reads_every_expert", lambda *_: dense_steps)
    return calls


@pytest.mark.parametrize("dense_steps", [False, True], ids=["gathered", "dense"])
@pytest.mark.parametrize("model_type", DECODED)
def test_static_decoding_with_fixed_shape_experts_gives_generates_greedy_tokens(model_type, dense_steps, monkeypatch):
    """Each decode step after the first token (the prefill's) computes every MoE layer's experts the one way forced,
    and the prefill keeps transformers' experts."""
    input_ids, mask = _prompts()
    expected, expected_log_probs = generate_greedy(_model(model_type), input_ids, mask, NEW_TOKENS, pad_token_id=0)
    calls = _counted(monkeypatch, dense_steps)
    decoder = StaticDecoder(_model(model_type), compile_step=False, buckets=False)
    tokens, log_probs = decoder.generate(input_ids, mask, NEW_TOKENS, Sampling(do_sample=False), None, pad_token_id=0)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)
    moe_layers = len(router_outputs(decoder.model))
    assert calls == {"gathered": 0, "dense": 0, ("dense" if dense_steps else "gathered"): (NEW_TOKENS - 1) * moe_layers}


def test_compiled_decode_step_with_fixed_shape_experts_gives_generates_greedy_tokens(monkeypatch):
    """The decode block through torch.compile (`aot_eager`: dynamo and AOTAutograd on the CPU), gathering: one
    graph for the blocks."""
    from torch._dynamo.testing import CompileCounterWithBackend

    input_ids, mask = _prompts()
    expected, expected_log_probs = generate_greedy(_model("qwen3_moe"), input_ids, mask, NEW_TOKENS, pad_token_id=0)
    monkeypatch.setattr(moe_decode, "reads_every_expert", lambda *_: False)
    counter = CompileCounterWithBackend("aot_eager")
    decoder = StaticDecoder(_model("qwen3_moe"), compile_step=True, buckets=False, backend=counter)
    tokens, log_probs = decoder.generate(input_ids, mask, NEW_TOKENS, Sampling(do_sample=False), None, pad_token_id=0)
    assert torch.equal(tokens, expected) and counter.frame_count == 1
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dense_steps", [False, True], ids=["gathered", "dense"])
def test_routing_replay_records_every_layers_choice_in_fixed_shape_decode_steps(dense_steps, monkeypatch):
    """Every token the decoder fed (prompt and response but the last) has, in every MoE layer, the experts that a
    forward of the whole sequences chooses."""
    input_ids, mask = _prompts()
    calls = _counted(monkeypatch, dense_steps)
    decoder = StaticDecoder(_model("qwen3_moe"), compile_step=False, buckets=False)
    decoder.routing = ExpertRouting(decoder.model).attach()
    tokens, _ = decoder.generate(input_ids, mask, NEW_TOKENS, Sampling(do_sample=False), None, pad_token_id=0)
    recorded = decoder.routed_experts
    assert sum(calls.values()) == (NEW_TOKENS - 1) * decoder.routing.layers
    full = torch.cat([mask, torch.ones_like(tokens)], 1)
    model = _model("qwen3_moe")
    with ExpertRouting(model) as routing, torch.no_grad():
        model(input_ids=torch.cat([input_ids, tokens], 1), attention_mask=full, position_ids=full.cumsum(-1) - 1)
    chosen = routing.chosen().view(*full.shape, routing.layers, routing.top_k)
    fed = full.clone()
    fed[:, -1] = 0
    assert recorded.shape == chosen.shape
    assert not differing(recorded, chosen)[fed.bool()].any()
