"""A Triton kernel for the static decoder's one-token attention on GPUs.

One program per (row, key/value head) attends the query heads that share the key/value head, as one block of
queries, over the row's KV cache from its first slot to the new token's slot and no further: the unfilled end of the
cache is never read. The cache is paged (`kv_pages.py`): the row's n-th page of slots is at the pool page its table
row names. Keys come in blocks of slots within a page (`_blocks`); the softmax is accumulated online (running
maximum and sum), in float32. Masked slots (left padding, a sliding window's past) score -inf and are not read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: a head size of 16 to 256 (one that is not a power of two, as Phi's 80
    and 96, is computed in the next power of two with its tail masked), a float dtype, pools of keys and values
    `[pages, kv_heads, page, head_dim]` with contiguous head dimensions."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return 16 <= query.shape[-1] <= 256 and query.dtype in dtypes and key.stride(-1) == value.stride(-1) == 1


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    filled: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    blocks: dict | None = None,
) -> torch.Tensor:
    """`query` `[rows, kv_heads, group, head_dim]` (the query heads of each key/value head) against the paged cache:
    pools `key`/`value` `[pages, kv_heads, page, head_dim]` under `table` `[rows, length / page]`, where `filled`
    `[rows, length]` (bool) and up to the slot `slot` `[1]`; returns `[rows, kv_heads, group, head_dim]` in
    `query`'s dtype. `blocks` overrides the launch settings of `_blocks` (`BLOCK_N`, which must divide the page,
    `num_stages`, `num_warps`: what `benchmarks/decode_step.py --sweep` tries)."""
    rows, kv_heads, group, head_dim = query.shape
    blocks = blocks or _blocks(head_dim)
    if key.shape[2] % blocks["BLOCK_N"]:
        raise ValueError(f"decode attention: blocks of {blocks['BLOCK_N']} slots do not divide pages of {key.shape[2]}")
    query = query.contiguous()
    out = torch.empty_like(query)
    filled = filled.view(torch.uint8) if filled.dtype == torch.bool else filled
    _decode_attention[(rows, kv_heads)](
        query,
        key,
        value,
        table,
        filled,
        slot,
        out,
        scale,
        *key.stride()[:3],
        *value.stride()[:3],
        table.stride(0),
        filled.stride(0),
        filled.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE=key.shape[2],
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # float32 without TF32's rounding
        **blocks,
    )
    return out


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
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_N)
    q_offsets = ((row * tl.num_programs(1) + head) * GROUP + g[:, None]) * HEAD_DIM + d[None, :]
    # a power of two has no lane to mask: those sizes compile as measured before other sizes were taken
    dims = tl.full([1, DIM_PAD], 1, tl.int1) if DIM_PAD == HEAD_DIM else d[None, :] < HEAD_DIM
    q_mask = (g[:, None] < GROUP) & dims
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    end = tl.load(slot_ptr) + 1
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(0, end, BLOCK_N):
        slots = start + n
        seen = tl.load(filled_ptr + row * filled_row + slots * filled_slot, mask=slots < end, other=0) != 0
        kv_mask = seen[:, None] & dims
        page = tl.load(table_ptr + row * table_row + start // PAGE)
        within = (start % PAGE + n)[:, None]
        k = tl.load(k_ptr + page * k_page + head * k_head + within * k_slot + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a block with no slot seen yet adds nothing
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(top - shift)
        v = tl.load(v_ptr + page * v_page + head * v_head + within * v_slot + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        total = total * rescale + tl.sum(weights, 1)
        top = new_top
    out = acc / total[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
