"""The Triton decode-attention kernel (`ketch/rollout/decode_kernel.py`), run by Triton's interpreter on the CPU,
over a paged cache against PyTorch's attention over the filled slots, in one chunk and split over the cache."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from interpreted import interpreted

pytest.importorskip("triton")

CASES = textwrap.dedent(
    """
    import json, sys, torch
    from ketch.rollout.decode_kernel import decode_attention
    from ketch.rollout.kv_pages import as_pages

    def case(rows, head_dim, splits, window, fp8=False, merge_block=16):
        g = torch.Generator().manual_seed(rows)
        kv_heads, group, length, slot = 2, 7, 300, 260
        q = torch.randn(rows, kv_heads, group, head_dim, generator=g)
        k, v = (torch.randn(rows, kv_heads, length, head_dim, generator=g) for _ in range(2))
        filled = torch.zeros(rows, length, dtype=torch.bool)
        for row in range(rows):
            filled[row, [0, 140, slot, 3][row % 4] : slot + 1 : 1 + (row % 4 == 3)] = True
        if window:  # a sliding window of `window` slots back from the new token's
            filled &= torch.arange(length) > slot - window
        filled[:, slot + 1 :] = True  # past the new token's slot: never read, even where marked filled
        k[:, :, slot + 1 :] = float("nan")
        v[:, :, slot + 1 :] = float("nan")
        (k_pool, table), (v_pool, _) = as_pages(k), as_pages(v)  # 3 pages of 128 slots a row, in reverse order
        if fp8:  # an FP8 cache: the kernel computes in the queries' dtype on the rounded keys and values
            k_pool, v_pool = k_pool.to(torch.float8_e4m3fn), v_pool.to(torch.float8_e4m3fn)
            k, v = (t.to(torch.float8_e4m3fn).float() for t in (k, v))
        for row in range(rows):  # pages wholly of left padding: the scratch page, as `KVPages` leaves them
            table[row, : [0, 140, slot, 3][row % 4] // 128] = 0
        if rows > 1:
            table[1] = 0  # a row that holds no page (finished) reads nothing
        out = decode_attention(q, k_pool, v_pool, table, filled, torch.tensor([slot]), 0.3, splits=splits,
                               merge_block=merge_block)
        seen = filled[:, None, None, : slot + 1]
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, : slot + 1], v[:, :, : slot + 1], attn_mask=seen, scale=0.3
        )
        attended = [row for row in range(rows) if row != 1 or rows == 1]
        result = {
            "max_diff": (out[attended] - expected[attended]).abs().max().item(),
            "shape": list(out.shape),
            "finite": bool(out.isfinite().all()),
        }
        if rows > 1:
            result["no_page_max"] = out[1].abs().max().item()
        if rows > 2:
            result["only_slot_diff"] = (out[2] - v[2, :, slot : slot + 1]).abs().max().item()
        return result

    print(json.dumps([case(*args) for args in json.loads(sys.argv[1])]))
    """
)


def run_cases(cases: list[tuple]) -> list[dict]:
    """The kernel on each `(rows, head_dim, splits, window)` in one interpreted process (imports once)."""
    return interpreted(CASES, json.dumps(cases))


def test_kernel_attends_over_the_filled_slots_up_to_the_new_token_only():
    """4 rows x 2 key/value heads x 7 query heads each, 300 cache slots of which 261 up to the new token's slot:
    no padding, left padding past the first block of 128 slots, a row that sees its new token only, gaps (a page of
    left padding is the scratch page in its table); NaN past the slot is never read, and a row whose table names no
    page gives zeros. Head size 80 (Phi's) is computed in
    128 lanes with the last 48 masked; one chunk."""
    for head_dim, result in zip((16, 80), run_cases([(4, 16, 1, 0), (4, 80, 1, 0)]), strict=True):
        assert result["shape"] == [4, 2, 7, head_dim] and result["finite"]
        assert result["max_diff"] < 1e-5 and result["only_slot_diff"] < 1e-6
        assert result["no_page_max"] == 0.0


SPLIT_CASES = [
    (1, 16, 2, 0),  # one row: the cache in two chunks of 256 and 5 slots (whole blocks of 128)
    (1, 16, 8, 0),  # 8 chunks of one block: the last 5 hold nothing and merge as nothing
    (1, 16, 20, 0),  # 20 chunks, merged in two blocks of 16 splits, the second's last 12 masked
    (4, 16, 3, 0),  # three chunks of one block each, the left padding of row 1 wholly inside the second
    (4, 80, 3, 0),
    (8, 16, 4, 0),  # two rows of each padding pattern
    (4, 16, 3, 100),  # a sliding window: slots 161..260 only, across the second and third chunks
    (8, 16, 2, 40),
]


def test_an_fp8_cache_is_read_as_its_rounded_keys_and_values():
    """Pools in float8 e4m3 (`rollout.kv_cache_dtype=fp8`), in one chunk and split: SDPA over the same rounded keys
    and values in float32, to 1e-5."""
    for result in run_cases([(4, 16, 1, 0, True), (4, 16, 3, 0, True)]):
        assert result["finite"] and result["max_diff"] < 1e-5, result


def test_split_kv_attention_equals_attention_over_the_whole_cache():
    """The cache split into chunks whose outputs merge by their log-sum-exps: at 1, 4 and 8 rows, 2 to 20 splits
    (some of them empty), head sizes 16 and 80, with and without a sliding window, the same attention as SDPA over
    the filled slots, to 1e-5 in float32; a row with no page still gives zeros."""
    for case, result in zip(SPLIT_CASES, run_cases(SPLIT_CASES), strict=True):
        rows, head_dim, _, _ = case
        assert result["shape"] == [rows, 2, 7, head_dim] and result["finite"], case
        assert result["max_diff"] < 1e-5, (case, result)
        assert result.get("no_page_max", 0.0) == 0.0, (case, result)


def test_the_merge_takes_the_splits_in_blocks_of_any_power_of_two():
    """20 splits merged in one block of 32 (the last 12 masked) or 128, and 3 in blocks of 2 (the second half
    masked): the same attention as SDPA, to 1e-5."""
    for result in run_cases([(1, 16, 20, 0, False, 128), (4, 16, 3, 0, False, 2), (1, 16, 20, 0, False, 32)]):
        assert result["finite"] and result["max_diff"] < 1e-5, result


def test_splits_fill_the_gpu_only_where_rows_and_heads_do_not():
    """On 132 SMs (an H100/H200), 4 programs a SM: 1 row x 2 key/value heads at 32k slots takes 128 chunks of 256
    slots; 4 rows 66; 64 rows at 4k 5; the fixed workload's 64 rows of 384 slots stay in one chunk, as do 512
    slots (fewer than two chunks' minimum), and 256 rows at 32k."""
    from ketch.rollout.decode_kernel import split_count

    assert split_count(1, 2, 32768, 132) == 128
    assert split_count(4, 2, 32768, 132) == 66
    assert split_count(64, 2, 4096, 132) == 5
    assert split_count(64, 2, 384, 132) == 1
    assert split_count(1, 2, 511, 132) == 1
    assert split_count(256, 2, 32768, 132) == 2
    assert split_count(1, 2, 32768, 1) == 2


def test_kernel_takes_head_sizes_of_16_to_256_and_float_caches():
    from ketch.rollout.decode_kernel import fits

    pool = torch.zeros(5, 2, 128, 64, dtype=torch.bfloat16)
    assert fits(torch.zeros(2, 2, 7, 64, dtype=torch.bfloat16), pool, pool)
    odd = torch.zeros(5, 2, 128, 80)
    assert fits(torch.zeros(2, 2, 7, 80, dtype=torch.bfloat16), odd, odd)
    assert not fits(torch.zeros(2, 2, 7, 8), torch.zeros(5, 2, 128, 8), torch.zeros(5, 2, 128, 8))
    assert not fits(torch.zeros(2, 2, 7, 320), torch.zeros(5, 2, 128, 320), torch.zeros(5, 2, 128, 320))
    assert not fits(torch.zeros(2, 2, 7, 64, dtype=torch.float64), pool, pool)
    assert not fits(torch.zeros(2, 2, 7, 64, dtype=torch.bfloat16), pool, pool.transpose(-1, -2))
