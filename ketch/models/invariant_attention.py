"""Batch-invariant attention on GPUs (`rollout.exact_log_probs`): one Triton kernel for the training forward over
whole sequences and for the decoder's one-token steps over its paged cache, so that a query gets the same bits on
both sides without a Python loop over key blocks on either.

A program attends `BLOCK_M` query rows of one (row, key/value head): the query heads that share the key head, at
consecutive positions ((position, head) flattened, head fastest). It walks the row's real keys (its first real
slot on: a row's real tokens are one run) in blocks of `KEYS` from the first, each block's scores one `[BLOCK_M,
KEYS]` dot in float32, merged by an online softmax in float32, the output rounded once. A query row's arithmetic
depends only on its query, the keys and values and its real index (its place among the row's real tokens): not on
the other rows of its tile, nor on how many blocks the program walks past the keys the row sees (such a block
leaves the running maximum, sum and output exactly as they were: a rescale of exp(0) = 1 and zeros added).

Keys and values are read through a page table from pools `[pages, kv_heads, page, head_dim]`: the decoder's paged
cache as it is, the training forward's keys and values copied into that layout (`pages.as_pool`). A query sees the real
keys up to its own (and, with a sliding window, fewer than `window` back); a query with none (padding) gives
zeros. The backward recomputes attention with SDPA under the same mask: gradients need no batch invariance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from ketch.models.pages import as_pool

PAGE = 128
"""Slots per page of the training forward's pools (`as_pool`; the decoder's pools have their own, read from their
shape)."""
BLOCK_M = 16
"""Query rows a program attends: a decode step's query heads of one key head (7 on Qwen2.5-0.5B) fit one tile."""
KEYS = 64
"""Keys per block of the walk."""


def invariant_attention(
    query: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    first: torch.Tensor,
    count: torch.Tensor,
    offset: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`query` `[rows, heads, q_len, head_dim]` over key and value `pools` `[pages, kv_heads, page, head_dim]` read
    through `table` `[rows, pages_per_row]` (int64): row r's real tokens fill its slots `first[r]` ..
    `first[r] + count[r]`, and its query at position s is the real token `s + offset[r]` (`first`, `count`,
    `offset` `[rows]` int64) -> `[rows, q_len, heads, head_dim]` in the query's dtype."""
    rows, heads, q_len, head_dim = query.shape
    kv_heads = pools[0].shape[1]
    group = heads // kv_heads
    out = query.new_empty(rows, q_len, heads, head_dim)
    key, value = pools
    grid = (rows, kv_heads, triton.cdiv(q_len * group, BLOCK_M))
    dim_pad = max(16, triton.next_power_of_2(head_dim))  # a side of `tl.dot` is at least 16 (the tests' heads of 8)
    _attend[grid](
        query, key, value, table, first, count, offset, out,
        q_len, scale, window or 0,
        *query.stride()[:3], *out.stride()[:3], *key.stride()[:3], *value.stride()[:3], table.stride(0),
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # float32 without TF32's rounding
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_M=BLOCK_M, KEYS=KEYS,
        PAGE=key.shape[2], WINDOW=window is not None,
    )  # fmt: skip
    return out


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, table_ptr, first_ptr, count_ptr, offset_ptr, out_ptr,
    q_len, scale, window,
    q_row, q_head, q_pos, o_row, o_pos, o_head, k_page, k_head, k_slot, v_page, v_head, v_slot, table_row,
    PRECISION: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, KEYS: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Program (row, key/value head, tile): query rows `tile * BLOCK_M` on, as (position, head in the group)."""
    row, kv_head = tl.program_id(0), tl.program_id(1)
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    position, head = r // GROUP, kv_head * GROUP + r % GROUP
    first, count = tl.load(first_ptr + row), tl.load(count_ptr + row)
    t = position + tl.load(offset_ptr + row)  # each query's real index
    sees = (position < q_len) & (t >= 0) & (t < count)
    d = tl.arange(0, DIM_PAD)
    dims = d < HEAD_DIM
    q_mask = sees[:, None] & dims[None, :]
    q = tl.load(q_ptr + row * q_row + head[:, None] * q_head + position[:, None] * q_pos + d[None, :], q_mask, 0.0)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    last = tl.max(tl.where(sees, t, -1))
    for start in range(0, last + 1, KEYS):
        j = start + tl.arange(0, KEYS)
        real = j < count
        slot = first + j
        page = tl.load(table_ptr + row * table_row + slot // PAGE, real, 0)
        within = (slot % PAGE)[:, None]
        kv_mask = real[:, None] & dims[None, :]
        k = tl.load(k_ptr + page[:, None] * k_page + kv_head * k_head + within * k_slot + d[None, :], kv_mask, 0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        seen = sees[:, None] & real[None, :] & (j[None, :] <= t[:, None])
        if WINDOW:
            seen &= j[None, :] > t[:, None] - window
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(top - shift)
        v = tl.load(v_ptr + page[:, None] * v_page + kv_head * v_head + within * v_slot + d[None, :], kv_mask, 0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        total = total * rescale + tl.sum(weights, 1)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_at = out_ptr + row * o_row + position[:, None] * o_pos + head[:, None] * o_head + d[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), (position < q_len)[:, None] & dims[None, :])


class TrainingAttention(torch.autograd.Function):
    """The batch-invariant attention of a forward through transformers' attention interface: `query` `[batch,
    heads, q_len, head_dim]` at the last q_len of the `key`/`value` positions `[batch, kv_heads, length,
    head_dim]` (all of them in a training forward; a `generate` step's new tokens after its cache), each row's real
    tokens the run of `real` `[batch, length]` (bool) -> `[batch, q_len, heads, head_dim]` through
    `invariant_attention`. The backward differentiates SDPA under the same mask (real keys up to the query's,
    within `window`)."""

    @staticmethod
    def forward(ctx, query, key, value, real: torch.Tensor, scale: float, window: int | None):
        ctx.save_for_backward(query, key, value, real)
        ctx.scale, ctx.window = scale, window
        first = real.long().argmax(-1)
        pool_k, table = as_pool(key, PAGE)
        pool_v, _ = as_pool(value, PAGE)
        offset = key.shape[2] - query.shape[2] - first
        return invariant_attention(query, (pool_k, pool_v), table, first, real.sum(-1), offset, scale, window)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, real = ctx.saved_tensors
        mask = training_mask(real, query.shape[2], ctx.window)
        some = mask.any(-1, keepdim=True)  # a query with no key gives zeros: attend anything, pass no gradient back
        group = query.shape[1] // key.shape[1]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            # keys and values repeated per query head rather than `enable_gqa`, which may send a masked SDPA to the
            # math kernel (a [heads, length, length] score matrix) instead of the memory-efficient one
            q, k, v = inputs[0], *(t.repeat_interleave(group, 1) for t in inputs[1:])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~some, scale=ctx.scale)
            grads = torch.autograd.grad(out, inputs, grad.transpose(1, 2) * some)
        return *grads, None, None, None


def training_mask(real: torch.Tensor, q_len: int, window: int | None) -> torch.Tensor:
    """`[batch, 1, q_len, length]` for queries at the last `q_len` of `real`'s `[batch, length]` positions: query i
    sees key j when both are real and j <= i (and j > i - `window`)."""
    length = real.shape[1]
    i = torch.arange(length - q_len, length, device=real.device)[:, None]
    j = torch.arange(length, device=real.device)
    causal = (j <= i) & ((j > i - window) if window is not None else True)
    return (real[:, None, length - q_len :, None] & real[:, None, None, :]) & causal
