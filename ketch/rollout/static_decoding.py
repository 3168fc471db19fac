"""Decoding with a preallocated KV cache, for the `hf` backend's `static` path.

`model.generate` spends most of a decode step in Python: logits processors, stopping criteria that read
the GPU every token, and hundreds of kernel launches per layer stack. Here the cache is allocated once per
(batch, length), the one-token step has fixed shapes and, on GPUs, is compiled into a CUDA graph (one
replay per token), sampling stays on the device, and the host looks at the tokens only every
`CHECK_EVERY` steps to stop early when every row has finished. Attention of the one new token reads the
KV cache once per key/value head (`grouped_decode_attention`), not once per query head.
"""

from __future__ import annotations

import logging
import time
from functools import cache

import torch
from torch import nn
from transformers import StaticCache

from ketch.cache import use_compile_cache

logger = logging.getLogger("ketch.rollout")

CHECK_EVERY = 16
"""Decode steps between the host's checks whether every row has met a stop token."""
PROMPT_BUCKET = 64
"""With shape buckets, prompts are left-padded to a multiple of this many tokens."""


DECODE_ATTENTION = "ketch_decode"
"""The attention implementation the decoding model is switched to."""


def grouped_decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature. For one new token per row, `query` `[batch, heads, 1, head_dim]`
    against the cache `key`/`value` `[batch, kv_heads, length, head_dim]`: the `heads / kv_heads` query heads
    that share a key/value head attend as one group of queries, so the cache is read once and never copied per
    query head (transformers' SDPA path repeats it when there is a mask). Longer queries (the prompt) go to SDPA.
    Returns `[batch, 1, heads, head_dim]`."""
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    if length != 1 or heads == kv_heads:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)  # query head i uses kv head i // group
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
    out = nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, head_dim), None


def use_grouped_decode_attention(model: nn.Module) -> None:
    """Switch a HF model to `grouped_decode_attention` (masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, grouped_decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(DECODE_ATTENTION)


class StaticDecoder:
    """Greedy or sampled decoding of left-padded prompts with `model` (a HF causal LM)."""

    def __init__(self, model: nn.Module, compile_step: bool, buckets: bool | None = None, backend: str = "inductor"):
        """`buckets` (default: when compiling) rounds batch shapes up so that few graphs are captured; `backend`
        is torch.compile's (inductor's CUDA graphs: `reduce-overhead`)."""
        self.model = model
        self.buckets = compile_step if buckets is None else buckets
        use_grouped_decode_attention(model)
        self.caches: dict[tuple[int, int], StaticCache] = {}
        self.stop_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self.step = self._step
        self.compiled = compile_step
        if compile_step:
            self.compile_cache = use_compile_cache()
            mode = {"mode": "reduce-overhead"} if backend == "inductor" else {"backend": backend}
            self.step = torch.compile(self._step, fullgraph=True, dynamic=False, **mode)

    def _step(self, tokens, attention_mask, position_ids, cache_position, cache):
        out = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
        )
        return out.logits[:, -1].float()

    def _cache(self, batch: int, length: int) -> StaticCache:
        key = (batch, length)
        if key not in self.caches:
            if self.compiled:
                logger.info(
                    "compiling the decode step into a CUDA graph for %d rows x %d tokens (once per shape; compiler "
                    "cache %s)",
                    batch,
                    length,
                    self.compile_cache,
                )
            self.caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = self.caches[key]
        cache.reset()
        return cache

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        stop_token_ids: list[int] | None,
        pad_token_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`responses` and their `log_probs` `[batch, max_new_tokens]` for prompts `[batch, prompt_len]`.
        After a row's first stop token its tokens are `pad_token_id` (log-prob 0); `stop_token_ids=None`
        decodes every row to the full length. With `buckets`, the batch runs padded to the next power of two
        rows and a multiple of `PROMPT_BUCKET` prompt tokens (more left padding), so that a few compiled shapes
        serve every batch; the padding rows are dropped from the result."""
        rows, prompt_len = input_ids.shape
        if not self.buckets:
            return self._generate(input_ids, attention_mask, max_new_tokens, sampling, stop_token_ids, pad_token_id)
        extra_rows = (1 << (rows - 1).bit_length()) - rows
        extra_len = -prompt_len % PROMPT_BUCKET
        input_ids = nn.functional.pad(input_ids, (extra_len, 0, 0, extra_rows), value=pad_token_id)
        attention_mask = nn.functional.pad(attention_mask, (extra_len, 0, 0, extra_rows))
        attention_mask[rows:, -1] = 1  # padding rows decode from one token, never seen by the real rows
        args = (max_new_tokens, sampling, stop_token_ids, pad_token_id)
        tokens, log_probs = self._generate(input_ids, attention_mask, *args, active_rows=rows)
        return tokens[:rows], log_probs[:rows]

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        stop_token_ids: list[int] | None,
        pad_token_id: int,
        active_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate` on a batch as it is; rows from `active_rows` on count as finished from the start."""
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        new_shape = (batch, prompt_len + max_new_tokens) not in self.caches
        start = time.perf_counter()
        cache = self._cache(batch, prompt_len + max_new_tokens)
        mask = torch.zeros(batch, prompt_len + max_new_tokens, dtype=attention_mask.dtype, device=device)
        mask[:, :prompt_len] = attention_mask
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self._step(input_ids, mask, positions, torch.arange(prompt_len, device=device), cache)
        position = positions[:, -1:] + 1
        tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros(batch, max_new_tokens, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        if active_rows is not None:
            done[active_rows:] = True
        is_stop = self._stop_table(stop_token_ids or [], logits.shape[-1], device)
        cache_positions = torch.arange(prompt_len, prompt_len + max_new_tokens, device=device)
        for t in range(max_new_tokens):
            token, log_prob = sampling.sample(logits)
            tokens[:, t] = token.masked_fill(done, pad_token_id)
            log_probs[:, t] = log_prob.masked_fill(done, 0.0)
            done |= is_stop[token]
            if t == max_new_tokens - 1 or (t % CHECK_EVERY == CHECK_EVERY - 1 and bool(done.all())):
                break
            mask[:, prompt_len + t] = 1
            logits = self.step(token[:, None], mask, position, cache_positions[t : t + 1], cache)
            position = position + 1
        if new_shape and self.compiled:
            logger.info(
                "first decode of %d rows x %d tokens took %.1f s",
                batch,
                prompt_len + max_new_tokens,
                time.perf_counter() - start,
            )
        return tokens, log_probs

    def _stop_table(self, stop_token_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """`[vocab]` bool, True at the stop tokens: one lookup per step, however many stop tokens there are."""
        key = (vocab, *stop_token_ids)
        if key not in self.stop_tables:
            table = torch.zeros(vocab, dtype=torch.bool, device=device)
            table[[i for i in stop_token_ids if 0 <= i < vocab]] = True
            self.stop_tables[key] = table
        return self.stop_tables[key]


class Sampling:
    """Picks the next token from float32 logits `[batch, vocab]` and returns its log-prob under the
    temperature-scaled distribution (what the training engine computes), before top-k/top-p filtering.

    Sampling takes the argmax of the filtered logits plus Gumbel noise (the Gumbel-max trick: the same
    distribution as a draw from their softmax); on CUDA it is compiled into a few fused kernels over the
    vocabulary, where softmax, `multinomial` and `log_softmax` took a pass (or several) each."""

    def __init__(self, do_sample: bool, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
        self.do_sample, self.temperature, self.top_p, self.top_k = do_sample, temperature, top_p, top_k

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(token, log_prob)`, each `[batch]`."""
        return _sampler(logits.device.type)(logits, self.do_sample, self.temperature, self.top_k, self.top_p)

    def _filter(self, scaled: torch.Tensor) -> torch.Tensor:
        return _filter(scaled, self.top_k, self.top_p)


def _sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float):
    if do_sample:
        scaled = logits / temperature
        gumbel = -(-torch.rand_like(scaled).log()).log()
        token = (_filter(scaled, top_k, top_p) + gumbel).argmax(-1)
    else:
        scaled, token = logits, logits.argmax(-1)
    return token, scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


def _filter(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k and the top-p nucleus set to -inf."""
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs > top_p  # the nucleus keeps the token that crosses top_p
        scaled = scaled.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return scaled


@cache
def _sampler(device_type: str):
    return torch.compile(_sample, dynamic=False) if device_type == "cuda" else _sample
