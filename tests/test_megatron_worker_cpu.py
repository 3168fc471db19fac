"""The actor worker with `strategy=megatron` on CPU processes (gloo): one GRPO update through `update_actor`, its
data placed by the data-parallel dispatch, gives the same `pg_loss`, `grad_norm` and entropy with TP=2 (with and
without sequence parallelism, the latter with activation recomputation) as with TP=1 and as the FSDP engine, for
tied and untied embeddings, and every tensor peer trains on all the rows.

The update is on-policy (no `old_log_prob`: ratio 1, the entropy from the update's own forward), in micro-batches
of 2 rows whose log-probs are projected 7 tokens at a time, as the GPU benchmark's update is (32 rows, 4096-token
chunks). Megatron's CUDA-only spots are pointed at the CPU as in `test_megatron_engine_cpu.py`.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'ketch[megatron]')")

from spawned import end_rank
from test_megatron_engine_cpu import _run_megatron_on_cpu

from ketch.config import derive_batch_plan, load_config
from ketch.controller import DP_COMPUTE_PROTO
from ketch.controller.dispatch import DataParallelLayout
from ketch.protocol import DataProto
from ketch.workers.common import role_dispatch_rank

PROMPT, RESPONSE = 7, 5
RECOMPUTE = "model.gradient_checkpointing=true"
TP2 = ["actor.megatron.tensor_model_parallel_size=2"]
RUNS = {  # name: (strategy, processes, model: "tied" or "untied" embeddings, config overrides)
    "fsdp": ("fsdp", 1, "tied", []),
    "tp1": ("megatron", 1, "tied", []),
    "tp2": ("megatron", 2, "tied", TP2),
    "tp2-sp-recompute": ("megatron", 2, "tied", [*TP2, "actor.megatron.sequence_parallel=true", RECOMPUTE]),
    "fsdp-untied": ("fsdp", 1, "untied", []),
    "tp2-untied": ("megatron", 2, "untied", TP2),
}
REFERENCE = {"tp1": "fsdp", "tp2": "fsdp", "tp2-sp-recompute": "fsdp", "tp2-untied": "fsdp-untied"}


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The tiny model (tied embeddings) and an untied copy of its shape with its own random weights."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from ketch.models.tiny import tiny_qwen2_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = tiny_qwen2_config(tokenizer, hidden_size=32, intermediate_size=64, num_layers=2, max_positions=128)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = tmp_path_factory.mktemp("untied")
    Qwen2ForCausalLM(config).save_pretrained(untied)
    tokenizer.save_pretrained(untied)
    return {"tied": str(tiny_model_dir), "untied": str(untied)}


def batch(vocab: int) -> DataProto:
    """8 responses to 2 prompts (GRPO groups of 4): left-padded prompts, three responses cut short."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (8, PROMPT + RESPONSE), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :2] = attention[5, :4] = 0
    attention[1, -2:] = attention[4, -1:] = attention[6, -4:] = 0
    advantages = torch.randn(8, 1, generator=g).expand(8, RESPONSE) * attention[:, PROMPT:]
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:],
            "response_mask": attention[:, PROMPT:],
            "advantages": advantages.contiguous(),
        }
    )


def actor_config(model_dir: str, run: str):
    """The worker's config: fsdp while loading (a config with strategy=megatron on a CPU does not validate)."""
    strategy, processes, _, extra = RUNS[run]
    config = load_config(
        overrides=[
            f"model.path={model_dir}",
            "model.dtype=float32",
            "trainer.device=cpu",
            f"trainer.n_cpu_workers={processes}",
            "data.train_batch_size=2",
            "rollout.n=4",
            f"data.max_prompt_length={PROMPT}",
            f"data.max_response_length={RESPONSE}",
            "algorithm.adv_estimator=grpo",
            "actor.ppo_mini_batch_size=null",
            "actor.ppo_micro_batch_size_per_device=2",
            *extra,
        ]
    )
    return dataclasses.replace(config, actor=dataclasses.replace(config.actor, strategy=strategy))


def layout(config, processes: int) -> DataParallelLayout:
    return DataParallelLayout.from_ranks([role_dispatch_rank(r, processes, config.actor) for r in range(processes)])


def _workers(rank: int, processes: int, models: dict[str, str], port: int, out: str) -> None:
    """The runs on `processes` processes, one after the other in the same processes (Megatron's grid is set up
    once per process, and sequence parallelism is no part of it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_megatron_on_cpu()
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import ketch.engine.megatron.engine as engine
    from ketch.workers import ActorRolloutRefWorker

    engine.chunked_vocab_parallel_log_probs = partial(engine.chunked_vocab_parallel_log_probs, chunk=7)
    layer_calls, layer_forward = [], TransformerLayer.forward

    def counted(*args, **kwargs):  # Megatron's layer forwards, recomputations included
        layer_calls.append(1)
        return layer_forward(*args, **kwargs)

    TransformerLayer.forward = counted
    for run in (run for run, (_, n, _, _) in RUNS.items() if n == processes):
        model_dir = models[RUNS[run][2]]
        config = actor_config(model_dir, run)
        worker = ActorRolloutRefWorker(config, model_dir, derive_batch_plan(config, config.world_size(False)), 1)
        worker.init_model()
        calls, _ = layout(config, processes).plan(DP_COMPUTE_PROTO, (batch(worker.hf_config.vocab_size),), {})
        seen, loss = [], worker._loss

        def recorded(out, micro, num_tokens, num_seqs, loss=loss, seen=seen):  # rows, tokens, loss denominator
            seen.append((len(micro), int(micro.batch["response_mask"].sum()), num_tokens.item()))
            return loss(out, micro, num_tokens, num_seqs)

        worker._loss = recorded
        layer_calls.clear()
        result = worker.update_actor(*calls[rank][0])
        torch.save((result, seen, len(layer_calls)), f"{out}/{run}{rank}.pt")
    end_rank()


@pytest.mark.slow
def test_megatron_tensor_parallel_update_matches_tp1_and_fsdp_through_the_actor_worker(models, tmp_path):
    for processes, port in ((1, 29625), (2, 29626)):
        mp.start_processes(_workers, args=(processes, models, port, str(tmp_path)), nprocs=processes)
    metrics = {}
    for run, (strategy, processes, model, extra) in RUNS.items():
        results = [torch.load(tmp_path / f"{run}{r}.pt", weights_only=False) for r in range(processes)]
        for _, seen, layer_calls in results:  # every tensor peer: all 8 rows (shuffled 3 1 5 6 7 4 0 2) in
            assert seen == [(2, 8, 33.0), (2, 6, 33.0), (2, 9, 33.0), (2, 10, 33.0)], run  # micro-batches of 2
            # Megatron's 2 layers run once per micro-batch, twice with recomputation (FSDP runs HF's layers)
            assert layer_calls == {"fsdp": 0, "megatron": 8}[strategy] * (1 + (RECOMPUTE in extra)), run
        gathered = layout(actor_config(models[model], run), processes).gather(
            DP_COMPUTE_PROTO, [result for result, _, _ in results], {}
        )
        metrics[run] = gathered.meta_info["metrics"]
    for run, reference in REFERENCE.items():
        for key in ("actor/pg_loss", "actor/entropy"):
            assert metrics[run][key] == pytest.approx(metrics[reference][key], abs=1e-5), (run, key)
        assert metrics[run]["actor/grad_norm"] == pytest.approx(metrics[reference]["actor/grad_norm"], rel=1e-4), run
