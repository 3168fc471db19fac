"""Same weights, same batch: the FSDP engine on one GPU and the Megatron engine without model parallelism on one
GPU, with TP=2 (also with sequence parallelism and activation recomputation under autocast) and with PP=2 on two
GPUs give the same log-probs, first-update `pg_loss` and `grad_norm`, within bf16 tolerances.

The model has the Qwen2.5-0.5B shape (24 layers, width 896, 14 query / 2 key-value heads, tied 151,936-token
vocabulary) with random weights stored in bf16, so both engines start from identical values; the Qwen3-0.6B shape
(28 layers, width 1,024, 16 query / 8 key-value heads of 128, query/key head norms) runs without model parallelism
and with TP=2. With KETCH_GPU_RESULTS=<dir> the measured differences are written there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'ketch[megatron]')")

from ketch.config.schema import MegatronConfig, OptimConfig
from ketch.protocol import DataProto

ROWS, PROMPT, RESPONSE, MICRO = 16, 64, 64, 4
TOLERANCE = {"log_prob_mean_abs": 0.02, "pg_loss_rel": 0.02, "grad_norm_rel": 0.03}
"""bf16 compute (FSDP: bf16 parameters; Megatron: float32 parameters under bf16 autocast) against each other."""


def save_model(family: str, path: Path) -> Path:
    """The Qwen2.5-0.5B or Qwen3-0.6B shape with random weights (Qwen3's head norms drawn too), stored in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": 151936, "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
    torch.manual_seed(0)
    if family == "qwen2":
        sizes = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14}
        model = Qwen2ForCausalLM(Qwen2Config(**common, **sizes, num_key_value_heads=2, tie_word_embeddings=True))
    else:
        sizes = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16}
        config = Qwen3Config(**common, **sizes, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    weight.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Per model family (built on first use): its directory, and the FSDP engine's log-probs and first update's
    metrics on one GPU."""
    runs = {}

    def get(family: str) -> tuple[Path, tuple]:
        if family not in runs:
            path = save_model(family, tmp_path_factory.mktemp(family))
            runs[family] = path, run("fsdp", 1, path, tmp_path_factory.mktemp(f"fsdp-{family}"))
        return runs[family]

    return get


def batch() -> DataProto:
    """Left-padded prompts, right-padded responses, advantages and an old policy a little off the current one."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 151000, (ROWS, PROMPT + RESPONSE), generator=g)
    attention = torch.ones_like(ids)
    for row in range(ROWS):
        attention[row, : row * 3] = 0
        attention[row, PROMPT + RESPONSE - row * 2 :] = 0
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": positions,
            "responses": ids[:, PROMPT:],
            "response_mask": attention[:, PROMPT:],
            "advantages": torch.randn(ROWS, RESPONSE, generator=g),
            "old_log_prob_offset": 0.05 * torch.randn(ROWS, RESPONSE, generator=g),
        }
    )


def pg_loss_fn(out: dict, micro: DataProto, num_tokens: torch.Tensor, num_seqs: torch.Tensor):
    """The actor's clipped PPO loss from ketch.algorithms, old log-probs = current + a fixed offset."""
    from ketch.algorithms import get_policy_loss

    b = micro.batch
    old = out["log_prob"].detach() + b["old_log_prob_offset"]
    loss, _ = get_policy_loss("vanilla")(
        old, out["log_prob"], b["advantages"], b["response_mask"], num_tokens=num_tokens, num_seqs=num_seqs
    )
    return loss, {"pg_loss": loss.detach()}


def _rank(
    rank: int, world: int, strategy: str, megatron: MegatronConfig | None, recompute: bool, model_dir: str, out: str
) -> None:
    port = 29641 if megatron is None else 29642 + megatron.pipeline_model_parallel_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from ketch.engine.distributed import init_process_group

    device = torch.device("cuda", rank)
    init_process_group(device)
    optim = OptimConfig(lr=1e-6, grad_clip=1.0)
    if strategy == "fsdp":
        from ketch.engine.engine import TrainEngine
        from ketch.engine.heads import PolicyModel
        from ketch.models import load_causal_lm

        lm = load_causal_lm(model_dir, torch.float32, "sdpa", False, {})
        engine = TrainEngine(PolicyModel(lm), device, optim, param_dtype=torch.bfloat16)
    else:
        from transformers import AutoConfig

        from ketch.engine.megatron.engine import MegatronEngine, hf_reader

        hf_config = AutoConfig.from_pretrained(model_dir)
        args = (hf_config, hf_reader(model_dir), megatron, device, optim)
        engine = MegatronEngine(*args, dtype=torch.bfloat16, gradient_checkpointing=recompute)
    data = batch()
    log_probs = engine.infer(data, MICRO, calc_entropy=True)
    metrics = engine.train_mini_batch(data.split(MICRO), pg_loss_fn)
    if rank == 0:
        torch.save(({k: v.cpu() for k, v in log_probs.items()}, metrics), f"{out}/{strategy}.pt")
    torch.distributed.destroy_process_group()


def run(strategy: str, world: int, model_dir: Path, out: Path, megatron: MegatronConfig | None = None, recompute=False):
    mp.start_processes(_rank, args=(world, strategy, megatron, recompute, str(model_dir), str(out)), nprocs=world)
    return torch.load(out / f"{strategy}.pt", weights_only=False)


TP2 = MegatronConfig(tensor_model_parallel_size=2)


@pytest.mark.parametrize(
    ("family", "megatron", "recompute"),
    [
        pytest.param("qwen2", MegatronConfig(), False, marks=pytest.mark.gpus(1), id="tp1"),
        pytest.param("qwen2", TP2, False, marks=pytest.mark.gpus(2), id="tp2"),
        pytest.param(
            "qwen2",
            MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True),
            True,
            marks=pytest.mark.gpus(2),
            id="tp2-sp-recompute",
        ),
        pytest.param(
            "qwen2", MegatronConfig(pipeline_model_parallel_size=2), False, marks=pytest.mark.gpus(2), id="pp2"
        ),
        pytest.param("qwen3", MegatronConfig(), False, marks=pytest.mark.gpus(1), id="qwen3-tp1"),
        pytest.param("qwen3", TP2, False, marks=pytest.mark.gpus(2), id="qwen3-tp2"),
    ],
)
def test_first_update_agrees_with_fsdp(fsdp_runs, tmp_path, family, megatron, recompute):
    model_dir, (fsdp_lp, fsdp) = fsdp_runs(family)
    mega_lp, mega = run("megatron", megatron.model_parallel_size, model_dir, tmp_path, megatron, recompute)
    mask = batch().batch["response_mask"].bool()
    diff = (mega_lp["log_prob"] - fsdp_lp["log_prob"])[mask].abs()
    figures = {
        "grid": ("qwen3-" if family == "qwen3" else "")
        + f"tp{megatron.tensor_model_parallel_size}-pp{megatron.pipeline_model_parallel_size}"
        + ("-sp" if megatron.sequence_parallel else "")
        + ("-recompute" if recompute else ""),
        "log_prob_mean_abs": diff.mean().item(),
        "log_prob_max_abs": diff.max().item(),
        "entropy_mean_abs": (mega_lp["entropy"] - fsdp_lp["entropy"])[mask].abs().mean().item(),
        "pg_loss": {"fsdp": fsdp["pg_loss"], "megatron": mega["pg_loss"]},
        "grad_norm": {"fsdp": fsdp["grad_norm"], "megatron": mega["grad_norm"]},
        "pg_loss_rel": abs(mega["pg_loss"] - fsdp["pg_loss"]) / abs(fsdp["pg_loss"]),
        "grad_norm_rel": abs(mega["grad_norm"] - fsdp["grad_norm"]) / fsdp["grad_norm"],
        "tolerance": TOLERANCE,
    }
    if results := os.environ.get("KETCH_GPU_RESULTS"):
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / f"megatron_vs_fsdp_{figures['grid']}.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    assert figures["log_prob_mean_abs"] < TOLERANCE["log_prob_mean_abs"]
    assert figures["pg_loss_rel"] < TOLERANCE["pg_loss_rel"]
    assert figures["grad_norm_rel"] < TOLERANCE["grad_norm_rel"]
