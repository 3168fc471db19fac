"""The Megatron engine on CPU processes (gloo) against a plain HF model: log-probs, entropy, the first update's
loss and gradient norm, the log-probs after the step, the HF export and a checkpoint round trip, for tensor
and sequence parallelism over two data-parallel ranks, and for interleaved pipeline parallelism with activation
recomputation (tied embeddings).

Megatron-Core hard-wires CUDA in a few places that do no arithmetic: buffer and RNG-tracker placement
(`torch.cuda.current_device`, the CUDA RNG tracker's fork), a tied embedding's first sync (`Tensor.cuda`),
a stream sync after pipeline sends (`torch.cuda.synchronize`) and the schedules' token counter
(`device="cuda"`). `_run_megatron_on_cpu` points those at the CPU; the model, schedules, collectives and the
engine's own code run as they are. `tests/gpu/` runs the same comparison unpatched on GPUs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'ketch[megatron]')")

from spawned import end_rank

from ketch.config.schema import MegatronConfig, OptimConfig
from ketch.data import build_char_tokenizer
from ketch.models import save_tiny_model
from ketch.protocol import DataProto

RESPONSE = 5


def batch(vocab: int) -> DataProto:
    """4 sequences of 12 tokens (the last 5 the response): two left-padded prompts, one response padded."""
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (4, 12))
    attention = torch.ones(4, 12, dtype=torch.long)
    attention[0, :3] = attention[1, :1] = attention[2, 10:] = 0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": positions,
            "responses": ids[:, -RESPONSE:],
            "response_mask": attention[:, -RESPONSE:],
            "advantages": torch.randn(4, RESPONSE),
        }
    )


def policy_loss(out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
    """-advantage x log-prob, token mean over the mini-batch (the counts are mini-batch totals)."""
    mask = micro.batch["response_mask"]
    return -(out["log_prob"] * micro.batch["advantages"] * mask).sum() / num_tokens, {}


def _run_megatron_on_cpu() -> None:
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.dot_product_attention as attention

    import ketch.engine.megatron.engine as engine

    class NoFork:
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    class CpuTorch:
        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *args, **kwargs):
            kwargs.pop("device", None)
            return torch.zeros(*args, **kwargs)

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    tp_random.get_cuda_rng_tracker = attention.tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoFork()
    engine.tensor_parallel = type(
        "TP", (), {"get_cuda_rng_tracker": NoFork, "model_parallel_cuda_manual_seed": lambda seed: None}
    )
    schedules.torch = CpuTorch()


def _rank(
    rank: int, world: int, megatron: MegatronConfig, recompute: bool, model_dir: str, port: int, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    _run_megatron_on_cpu()
    from megatron.core import parallel_state
    from transformers import AutoConfig

    from ketch.engine.megatron.engine import MegatronEngine, hf_reader

    hf_config = AutoConfig.from_pretrained(model_dir)
    optim = OptimConfig(lr=1e-3, grad_clip=0.0)
    args = (hf_config, hf_reader(model_dir), megatron, torch.device("cpu"), optim)
    engine = MegatronEngine(*args, seed=0, gradient_checkpointing=recompute)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = batch(hf_config.vocab_size).chunk(dp_size)[dp_rank]
    before = engine.infer(mine, 3, calc_entropy=True)  # uneven micro-batches (3 + 1 rows) where 4 rows
    exported = dict(engine.full_parameters(dtype=torch.float32))
    engine.save_checkpoint(Path(out) / "ckpt", {"update_count": 0})
    metrics = engine.train_mini_batch(mine.split(3), policy_loss)  # uneven: the pipeline pads with loss-free rows
    stepped = {name: tensor.clone() for name, tensor in engine.full_parameters(dtype=torch.float32)}  # may be views
    after = engine.infer(mine, 2)["log_prob"]
    restored = engine.load_checkpoint(Path(out) / "ckpt")
    again = engine.infer(mine, None)["log_prob"]  # one micro-batch (the interleaved schedule gets a filler)
    result = (dp_rank, before, metrics, after, torch.equal(again, before["log_prob"]), restored)
    torch.save((*result, (exported, stepped) if rank == 0 else None), f"{out}/{rank}.pt")
    end_rank()


def reference(model_dir: Path) -> tuple[dict, float, float, torch.Tensor, dict]:
    """The same batch and update on the plain HF model in one process."""
    from transformers import AutoModelForCausalLM

    from ketch.engine.heads import PolicyModel

    model = PolicyModel(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    b = batch(model.lm.config.vocab_size).batch
    inputs = (b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE)
    out = model(*inputs, calc_entropy=True)
    loss = -(out["log_prob"] * b["advantages"] * b["response_mask"]).sum() / b["response_mask"].sum()
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
    weights = {k: v.detach().clone() for k, v in model.lm.state_dict().items()}
    torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0).step()  # OptimConfig's default
    with torch.no_grad():
        after = model(*inputs)["log_prob"]
    stepped = {k: v.detach().clone() for k, v in model.lm.state_dict().items()}
    return {k: v.detach() for k, v in out.items()}, loss.item(), grad_norm, after, (weights, stepped)


def tiny_qwen3(path: Path, layers: int) -> Path:
    """A random Qwen3 (query/key head norms drawn, not ones; heads of 16 over a hidden size of 32; untied)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4}
    model = Qwen3ForCausalLM(Qwen3Config(**sizes, num_key_value_heads=2, head_dim=16, vocab_size=100))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "megatron", "recompute", "world", "layers", "port"),
    [
        ("qwen2", MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), False, 4, 2, 29621),
        (
            "qwen2",
            MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            True,
            2,
            4,
            29622,
        ),
        ("qwen3", MegatronConfig(tensor_model_parallel_size=2), False, 2, 2, 29623),
    ],
    ids=["tp2-sp-dp2", "pp2-vpp2-recompute", "qwen3-tp2"],
)
def test_megatron_engine_matches_the_hf_model(tmp_path, model, megatron, recompute, world, layers, port):
    if model == "qwen3":  # the head norms' gradients are summed over the tensor ranks, each normalizing its heads
        model_dir = tiny_qwen3(tmp_path / "model", layers)
    else:  # tied embeddings, GQA 4/2
        sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": layers, "max_positions": 64}
        model_dir = save_tiny_model(tmp_path / "model", build_char_tokenizer(), **sizes)
    mp.start_processes(_rank, args=(world, megatron, recompute, str(model_dir), port, str(tmp_path)), nprocs=world)
    out, loss, grad_norm, after, (weights, stepped) = reference(model_dir)
    mask = batch(100).batch["response_mask"].bool()
    dp_size = world // megatron.model_parallel_size
    for rank in range(world):
        dp_rank, before, metrics, after_step, restored, extra, exported = torch.load(
            tmp_path / f"{rank}.pt", weights_only=False
        )
        rows = slice(dp_rank * 4 // dp_size, (dp_rank + 1) * 4 // dp_size)
        m = mask[rows]
        for key in ("log_prob", "entropy"):
            torch.testing.assert_close(before[key][m], out[key][rows][m], rtol=0, atol=1e-5)
        assert metrics["loss"] == pytest.approx(loss, abs=1e-5)  # summed over micro-batches and data ranks
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        torch.testing.assert_close(after_step[m], after[rows][m], rtol=0, atol=1e-4)
        assert restored and extra == {"update_count": 0}
        if exported is not None:
            exported, exported_stepped = exported
            assert exported.keys() == weights.keys()
            assert all(torch.equal(exported[k], weights[k]) for k in weights)
            # AdamW's first step moves each weight by about the learning rate along its gradient's sign, whatever
            # the gradient's size: a gradient with part of its sum missing (a head norm's) moves some the other way
            moved = {k: (exported_stepped[k] - stepped[k]).abs().max().item() for k in weights}
            assert max(moved.values()) < 1e-5, {k: v for k, v in moved.items() if v > 1e-5}
    # `ketch export`'s merge of the checkpoint (written before the update) on the CPU, without a process group
    from transformers import AutoConfig

    from ketch.engine.export import load_checkpoint_state

    config = AutoConfig.from_pretrained(model_dir)
    config.save_pretrained(tmp_path / "ckpt" / "hf")
    merged = load_checkpoint_state(tmp_path / "ckpt")
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()  # tied: written once, as the embedding
    assert merged.keys() == weights.keys() - tied
    assert all(torch.equal(merged[k], weights[k]) for k in merged)


def value_loss(out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
    """Squared error to the advantages used as returns, token mean over the mini-batch."""
    mask = micro.batch["response_mask"]
    return ((out["values"] - micro.batch["advantages"]) ** 2 * mask).sum() / num_tokens, {}


def _critic(model_dir: Path):
    from ketch.models import load_critic

    torch.manual_seed(3)  # the fresh value head: the same draw in every process
    return load_critic(str(model_dir), torch.float32, "sdpa")


def _critic_rank(rank: int, world: int, megatron: MegatronConfig, model_dir: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    _run_megatron_on_cpu()
    from ketch.engine.megatron.engine import MegatronEngine

    critic = _critic(Path(model_dir))
    read, optim = critic.state_dict().__getitem__, OptimConfig(lr=1e-3, grad_clip=0.0)
    engine = MegatronEngine(critic.config, read, megatron, torch.device("cpu"), optim, seed=0, value_head=True)
    data = batch(critic.config.vocab_size)
    values = engine.infer(data, 2)["values"]
    metrics = engine.train_mini_batch(data.split(2), value_loss)
    exported = dict(engine.full_parameters())
    torch.save((values, metrics, exported), f"{out}/critic{rank}.pt")
    end_rank()


@pytest.mark.slow
def test_megatron_critic_matches_the_hf_value_model(tmp_path):
    from ketch.engine.heads import ValueModel

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "max_positions": 64}
    model_dir = save_tiny_model(tmp_path / "model", build_char_tokenizer(), **sizes)
    megatron = MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    mp.start_processes(_critic_rank, args=(2, megatron, str(model_dir), 29623, str(tmp_path)), nprocs=2)
    model = ValueModel(_critic(model_dir))
    weights = {k: v.detach().clone() for k, v in model.critic.state_dict().items()}
    b = batch(model.critic.config.vocab_size).batch
    values = model(b["input_ids"], b["attention_mask"], b["position_ids"], RESPONSE)["values"]
    mask = b["response_mask"]
    loss = ((values - b["advantages"]) ** 2 * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None)).item()
    for rank in range(2):
        got, metrics, exported = torch.load(tmp_path / f"critic{rank}.pt", weights_only=False)
        torch.testing.assert_close(got[mask.bool()], values.detach()[mask.bool()], rtol=0, atol=1e-5)
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        assert exported.keys() == weights.keys()  # model.* and score.{weight,bias}, as the HF critic


def _nan_rank(rank: int, model_dir: str, out: str) -> None:
    import logging

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29624")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    _run_megatron_on_cpu()
    from transformers import AutoConfig

    from ketch.engine.megatron.engine import MegatronEngine, hf_reader

    hf_config = AutoConfig.from_pretrained(model_dir)
    optim = OptimConfig(lr=1e-3)
    engine = MegatronEngine(hf_config, hf_reader(model_dir), MegatronConfig(), torch.device("cpu"), optim, seed=0)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ketch.engine").addHandler(handler)

    def nan_loss(out, micro, num_tokens, num_seqs):
        return policy_loss(out, micro, num_tokens, num_seqs)[0] * float("nan"), {}

    metrics = engine.train_mini_batch(batch(hf_config.vocab_size).split(2), nan_loss)
    torch.save((metrics["skipped_steps"], messages), f"{out}/nan.pt")
    end_rank()


@pytest.mark.slow
def test_a_non_finite_gradient_skips_the_step_and_names_the_parameters(tmp_path):
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "max_positions": 64}
    model_dir = save_tiny_model(tmp_path / "model", build_char_tokenizer(), **sizes)
    mp.start_processes(_nan_rank, args=(str(model_dir), str(tmp_path)), nprocs=1)
    skipped, messages = torch.load(tmp_path / "nan.pt", weights_only=False)
    assert skipped == 1.0
    # one Qwen2 layer: the embedding, 7 layer tensors (2 norms, QKV weight and bias, projection, fc1, fc2) and the
    # final norm, all NaN; the first 4 by name in registration order (the layer registers its input norm first)
    assert messages == [
        "non-finite gradient norm (nan): optimizer step skipped; non-finite on rank 0: "
        "0.embedding.word_embeddings.weight, 0.decoder.layers.0.input_layernorm.weight, "
        "0.decoder.layers.0.self_attention.linear_proj.weight, 0.decoder.layers.0.self_attention.linear_qkv.weight "
        "and 5 more"
    ]


def _zero_rank(rank: int, sharded: bool, model_dir: str, port: int, out: str) -> None:
    """Two data-parallel ranks: an update, a checkpoint, a second update, then the checkpoint again and the
    second update once more; the run without sharding then tries to load the sharded run's checkpoint."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    _run_megatron_on_cpu()
    from transformers import AutoConfig

    from ketch.engine.megatron.engine import MegatronEngine, hf_reader
    from ketch.engine.optim import optimizer_state

    hf_config = AutoConfig.from_pretrained(model_dir)
    megatron = MegatronConfig(use_distributed_optimizer=sharded)
    optim = OptimConfig(lr=1e-2, lr_scheduler="cosine")  # each update at its own learning rate
    engine = MegatronEngine(hf_config, hf_reader(model_dir), megatron, torch.device("cpu"), optim, 4)
    mine = batch(hf_config.vocab_size).chunk(2)[rank]
    engine.train_mini_batch(mine.split(1), policy_loss)
    ckpt = Path(out) / f"ckpt-{sharded}"
    engine.save_checkpoint(ckpt, {})
    second = engine.train_mini_batch(mine.split(1), policy_loss), engine.infer(mine, 2)["log_prob"]
    engine.load_checkpoint(ckpt)
    again = engine.train_mini_batch(mine.split(1), policy_loss), engine.infer(mine, 2)["log_prob"]
    refused = ""
    if not sharded:
        try:
            engine.load_checkpoint(Path(out) / "ckpt-True")
        except ValueError as error:
            refused = str(error)
    shares = len(optimizer_state(engine.optimizer)["state"]), len(engine.params)
    weights = dict(engine.full_parameters(dtype=torch.float32))
    torch.save((second, again, shares, weights, refused), f"{out}/zero-{sharded}-{rank}.pt")
    end_rank()


@pytest.mark.slow
def test_the_distributed_optimizer_splits_adamw_over_data_ranks_and_trains_the_same(tmp_path):
    """`use_distributed_optimizer` over two data-parallel ranks: each rank holds the moments of part of the
    parameters, the two updates give the weights of the unsharded optimizer exactly, and a checkpoint resumes
    the second update exactly; an unsharded run refuses the sharded checkpoint, naming both grids."""
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "max_positions": 64}
    model_dir = save_tiny_model(tmp_path / "model", build_char_tokenizer(), **sizes)
    for sharded, port in ((True, 29625), (False, 29626)):
        mp.start_processes(_zero_rank, args=(sharded, str(model_dir), port, str(tmp_path)), nprocs=2)
    runs = {s: [torch.load(tmp_path / f"zero-{s}-{r}.pt", weights_only=False) for r in (0, 1)] for s in (True, False)}
    for rank in (0, 1):
        (metrics, log_prob), (metrics_again, log_prob_again), _, weights, _ = runs[True][rank]
        assert metrics == metrics_again and torch.equal(log_prob, log_prob_again)
        plain = runs[False][rank]
        assert metrics == plain[0][0] and torch.equal(log_prob, plain[0][1])
        assert weights.keys() == plain[3].keys() and all(torch.equal(weights[k], plain[3][k]) for k in weights)
    (_, total), (shard0, _), (shard1, _) = runs[False][0][2], runs[True][0][2], runs[True][1][2]
    assert runs[False][1][2] == (total, total) and shard0 + shard1 == total and 0 < shard0 < total
    refused = runs[False][0][4]
    assert refused.startswith(f"checkpoint {tmp_path / 'ckpt-True'} was written on the grid")
    assert "'distributed_optimizer': True" in refused and "'distributed_optimizer': False" in refused
