"""The static decoder's paged KV cache (`ketch/rollout/kv_pages.py`): pages go to the rows that decode and come
back from the rows that have finished, compaction moves table rows, a pool that runs out grows with its pages
intact, and decoding through a pool that grows gives the tokens and log-probs of one that never does."""

from __future__ import annotations

import torch
from torch import nn

from ketch.architecture import AttentionShape
from ketch.rollout import kv_pages
from ketch.rollout.kv_pages import PAGE, KVPages


def pages_of(rows: int, length: int) -> KVPages:
    """Two blocks' pools with 1 key/value head of size 4."""
    attentions = [nn.Linear(2, 2), nn.Linear(2, 2)]
    return KVPages(attentions, AttentionShape(heads=2, kv_heads=1, head_dim=4), rows, length, torch.device("cpu"))


def test_pages_go_to_unfinished_rows_and_come_back_from_finished_ones():
    pages = pages_of(rows=4, length=1000)  # 8 pages a row; the pool: the scratch page and 4 x 8
    assert pages.per_row == 8 and pages.pages == 33 and pages.pools[0][0].shape == (33, 1, PAGE, 4)
    assert not pages.assign([0, 1, 2, 3], rows=4, slots=200)  # 2 pages each
    assert pages.held.tolist() == [2, 2, 2, 2] and len(pages.free) == 24
    first = pages.host[:, :2].clone()
    assert sorted(first.flatten().tolist()) == list(range(1, 9))
    assert not pages.assign([1, 3], rows=4, slots=300)  # rows 0 and 2 finished: their 4 pages come back
    assert pages.held.tolist() == [0, 3, 0, 3] and len(pages.free) == 24 + 4 - 2
    assert pages.host[0].tolist() == [0] * 8 and pages.host[2].tolist() == [0] * 8  # the scratch page
    assert torch.equal(pages.host[[1, 3], :2], first[[1, 3]])  # a row keeps its pages
    assert torch.equal(pages.table, pages.host)
    held = pages.host[[1, 3], :3].flatten().tolist()
    assert len(set(held)) == 6 and 0 not in held
    rows_3, rows_1 = pages.host[3].clone(), pages.host[1].clone()
    pages.move([3, 1], rows=4)  # compaction: row 3 first, then row 1; rows 2 and 3 write into the scratch page
    assert torch.equal(pages.host[0], rows_3) and torch.equal(pages.host[1], rows_1)
    assert pages.held.tolist() == [3, 3, 0, 0] and not pages.host[2:].any()
    assert torch.equal(pages.table, pages.host)


def test_a_pool_that_runs_out_grows_with_its_pages_intact(monkeypatch):
    monkeypatch.setattr(kv_pages, "POOL_SLOTS_PER_ROW", PAGE)  # a page a row to begin with
    pages = pages_of(rows=4, length=1000)
    assert pages.pages == 5
    pages.assign([0, 1, 2, 3], rows=4, slots=PAGE)
    page = int(pages.host[2, 0])
    pages.pools[1][1][page] = 7.0
    pages.attentions[0].decode_kv = pages.pools[0]
    assert pages.assign([0, 1, 2, 3], rows=4, slots=3 * PAGE)  # 8 more pages than the 0 free: 5 + 8 = 13 > 2 x 5
    assert pages.pages == 13 and pages.held.tolist() == [3, 3, 3, 3] and pages.free == []
    assert pages.attentions[0].decode_kv is None  # the old pools are not kept alive
    assert (pages.pools[1][1][page] == 7.0).all() and pages.pools[1][1].sum() == 7.0 * PAGE * 4
    assert int(pages.host[2, 0]) == page
    assert sorted(pages.host[:, :3].flatten().tolist()) == list(range(1, 13))
    pages.assign([0], rows=4, slots=8 * PAGE)  # rows 1-3 give back 9 pages, row 0 takes 5: no growth
    assert pages.pages == 13 and len(pages.free) == 4
    pages.assign([0, 1, 2, 3], rows=4, slots=8 * PAGE)  # 24 more, 4 free: doubled to 26 would not do; capped at 33
    assert pages.pages == 33 and pages.free == []


def test_decoding_through_a_pool_that_grows_gives_the_same_tokens_and_log_probs(tiny_model_dir, monkeypatch):
    """8 sampled rows of up to 300 tokens after prompts of 64 slots (3 pages each), lengths spread by a stop
    token, compacting from 16 tokens to go: a pool of one page a row that grows as the rows outgrow it against a
    pool with room for every row's whole length; the same tokens and log-probs, those of a fresh forward of each
    sequence, and the grown pool ends smaller than the whole length's."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model, reference = (load_causal_lm(str(tiny_model_dir), torch.float32).eval() for _ in range(2))
    input_ids = torch.randint(4, 60, (8, 6), generator=torch.Generator().manual_seed(0))
    args = (input_ids, torch.ones_like(input_ids), 300, Sampling(do_sample=True), [5])
    out, pools = {}, {}
    for per_row in (PAGE, 4096):
        monkeypatch.setattr(kv_pages, "POOL_SLOTS_PER_ROW", per_row)
        torch.manual_seed(1)
        decoder = StaticDecoder(model, compile_step=False, buckets=True, compact_remaining=16)
        out[per_row] = decoder.generate(*args, pad_token_id=0)
        pools[per_row] = decoder.caches[(8, 364)].pages.pages
        assert sorted(decoder.caches[(8, 364)].fronts) == [1, 2, 4]
    assert pools == {PAGE: 18, 4096: 1 + 8 * 3}  # 1 + 8 x 1 pages, doubled once
    tokens, log_probs = out[PAGE]
    assert torch.equal(tokens, out[4096][0]) and torch.equal(log_probs, out[4096][1])
    lengths = (log_probs != 0).sum(1)
    assert lengths.tolist() == [48, 116, 144, 4, 172, 300, 16, 104]  # after 64 prompt slots: 1 to 3 pages
    with torch.no_grad():
        logits = reference(torch.cat([input_ids, tokens], 1)).logits[:, 5:-1].log_softmax(-1)
    expected = logits.gather(-1, tokens[:, :, None]).squeeze(-1)
    filled = torch.arange(300) < lengths[:, None]
    torch.testing.assert_close(log_probs[filled], expected[filled], atol=1e-5, rtol=0)


def test_a_rows_pages_begin_at_its_first_real_token():
    """A batch whose rows' real tokens begin at slots 0, 130, 300 and 1000 (left padding): each row gets pages from
    the page of its first real token to the slots asked for, none for the pages of padding before it (the
    scratch page stays in its table there); they come back when it finishes, compaction carries where they begin,
    and the next batch begins afresh."""
    pages = pages_of(rows=4, length=1000)  # 8 pages a row
    pages.assign([0, 1, 2, 3], rows=4, slots=200)  # a batch without padding: 2 pages each
    pages.begin(torch.tensor([0, 130, 300, 999]))
    assert pages.held.tolist() == [0, 0, 0, 0] and len(pages.free) == 32 and not pages.table.any()
    pages.assign([0, 1, 2, 3], rows=4, slots=4 * PAGE)  # slots 0-511: pages 0-3
    assert pages.first.tolist() == [0, 1, 2, 7] and pages.held.tolist() == [4, 3, 2, 0]
    assert (pages.host[0, :4] > 0).all() and pages.host[1, 0] == 0 and (pages.host[1, 1:4] > 0).all()
    assert not pages.host[2, :2].any() and (pages.host[2, 2:4] > 0).all() and not pages.host[:, 4:].any()
    pages.assign([1, 2, 3], rows=4, slots=1000)  # row 0 finished; rows 1-3 to page 7
    assert pages.held.tolist() == [0, 7, 6, 1] and len(pages.free) == 32 - 14 and pages.most_held == 14
    pages.assign([1, 3], rows=4, slots=1000)  # row 2 finished too
    row_3 = pages.host[3].clone()
    pages.move([3, 1], rows=4)
    assert pages.first.tolist() == [7, 1, 0, 0] and pages.held.tolist() == [1, 7, 0, 0]
    assert torch.equal(pages.host[0], row_3) and torch.equal(pages.table, pages.host)
    pages.begin(torch.tensor([0, 0]))  # the next batch: every row's pages back
    assert pages.held.tolist() == [0, 0, 0, 0] and len(pages.free) == 32 and pages.first.tolist() == [0, 0, 0, 0]


def test_left_padding_takes_no_pages_and_decodes_as_the_unpadded_prompt(tiny_model_dir):
    """Prompts of 180, 5 and 60 tokens left-padded to 200 slots, 20 greedy tokens each: the rows hold 2, 1 and 1
    pages (from the page of their first real token: slots 20, 195 and 140), not the 2 each of the padded
    rectangle, and each row's log-probs are those of a fresh forward of its unpadded prompt and tokens."""
    from ketch.models import load_causal_lm
    from ketch.rollout.sampling import Sampling
    from ketch.rollout.static_decoding import StaticDecoder

    model, reference = (load_causal_lm(str(tiny_model_dir), torch.float32).eval() for _ in range(2))
    lengths = [180, 5, 60]
    input_ids = torch.randint(9, 60, (3, 200), generator=torch.Generator().manual_seed(0))
    attention_mask = (torch.arange(200) >= 200 - torch.tensor(lengths)[:, None]).long()
    decoder = StaticDecoder(model, compile_step=False, buckets=False)
    tokens, log_probs = decoder.generate(input_ids * attention_mask, attention_mask, 20, Sampling(False), [], 0)
    pages = decoder.caches[(3, 220)].pages
    assert pages.first.tolist() == [0, 1, 1] and pages.most_held == 4
    for row, length in enumerate(lengths):
        sequence = torch.cat([input_ids[row, 200 - length :], tokens[row]])[None]
        with torch.no_grad():
            logits = reference(sequence).logits[0, length - 1 : -1].log_softmax(-1)
        expected = logits.gather(-1, tokens[row, :, None]).squeeze(-1)
        torch.testing.assert_close(log_probs[row], expected, atol=1e-5, rtol=0)
