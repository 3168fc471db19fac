"""A Triton kernel for the static decoder's sampling on GPUs, where no top-k or top-p filter is set.

Two passes over each row's logits `[vocab]`, scaled by the temperature:

1. The vocabulary is split into chunks of `CHUNK` logits, one program each, so that a few dozen rows still fill
   the GPU. A chunk keeps its maximum, the sum of its exponentials below it (for the softmax), and its largest
   logit's token (for greedy decoding).
2. One program per row combines the chunks into the softmax's normalizer. Greedy decoding takes the best chunk's
   token; sampling draws one uniform number per row (Philox, keyed on a seed tensor on the device, so that a
   CUDA graph replays it with the seed it finds there) and inverts the softmax's cumulative distribution: first
   across chunks, then within the one chunk it falls in. One random number per row, not one per logit as
   Gumbel-max sampling draws, whose random numbers cost more than reading the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
"""Logits per program of the first pass (at 64–256 rows of 151,936 logits on an H200, 4,096 took 13.3–38.7 µs a
draw; 1,024 and 8,192 were 2–37% slower)."""


def fits(logits: torch.Tensor) -> bool:
    """Whether the kernel takes these logits `[rows, vocab]`: 2-d, contiguous along the vocabulary."""
    return logits.dim() == 2 and logits.stride(-1) == 1


def sample(
    logits: torch.Tensor, temperature: float, do_sample: bool, seed: torch.Tensor, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token, log_prob)`, `[rows]` int64 and float32, from `logits` `[rows, vocab]`: a draw from the softmax of
    `logits / temperature` (the noise keyed on `seed` `[1]` int64) when `do_sample`, else its argmax (the first
    of equal ones), and the token's log-prob under that softmax; `chunk` logits (a power of two) per program."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, chunk)
    top, total = (torch.empty(rows, chunks, device=logits.device) for _ in range(2))
    best = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_statistics[(rows, chunks)](logits, logits.stride(0), vocab, temperature, top, total, best, CHUNK=chunk)
    token = torch.empty(rows, dtype=torch.long, device=logits.device)
    log_prob = torch.empty(rows, device=logits.device)
    _draw[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        seed,
        top,
        total,
        best,
        chunks,
        token,
        log_prob,
        SAMPLE=do_sample,
        CHUNK=chunk,
        CHUNKS=triton.next_power_of_2(chunks),
    )
    return token, log_prob


@triton.jit
def _scaled(logits_ptr, row_stride, vocab, temperature, row, tokens):
    """The logits at `tokens` of `row` divided by the temperature, in float32 (-inf past the vocabulary)."""
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + tokens, mask=tokens < vocab, other=float("-inf"))
    return x.to(tl.float32) / temperature


@triton.jit
def _chunk_statistics(logits_ptr, row_stride, vocab, temperature, top_ptr, total_ptr, best_ptr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    scaled = _scaled(logits_ptr, row_stride, vocab, temperature, row, chunk * CHUNK + tl.arange(0, CHUNK))
    top = tl.max(scaled, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a chunk of -inf logits adds nothing to the sum
    out = row * tl.num_programs(1) + chunk
    tl.store(top_ptr + out, top)
    tl.store(total_ptr + out, tl.sum(tl.exp(scaled - shift), 0))
    tl.store(best_ptr + out, chunk * CHUNK + tl.argmax(scaled, 0))


@triton.jit
def _draw(
    logits_ptr,
    row_stride,
    vocab,
    temperature,
    seed_ptr,
    top_ptr,
    total_ptr,
    best_ptr,
    chunks,
    token_ptr,
    log_prob_ptr,
    SAMPLE: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS)
    inside = c < chunks
    top = tl.load(top_ptr + row * chunks + c, mask=inside, other=float("-inf"))
    overall = tl.max(top, 0)
    mass = tl.load(total_ptr + row * chunks + c, mask=inside, other=0.0)
    mass = tl.where(top == float("-inf"), 0.0, mass * tl.exp(top - overall))  # each chunk's sum of exp(x - max)
    normalizer = tl.sum(mass, 0)
    if SAMPLE:
        target = tl.rand(tl.load(seed_ptr), row) * normalizer
        before = tl.cumsum(mass, 0) - mass
        chunk = tl.max(tl.where(inside & (before <= target) & (mass > 0), c, 0), 0)
        left = target - tl.sum(tl.where(c == chunk, before, 0.0), 0)
        n = tl.arange(0, CHUNK)
        weights = tl.exp(_scaled(logits_ptr, row_stride, vocab, temperature, row, chunk * CHUNK + n) - overall)
        crossed = tl.sum((tl.cumsum(weights, 0) <= left).to(tl.int32), 0)
        last = tl.max(tl.where(weights > 0, n, 0), 0)  # rounding may leave `left` past the chunk's sum
        token = chunk * CHUNK + tl.minimum(crossed, last)
    else:
        best = tl.load(best_ptr + row * chunks + c, mask=inside, other=0)
        token = tl.sum(tl.where(c == tl.argmax(top, 0), best, 0), 0)
    scaled = tl.load(logits_ptr + row.to(tl.int64) * row_stride + token).to(tl.float32) / temperature
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(log_prob_ptr + row, scaled - overall - tl.log(normalizer))
