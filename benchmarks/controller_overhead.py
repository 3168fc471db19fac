"""Overhead of the Ray single controller: an empty DP_COMPUTE_PROTO round trip, and moving a DataProto of
1,000 x 2,000 int64 tokens (16 MB) to 2 workers and back.

    python benchmarks/controller_overhead.py [--workers 2] [--repeats 20] [--out results/controller.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from ketch.controller import DP_COMPUTE_PROTO, Worker, register
from ketch.controller.ray_group import RayClassWithInitArgs, RayWorkerGroup
from ketch.controller.resource_pool import RayResourcePool
from ketch.protocol import DataProto


class Echo(Worker):
    @register(DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    ray.init(num_cpus=max(2, args.workers), include_dashboard=False, logging_level="ERROR")
    group = RayWorkerGroup(RayResourcePool([args.workers]), RayClassWithInitArgs(Echo))
    empty = DataProto.from_dict({"x": torch.zeros(args.workers, 1)})
    tokens = DataProto.from_dict({"input_ids": torch.randint(0, 150_000, (1000, 2000), dtype=torch.int64)})
    results = {
        "workers": args.workers,
        "empty_round_trip_ms": 1000 * median_seconds(lambda: group.echo(empty), args.repeats),
        "tokens_1k_x_2k_round_trip_ms": 1000 * median_seconds(lambda: group.echo(tokens), args.repeats),
        "tokens_megabytes": tokens.batch["input_ids"].numel() * 8 / 1e6,
    }
    group.shutdown()
    ray.shutdown()
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
