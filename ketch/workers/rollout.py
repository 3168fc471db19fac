"""`RolloutWorker`: a standalone rollout (`rollout.placement=standalone`). The rollout engine has processes (and
devices) of its own, so it never sleeps for training; it takes the actor's weights over a `WeightBridge`."""

from __future__ import annotations

import time

from ketch.config.schema import KetchConfig
from ketch.controller import ONE_TO_ALL, PROCESS_COMPUTE_PROTO, Worker, register
from ketch.models import load_tokenizer, resolve_dtype
from ketch.protocol import DataProto
from ketch.workers.common import DeviceMemory, rollout_engine, setup_process
from ketch.workers.weight_bridge import WeightBridge

SEED_OFFSET = 1_000_003
"""Added to `trainer.seed` so that the rollout processes' random streams differ from the actor ranks'."""


class RolloutWorker(DeviceMemory, Worker):
    """Generates from `model_path` until the first weights arrive, then from the actor's."""

    def __init__(self, config: KetchConfig, model_path: str):
        super().__init__()
        self.config, self.model_path = config, model_path
        self.bridge: WeightBridge | None = None

    @register(ONE_TO_ALL)
    def init_model(self) -> None:
        c = self.config
        seed = c.trainer.seed + SEED_OFFSET
        self.device = setup_process(c.trainer.device, seed)
        dtype = resolve_dtype(c.model.dtype, self.device)
        tokenizer = load_tokenizer(
            c.model.tokenizer_path or self.model_path, c.model.trust_remote_code, self.model_path
        )
        self.rollout = rollout_engine(c, self.model_path, tokenizer, dtype, self.device, seed + self.rank)

    @register(PROCESS_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample responses for this process's prompts (see `Rollout.generate` for the fields)."""
        return self.rollout.generate(prompts).to("cpu")

    @register(PROCESS_COMPUTE_PROTO)
    def warm_up_rollout(self, prompts: DataProto) -> None:
        """`Rollout.warm_up` on this process's share of `prompts`, split as `generate_sequences` splits them."""
        self.rollout.warm_up(prompts)

    @register(ONE_TO_ALL)
    def join_weight_bridge(self, host: str, port: int) -> None:
        """Open bridge rank 1 + this rank (the actor's rank 0 is rank 0) and wait for the weights' specs."""
        self.bridge = WeightBridge(host, port, 1 + self.rank, 1 + self.world_size, self.device)
        self.bridge.fetch_specs()

    @register(ONE_TO_ALL)
    def receive_weights(self) -> float:
        """Load the weights the actor's rank 0 sends now; returns the seconds it took."""
        start = time.perf_counter()
        self.rollout.update_weights(self.bridge.receive())
        return time.perf_counter() - start

    @register(ONE_TO_ALL)
    def weight_norm(self, name: str) -> float:
        """The norm of one parameter as the rollout engine holds it."""
        return self.rollout.weight_norm(name)
