"""Data-parallel dispatch over a tensor/pipeline-parallel grid: peers of one data-parallel rank get the same
piece, and only one of them returns it (the seed's ONE_TO_ALL / DP_COMPUTE_PROTO contract); generation splits
over every process instead, so that no prompt is generated twice (PROCESS_COMPUTE_PROTO)."""

from __future__ import annotations

import os

import pytest
import torch

from ketch.controller import (
    DP_COMPUTE_PROTO,
    ONE_TO_ALL,
    PROCESS_COMPUTE_PROTO,
    DataParallelLayout,
    Worker,
    register,
    registered_methods,
)
from ketch.engine.megatron.grid import RankGrid
from ketch.protocol import DataProto

# 8 processes = TP 2 x DP 2 x PP 2 in Megatron's order (tensor innermost, pipeline outermost)
TP2_DP2_PP2 = [RankGrid(rank, world=8, tp=2, pp=2).dispatch_rank() for rank in range(8)]


def test_megatron_grid_puts_tensor_ranks_innermost_and_pipeline_outermost():
    coords = [(g.tp_rank, g.dp_rank, g.pp_rank) for g in (RankGrid(r, world=8, tp=2, pp=2) for r in range(8))]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    # the results of a data-parallel rank come from its last pipeline stage, tensor rank 0: processes 4 and 6
    assert TP2_DP2_PP2 == [(0, False), (0, False), (1, False), (1, False), (0, True), (0, False), (1, True), (1, False)]


def test_every_peer_gets_its_data_parallel_piece_and_collectors_return_it():
    layout = DataParallelLayout.from_ranks(TP2_DP2_PP2)
    assert (layout.world_size, layout.dp_size) == (8, 2)
    calls, context = layout.plan(DP_COMPUTE_PROTO, (DataProto.from_dict({"x": torch.arange(5)}),), {})
    # 5 rows padded to 6: data-parallel rank 0 gets rows 0-2, rank 1 rows 3, 4 and a pad copy
    assert [c[0][0].batch["x"].tolist() for c in calls] == [[0, 1, 2]] * 2 + [[3, 4, 0]] * 2 + [[0, 1, 2]] * 2 + [
        [3, 4, 0]
    ] * 2
    # each process returns its piece + 10 x its process rank: only processes 4 (dp 0) and 6 (dp 1) are read
    results = [DataProto.from_dict({"y": c[0][0].batch["x"] + 10 * p}) for p, c in enumerate(calls)]
    assert layout.gather(DP_COMPUTE_PROTO, results, context).batch["y"].tolist() == [40, 41, 42, 63, 64]


def test_generation_gives_every_process_its_own_piece_and_reads_every_result():
    layout = DataParallelLayout.from_ranks(TP2_DP2_PP2)
    calls, context = layout.plan(PROCESS_COMPUTE_PROTO, (DataProto.from_dict({"x": torch.arange(7)}),), {})
    # 7 rows padded to 8: process p gets row p, process 7 a pad copy of row 0
    assert [c[0][0].batch["x"].tolist() for c in calls] == [[0], [1], [2], [3], [4], [5], [6], [0]]
    results = [DataProto.from_dict({"y": c[0][0].batch["x"] + 10 * p}) for p, c in enumerate(calls)]
    assert layout.gather(PROCESS_COMPUTE_PROTO, results, context).batch["y"].tolist() == [0, 11, 22, 33, 44, 55, 66]


def test_actor_generates_over_processes_and_scores_over_data_parallel_ranks():
    """The actor worker's own registrations on a TP=2 x DP=2 grid (4 GPUs): 8 prompts are generated 2 per
    process, each once; the generated 8 rows are scored 4 per data-parallel rank, tensor peers alike."""
    from ketch.config import load_config
    from ketch.workers.actor import ActorRolloutRefWorker
    from ketch.workers.common import role_dispatch_rank

    sizes = ["actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4"]
    config = load_config(overrides=["actor.strategy=megatron", *sizes])
    layout = DataParallelLayout.from_ranks([role_dispatch_rank(r, 4, config.actor) for r in range(4)])
    methods = registered_methods(ActorRolloutRefWorker)
    rows = (DataProto.from_dict({"x": torch.arange(8)}),)
    generate, _ = layout.plan(methods["generate_sequences"].dispatch, rows, {})
    assert [c[0][0].batch["x"].tolist() for c in generate] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    score, _ = layout.plan(methods["compute_log_prob"].dispatch, rows, {})
    assert [c[0][0].batch["x"].tolist() for c in score] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2


def test_one_to_all_still_reaches_and_returns_every_process():
    layout = DataParallelLayout.from_ranks(TP2_DP2_PP2)
    calls, context = layout.plan(ONE_TO_ALL, ("ping",), {})
    assert calls == [(("ping",), {})] * 8
    assert layout.gather(ONE_TO_ALL, list(range(8)), context) == list(range(8))


def test_a_data_parallel_rank_without_one_collector_is_refused_naming_the_role():
    with pytest.raises(
        ValueError, match=r"actor: data-parallel ranks \[0, 0, 1, 1\] with collectors at processes \[0, 1, 2\]"
    ):
        DataParallelLayout.from_ranks([(0, True), (0, True), (1, True), (1, False)], role="actor")


class GridProbe(Worker):
    """A rank of a fake TP=2 x DP=2 grid (no model): records what it was given."""

    def __init__(self):
        self.seen: list[int] = []

    def dispatch_rank(self) -> tuple[int, bool]:
        return RankGrid(self.rank, self.world_size, tp=2, pp=1).dispatch_rank()

    @register(DP_COMPUTE_PROTO)
    def tag(self, data: DataProto) -> DataProto:
        self.seen = data.batch["x"].tolist()
        return DataProto.from_dict({"x": data.batch["x"], "rank": torch.full((len(data),), self.rank)})

    @register(PROCESS_COMPUTE_PROTO)
    def generate(self, data: DataProto) -> DataProto:
        return self.tag(data)

    @register(ONE_TO_ALL)
    def what_did_you_see(self) -> list[int]:
        return self.seen


@pytest.mark.slow
def test_ray_group_dispatches_over_data_parallel_ranks_of_a_grid():
    ray = pytest.importorskip("ray")
    from ketch.controller.ray_group import RayClassWithInitArgs, RayWorkerGroup
    from ketch.controller.resource_pool import RayResourcePool

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        try:
            group = RayWorkerGroup(RayResourcePool([4]), RayClassWithInitArgs(GridProbe), timeout=120)
            out = group.tag(DataProto.from_dict({"x": torch.arange(4)}))
            seen = group.what_did_you_see()
            generated = group.generate(DataProto.from_dict({"x": torch.arange(4)}))
            seen_generating = group.what_did_you_see()
            group.shutdown()
        finally:
            ray.shutdown()
    # processes 0, 1 are data-parallel rank 0 (rows 0, 1); processes 2, 3 rank 1 (rows 2, 3); tensor rank 0 answers
    assert seen == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert (out.batch["x"].tolist(), out.batch["rank"].tolist()) == ([0, 1, 2, 3], [0, 0, 2, 2])
    # generation: each process its own row, every process answers
    assert seen_generating == [[0], [1], [2], [3]]
    assert (generated.batch["x"].tolist(), generated.batch["rank"].tolist()) == ([0, 1, 2, 3], [0, 1, 2, 3])


@pytest.mark.parametrize(
    ("strategy", "dp_ranks"), [("megatron", [0, 0, 1, 1]), ("fsdp", [0, 1, 2, 3])], ids=["tp2-dp2", "fsdp-dp4"]
)
def test_tensor_peers_shuffle_their_mini_batches_alike(monkeypatch, strategy, dp_ranks):
    """Megatron's tensor peers compute one model on one batch: a rank-seeded shuffle would hand each peer other
    rows (wrong, finite gradients). The seed follows the data-parallel rank: base + 7919 x update + dp rank."""
    from ketch.config import load_config
    from ketch.workers.actor import ActorRolloutRefWorker
    from ketch.workers.common import shuffle_seed

    sizes = ["actor.megatron.tensor_model_parallel_size=2"] if strategy == "megatron" else []
    grpo = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=4"]
    config = load_config(overrides=[f"actor.strategy={strategy}", *grpo, *sizes])
    seeds = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        seeds.append(shuffle_seed(ActorRolloutRefWorker(config, "unused", None, 1), update_count=2))
    assert seeds == [config.trainer.seed + 7919 * 2 + dp for dp in dp_ranks]
