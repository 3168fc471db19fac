"""The architecture matrix: a tiny random model of every family in `families.MATRIX` (2 blocks, 64 wide,
sliding windows of 8 tokens where the family has them, 4 experts where it has a router) through the GPU's code
paths on the CPU: packed against padded training forwards, the training head against the model's own logits,
the static decoder (its blocks compiled) against `generate`, and two GRPO steps with packing and static decoding
forced on. Families that a path does not cover take the other one, said once in an INFO line. Several keep
randomness in their configs (GPT-2's, GPT-BigCode's, OPT's, XGLM's and Seed-OSS's dropout, PhiMoE's router): the GRPO
rows pass the first step's mismatch check (`actor.mismatch_check=error`) and keep the rollout's log-probs within 1e-5
of the training forward's."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from families import MATRIX, save_tiny_family_model, tiny_family_config
from greedy import generate_greedy

from ketch.architecture import FAMILIES, packing_problem, router, static_decoding_problem
from ketch.data import build_char_tokenizer
from ketch.engine.engine import compile_blocks, compiles
from ketch.engine.heads import PolicyModel
from ketch.models import load_causal_lm
from ketch.trainer.ppo import PPOTrainer

OFF_INTERFACE = "its attention does not go through transformers' attention interface"
NOT_PACKED = {
    "gemma2": "it soft-caps its attention logits (config.attn_logit_softcapping)",
    "stablelm": OFF_INTERFACE,
    "bloom": OFF_INTERFACE,
    "xglm": OFF_INTERFACE,
    "jamba": OFF_INTERFACE,
    "nemotron": "its decoder blocks do not pass keyword arguments on to its attention function",
    "recurrent_gemma": "not all of its decoder blocks have an attention module (recurrent or state-space blocks)",
    "gpt_oss": "its attention adds sink logits (attention sinks)",
    "lfm2": "not all of its layers are full or sliding-window attention (config.layer_types: ['conv', "
    "'full_attention'])",
    "llama4_text": "not all of its layers are full or sliding-window attention (config.layer_types: "
    "['chunked_attention'])",
}
"""The families whose training forwards stay padded, and why."""
NOT_STATIC = NOT_PACKED | {
    "deepseek_v3": "its keys and values are not of its config's head size (multi-head latent attention)",
    "lfm2": "its decoder blocks have no single attention module each",
    "jamba": "its decoder blocks have no single attention module each",
    "recurrent_gemma": "its decoder blocks have no single attention module each",
}
"""The families that decode with `generate`, and why."""
MOE = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v3",
    "llama4_text",
    "phimoe",
    "granitemoe",
    "jamba",
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """family_dir(model_type): the family's tiny model with the character tokenizer, saved once per module."""
    saved: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in saved:
            path = tmp_path_factory.mktemp(model_type)
            saved[model_type] = save_tiny_family_model(path, model_type, build_char_tokenizer())
        return saved[model_type]

    return make


def ragged_batch(vocab: int, prompt_len: int = 10, response_len: int = 12):
    """4 rows: prompts of 10, 4, 1, 7 tokens (left-padded), responses of 12, 3, 9, 1 (right-padded); the longest
    sequences pass the tiny models' sliding window of 8."""
    prompt_lens, response_lens = torch.tensor([10, 4, 1, 7]), torch.tensor([12, 3, 9, 1])
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - prompt_lens[:, None]).long()
    response_mask = (torch.arange(response_len) < response_lens[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, vocab, attention_mask.shape, generator=torch.Generator().manual_seed(1))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids * attention_mask, attention_mask, position_ids, response_len


def test_every_family_has_a_tiny_model():
    assert FAMILIES.keys() <= set(MATRIX)
    assert len(MATRIX) == 44


@pytest.mark.parametrize("model_type", MATRIX)
def test_packed_and_compiled_forwards_give_the_padded_log_probs_entropy_and_gradients(family_dir, model_type, caplog):
    """In float32 to 1e-5, packed as it is and packed with its blocks compiled (dynamo and AOTAutograd; `aot_eager`
    builds no inductor code on a CPU; not a mixture of experts, whose experts compile in bfloat16 only): log-probs,
    entropy, gradients and a mixture of experts' router loss. The
    log-probs are also those of the model's own logits (Granite's and Cohere's scaled logits, Gemma's soft-capped
    ones), which sampling sees."""
    path = family_dir(model_type)
    heads = {}
    with caplog.at_level(logging.INFO, logger="ketch.engine"):
        for name, packed in (("padded", False), ("packed", True), ("compiled", True)):
            heads[name] = PolicyModel(load_causal_lm(str(path), torch.float32), packed)
    compiled = compiles(heads["compiled"].lm, torch.float32)
    assert compiled == (model_type not in MOE)  # transformers' experts compile in bfloat16 only (the GPU matrix)
    if compiled:
        compile_blocks(heads["compiled"], backend="aot_eager")
    assert heads["packed"].packed == (model_type not in NOT_PACKED)
    said = [r.getMessage() for r in caplog.records if "padded batches" in r.getMessage()]
    reason = NOT_PACKED.get(model_type)
    name = type(heads["packed"].lm).__name__
    assert said == ([f"{name} trains on padded batches, not packed: {reason}"] if reason else [])
    input_ids, attention_mask, position_ids, response_len = ragged_batch(heads["packed"].lm.config.vocab_size)
    mask = attention_mask[:, -response_len:].bool()
    out, grads = {}, {}
    for name, head in heads.items():
        out[name] = head(input_ids, attention_mask, position_ids, response_len, calc_entropy=True)
        loss = (out[name]["log_prob"] + out[name]["entropy"]).sum() + out[name].get("router_aux_loss", 0)
        loss.backward()
        grads[name] = {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
    assert len(grads["padded"]) > 10
    for name in ("packed", "compiled"):
        for key in ("log_prob", "entropy"):
            torch.testing.assert_close(out[name][key][mask], out["padded"][key][mask], atol=1e-5, rtol=0)
        assert grads[name].keys() == grads["padded"].keys()
        for param, grad in grads["padded"].items():
            torch.testing.assert_close(grads[name][param], grad, atol=1e-5, rtol=1e-4, msg=f"{name} {param}")
    with torch.no_grad():
        logits = heads["padded"].lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    sampled = logits.logits[:, -response_len - 1 : -1].float().log_softmax(-1)
    sampled = sampled.gather(-1, input_ids[:, -response_len:, None])[..., 0]
    torch.testing.assert_close(out["padded"]["log_prob"][mask], sampled[mask], atol=1e-5, rtol=0)
    assert out["padded"]["log_prob"][mask].min() < -1
    assert all(("router_aux_loss" in o) == (model_type in MOE) for o in out.values())
    if model_type in MOE:
        for name in ("packed", "compiled"):
            torch.testing.assert_close(
                out[name]["router_aux_loss"], out["padded"]["router_aux_loss"], atol=1e-6, rtol=0
            )
        top_k = router(heads["packed"].lm.config).top_k  # near balanced at init, the loss is about top_k
        assert out["packed"]["router_aux_loss"].item() == pytest.approx(top_k, abs=0.1)


@pytest.mark.parametrize("model_type", MATRIX)
def test_static_decoding_with_compiled_blocks_gives_the_greedy_tokens_of_generate(family_dir, model_type):
    """Left-padded prompts of 9, 4 and 1 tokens, 12 new tokens (past the sliding window), the decode blocks
    compiled by dynamo (`aot_eager`: no inductor code to build on a CPU)."""
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model = load_causal_lm(str(family_dir(model_type)), torch.float32).eval()
    assert static_decoding_problem(model) == NOT_STATIC.get(model_type)
    if model_type in NOT_STATIC:
        with pytest.raises(ValueError, match=re.escape(f"cannot be decoded here: {NOT_STATIC[model_type]}")):
            StaticDecoder(model, compile_step=False)
        return
    attention_mask = (torch.arange(9) >= 9 - torch.tensor([9, 4, 1])[:, None]).long()
    input_ids = torch.randint(4, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    input_ids = input_ids * attention_mask
    expected, expected_log_probs = generate_greedy(model, input_ids, attention_mask, 12, pad_token_id=0)
    decoder = StaticDecoder(model, compile_step=True, buckets=False, backend="aot_eager")
    tokens, log_probs = decoder.generate(input_ids, attention_mask, 12, Sampling(do_sample=False), None, 0)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_type", MATRIX)
def test_two_grpo_steps_with_packing_and_static_decoding(tiny_config, family_dir, model_type):
    """The rollout's log-probs of the sampled tokens are the training forward's (float32), and a mixture of experts
    logs its router loss."""
    config = tiny_config(
        f"model.path={family_dir(model_type)}",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "data.train_batch_size=4",
        "model.use_remove_padding=true",
        "rollout.hf_decoding=static",
    )
    trainer = PPOTrainer(config)
    trainer._open()
    steps = [trainer._train_step(trainer.loader.next_batch(), step) for step in (1, 2)]
    policy, rollout = trainer.actor_rollout.worker.actor.module, trainer.actor_rollout.worker.rollout
    trainer.groups.shutdown()
    assert policy.packed == (model_type not in NOT_PACKED)
    assert (rollout.decoder is not None) == (model_type not in NOT_STATIC)
    for metrics in steps:
        assert metrics["training/rollout_probs_diff_max"] < 1e-5
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        assert ("actor/router_aux_loss" in metrics) == (model_type in MOE)
    if model_type in MOE:  # the model config's weight: OLMoE 0.01, DeepSeek-V3 none (its router's bias balances)
        coef = {"olmoe": 0.01, "deepseek_v3": 0.0}.get(model_type, 0.001)
        assert router(policy.lm.config).aux_loss_coef == coef
        assert steps[1]["actor/router_aux_loss"] == pytest.approx(router(policy.lm.config).top_k, abs=0.1)


def test_a_model_no_path_supports_stops_at_start_up_in_one_line(tiny_config, tmp_path):
    from transformers import T5Config

    from ketch.models import ModelLoadError

    T5Config(vocab_size=100, architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelLoadError) as failure:
        PPOTrainer(tiny_config(f"model.path={tmp_path / 't5'}"))
    assert str(failure.value) == (
        f"model.path={tmp_path / 't5'}: T5ForConditionalGeneration is an encoder-decoder model; ketch trains "
        "decoder-only causal LMs (AutoModelForCausalLM: Llama, Qwen, Mistral, Gemma, Phi, OLMo, GPT-2, their "
        "mixtures of experts, ...)"
    )


def test_tensor_parallel_checks_apply_above_one_rank_and_read_each_familys_fields():
    """GPT-2 has no `intermediate_size` (its `n_inner` is None: four times the hidden size) and no key/value head
    count: nothing to check for one rank, and its family's split is not known for two."""
    from ketch.architecture import intermediate_size, tensor_parallel_problems

    tokenizer = build_char_tokenizer()
    gpt2, llama = (tiny_family_config(t, tokenizer) for t in ("gpt2", "llama"))
    assert gpt2.n_inner is None and intermediate_size(gpt2) == 256
    assert tensor_parallel_problems(1, gpt2) == []
    assert tensor_parallel_problems(2, gpt2) == [
        "rollout.tensor_parallel_size=2: the tensor-parallel split of model_type='gpt2' is not known (known: llama, "
        "qwen2, qwen3, mistral, gemma, gemma3_text, granite); use rollout.tensor_parallel_size=1, or more rollout "
        "processes with one model each"
    ]
    assert tensor_parallel_problems(2, llama) == []
    assert tensor_parallel_problems(4, llama) == [
        "rollout.tensor_parallel_size=4 does not divide the model's num_key_value_heads=2; pick a divisor of it"
    ]


def test_ppo_with_a_critic_on_a_model_without_a_value_head_class_stops_at_start_up(tiny_config, family_dir):
    """OLMo 2 has no `*ForTokenClassification` in transformers: PPO's critic cannot be built on it; GRPO runs."""
    from ketch.models import ModelLoadError

    path = family_dir("olmo2")
    with pytest.raises(ModelLoadError) as failure:
        PPOTrainer(tiny_config(f"model.path={path}", "algorithm.adv_estimator=gae"))
    assert str(failure.value) == (
        f"model.path={path}: a critic needs the backbone with a scalar value head (AutoModelForTokenClassification), "
        "and transformers has no token-classification class for model_type='olmo2'; use a critic-free estimator "
        "(algorithm.adv_estimator=grpo, rloo, reinforce_plus_plus, remax), or critic.model_path of an architecture "
        "that has one"
    )
    PPOTrainer(tiny_config(f"model.path={path}", "algorithm.adv_estimator=grpo"))  # starts


class _Router(torch.nn.Linear):
    pass


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = _Router(4, 2), torch.nn.Linear(4, 4)


def _moe(spec) -> torch.nn.Module:
    """A model of two expert blocks whose class records its router logits by `spec`, as transformers' models do."""
    model_class = type("TinyMoe", (torch.nn.Module,), {"_can_record_outputs": {"router_logits": spec}})
    model = model_class()
    model.layers = torch.nn.ModuleList([_Experts(), _Experts()])
    return model


def test_router_outputs_read_each_form_of_transformers_record():
    """transformers records router logits by module class (index 1: Llama 4's `Llama4TextMoe` in transformers 5.17,
    which stopped the GPU run), by a suffix of the module names, by an `OutputRecorder` with its own index (5.19's
    `OutputRecorder(Llama4Router, index=1)`, Mixtral's index 0) and layer name (Jamba's), or by a list of these."""
    from transformers.utils.output_capturing import OutputRecorder

    from ketch.architecture import router_outputs

    def found(spec):
        model = _moe(spec)
        names = {id(m): n for n, m in model.named_modules()}
        return [(names[id(m)], i) for m, i in router_outputs(model)]

    assert found(_Experts) == [("layers.0", 1), ("layers.1", 1)]
    assert found("gate") == [("layers.0.gate", 1), ("layers.1.gate", 1)]
    assert found(OutputRecorder(_Router, index=0)) == [("layers.0.gate", 0), ("layers.1.gate", 0)]
    both = [("layers.0.gate", 0), ("layers.1.gate", 0), ("layers.1", 1)]
    assert found([OutputRecorder(_Router, index=0), "1"]) == both
    # Jamba's: every nn.Linear named `gate` (not the other linear layers), index 0
    assert found(OutputRecorder(torch.nn.Linear, layer_name="gate")) == [("layers.0.gate", 0), ("layers.1.gate", 0)]
    assert router_outputs(torch.nn.Linear(2, 2)) == []


def test_a_model_without_weights_gets_the_same_answers_as_the_loaded_one():
    """`ketch doctor` asks about a model on the meta device: the probe of keyword arguments runs there too (GPT-2's
    forward stops before its attention without weights, and counts as passing them on, as it does when loaded)."""
    from ketch.doctor.config_checks import meta_model

    tokenizer = build_char_tokenizer()
    for model_type in MATRIX:
        model = meta_model(tiny_family_config(model_type, tokenizer), False)
        assert packing_problem(model) == NOT_PACKED.get(model_type), model_type
        assert static_decoding_problem(model) == NOT_STATIC.get(model_type), model_type
