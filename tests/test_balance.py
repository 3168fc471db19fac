"""Token balancing over data-parallel ranks."""

from __future__ import annotations

import torch

from ketch.protocol import DataProto
from ketch.trainer.balance import balance_tokens, balanced_order


def test_balanced_order_evens_out_real_tokens_per_rank():
    # contiguous halves would hold 8+1+7 = 16 and 2+6+3 = 11 tokens; longest first, each to the lighter rank
    # with room: 8->A, 7->B, 6->B, 3->A, 2->A (A full), 1->B: A = 8+3+2 = 13, B = 7+6+1 = 14
    assert balanced_order([8, 1, 7, 2, 6, 3], parts=2) == [0, 5, 3, 2, 4, 1]


def test_uneven_rows_fill_the_first_chunks_one_row_longer():
    order = balanced_order([5, 4, 3, 2, 1], parts=2)
    assert sorted(order) == [0, 1, 2, 3, 4] and len(order) == 5
    # chunks of 3 and 2 rows: 5->A, 4->B, 3->B (7), 2->A (7), 1->A (A: 3 rows)
    assert order == [0, 3, 4, 1, 2]


def test_balance_tokens_reorders_every_field_and_leaves_one_rank_alone():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    batch = DataProto.from_dict({"attention_mask": mask, "row": torch.arange(4)})
    assert balance_tokens(batch, 1) is batch
    # lengths 3, 1, 4, 2: 4->A, 3->B, 2->B (the lighter; now full), 1->A: A = 4+1, B = 3+2
    assert balance_tokens(batch, 2).batch["row"].tolist() == [2, 1, 0, 3]
