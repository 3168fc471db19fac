"""HF Llama/Qwen2 ↔ Megatron-Core weights: the fused layouts worked by hand, bit-exact round trips through
TP=2 x PP=2 shards, the config mapping, and real GPTModel chunks built on the CPU with the same keys and shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from spawned import end_rank
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'ketch[megatron]')")

from test_megatron_engine_cpu import _run_megatron_on_cpu

from ketch.config.schema import MegatronConfig
from ketch.engine.megatron.weights import (
    ModelShape,
    Parallel,
    UnsupportedModelError,
    fuse_qkv,
    hf_to_megatron,
    hf_to_megatron_chunk,
    megatron_to_hf,
    shard,
    split_qkv,
    unshard,
)

SIZES = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4}


def hf_model(kind: str, tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**SIZES, num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tied))
    if kind == "qwen3":  # head_dim 16: the heads are wider than hidden / heads; the head norms drawn, not ones
        config = Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=16, vocab_size=64, tie_word_embeddings=tied)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    weight.uniform_(0.5, 1.5)
        return model
    config = LlamaConfig(**SIZES, num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tied, rope_theta=5e5)
    return LlamaForCausalLM(config)


def test_qkv_groups_each_kv_heads_queries_then_key_then_value():
    # 4 query heads share 2 key/value heads, head_dim 1, hidden 1: group g = queries 2g, 2g+1, key g, value g
    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=1, tied=True, qkv_bias=True)
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    fused = fuse_qkv(q, k, v, shape)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert shard(fused, "column", tp=2, rank=1).tolist() == [2, 3, 11, 21]  # rank 1 holds the whole group 1
    assert [x.tolist() for x in split_qkv(fused, shape)] == [[0, 1, 2, 3], [10, 11], [20, 21]]


def test_gated_fc1_shard_holds_its_slice_of_gate_then_of_up():
    fc1 = torch.tensor([0.0, 1, 2, 3, 10, 11, 12, 13])  # [gate; up]
    pieces = [shard(fc1, "gated", tp=2, rank=r) for r in range(2)]
    assert [p.tolist() for p in pieces] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    assert torch.equal(unshard(pieces, "gated"), fc1)


def test_row_parallel_splits_the_input_dimension():
    weight = torch.arange(8.0).reshape(2, 4)
    assert shard(weight, "row", tp=2, rank=1).tolist() == [[2, 3], [6, 7]]


def test_interleaved_pipeline_places_layers_like_megatron():
    parallel = Parallel(tp=1, pp=2, vpp=2)
    placed = {(p, v): list(parallel.layers(8, p, v)) for p in range(2) for v in range(2)}
    assert placed == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}


@pytest.mark.parametrize(
    ("kind", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", True)]
)
def test_round_trip_through_tp2_pp2_shards_is_bit_exact(kind, tied):
    model = hf_model(kind, tied)
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    shape = ModelShape.from_hf(model.config)
    assert (shape.qkv_bias, shape.qk_norm) == (kind == "qwen2", kind == "qwen3")
    chunks = hf_to_megatron(hf, shape, Parallel(tp=2, pp=2))
    # first stage: embedding + layers 0, 1; last stage: layers 2, 3 (numbered 0, 1 there), norm, output layer
    first, last = chunks[(0, 0, 1)], chunks[(1, 0, 1)]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert torch.equal(
        last["output_layer.weight"], (hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"])[32:]
    )
    assert torch.equal(
        last["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.2.mlp.down_proj.weight"][:, 24:]
    )
    if kind == "qwen3":  # one norm weight per head dimension, whole on every tensor rank
        for tp_rank in range(2):
            norm = chunks[(1, 0, tp_rank)]["decoder.layers.1.self_attention.k_layernorm.weight"]
            assert torch.equal(norm, hf["model.layers.3.self_attn.k_norm.weight"]) and norm.shape == (16,)
    back = megatron_to_hf(chunks, shape, Parallel(tp=2, pp=2))
    full = hf_to_megatron(hf, shape, Parallel())[(0, 0, 0)]
    assert all(tuple(t.shape) == shape.full_shape(_global_name(n)) for n, t in full.items())
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_critic_round_trip_keeps_the_scalar_head_whole_on_every_tensor_rank():
    from transformers import Qwen2ForTokenClassification

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES, num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True, num_labels=1)
    hf = Qwen2ForTokenClassification(config).state_dict()
    shape, parallel = ModelShape.from_hf(config, value_head=True), Parallel(tp=2, pp=2)
    assert not shape.tied  # the head is a score, never the embedding
    chunks = hf_to_megatron(hf, shape, parallel)
    for tp_rank in range(2):
        assert torch.equal(chunks[(1, 0, tp_rank)]["output_layer.weight"], hf["score.weight"])  # [1, 32] whole
        assert torch.equal(chunks[(1, 0, tp_rank)]["output_layer.bias"], hf["score.bias"])
    back = megatron_to_hf(chunks, shape, parallel)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def _global_name(name: str) -> str:
    return name.split(".", 3)[3] if name.startswith("decoder.layers.") else name


def test_qkv_shard_shape_of_a_gqa_layer():
    shape = ModelShape.from_hf(hf_model("qwen2", tied=False).config)
    chunk = hf_to_megatron_chunk(
        hf_model("qwen2", tied=False).state_dict().__getitem__, shape, Parallel(tp=2), (0, 0, 0)
    )
    # one of 2 kv groups per rank: 2 query heads + key + value, head_dim 8 -> 32 rows
    assert chunk["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (32, 32)
    assert chunk["decoder.layers.0.mlp.linear_fc1.weight"].shape == (48, 32)  # half of gate + half of up


def test_transformer_config_carries_the_hf_settings():
    from ketch.engine.megatron.model import transformer_config
    from ketch.engine.megatron.weights import rope_settings

    config = Qwen2Config(**SIZES, num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5, rope_theta=1e6)
    mc = transformer_config(config, MegatronConfig(tensor_model_parallel_size=2), torch.bfloat16)
    fields = (mc.num_layers, mc.hidden_size, mc.ffn_hidden_size, mc.num_attention_heads, mc.num_query_groups)
    assert fields == (4, 32, 48, 4, 2)
    assert (mc.kv_channels, mc.layernorm_epsilon, mc.normalization, mc.gated_linear_unit) == (8, 1e-5, "RMSNorm", True)
    assert (mc.add_qkv_bias, mc.add_bias_linear, mc.tensor_model_parallel_size, mc.bf16) == (True, False, 2, True)
    # float32 parameters, bfloat16 compute under the schedules' autocast, losses taken as they are
    assert (mc.params_dtype, mc.enable_autocast, mc.autocast_dtype) == (torch.float32, True, torch.bfloat16)
    assert mc.calculate_per_token_loss
    assert rope_settings(config) == {"rotary_base": 1e6, "rope_scaling": False}
    llama31 = LlamaConfig(
        **SIZES,
        max_position_embeddings=16384,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    assert rope_settings(llama31) == {"rotary_base": 10000.0, "rope_scaling": True, "rope_scaling_factor": 8.0}


def test_unmapped_architectures_are_refused_by_name():
    from ketch.config import ConfigError
    from ketch.engine.megatron.weights import check_supported

    assert issubclass(UnsupportedModelError, ConfigError)  # `ketch train: error: ...`, exit 2, at start-up
    with pytest.raises(UnsupportedModelError, match=r"RoPE scaling \{'rope_type': 'yarn'"):
        check_supported(LlamaConfig(**SIZES, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        ModelShape.from_hf(type("C", (), {"model_type": "gpt2"})())
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelShape.from_hf(LlamaConfig(**SIZES, attention_bias=True))
    with pytest.raises(UnsupportedModelError, match="qwen3 with attention_bias"):
        ModelShape.from_hf(Qwen3Config(**SIZES, attention_bias=True))


MODELS = (("qwen2", False), ("llama", True), ("qwen3", False))
"""The chunk-layout cases, both on a TP=2 x PP=2 grid (one set of processes): untied, and tied (whose last
stage holds its own copy of the embedding as the output layer)."""


def _build_and_load(rank: int, tp: int, pp: int, port: int, out: str) -> None:
    """One rank: build its GPTModel chunk of each model on the CPU (gloo), check the adapter's keys/shapes,
    load, save back."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp * pp)
    _run_megatron_on_cpu()  # the tied embedding's first sync over the stages calls Tensor.cuda
    from megatron.core import parallel_state

    from ketch.engine.megatron.model import build_chunks, transformer_config

    parallel_state.initialize_model_parallel(tp, pp)
    coord = (parallel_state.get_pipeline_model_parallel_rank(), 0, parallel_state.get_tensor_model_parallel_rank())
    for kind, tied in MODELS:
        model = hf_model(kind, tied)
        shape, parallel = ModelShape.from_hf(model.config), Parallel(tp=tp, pp=pp)
        config = transformer_config(model.config, MegatronConfig(tp, pp), torch.float32)
        (chunk,) = build_chunks(model.config, config, coord[0])
        ours = hf_to_megatron_chunk(model.state_dict().__getitem__, shape, parallel, coord)
        theirs = {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}, (kind, coord)
        chunk.load_state_dict(ours, strict=False)
        state = {k: v.clone() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
        torch.save((coord, state), f"{out}/{kind}{rank}.pt")
    end_rank()


@pytest.mark.slow
def test_megatron_gptmodel_chunks_have_the_adapters_layout(tmp_path):
    tp, pp = 2, 2
    mp.start_processes(_build_and_load, args=(tp, pp, 29571, str(tmp_path)), nprocs=tp * pp, start_method="spawn")
    for kind, tied in MODELS:
        chunks = dict(torch.load(tmp_path / f"{kind}{r}.pt") for r in range(tp * pp))
        model = hf_model(kind, tied)
        hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        back = megatron_to_hf(chunks, ModelShape.from_hf(model.config), Parallel(tp=tp, pp=pp))
        assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf), kind
