"""The weight bridge over NCCL: one process (the group's construction and a broadcast to itself), and a sender
on GPU 0 with a receiver on GPU 1, the standalone rollout's layout on two GPUs."""

from __future__ import annotations

import pytest
from test_weight_bridge import check_received, run_bridge


def test_an_nccl_bridge_of_one_process_opens_and_checks_the_specs(tmp_path):
    run_bridge(1, "cuda", tmp_path)
    check_received(1, tmp_path)


@pytest.mark.gpus(2)
def test_a_receiver_on_the_second_gpu_gets_every_version_bit_for_bit(tmp_path):
    run_bridge(2, "cuda", tmp_path)
    check_received(2, tmp_path)
