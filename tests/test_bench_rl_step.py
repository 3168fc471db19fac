"""The bookkeeping of `benchmarks/rl_step.py`: throughput from each step's real tokens, MFU over every GPU."""

from __future__ import annotations

import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest

from ketch.config import load_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_step.py"


@pytest.fixture(scope="module")
def rl_step():
    spec = importlib.util.spec_from_file_location("rl_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(step: float, gen: float, update: float, tokens: int, mean_response: float) -> dict:
    timings = {"gen": gen, "reward": 0.5, "adv": 0.1, "update_actor": update, "step": step, "weight_sync": 0.2}
    return {f"timing_s/{k}": v for k, v in timings.items()} | {
        "perf/total_num_tokens": tokens,
        "response_length/mean": mean_response,
    }


def test_throughputs_come_from_each_steps_real_tokens_and_mfu_from_every_gpu(rl_step):
    records = [record(4.0, 2.0, 1.0, 1000, 50.0), record(5.0, 3.0, 1.5, 1500, 60.0)]
    args = Namespace(
        variant="grpo", workload="variable", scale="small", device="cuda", set=[], memory_cap_gib=None, lora_rank=0
    )
    config = load_config(overrides=["trainer.device=cuda", "trainer.n_gpus_per_node=2"])
    result = rl_step.summarize(records, rl_step.SCALES["small"], args, rows=10, config=config)
    assert result["tokens_per_step"] == 1250  # median of 1000 and 1500
    assert result["response_tokens_per_step"] == 550  # 10 rows x 50 and x 60
    assert result["tokens_per_s"] == pytest.approx(275)  # median of 1000 / 4 and 1500 / 5
    assert result["decode_tokens_per_s"] == pytest.approx(225)  # median of 500 / 2 and 600 / 3
    assert result["seconds"]["step"] == 4.5
    assert result["seconds"]["overhead"] == pytest.approx(4.5 - (2.5 + 0.5 + 0.1 + 1.25))
    # small scale: 2 x (128 x (128 + 2 x 32 x 2) + 128^2 + 3 x 128 x 512) + 2048 x 128 = 753,664 parameters;
    # 6 x 753,664 x 1000 tokens per 1.0 s (and per 1.5 s for 1500) over 2 GPUs of 989 TFLOP/s
    assert result["parameters"] == 753_664
    assert result["update_mfu"] == pytest.approx(6 * 753_664 * 1000 / (2 * 989e12))


def test_a_generation_started_ahead_is_outside_the_step_and_mfu_counts_the_actors_gpus_only(rl_step):
    records = [record(4.0, 2.0, 1.0, 1000, 50.0) | {"timing_s/wait_gen": 0.3}]
    args = Namespace(
        variant="grpo", workload="fixed", scale="small", device="cuda", set=[], memory_cap_gib=None, lora_rank=0
    )
    overrides = ["trainer.device=cuda", "rollout.placement=standalone", "rollout.staleness=1"]
    result = rl_step.summarize(records, rl_step.SCALES["small"], args, rows=10, config=load_config(overrides=overrides))
    assert result["devices"] == 2  # one GPU for the actor, one for the rollout
    # the step less adv, the update, the wait for the generation and the standalone weight hand-off
    assert result["seconds"]["overhead"] == pytest.approx(4.0 - (0.1 + 1.0 + 0.3 + 0.2))
    assert result["update_mfu"] == pytest.approx(6 * 753_664 * 1000 / (1 * 989e12))


def test_lora_trains_adapters_and_its_mfu_counts_no_weight_gradients(rl_step, tmp_path):
    args = Namespace(
        variant="ppo", workload="fixed", scale="small", device="cuda", set=[], memory_cap_gib=None, lora_rank=64
    )
    given = rl_step.overrides(rl_step.SCALES["small"], tmp_path / "model", tmp_path / "data", args, 2, tmp_path)
    assert {"actor.lora.rank=64", "critic.lora.rank=64", "actor.optim.lr=1e-5"} <= set(given)
    config = load_config(overrides=["trainer.device=cuda"])
    result = rl_step.summarize([record(4.0, 2.0, 1.0, 1000, 50.0)], rl_step.SCALES["small"], args, 10, config)
    # the forward and the activations' gradients: 4 x 753,664 parameters x 1000 tokens per 1.0 s on one GPU
    assert result["lora_rank"] == 64 and result["update_mfu"] == pytest.approx(4 * 753_664 * 1000 / 989e12)


def test_variable_workload_stops_on_one_token_id_in_stop_every(rl_step):
    assert rl_step.workload_overrides("fixed", 2048) == ["rollout.ignore_eos=true"]
    ignore, stops = rl_step.workload_overrides("variable", 300)
    assert ignore == "rollout.ignore_eos=false"
    assert stops == "rollout.stop_token_ids=[3,131,259]"
    # 32k-token reasoning responses: one id in 8,192, so about one stop per 8,192 sampled tokens
    assert rl_step.stop_every(32768) == 8192 and rl_step.stop_every(256) == 128
    assert rl_step.workload_overrides("variable", 20000, 32768)[1] == "rollout.stop_token_ids=[3,8195,16387]"


def test_the_first_step_profile_lists_the_functions_that_ran_by_cumulative_and_own_time(rl_step, tmp_path):
    def marked_work():
        return sum(range(10_000))

    with rl_step.host_profiled(None):  # no file: nothing profiled
        marked_work()
    out = tmp_path / "first_step.txt"
    with rl_step.host_profiled(str(out)):
        assert marked_work() == 49_995_000
    text = out.read_text()
    assert "marked_work" in text
    assert "Ordered by: cumulative time" in text and "Ordered by: internal time" in text
    assert list(tmp_path.iterdir()) == [out]
