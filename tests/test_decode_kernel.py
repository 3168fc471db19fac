"""The Triton decode-attention kernel (`ketch/rollout/decode_kernel.py`), run by Triton's interpreter on the CPU,
over a paged cache against PyTorch's attention over the filled slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CASE = textwrap.dedent(
    """
    import json, sys, torch
    from ketch.rollout.decode_kernel import decode_attention
    from ketch.rollout.kv_pages import as_pages

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, group, head_dim, length, slot = 4, 2, 7, int(sys.argv[1]), 300, 260
    q = torch.randn(rows, kv_heads, group, head_dim, generator=g)
    k, v = (torch.randn(rows, kv_heads, length, head_dim, generator=g) for _ in range(2))
    filled = torch.zeros(rows, length, dtype=torch.bool)
    filled[0, : slot + 1] = True      # no padding
    filled[1, 140 : slot + 1] = True  # left padding past the first block of 128 slots
    filled[2, slot] = True            # only the new token
    filled[3, 3 : slot + 1 : 2] = True
    filled[:, slot + 1 :] = True      # past the new token's slot: never read, even where marked filled
    k[:, :, slot + 1 :] = float("nan")
    v[:, :, slot + 1 :] = float("nan")
    (k_pool, table), (v_pool, _) = as_pages(k), as_pages(v)  # 3 pages of 128 slots a row, in reverse order
    out = decode_attention(q, k_pool, v_pool, table, filled, torch.tensor([slot]), 0.3)
    seen = filled[:, None, None, : slot + 1]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, : slot + 1], v[:, :, : slot + 1], attn_mask=seen, scale=0.3
    )
    only_slot = (out[2] - v[2, :, slot : slot + 1]).abs().max().item()
    print(json.dumps({"max_diff": (out - expected).abs().max().item(), "only_slot_diff": only_slot,
                      "shape": list(out.shape), "finite": bool(out.isfinite().all())}))
    """
)


@pytest.mark.parametrize("head_dim", [16, 80])
def test_kernel_attends_over_the_filled_slots_up_to_the_new_token_only(head_dim):
    """4 rows x 2 key/value heads x 7 query heads each, 300 cache slots of which 261 up to the new token's slot:
    left padding, a row that sees its new token only, gaps; NaN past the slot is never read. Head size 80 (Phi's)
    is computed in 128 lanes with the last 48 masked."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", CASE, str(head_dim)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shape"] == [4, 2, 7, head_dim] and result["finite"]
    assert result["max_diff"] < 1e-5 and result["only_slot_diff"] < 1e-6


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
