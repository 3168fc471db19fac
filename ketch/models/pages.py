"""A contiguous KV cache as pages: the layout of the paged pools that the static decoder keeps
(`ketch/rollout/kv_pages.py`) and that batch-invariant attention reads (`invariant_attention.py`)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def as_pool(cache: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values `[rows, kv_heads, length, head_dim]` as a pool `[rows * pages, kv_heads, page, head_dim]` (a
    copy, the length padded to whole pages) and its table `[rows, pages]` (int64), row r's pages in order."""
    rows, kv_heads, length, head_dim = cache.shape
    pages = -(-length // page)
    padded = F.pad(cache, (0, 0, 0, pages * page - length))
    pool = padded.view(rows, kv_heads, pages, page, head_dim).transpose(1, 2).reshape(-1, kv_heads, page, head_dim)
    return pool, torch.arange(rows * pages, device=cache.device).view(rows, pages)
