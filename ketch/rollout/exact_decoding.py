"""The static decoder in `rollout.exact_log_probs` mode (`ExactDecoder`): the paged KV cache, lockstep rows and
CUDA graphs of `static_decoding.py`, with every token computed by the ops of the actor's training forward
(`ketch.models.batch_invariant`), so that the log-probs it returns are the training forward's, bit for bit.

What changes against the default decoder: the projections stay separate `batch_invariant.linear` calls (a fused
q/k/v or gate/up matmul reduces each column in another kernel: not the training forward's bits), no block is
compiled (inductor would fuse the norms, the rotary and SiLU into kernels of its own; the eager step is still
captured into CUDA graphs on CUDA), a mixture's decode steps run every expert over the step's rows through
`linear` (`_every_expert`: fixed shapes, no wait for the GPU), and each sampled token's log-prob is
`batch_invariant.label_log_probs` of the step's logits (the sampler's own fused log-softmax reduces otherwise).

**Which keys fall into which block.** `batch_invariant.attention` moves a row's real keys (those some query
attends) to the front, in order, and walks them in blocks of `KEYS` from the first: in the training forward, whose
row is [left padding][prompt][response][right padding], the key of the row's j-th real token sits in block
j // KEYS at place j % KEYS, wherever the row's padding ends. The decoder's cache keeps the default layout: the rows
write in lockstep (every row's new token in the same slot), so a row's prompt ends where every prompt ends, and its
real tokens fill the slots `first .. slot` (its left padding before, the slots of tokens still to come after). Its
j-th real token's key is therefore the cache slot `first + j`, and the decode step reads slots `first + j` for j in
0 .. `KEYS` * blocks (`_compacted_slots`): the same keys in the same blocks, at the same places, as the training
forward's walk, a sliding window cutting the same keys. A prompt whose real tokens are not one run (a gap in its
attention mask) would break this and is refused (`ExactDecoder.generate`).

**Why the walks give the same bits.** For a query at its row's real token t, both walks compute, block after
block, scores in a `[ROWS, head_dim] @ [head_dim, KEYS]` matmul, the block's maximum and exponentials, the sum of
its weights over `KEYS` and the weighted values in a `[ROWS, KEYS] @ [KEYS, head_dim]` matmul, and merge them
into the running sums in block order with the same elementwise ops, the same dtype. Keys after t are masked on
both sides (later tokens in the training forward, slots not yet filled here, or slots past the cache's end): their
weight is exp(-inf) = 0, so whatever finite values such a slot holds, its products are zeros and add nothing. A
block with no key to attend (the training forward's blocks after t, this walk's blocks past the row's tokens)
leaves the running maximum where it was, its rescale is exp(0) = 1 and its sums 0: the running sums stay as they
were, bit for bit, so the two walks may run over different numbers of blocks. Only the order of the work differs:
this walk computes every block's scores, maxima (a running maximum is a cumulative maximum: max rounds nothing),
exponentials and weighted values at once, as batches of the same matmul shape, and merges them in block order
after. The query heads that share a key head are one block of `ROWS` query rows, as the training forward's rows of
those heads are (its blocks hold other tokens' rows too: a row's result does not depend on the others').

**Rows.** On CUDA torch reduces a row over the hidden size (the RMSNorms' mean) with more threads, in another
order, when fewer than 16 rows are reduced together (its reduce config gives each row the threads the other rows
leave), so a batch decodes in at least `ROWS` rows (`min_rows`; compaction stops there too); the training forward
reduces many tokens together. (The RMSNorms now run one Triton program a row on CUDA, `invariant_norm.py`; the
floor stays until a GPU shows the steps agree without it.)

**On CUDA** both sides attend through one Triton kernel instead (`ketch.models.invariant_attention`, the same
walk, each query row's arithmetic its own), the decode step reading the paged cache through the page table from
each row's first filled slot (`_cache_runs`): no Python loop over key blocks on either side, and a step walks the
blocks its rows' keys fill, not the whole cache. The walks above are the CPU's.

**Cost.** The step runs eagerly (with the CPU's walk about 100 kernels a layer on Qwen2.5-0.5B's layout with a
cache of 384 slots), captured into CUDA graphs on CUDA.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from ketch.models.batch_invariant import KEYS, ROWS, attention, boolean_mask, label_log_probs, linear, on_kernels
from ketch.rollout.decode_buffers import DecodeBuffers
from ketch.rollout.kv_pages import PAGE, slot_places, write, write_at
from ketch.rollout.moe_decode import in_decode_step
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import StaticDecoder

EXACT_DECODE = "ketch_exact_decode"
"""The attention implementation the exactly decoding model is switched to."""


def _compacted_slots(mask: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's j-th real token's key sits, for j in 0 .. `KEYS` * ceil(length / `KEYS`), from `mask`
    `[rows, length]` (True: a filled slot, one run per row) and the page table `table` `[rows, length / PAGE]`:
    its page and place in the page `[rows, keys]` (int64) and whether there is such a token `[rows, keys]`."""
    length = mask.shape[1]
    first = mask.byte().argmax(-1, keepdim=True)  # the row's first filled slot
    slots = first + torch.arange(-(-length // KEYS) * KEYS, device=mask.device)
    inside = slots < length
    slots = slots.clamp(max=length - 1)
    return table.gather(1, slots // PAGE), slots % PAGE, mask.gather(1, slots) & inside


def _cache_runs(mask: torch.Tensor, table: torch.Tensor, slot: torch.Tensor) -> tuple:
    """Each row's first filled slot, number of filled slots and the new token's real index `[rows]` (int64), from
    `mask` `[rows, length]` (True: a filled slot, one run per row): where `invariant_attention` finds the row's real
    tokens; and where the step's new key goes under the page `table` (`kv_pages.slot_places` of the new token's
    `slot` `[1]`). Computed once a step, for every layer."""
    count = mask.sum(-1)
    return mask.byte().argmax(-1), count, count - 1, slot_places(table, slot)


def _walk_cache(
    query: torch.Tensor,
    pools: tuple[torch.Tensor, torch.Tensor],
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One new token's attention, `query` `[rows, heads, 1, head_dim]`, over the paged cache: key and value pools
    `[pages, kv_heads, PAGE, head_dim]`, read at `keys` (`_compacted_slots`); returns `[rows, 1, heads, head_dim]`,
    the bits `batch_invariant.attention` gives this token in the training forward (see the module's docstring)."""
    rows, heads, _, head_dim = query.shape
    page, place, valid = keys
    if sliding_window is not None:  # the training mask's kv > q - window, counted in real tokens
        since = valid.sum(-1, keepdim=True) - sliding_window
        valid = valid & (torch.arange(valid.shape[1], device=valid.device) >= since)
    kv_heads, blocks = pools[0].shape[1], valid.shape[1] // KEYS
    group = heads // kv_heads
    q = F.pad(query.reshape(rows, kv_heads, group, head_dim), (0, 0, 0, -group % ROWS))
    q = q.view(rows, kv_heads, -1, 1, ROWS, head_dim)  # [rows, kv_heads, q_blocks, 1, ROWS, head_dim]
    shape = (rows, kv_heads, q.shape[2], blocks)
    key, value = (pool[page, :, place].view(rows, blocks, KEYS, kv_heads, head_dim) for pool in pools)
    key = key.permute(0, 3, 1, 4, 2)[:, :, None].expand(*shape, head_dim, KEYS).reshape(-1, head_dim, KEYS)
    value = value.permute(0, 3, 1, 2, 4)[:, :, None].expand(*shape, KEYS, head_dim).reshape(-1, KEYS, head_dim)
    scores = torch.bmm(q.expand(*shape, ROWS, head_dim).reshape(-1, ROWS, head_dim), key).view(*shape, ROWS, KEYS)
    mask = valid.view(rows, 1, 1, blocks, 1, KEYS)
    scores = (scores * scale).masked_fill(~mask, float("-inf"))
    peak = scores.amax(-1).cummax(3).values  # [rows, kv_heads, q_blocks, blocks, ROWS]: the running maximum
    shift = torch.where(peak == float("-inf"), 0.0, peak)
    weights = torch.exp(scores - shift[..., None])
    before = F.pad(peak[:, :, :, :-1], (0, 0, 1, 0), value=float("-inf"))  # the running maximum before each block
    rescale = torch.exp(before - shift)
    sums = weights.sum(-1)
    weighted = torch.bmm(weights.view(-1, ROWS, KEYS), value).view(*shape, ROWS, head_dim)
    total, acc = q.new_zeros((*shape[:3], ROWS)), q.new_zeros((*shape[:3], ROWS, head_dim))
    for block in range(blocks):  # merged in block order, as the training forward's walk merges them
        total = total * rescale[:, :, :, block] + sums[:, :, :, block]
        acc = acc * rescale[:, :, :, block, :, None] + weighted[:, :, :, block]
    out = acc / torch.where(total > 0, total, 1.0)[..., None]
    return out.view(rows, kv_heads, -1, head_dim)[:, :, :group].reshape(rows, 1, heads, head_dim)


def exact_cached_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    cache_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered `EXACT_DECODE`: writes the new `key`/`value` `[batch, kv_heads, new, head_dim]` into the
    module's paged cache (`module.decode_kv`, as `decode_attention.cached_attention` does) at `cache_slots` `[new]`,
    then attends as the training forward does: the prompt (`new` > 1) among its own tokens through
    `batch_invariant.attention` under its boolean mask, one new token over the cache where `module.exact_keys`
    (`_compacted_slots`, set for the step by `ExactDecoder._iterate`) says its row's real tokens sit. With the kernels
    (`_cache_runs`' `exact_keys`) a step writes its key and value at the page and place computed once for every
    layer, and attends through `invariant_attention`."""
    if cache_slots is None or not hasattr(module, "decode_kv"):
        raise ValueError(f"{EXACT_DECODE} attention: call the model with `cache_slots` (see ExactDecoder)")
    keys, values, table = module.decode_kv
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if query.shape[2] == 1 and on_kernels(query):  # the training forward's Triton kernel over the paged cache
        from ketch.models.invariant_attention import invariant_attention

        first, count, last, places = module.exact_keys
        write_at(keys, places, key)
        write_at(values, places, value)
        return invariant_attention(query, (keys, values), table, first, count, last, scale, sliding_window), None
    write(keys, table, cache_slots, key)
    write(values, table, cache_slots, value)
    if query.shape[2] > 1:
        kwargs["sliding_window"] = sliding_window
        return attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return _walk_cache(query, (keys, values), module.exact_keys, scale, sliding_window), None


def _every_expert(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """A decode step's experts (Qwen3-MoE's layout, as `batch_invariant`'s experts forward reads it) with fixed
    shapes: `[tokens, hidden]` -> `[tokens, hidden]`. Every expert runs over every token through `linear` (a token's
    row gets the bits it gets among the expert's tokens in the training forward), weighed by the token's weight for
    it (0 where it did not choose it), and is added in the experts' order: a token gets its chosen experts' outputs
    in the training forward's order, and zeros, which change nothing, for the others."""
    out = torch.zeros_like(hidden_states)
    tokens = torch.arange(len(hidden_states), device=hidden_states.device)
    for expert in range(self.num_experts):
        weight = torch.where(top_k_index == expert, top_k_weights, 0).sum(-1, keepdim=True)  # one term or none
        gate, up = linear(hidden_states, self.gate_up_proj[expert]).chunk(2, dim=-1)
        routed = linear(self.act_fn(gate) * up, self.down_proj[expert]) * weight
        out.index_add_(0, tokens, routed.to(out.dtype))
    return out


@functools.cache
def _fixed_shape_class(cls: type) -> type:
    """A subclass of the batch-invariant experts class `cls` that runs `_every_expert` in the decoder's decode steps
    (`moe_decode.decoding`) and `cls`'s forward (the training forward's, which waits for the GPU to find each
    expert's tokens) in the prefill."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        compute = _every_expert if in_decode_step() else cls.forward
        return compute(self, hidden_states, top_k_index, top_k_weights)

    return type(f"FixedShape{cls.__name__}", (cls,), {"forward": forward})


def use_exact_decoding(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Switch a batch-invariant model (`batch_invariant.make_batch_invariant`) to `exact_cached_attention` (prompt
    masks built as the training forward's) and the experts of its `blocks` to their fixed-shape decode steps."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(EXACT_DECODE, exact_cached_attention)
    AttentionMaskInterface.register(EXACT_DECODE, boolean_mask)
    model.set_attn_implementation(EXACT_DECODE)
    for block in blocks:
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if experts is None:
            continue
        if not type(experts).__name__.startswith("BatchInvariant"):
            raise ValueError(f"exact decoding: the experts {type(experts).__name__} have no batch-invariant forward")
        experts.__class__ = _fixed_shape_class(type(experts))


class ExactDecoder(StaticDecoder):
    """`StaticDecoder` for a batch-invariant model (`rollout.exact_log_probs`): the same interface and buffers, every
    token computed with the training forward's ops (see the module's docstring). Nothing is compiled; with
    `compile_step` (on CUDA) the eager step is captured into a CUDA graph per shape, and shapes are bucketed."""

    min_rows = ROWS

    def __init__(self, model: nn.Module, compile_step: bool, **settings):
        """`compile_step`: capture the decode step (and bucket the shapes, unless `buckets` says otherwise);
        `settings`: `StaticDecoder`'s, but neither `kv_dtype` (the cache holds the keys unrounded) nor `backend`."""
        if settings.get("kv_dtype") not in (None, model.dtype):
            raise ValueError("exact decoding: the KV cache holds the model's keys and values, not rounded ones")
        buckets = settings.pop("buckets", None)
        buckets = compile_step if buckets is None else buckets
        super().__init__(model, compile_step=False, buckets=buckets, capture=compile_step, **settings)

    def _use_decode_forwards(self) -> list[str]:
        use_exact_decoding(self.model, self.blocks)
        return []

    def release(self) -> None:
        super().release()
        for module in self.attentions:
            module.exact_keys = None

    def _sample(
        self, logits: torch.Tensor, sampling: Sampling, seed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's token, with its log-prob from `label_log_probs`, the training forward's op."""
        token, _ = super()._sample(logits, sampling, seed)
        log_prob, _ = label_log_probs(logits, token, sampling.temperature if sampling.do_sample else 1.0)
        return token, log_prob

    def _iterate(self, b: DecodeBuffers, sampling: Sampling, is_stop: torch.Tensor, pad: int) -> None:
        """Where each row's real tokens sit in the cache (`_cache_runs` with the kernels, else `_compacted_slots`),
        for every block's attention, then the step."""
        keys = _cache_runs(b.mask, b.table, b.slot) if on_kernels(b.mask) else _compacted_slots(b.mask, b.table)
        for module in self.attentions:
            module.exact_keys = keys
        super()._iterate(b, sampling, is_stop, pad)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *args, **kwargs):
        """`StaticDecoder.generate`, for prompts whose real tokens are one run each (left padding): the cache then
        holds a row's tokens in one run too, as `_compacted_slots` reads them."""
        real = attention_mask.long()
        if not torch.equal(real, real.cummax(-1).values):
            raise ValueError("exact decoding: a prompt's attention mask has a gap; pad prompts on the left only")
        return super().generate(input_ids, attention_mask, *args, **kwargs)
