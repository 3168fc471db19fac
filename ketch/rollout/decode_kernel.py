"""A Triton kernel for the static decoder's one-token attention on GPUs, split over the KV cache (split-KV).

Each program attends the query heads that share one key/value head, as one block of queries, over one chunk of a
row's KV cache: programs `(row, key/value head, split)`, the cache from its first slot to the new token's slot cut
into `splits` chunks of whole blocks. The unfilled end of the cache is never read. The cache is paged
(`kv_pages.py`): the row's n-th page of slots is at the pool page its table row names; a row whose table names no
page for the new token's slot (a finished row, or one that pads a batch) reads nothing, and the pages of a row's
left padding are the scratch page, masked. Keys come in blocks of slots within a page
(`_blocks`); the softmax is accumulated online (running maximum and sum), in float32. Masked slots (left padding,
a sliding window's past) score -inf and are not read. With more than one split, each chunk's normalised output and
its log-sum-exp go to float32 buffers that a second kernel merges (`_merge`). The split count depends only on the
shape (rows, key/value heads, cache length) and the GPU's SM count (`split_count`), so a CUDA graph captured for a
shape holds it; a chunk's length follows the new token's slot, read on the device.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

MIN_SPLIT_SLOTS = 256
"""The fewest cache slots a split is given: shorter chunks would spend more on the merge than they save."""
PROGRAMS_PER_SM = 4
"""Programs per SM that the splits aim for: a few rows at long context fill the GPU instead of a handful of SMs."""
MERGE_BLOCK = 128
"""Splits `_merge` loads at a time (fewer where there are fewer, or where a block would pass `MERGE_ELEMENTS`): at
1 row x 32k on an H100 (128 splits) a layer's attention took 16.3 µs loading 16 at a time and 13.2 µs loading all
128 (1.91x the memory floor), at 4 rows 36.2 against 33.6 µs (`decode_step.py --floor`, 2026-12-07)."""
MERGE_ELEMENTS = 8192
"""The most split outputs' numbers one merge load holds (128 splits of a head size of 64, as measured)."""


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a head size of 16 to 256 (one that is not a power of two, as Phi's 80
    and 96, is computed in the next power of two with its tail masked), a float dtype, pools of keys and values
    `[pages, kv_heads, page, head_dim]` with contiguous head dimensions."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return 16 <= query.shape[-1] <= 256 and query.dtype in dtypes and key.stride(-1) == value.stride(-1) == 1


def split_count(rows: int, kv_heads: int, length: int, sms: int) -> int:
    """Chunks to split each (row, key/value head)'s cache of `length` slots into, on a GPU of `sms` SMs: enough
    programs for `PROGRAMS_PER_SM` a SM, chunks of at least `MIN_SPLIT_SLOTS` slots, 1 where the rows and heads
    alone fill the GPU (the fixed workload's 64 rows of a few hundred slots)."""
    wanted = -(-PROGRAMS_PER_SM * sms // (rows * kv_heads))
    return max(1, min(wanted, length // MIN_SPLIT_SLOTS))


def sm_count(tensor: torch.Tensor) -> int:
    """The SMs of the CUDA device that holds `tensor`; 1 for a CPU tensor (Triton's interpreter)."""
    return _sms(tensor.device.index or 0) if tensor.is_cuda else 1


@cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    filled: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    blocks: dict | None = None,
    splits: int | None = None,
    merge_block: int = MERGE_BLOCK,
) -> torch.Tensor:
    """`query` `[rows, kv_heads, group, head_dim]` (the query heads of each key/value head) against the paged cache:
    pools `key`/`value` `[pages, kv_heads, page, head_dim]` under `table` `[rows, length / page]`, where `filled`
    `[rows, length]` (bool) and up to the slot `slot` `[1]`; returns `[rows, kv_heads, group, head_dim]` in
    `query`'s dtype (zeros in rows whose table names no page). `blocks` overrides the launch settings of `_blocks`
    (`BLOCK_N`, which must divide the page, `num_stages`, `num_warps`: what `benchmarks/decode_step.py --sweep`
    tries), `splits` the split count of `split_count` (`--floor` times one split against it; CPU tensors, under
    Triton's interpreter, count as one SM) and `merge_block` the splits the merge loads at a time (a power of two)."""
    rows, kv_heads, group, head_dim = query.shape
    blocks = blocks or _blocks(head_dim)
    if key.shape[2] % blocks["BLOCK_N"]:
        raise ValueError(f"decode attention: blocks of {blocks['BLOCK_N']} slots do not divide pages of {key.shape[2]}")
    if splits is None:
        splits = split_count(rows, kv_heads, filled.shape[1], sm_count(query))
    query, sizes = query.contiguous(), _sizes(group, head_dim)
    out = lse = torch.empty_like(query)  # lse: unused with one split
    if splits > 1:
        out = query.new_empty(rows, kv_heads, splits, group, head_dim, dtype=torch.float32)
        lse = query.new_empty(rows, kv_heads, splits, group, dtype=torch.float32)
    filled = filled.view(torch.uint8) if filled.dtype == torch.bool else filled
    _decode_attention[(rows, kv_heads, splits)](
        query,
        key,
        value,
        table,
        filled,
        slot,
        out,
        lse,
        scale,
        *key.stride()[:3],
        *value.stride()[:3],
        table.stride(0),
        filled.stride(0),
        filled.stride(1),
        SPLITS=splits,
        PAGE=key.shape[2],
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # float32 without TF32's rounding
        **sizes,
        **blocks,
    )
    if splits == 1:
        return out
    merged = torch.empty_like(query)
    pad = triton.next_power_of_2(splits)
    heads = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "DIM_PAD": sizes["DIM_PAD"],
        "SPLIT_BLOCK": min(pad, merge_block, MERGE_ELEMENTS // sizes["DIM_PAD"]),
    }
    _merge[(rows, kv_heads, group)](out, lse, merged, SPLITS=splits, SPLITS_PAD=pad, **heads)
    return merged


def _sizes(group: int, head_dim: int) -> dict:
    """The query heads of a key/value head and the head size, each as it is and padded to a power of two."""
    return {
        "GROUP": group,
        "GROUP_PAD": max(16, triton.next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "DIM_PAD": triton.next_power_of_2(head_dim),
    }


def _blocks(head_dim: int) -> dict:
    """Cache slots per block of keys and the blocks loaded ahead. At head size 64 on an H200 (64 rows, 320 of
    384 slots) 128 slots, two blocks ahead took 6.7 µs against 8.4 µs for 64 slots; larger heads keep 64 slots,
    whose tiles fit the shared memory of smaller GPUs."""
    return {"BLOCK_N": 128, "num_stages": 2} if head_dim <= 64 else {"BLOCK_N": 64, "num_stages": 3}


@triton.jit
def _decode_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    filled_ptr,
    slot_ptr,
    out_ptr,
    lse_ptr,
    scale,
    k_page,
    k_head,
    k_slot,
    v_page,
    v_head,
    v_slot,
    table_row,
    filled_row,
    filled_slot,
    SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_N)
    q_offsets = ((row * tl.num_programs(1) + head) * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
    # a power of two has no lane to mask: those sizes compile as measured before other sizes were taken
    dims = tl.full([1, DIM_PAD], 1, tl.int1) if DIM_PAD == HEAD_DIM else d[None, :] < HEAD_DIM
    q_mask = (g[:, None] < GROUP) & dims
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    slot = tl.load(slot_ptr)
    paged = tl.load(table_ptr + row * table_row + slot // PAGE) != 0  # the scratch page: the row holds none
    end = tl.where(paged, slot + 1, 0)
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N  # whole blocks: a block never straddles two pages
    first = split * chunk
    last = tl.minimum(first + chunk, end)
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(first, last, BLOCK_N):
        slots = start + n
        seen = tl.load(filled_ptr + row * filled_row + slots * filled_slot, mask=slots < last, other=0) != 0
        kv_mask = seen[:, None] & dims
        page = tl.load(table_ptr + row * table_row + start // PAGE)
        within = (start % PAGE + n)[:, None]
        k = tl.load(k_ptr + page * k_page + head * k_head + within * k_slot + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # an FP8 cache (rollout.kv_cache_dtype) computes in the queries' dtype
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a block with no slot seen yet adds nothing
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(top - shift)
        v = tl.load(v_ptr + page * v_page + head * v_head + within * v_slot + d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        total = total * rescale + tl.sum(weights, 1)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # nothing seen: zeros
    part = ((row * tl.num_programs(1) + head) * SPLITS + split) * GROUP + g
    tl.store(out_ptr + part[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if SPLITS > 1:
        tl.store(lse_ptr + part, top + tl.log(total), mask=g < GROUP)  # -inf where nothing was seen


@triton.jit
def _merge(
    part_ptr,
    lse_ptr,
    out_ptr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """One query head of one row: its splits' outputs `[SPLITS, HEAD_DIM]`, weighed by the exponentials of their
    log-sum-exps against the largest, as one softmax over the whole cache would have weighed them. The log-sum-exps
    load as one vector and the outputs in blocks of `SPLIT_BLOCK` splits: a few rows' merge is a few loads deep."""
    head = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)  # (row, key/value head)
    g = tl.program_id(2)
    lse_at = lse_ptr + head * SPLITS * GROUP + g  # split s's log-sum-exp at lse_at + s * GROUP
    part_at = part_ptr + (head * SPLITS * GROUP + g) * HEAD_DIM  # and its output at part_at + s * GROUP * HEAD_DIM
    s = tl.arange(0, SPLITS_PAD)
    top = tl.max(tl.load(lse_at + s * GROUP, mask=s < SPLITS, other=float("-inf")), 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, DIM_PAD)
    b = tl.arange(0, SPLIT_BLOCK)
    total = tl.zeros([SPLIT_BLOCK], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for first in range(0, SPLITS, SPLIT_BLOCK):
        split = first + b
        weight = tl.exp(tl.load(lse_at + split * GROUP, mask=split < SPLITS, other=float("-inf")) - shift)
        mask = (split[:, None] < SPLITS) & (d[None, :] < HEAD_DIM)
        part = tl.load(part_at + split[:, None] * GROUP * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        acc += tl.sum(weight[:, None] * part, 0)
        total += weight
    total = tl.sum(total, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (head * GROUP + g) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
