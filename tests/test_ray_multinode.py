"""Multi-node placement on one machine: a Ray cluster of two simulated nodes (separate raylets)."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from ketch.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_nnodes_2_places_one_rank_on_each_node_and_trains(two_nodes, tiny_config):
    config = tiny_config(
        "trainer.nnodes=2",
        "trainer.n_cpu_workers=1",
        f"trainer.ray_address={two_nodes.address}",
        "trainer.total_steps=2",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
    )
    trainer = PPOTrainer(config)
    trainer._open()
    places = trainer.groups.owned[0].places
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len({places[rank]["node_id"] for rank in (0, 1)}) == 2
    assert {places[rank]["node_id"] for rank in (0, 1)} == alive
    for step in (1, 2):
        trainer.step = step
        metrics = trainer._train_step(trainer.loader.next_batch(), 1)
    trainer.groups.shutdown()
    assert trainer.plan.world_size == 2
    assert "actor/pg_loss" in metrics


def test_more_nodes_than_the_cluster_has_is_a_clear_error(two_nodes, tiny_config):
    config = tiny_config(
        "trainer.nnodes=3",
        f"trainer.ray_address={two_nodes.address}",
        "trainer.total_steps=1",
        "data.train_batch_size=9",
    )
    with pytest.raises(RuntimeError, match=r"trainer.nnodes=3 needs 3 Ray nodes .* the cluster has 2 alive node"):
        PPOTrainer(config)._open()
