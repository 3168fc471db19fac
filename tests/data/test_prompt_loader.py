"""`PromptLoader.peek`: the batch `next_batch` returns next, across an epoch boundary, without moving."""

from __future__ import annotations

import torch

from ketch.data.prompt_loader import PromptLoader


class Numbers:
    """Prompts 0..n-1; a batch holds their indices."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def collate(self, rows: list[int]) -> dict:
        return {"index": torch.tensor(rows)}


def test_peek_shows_the_next_batch_without_moving_and_rolls_over_epochs_as_next_batch_does():
    loader = PromptLoader(Numbers(5), batch_size=2, shuffle=True, seed=3)  # 2 batches an epoch, 1 prompt dropped
    seen = []
    for _ in range(5):
        state = loader.state_dict()
        peeked = loader.peek()
        assert loader.state_dict() == state
        batch = loader.next_batch()
        assert torch.equal(peeked.batch["index"], batch.batch["index"])
        assert peeked.meta_info["epoch"] == batch.meta_info["epoch"]
        seen.append((batch.meta_info["epoch"], sorted(batch.batch["index"].tolist())))
    assert [epoch for epoch, _ in seen] == [0, 0, 1, 1, 2]
    assert len({i for epoch, rows in seen if epoch == 0 for i in rows}) == 4  # no prompt twice in an epoch
    assert loader.state_dict() == {"epoch": 2, "batch_index": 1, "seed": 3}
