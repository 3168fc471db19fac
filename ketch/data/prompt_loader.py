"""`PromptLoader`: batches of prompts in a seeded order per epoch, with a state that makes resume exact."""

from __future__ import annotations

import numpy as np

from ketch.data.errors import DatasetError
from ketch.protocol import DataProto


class PromptLoader:
    """Yields `DataProto` batches of `batch_size` prompts; epoch e uses the permutation seeded by (seed, e).

    The position (epoch, batch within it) is the whole state: after `load_state_dict`, the next batch is
    the first one not yet seen. A last partial batch of an epoch is dropped."""

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0):
        if len(dataset) < batch_size:
            raise DatasetError(
                f"the training set has {len(dataset)} prompts, fewer than one batch "
                f"(data.train_batch_size={batch_size}); lower the batch size or add data"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch, self.batch_index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self) -> DataProto:
        """The next batch; rolls over into the next epoch when this one is used up."""
        epoch, index = self._next_position()
        self.epoch, self.batch_index = epoch, index + 1
        return self._batch(epoch, index)

    def peek(self) -> DataProto:
        """The batch that `next_batch` will return next, without moving."""
        return self._batch(*self._next_position())

    def _next_position(self) -> tuple[int, int]:
        """(epoch, batch index) of the next batch."""
        if self.batch_index == self.batches_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.batch_index

    def _batch(self, epoch: int, index: int) -> DataProto:
        rows = self._order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        batch = DataProto.from_single_dict(self.dataset.collate([self.dataset[int(i)] for i in rows]))
        batch.meta_info["epoch"] = epoch
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_index, self.seed = state["epoch"], state["batch_index"], state["seed"]
