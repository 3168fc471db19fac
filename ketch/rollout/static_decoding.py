"""Decoding with a paged KV cache at fixed addresses, for the `hf` backend's `static` path.

`model.generate` spends most of a decode step in Python: logits processors, stopping criteria that read
the GPU every token, and hundreds of kernel launches per layer stack. Here the KV cache is allocated once per
(batch, length) shape and held by the decoder (`DecodeBuffers`), the one-token step has fixed shapes, sampling
stays on the device, and the host looks at the tokens only every `CHECK_EVERY` steps to stop early when every
row has finished; at those checks it also hands the rows their cache pages (`kv_pages.py`: a row holds the slots it
has reached, a finished row none). Attention of the one new token reads the KV cache once per key/value head
(`decode_attention.py`), not once per query head, Llama-style layers compute q/k/v and gate/up with one
matmul each (`fused_projections.py`), and the experts of mixtures of experts compute with fixed shapes and no wait
for the GPU (`moe_decode.py`).

Compiled (on GPUs), each transformer block is compiled with torch.compile, and the blocks share one graph: the
block's parameters and its KV cache are inputs of the graph, so dynamo traces one block, not the whole layer
stack, once per shape; the compiled block is saved, and a later run loads it without tracing
(`ketch.compiled`). On CUDA the whole step, compiled blocks and the eager code around them, is then captured
into one CUDA graph per shape and sampling setting, together with the sampling of the next token and the
bookkeeping after it (where it lands, which rows have finished, the next step's inputs), so that a token costs
one graph replay and no other launch. With shape buckets, a KV cache has room for the rollout's longest prompt
(`longest_prompt`) and the response, so batches whose prompts differ in length decode in one shape, and
`generate(..., stop_after=2)` on a batch of the run's size loads and captures that shape before the first step.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
from torch import nn

from ketch.architecture import (
    attention_shape,
    block_attention,
    cuda_graph_problem,
    decoder_blocks,
    static_decoding_problem,
)
from ketch.compiled import eager, saved_compile
from ketch.models.mrope import has_mrope, rope_positions
from ketch.models.router_replay import ExpertRouting, compact_dtype
from ketch.models.vision import image_model_inputs
from ketch.rollout.decode_attention import use_cached_attention
from ketch.rollout.decode_buffers import DecodeBuffers
from ketch.rollout.fused_projections import fuse_projections
from ketch.rollout.group_stop import GroupStop
from ketch.rollout.moe_decode import decoding, use_fixed_shape_experts
from ketch.rollout.sampling import Sampling, compiled_sampler

logger = logging.getLogger("ketch.rollout")

CHECK_EVERY = 16
"""Decode steps between the host's checks whether every row has met a stop token."""
PROMPT_BUCKET = 64
"""With shape buckets, prompts are left-padded to a multiple of this many tokens."""
COMPACT_REMAINING = 512
"""With shape buckets, a batch whose unfinished rows fit in half its rows moves them into the next smaller shape
(`StaticDecoder._compact`) when at least this many tokens may still come: long responses whose lengths spread
stop paying for the rows that have finished; a short response's tail is not worth compiling another shape."""
RECOMPILE_LIMIT = 64
"""Graphs that dynamo keeps per function before it runs new shapes eagerly (8 by default), where the decode
block is compiled with torch.compile itself (a backend object, not saved): every decode shape adds one."""


PREFILL_TOKENS = 32768
"""The most prompt tokens one prefill forward takes: longer batches (a partial rollout's continuations, thousands
of tokens a row) prefill in groups of rows, so that their activations stay within a few GiB."""


def prefill_groups(attention_mask: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The prefill's groups of left-padded prompts (`attention_mask` `[batch, prompt_len]`): rows `[n]` (int64, on
    the mask's device) from the longest prompt (first real token to the end) down, each group as many as fit
    `PREFILL_TOKENS` at its longest prompt's length (one row at least), with the column its longest prompt begins
    at. A partial rollout's continuations (thousands of tokens) and fresh prompts (tens) then prefill apart, each
    at its own length."""
    firsts = attention_mask.int().argmax(-1).tolist()  # an all-padding row: 0, its whole length
    order = sorted(range(len(firsts)), key=lambda row: firsts[row])
    groups, start, prompt_len = [], 0, attention_mask.shape[1]
    while start < len(order):
        first = firsts[order[start]]
        end = start + max(1, PREFILL_TOKENS // (prompt_len - first))
        groups.append((torch.tensor(order[start:end], device=attention_mask.device), first))
        start = end
    return groups


def _decode_block(block: nn.Module, *args, **kwargs):
    """`block`'s own forward, in a function of its own for the decoder to compile: where torch.compile itself
    compiles it, dynamo keeps its shape history (which makes shapes that changed dynamic) and its recompile
    limit per function, so the decode shapes stay apart from the training forwards' (`engine.compile_blocks`
    compiles a function of its own too)."""
    return type(block).forward(block, *args, **kwargs)


def _finished(device: torch.device) -> float:
    """The time once the work queued on `device` has run (a log line's timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StaticDecoder:
    """Greedy or sampled decoding of left-padded prompts with `model` (a HF causal LM)."""

    min_rows = 1
    """With buckets, a batch decodes in at least this many rows."""

    def __init__(
        self,
        model: nn.Module,
        compile_step: bool,
        buckets: bool | None = None,
        backend: str = "inductor",
        longest_prompt: int = 0,
        compact_remaining: int = COMPACT_REMAINING,
        never_sampled: list[int] | None = None,
        kv_dtype: torch.dtype | None = None,
        capture: bool | None = None,
    ):
        """`compile_step` compiles each transformer block (one graph shared by all, `backend` is torch.compile's)
        and on CUDA captures the decode step into a CUDA graph per shape; `buckets` (default: when compiling)
        rounds batch shapes up so that few shapes are compiled and captured, and sizes every KV cache for a prompt
        of `longest_prompt` tokens or more, and compacts a batch whose unfinished rows fit in half its rows with at
        least `compact_remaining` tokens to go (`COMPACT_REMAINING`). Tokens `never_sampled` (a vision-language
        model's image placeholders) are never sampled, and the log-probs stay those of the model's whole
        distribution, as `generate`'s with `suppress_tokens`. `kv_dtype` is the KV cache's (default: the model's;
        `torch.float8_e4m3fn` for `rollout.kv_cache_dtype=fp8`). `capture` (default: `compile_step`) captures the
        step into CUDA graphs on CUDA, compiled or not."""
        self.model = model
        device = next(model.parameters()).device
        self.never_sampled = torch.tensor(never_sampled, device=device) if never_sampled else None
        self.kv_dtype = kv_dtype
        self.compact_remaining = compact_remaining
        self.buckets = compile_step if buckets is None else buckets
        self.longest_prompt = -(-longest_prompt // PROMPT_BUCKET) * PROMPT_BUCKET if self.buckets else 0
        problem = static_decoding_problem(model)
        if problem:
            raise ValueError(f"static decoding: {type(model).__name__} cannot be decoded here: {problem}")
        self.blocks = decoder_blocks(model)
        self.attentions = [block_attention(block) for block in self.blocks]
        self.shape = attention_shape(model.config)
        other_experts = self._use_decode_forwards()
        self.caches: dict[tuple[int, int], DecodeBuffers] = {}
        self.seen: set[tuple] = set()  # shapes (and shapes with a sampling key) decoded before: logged once
        self.stop_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self.compiled = compile_step
        capture = compile_step if capture is None else capture
        no_graph = cuda_graph_problem(model.config) if capture else None
        if capture and not no_graph and other_experts:
            no_graph = f"its experts ({', '.join(other_experts)}) are not of a layout with fixed-shape decoding"
        self.capture = capture and no_graph is None
        if no_graph and next(model.parameters()).is_cuda:
            logger.info("%s decodes compiled, without CUDA graphs: %s", type(model).__name__, no_graph)
        self.weights: list[int] = []
        self.routing: ExpertRouting | None = None
        """Set (attached) to record each token's experts: `generate` then leaves them in `routed_experts`."""
        self.cut_at = torch.zeros(0, dtype=torch.long)
        """The last `generate`'s tokens of each row where its `group_stop` cut it (see `generate`)."""
        self.routed_experts: torch.Tensor | None = None
        """With `routing`: the last `generate`'s experts of each prompt token and each token fed back, `[batch,
        prompt_len + max_new_tokens, moe_layers, top_k]` (zeros where no token was fed: the last, padding)."""
        if compile_step:
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
            name = f"decode_block-{type(self.blocks[0]).__name__}"
            compiled = saved_compile(_decode_block, name, dynamic=False, backend=backend)
            self.compile_cache = compiled.directory
            compiled.load()
            if next(model.parameters()).is_cuda:
                compiled_sampler("cuda").load()
            for block in self.blocks:
                block.forward = partial(compiled, block)

    def _use_decode_forwards(self) -> list[str]:
        """Switch the model to the decoder's attention over its KV cache, fused projections and fixed-shape experts;
        returns the class names of experts modules left as they were (`use_fixed_shape_experts`)."""
        use_cached_attention(self.model)
        fuse_projections(self.blocks)
        return use_fixed_shape_experts(self.blocks)

    def release(self) -> None:
        """Drop every shape's KV cache and CUDA graphs, and the attention modules' references to the last one used
        (or its memory would stay allocated); the next `generate` of a shape allocates and captures it again (its
        compiled block stays loaded)."""
        self.caches.clear()
        for attention in self.attentions:
            attention.decode_kv = None

    def _step(self, tokens, attention_mask, position_ids, cache_slots, **images):
        """Logits `[batch, vocab]` of the last position (in the model's dtype: the sampler reads them as float32),
        after `tokens` `[batch, new]` at `position_ids` (`[batch, new]`, or a Qwen vision-language model's `[3,
        batch, new]`) are written into the KV cache slots `cache_slots` `[new]`; `images`: a prefill's
        (`ketch.models.vision.image_model_inputs`)."""
        out = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            cache_slots=cache_slots,
            logits_to_keep=1,
            **images,
        )
        return out.logits[:, -1]

    def _prefill(self, b: DecodeBuffers, input_ids, attention_mask, positions, experts=None, images=None):
        """Logits `[batch, vocab]` of the prompts' last positions, with their keys and values written into `b`'s
        cache: eager (the prompt runs once a call: not worth a compile), in groups of rows of similar lengths
        (`prefill_groups`), each group from its longest prompt's first token on (the left padding before it is
        neither computed nor cached), with its rows' `images`; the prompt tokens' experts go to `experts` `[batch,
        length, moe_layers, top_k]` where given."""
        prompt_len = input_ids.shape[1]
        logits = None
        with eager():
            for rows, first in prefill_groups(attention_mask):
                b.use(rows)
                ids, kept = input_ids[rows, first:], slice(first, None)
                inputs = {}
                if images is not None:
                    inputs = image_model_inputs(self.model.config, ids, [images[i] for i in rows.tolist()])
                slots = torch.arange(first, prompt_len, device=ids.device)
                out = self._step(ids, attention_mask[rows, kept], positions[..., rows, kept], slots, **inputs)
                logits = out.new_empty(len(input_ids), *out.shape[1:]) if logits is None else logits
                logits[rows] = out
                if experts is not None:
                    experts[rows, first:prompt_len] = self.routing.chosen().view(len(rows), -1, *experts.shape[2:])
        b.use()
        return logits

    def _buffers(self, batch: int, length: int, device: torch.device) -> DecodeBuffers:
        key = (batch, length)
        if key not in self.caches:
            if self.compiled and key not in self.seen:
                logger.info(
                    "compiling the decode step for %d rows x %d tokens: one %s graph for its %d blocks%s "
                    "(once per shape, or loaded from %s)",
                    batch,
                    length,
                    type(self.blocks[0]).__name__,
                    len(self.blocks),
                    ", then capturing the whole step in a CUDA graph" if self.capture and device.type == "cuda" else "",
                    self.compile_cache,
                )
            self.caches[key] = DecodeBuffers(self.attentions, self.shape, batch, length, device, self.kv_dtype)
        buffers = self.caches[key]
        buffers.use()
        weights = [p.data_ptr() for p in self.model.parameters()]
        if weights != self.weights:  # a CUDA graph reads the weights where they were at its capture
            self.weights = weights
            for other in self.caches.values():
                other.clear_graphs()
        return buffers

    def _record(self, b: DecodeBuffers, logits: torch.Tensor, sampling: Sampling, is_stop: torch.Tensor, pad: int):
        """Sample each row's next token from `logits` `[rows, vocab]` and make it the next step's input: it takes
        the slot after `b.slot`, where `b.responses` and `b.log_probs` get it (the pad token and 0 in rows that had
        finished before it); a stop token finishes its row."""
        token, log_prob = self._sample(logits, sampling, b.seed)
        b.seed.add_(1)
        slot = b.slot + 1
        b.responses.index_copy_(1, slot, token.masked_fill(b.done, pad)[:, None])
        b.log_probs.index_copy_(1, slot, log_prob.masked_fill(b.done, 0.0)[:, None])
        b.done |= is_stop[token]
        b.tokens.copy_(token[:, None])
        b.mask.index_fill_(1, slot, True)
        b.slot.copy_(slot)

    def _sample(
        self, logits: torch.Tensor, sampling: Sampling, seed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next token and its log-prob `[rows]` from `logits` `[rows, vocab]`, never a token of
        `never_sampled` (the log-prob is still the whole distribution's); `seed` `[1]` keys the noise."""
        if self.never_sampled is None:
            return sampling.sample(logits, seed)
        masked = logits.index_fill(1, self.never_sampled, float("-inf"))
        token, log_prob = sampling.sample(masked, seed)
        scale = sampling.temperature if sampling.do_sample else 1.0
        return token, log_prob + ((masked.float() / scale).logsumexp(-1) - (logits.float() / scale).logsumexp(-1))

    def _iterate(self, b: DecodeBuffers, sampling: Sampling, is_stop: torch.Tensor, pad: int) -> None:
        """One token: the decode step of `b.tokens` (experts of fixed shapes: `moe_decode.decoding`), then `_record`
        of the token after it."""
        with decoding():
            logits = self._step(b.tokens, b.mask4d, b.positions, b.slot)
        b.positions.add_(1)
        self._record(b, logits, sampling, is_stop, pad)

    def _decode(self, b: DecodeBuffers, sampling: Sampling, is_stop: torch.Tensor, pad: int) -> None:
        """`_iterate` on `b`. Compiled on CUDA, the first iteration of a shape and sampling setting runs on a side
        stream (it compiles the block and the sampler) and is then captured into a CUDA graph that later
        iterations replay; not for a model whose step waits for the GPU (`architecture.cuda_graph_problem`)."""
        args = (b, sampling, is_stop, pad)
        if not (self.capture and b.tokens.is_cuda) or self.routing is not None:  # a graph's replay records nothing
            return self._iterate(*args)
        key = (sampling.key(), is_stop.data_ptr(), pad)
        if key in b.graphs:
            return b.graphs[key].replay()
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._iterate(*args)  # this token's iteration (capture runs nothing)
        torch.cuda.current_stream().wait_stream(side)
        compiled = _finished(b.tokens.device)
        b.graphs[key] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(b.graphs[key], pool=b.pool, capture_error_mode="thread_local"):
            self._iterate(*args)
        seen = (tuple(b.mask.shape), key)
        log = logger.debug if seen in self.seen else logger.info  # captured again: after `release`
        self.seen.add(seen)
        log(
            "decode step of %d rows x %d tokens: compiled/loaded in %.1f s, CUDA graph captured in %.1f s",
            *b.mask.shape,
            compiled - start,
            time.perf_counter() - compiled,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        stop_token_ids: list[int] | None,
        pad_token_id: int,
        stop_after: int | None = None,
        images: list[dict] | None = None,
        positions: torch.Tensor | None = None,
        group_stop: GroupStop | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`responses` and their `log_probs` `[batch, max_new_tokens]` for prompts `[batch, prompt_len]` (with
        `images`, each row's `multi_modal_inputs` for a vision-language model: read at prefill; `positions`, a Qwen
        one's multimodal rotary positions `[batch, 3, prompt_len]` as the rollout computed them, else computed here).
        After a row's first stop token its tokens are `pad_token_id` (log-prob 0); `stop_token_ids=None`
        decodes every row to the full length. With `buckets`, the batch runs padded to the next power of two
        rows (at least `min_rows`) and a multiple of `PROMPT_BUCKET` prompt tokens (more left padding), so that a
        few compiled shapes serve every batch; the padding rows are dropped from the result. `stop_after` decodes
        only that many tokens (the rest are `pad_token_id`) in the shape of `max_new_tokens`: a warm-up, or a
        partial rollout's round, whose prompts may be longer than the longest prompt (see `_length`). With
        `group_stop`, decoding stops once enough groups of rows are finished, and `cut_at` `[batch]` holds each row's
        tokens at that point (`max_new_tokens` for the rows the stop did not cut; `ketch.rollout.group_stop`)."""
        rows, prompt_len = input_ids.shape
        args = (max_new_tokens, sampling, stop_token_ids, pad_token_id, stop_after)
        self.cut_at = torch.full((rows,), max_new_tokens, dtype=torch.long, device=input_ids.device)
        group_stop = None if group_stop is None else group_stop.to(input_ids.device)
        if not self.buckets:
            return self._generate(
                input_ids, attention_mask, *args, images=images, positions=positions, group_stop=group_stop
            )
        extra_rows = max(self.min_rows, 1 << (rows - 1).bit_length()) - rows
        extra_len = -prompt_len % PROMPT_BUCKET
        room = self.longest_prompt + max_new_tokens - min(max_new_tokens, stop_after or max_new_tokens) - prompt_len
        if prompt_len > self.longest_prompt and room >= 0:  # a continuation: padded no further than the shape holds
            extra_len = min(extra_len, room)
        input_ids = nn.functional.pad(input_ids, (extra_len, 0, 0, extra_rows), value=pad_token_id)
        attention_mask = nn.functional.pad(attention_mask, (extra_len, 0, 0, extra_rows))
        attention_mask[rows:, -1] = 1  # padding rows decode from one token, never seen by the real rows
        images = None if images is None else [*images, *[{}] * extra_rows]
        positions = None if positions is None else nn.functional.pad(positions, (extra_len, 0, 0, 0, 0, extra_rows))
        more = {"active_rows": rows, "images": images, "positions": positions, "group_stop": group_stop}
        tokens, log_probs = self._generate(input_ids, attention_mask, *args, **more)
        if self.routing is not None:
            self.routed_experts = self.routed_experts[:rows, extra_len:]
        return tokens[:rows], log_probs[:rows]

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling,
        stop_token_ids: list[int] | None,
        pad_token_id: int,
        stop_after: int | None = None,
        active_rows: int | None = None,
        images: list[dict] | None = None,
        positions: torch.Tensor | None = None,
        group_stop: GroupStop | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate` on a batch as it is; rows from `active_rows` on count as finished from the start."""
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        decoded = min(max_new_tokens, stop_after or max_new_tokens)
        shape = (batch, self._length(prompt_len, max_new_tokens, decoded))
        timed = self.compiled and shape not in self.seen  # a shape's first decode is logged, with its prompt's part
        start = time.perf_counter()
        b = self._buffers(*shape, device)
        positions, last = self._positions(input_ids, attention_mask, images, positions)
        active = batch if active_rows is None else active_rows
        b.start(attention_mask, last, active, pad_token_id, prompt_len + CHECK_EVERY)
        experts = self._experts(batch, shape[1], device)
        logits = self._prefill(b, input_ids, attention_mask, positions, experts, images)
        prompt_s = _finished(device) - start if timed else 0.0
        is_stop = self._stop_table(stop_token_ids or [], logits.shape[-1], device)
        self._record(b, logits, sampling, is_stop, pad_token_id)
        root, rows = b, torch.arange(batch, device=device)  # rows: the batch's row in each row of `b`
        out = (b.responses, b.log_probs)
        for t in range(1, decoded):
            if t % CHECK_EVERY == 0:
                unfinished = (~b.done).nonzero().squeeze(1)
                if len(unfinished) == 0:
                    break
                if group_stop is not None and group_stop.reached(rows[unfinished]):
                    self.cut_at[rows[unfinished]] = t
                    break
                slots = prompt_len + t - 1 + CHECK_EVERY  # the next check comes before any row writes slot `slots`
                b.provide(unfinished.tolist(), slots)
                if self._compacts(len(unfinished), len(b.done), decoded - t):
                    out = self._save_rows(b, rows, out)
                    b, rows = self._compact(root, b, unfinished), rows[unfinished]
            self._decode(b, sampling, is_stop, pad_token_id)
            if experts is not None:  # the token fed at step t sits at slot prompt_len + t - 1
                experts[rows, prompt_len + t - 1] = self.routing.chosen()[: len(rows)]
        if b is not root:
            out = self._save_rows(b, rows, out)
        if timed:
            logger.info(
                "first decode of %d rows x %d tokens took %.2f s (its prompt %.2f s)",
                *shape,
                _finished(device) - start,
                prompt_s,
            )
        self.seen.add(shape)
        end = min(prompt_len + max_new_tokens, shape[1])  # a continuation's cache may end before its max_new_tokens
        pad = (0, prompt_len + max_new_tokens - end)  # copies, whatever the padding: the buffers decode again
        tokens = nn.functional.pad(out[0][:, prompt_len:end], pad, value=pad_token_id)
        if experts is not None:
            self.routed_experts = nn.functional.pad(experts[:, :end], (0, 0, 0, 0, *pad))
        return tokens, nn.functional.pad(out[1][:, prompt_len:end], pad)

    def _positions(self, input_ids, attention_mask, images, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' positions `[batch, prompt_len]` (a Qwen vision-language model's multimodal rotary positions
        `[3, batch, prompt_len]`: `rotary` `[batch, 3, prompt_len]` where given, else, with images, from
        `ketch.models.mrope`) and the position `[batch, 1]` after which each row's response counts on (the largest
        of its prompt's: past an image, the text position plus the row's offset)."""
        text = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if rotary is None and images is not None and any(images) and has_mrope(self.model.model):
            rotary = rope_positions(self.model.model, input_ids, attention_mask, images)
        if rotary is None:
            return text, text[:, -1:]
        return rotary.transpose(0, 1), rotary.amax(dim=(1, 2)).unsqueeze(1)

    def _experts(self, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
        """With `routing`: zeros `[batch, length, moe_layers, top_k]` for the experts of a batch's tokens."""
        r = self.routing
        if r is None:
            return None
        return torch.zeros(batch, length, r.layers, r.top_k, dtype=compact_dtype(r.experts), device=device)

    def _length(self, prompt_len: int, max_new_tokens: int, decoded: int) -> int:
        """The KV cache length for prompts of `prompt_len` tokens decoding `decoded` of `max_new_tokens` tokens: room
        for the prompt (with buckets, at least the longest) and `max_new_tokens`; a longer prompt with room for its
        `decoded` tokens in the longest prompt's shape takes it (a partial rollout's continuation: one shape a run)."""
        usual = self.longest_prompt + max_new_tokens
        if self.buckets and prompt_len > self.longest_prompt and prompt_len + decoded <= usual:
            return usual
        return max(prompt_len, self.longest_prompt) + max_new_tokens

    def _compacts(self, unfinished: int, rows: int, remaining: int) -> bool:
        """Whether a batch of `rows` rows with `unfinished` rows left and up to `remaining` tokens to go compacts
        (into no fewer than `min_rows` rows)."""
        return self.buckets and max(unfinished, self.min_rows) <= rows // 2 and remaining >= self.compact_remaining

    def _compact(self, root: DecodeBuffers, b: DecodeBuffers, unfinished: torch.Tensor) -> DecodeBuffers:
        """Rows `unfinished` `[n]` of `b` moved into the first rows of `root`'s memory, as the buffers of the next
        power of two rows, at least `min_rows` (`root.front`), whose other rows repeat the first of them, finished
        (their pages the scratch page). The rows' pages move by their page table rows."""
        size = max(self.min_rows, 1 << (len(unfinished) - 1).bit_length())
        small = root.front(size)
        b.move_rows(torch.cat([unfinished, unfinished[:1].expand(size - len(unfinished))]), small)
        root.pages.move(unfinished.tolist(), len(b.done))
        small.done[len(unfinished) :] = True
        small.use()
        return small

    @staticmethod
    def _save_rows(b: DecodeBuffers, rows: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]):
        """`out` (responses and log-probs `[batch, length]`) with `b`'s first `len(rows)` rows written at the batch
        rows `rows`; before the first compaction `out` is `b`'s own, and a copy of it holds every row already."""
        if out[0] is b.responses:
            return b.responses.clone(), b.log_probs.clone()
        out[0][rows] = b.responses[: len(rows)]
        out[1][rows] = b.log_probs[: len(rows)]
        return out

    def _stop_table(self, stop_token_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """`[vocab]` bool, True at the stop tokens: one lookup per step, however many stop tokens there are."""
        key = (vocab, *stop_token_ids)
        if key not in self.stop_tables:
            table = torch.zeros(vocab, dtype=torch.bool, device=device)
            table[[i for i in stop_token_ids if 0 <= i < vocab]] = True
            self.stop_tables[key] = table
        return self.stop_tables[key]
