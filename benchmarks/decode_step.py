"""Where a decode step of the static decoder spends its time, by batch size (one GPU).

On the fixed workload's model (Qwen2.5-0.5B shape, random bf16 weights, 128 prompt + 256 sampled tokens) and
for each `--rows`: one whole generation (median of `--steps`), one token's captured iteration alone (the CUDA
graph of decode step, sampling and bookkeeping, replayed for the token after slot 128 of 384), and with
`--profile DIR` a torch.profiler table of one generation's kernels. `--parts` times the pieces of one layer's
step in isolation (each captured in a CUDA graph of 20 calls): the decode attention as ketch's Triton kernel, by
SDPA backend and as compiled math, the projections separate against fused (q/k/v, gate/up), and one token's
sampling from the `[rows, vocab]` logits as compiled torch against ketch's Triton kernel; `--sweep` times the
Triton kernels' launch settings (attention blocks, warps and stages; the sampler's chunk size). Strong scaling
over data-parallel GPUs needs a decode step that shrinks with its rows; this shows which kernels do not.
`--model` decodes another shape (`MODELS`; `--layers N` keeps N of its layers), `--unfused` keeps the layers' own
projections, `--fp8` runs them in FP8 (`rollout.quantization=fp8`), `--kv-fp8` keeps the KV cache in FP8
(`rollout.kv_cache_dtype=fp8`), and `--moe-loops` keeps a mixture's experts as
transformers computes them (no CUDA graphs: the decoding before `rollout/moe_decode.py`).
`--long-tail N` also decodes responses whose lengths spread up to N tokens (`rl_step.py --workload variable`'s
stop tokens), the whole batch to its longest row against the unfinished rows compacted into smaller shapes, and
reports the paged KV cache's size, the pages its rows held at most and what a cache of the whole length would take.
`--floor` times one layer's decode attention at long contexts (`FLOOR_SHAPES`: rows x context) split over the cache
as the decoder runs it, in one chunk per (row, key/value head) as before split-KV, and as torch SDPA on a contiguous
cache, against the memory floor (the bytes of keys and values read / the GPU's copy bandwidth); `--long-step N`
times one captured decode step at N tokens of context for each of `--rows`, with a profile of its kernels.

    PYTHONPATH=. python3 benchmarks/decode_step.py --rows 64 128 --parts --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from rl_step import SCALES, qwen2_config, random_model, stop_every
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.rollout import fused_projections, moe_decode
from ketch.rollout.fp8 import FP8Projections
from ketch.rollout.kv_pages import KVPages, as_pages
from ketch.rollout.sampling import Sampling
from ketch.rollout.static_decoding import COMPACT_REMAINING, StaticDecoder

S = SCALES["full"]


def cuda_seconds(fn, calls: int = 20, replays: int = 10) -> float:
    """Seconds per call of `fn()`, captured `calls` times into one CUDA graph and replayed (launch cost gone); a
    list of functions is called in turn (each on its own inputs, so that the GPU's L2 cache holds none of them)."""
    fns = fn if isinstance(fn, list) else [fn]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fns[i % len(fns)]()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (calls * replays)


def generation(decoder: StaticDecoder, rows: int, steps: int, profile: str | None) -> dict:
    """Whole generations of `rows` rows, then the captured decode step replayed alone."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, S["vocab"], (rows, S["prompt_len"]), generator=g).cuda()
    mask = torch.ones_like(ids)
    seconds = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.generate(ids, mask, S["response_len"], Sampling(True), None, pad_token_id=0)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    replay = captured_token(decoder.caches[(rows, S["prompt_len"] + S["response_len"])])
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decoder.generate(ids, mask, S["response_len"], Sampling(True), None, pad_token_id=0)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90)
        Path(profile).mkdir(parents=True, exist_ok=True)
        Path(profile, f"decode_{rows}rows.txt").write_text(table)
    gen = statistics.median(seconds[1:])
    return {
        "rows": rows,
        "gen_s": round(gen, 4),
        "ms_per_token": round(gen / S["response_len"] * 1e3, 3),
        "captured_token_ms": replay and round(replay * 1e3, 3),
        "first_gen_s": round(seconds[0], 2),
    }


def captured_token(buffers) -> float | None:
    """Seconds of one replay of the captured decode step of `buffers` (None where the step was not captured)."""
    if not buffers.graphs:
        return None
    (graph,) = buffers.graphs.values()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        buffers.slot.fill_(S["prompt_len"])  # replays write the token after this slot
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50


def attention_inputs(rows: int) -> tuple[torch.Tensor, ...]:
    """One layer's decode attention inputs in bf16: queries `[rows, kv_heads, group, head_dim]`, a cache of 384
    slots `[rows, kv_heads, 384, head_dim]` (keys, values) filled up to the new token at slot 319, and that slot."""
    kv_heads, group, length, dim = S["kv_heads"], S["heads"] // S["kv_heads"], 384, S["hidden"] // S["heads"]
    q = torch.randn(rows, kv_heads, group, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    filled = torch.zeros(rows, length, dtype=torch.bool, device="cuda")
    filled[:, :320] = True
    slot = torch.tensor([319], device="cuda")
    return q, k, v, filled, slot


def attention_parts(rows: int) -> dict:
    """Microseconds of one layer's decode attention (7 query heads per key/value head, 384 cache slots, the new
    token at slot 319; the kernel over the same cache in pages), by implementation, and each one's largest
    difference from float32 attention."""
    from ketch.rollout.decode_kernel import decode_attention

    q, k, v, filled, slot = attention_inputs(rows)
    mask, scale = filled[:, None, None, :], q.shape[-1] ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def math(q, k, v, mask):
        scores = (q @ k.transpose(-1, -2)).float() * scale
        return (scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)) @ v

    exact = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    compiled_math = torch.compile(math, dynamic=False)
    (k_pool, table), (v_pool, _) = as_pages(k), as_pages(v)
    runs = {"triton_kernel": lambda: decode_attention(q, k_pool, v_pool, table, filled, slot, scale)}
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        runs[f"sdpa_{name}"] = lambda backend=backend: _with_backend(backend, lambda: sdpa(q, k, v, attn_mask=mask))
    runs["compiled_math"] = lambda: compiled_math(q, k, v, mask)
    out = {}
    for name, run in runs.items():
        diff = (run().float() - exact).abs().max().item()
        out[name] = {"us": round(cuda_seconds(run) * 1e6, 2), "max_diff": round(diff, 5)}
    return out


def _with_backend(backend, run):
    with sdpa_kernel(backend):
        return run()


def projection_parts(rows: int) -> dict:
    """Microseconds of one layer's projections at `rows` tokens: q/k/v (with bias) and gate/up separate
    against one fused matmul each; o and down for comparison."""
    h, i, kv = S["hidden"], S["intermediate"], S["kv_heads"] * (S["hidden"] // S["heads"])
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(rows, i, device="cuda", dtype=torch.bfloat16)

    def linear(n_out, n_in, bias=False):
        return torch.nn.Linear(n_in, n_out, bias=bias, device="cuda", dtype=torch.bfloat16)

    q, k, v, qkv = linear(h, h, True), linear(kv, h, True), linear(kv, h, True), linear(h + 2 * kv, h, True)
    gate, up, gate_up, down, o = linear(i, h), linear(i, h), linear(2 * i, h), linear(h, i), linear(h, h)
    parts = {
        "qkv_separate": lambda: (q(x), k(x), v(x)),
        "qkv_fused": lambda: qkv(x),
        "o": lambda: o(x),
        "gate_up_separate": lambda: (gate(x), up(x)),
        "gate_up_fused": lambda: gate_up(x),
        "down": lambda: down(y),
    }
    with torch.no_grad():
        return {name: round(cuda_seconds(fn) * 1e6, 2) for name, fn in parts.items()}


def sampler_parts(rows: int) -> dict:
    """Microseconds of one token's draw (temperature 1, no filter) from bf16 logits `[rows, vocab]`: the
    compiled torch sampler (what filtered sampling runs) against the Triton kernel."""
    logits = torch.randn(rows, S["vocab"], device="cuda", dtype=torch.bfloat16)
    seed = torch.zeros(1, dtype=torch.long, device="cuda")
    sampling = Sampling(True)
    parts = {"compiled_torch": lambda: sampling.sample(logits), "triton_kernel": lambda: sampling.sample(logits, seed)}
    return {name: round(cuda_seconds(fn) * 1e6, 2) for name, fn in parts.items()}


def sweep(rows: int) -> dict:
    """Microseconds of the Triton attention kernel by launch setting (`BLOCK_N` slots × warps × stages, the same
    shapes as `attention_parts`) and of a draw by the sampling kernel's chunk size: what picked the defaults."""
    from ketch.rollout import sample_kernel
    from ketch.rollout.decode_kernel import decode_attention

    q, k, v, filled, slot = attention_inputs(rows)
    (k_pool, table), (v_pool, _) = as_pages(k), as_pages(v)
    attention = {}
    for block, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        blocks = {"BLOCK_N": block, "num_warps": warps, "num_stages": stages}
        run = partial(decode_attention, q, k_pool, v_pool, table, filled, slot, q.shape[-1] ** -0.5, blocks)
        attention[f"block{block}_warps{warps}_stages{stages}"] = round(cuda_seconds(run) * 1e6, 2)
    logits = torch.randn(rows, S["vocab"], device="cuda", dtype=torch.bfloat16)
    seed = torch.zeros(1, dtype=torch.long, device="cuda")
    sampler = {
        f"chunk{chunk}_{'sampled' if do_sample else 'greedy'}": round(
            cuda_seconds(partial(sample_kernel.sample, logits, 1.0, do_sample, seed, chunk)) * 1e6, 2
        )
        for chunk, do_sample in itertools.product((1024, 2048, 4096, 8192), (True, False))
    }
    return {"attention_us": attention, "sampler_us": sampler}


FLOOR_SHAPES = ((1, 32768), (4, 32768), (64, 4096), (16, 8192), (64, 384), (128, 384))
"""(rows, context) of `--floor`: the long tail at 32k, a batch at 4k and 8k, the fixed workload's shapes."""
L2_BYTES = 2**28
"""Keys and values per timed shape spread over copies of at least this many bytes: no call finds them in L2."""


def copy_bandwidth() -> float:
    """Bytes a second that a device-to-device copy of 1 GiB moves (read and written)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_seconds(lambda: dst.copy_(src), calls=5, replays=4)


def attention_floor(rows: int, length: int, bandwidth: float) -> dict:
    """Microseconds of one layer's decode attention of `rows` rows at `length` slots of context (the model's heads,
    bf16), each call on its own copy of the cache: the kernel as the decoder runs it (split over the cache), in one
    chunk per (row, key/value head), at each split count that fits (`split_sweep_us`), with the merge loading 16 to
    128 splits at a time where it has more than 16 (`merge_block_us`), and SDPA over a contiguous cache
    (no mask, GQA: its flash kernel), against the floor of reading the keys and values once at `bandwidth`; with
    the split kernel's largest difference from float32 SDPA."""
    from ketch.rollout.decode_kernel import MERGE_BLOCK, MIN_SPLIT_SLOTS, decode_attention, sm_count, split_count

    kv_heads, group, dim = S["kv_heads"], S["heads"] // S["kv_heads"], S["hidden"] // S["heads"]
    kv_bytes = 2 * rows * kv_heads * length * dim * 2
    copies = max(1, min(20, -(-L2_BYTES // kv_bytes)))
    q = torch.randn(rows, kv_heads, group, dim, device="cuda", dtype=torch.bfloat16)
    caches = [tuple(torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))]
    caches += [tuple(t.clone() for t in caches[0]) for _ in range(copies - 1)]
    pools = [(as_pages(k), as_pages(v)) for k, v in caches]
    filled = torch.ones(rows, length, dtype=torch.bool, device="cuda")
    slot, scale = torch.tensor([length - 1], device="cuda"), dim**-0.5
    flat_q = q.reshape(rows, kv_heads * group, 1, dim)

    def kernel(splits=None, merge_block=MERGE_BLOCK):
        return [
            partial(decode_attention, q, k, v, table, filled, slot, scale, splits=splits, merge_block=merge_block)
            for (k, table), (v, _) in pools
        ]

    sdpa = [
        partial(torch.nn.functional.scaled_dot_product_attention, flat_q, k, v, scale=scale, enable_gqa=True)
        for k, v in caches
    ]
    k, v = caches[0]
    exact = torch.nn.functional.scaled_dot_product_attention(
        flat_q.float(), k.float(), v.float(), scale=scale, enable_gqa=True
    )
    error = (kernel()[0]().reshape(exact.shape).float() - exact).abs().max().item()
    floor_us = kv_bytes / bandwidth * 1e6
    times = {
        name: cuda_seconds(fns) * 1e6
        for name, fns in (("split_kv", kernel()), ("one_chunk", kernel(1)), ("sdpa", sdpa))
    }
    record = {"rows": rows, "context": length, "splits": split_count(rows, kv_heads, length, sm_count(q))}
    record |= {f"{name}_us": round(us, 2) for name, us in times.items()}
    counts = [n for n in (8, 16, 32, 64, 128, 256) if n <= length // MIN_SPLIT_SLOTS]
    record["split_sweep_us"] = {n: round(cuda_seconds(kernel(n)) * 1e6, 2) for n in counts}
    if record["splits"] > 16:  # the merge loads more than one block of the smallest size
        blocks = (16, 32, 64, 128)
        record["merge_block_us"] = {b: round(cuda_seconds(kernel(merge_block=b)) * 1e6, 2) for b in blocks}
    record |= {f"{name}_over_floor": round(us / floor_us, 2) for name, us in times.items()}
    return record | {"floor_us": round(floor_us, 2), "kv_mb": round(kv_bytes / 1e6, 2), "max_diff": round(error, 5)}


def long_step(decoder: StaticDecoder, rows: int, length: int, profile: str | None) -> dict:
    """Milliseconds of one captured decode step (decode, sampling, bookkeeping) of `rows` rows at `length` slots of
    context, every slot filled and paged; with `profile`, a table of the step's kernels (20 replays)."""
    ids = torch.randint(3, S["vocab"], (rows, S["prompt_len"]), device="cuda")
    shape = (rows, S["prompt_len"] + length)
    warm = (ids, torch.ones_like(ids), length, Sampling(True), None)
    decoder.generate(*warm, pad_token_id=0, stop_after=2)
    b = decoder.caches[shape]
    b.provide(list(range(rows)), shape[1])  # every row's pages for the whole length: the pool grows
    decoder.generate(*warm, pad_token_id=0, stop_after=2)  # captured again on the grown pool
    (graph,) = b.graphs.values()
    b.mask.fill_(True)

    def replay():
        b.slot.fill_(shape[1] - 3)
        graph.replay()

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        replay()
    torch.cuda.synchronize()
    record = {"rows": rows, "context": shape[1], "step_ms": round((time.perf_counter() - start) / 50 * 1e3, 3)}
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=90)
        Path(profile).mkdir(parents=True, exist_ok=True)
        Path(profile, f"long_step_{rows}rows_{length}.txt").write_text(table)
    decoder.release()
    return record


def benchmark_model(name: str, layers: int | None) -> torch.nn.Module:
    """Random bf16 weights on the GPU in one of `MODELS`' shapes, with `layers` decoder layers if given."""
    if name.startswith("qwen2.5-"):
        s = S if name == "qwen2.5-0.5b" else SCALES[name.removeprefix("qwen2.5-")]
        s = s | {"layers": layers or s["layers"]}
        config = qwen2_config(s, tie_word_embeddings=s["tied"], max_position_embeddings=4096)
        return random_model(config, 5e8 if name == "qwen2.5-0.5b" else 1e9, "cuda").cuda().eval()
    torch.manual_seed(0)
    with torch.device("cuda"):
        if name == "qwen3-0.6b":
            sizes = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": layers or 28}
            sizes |= {"num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True}
            config = Qwen3Config(vocab_size=S["vocab"], head_dim=128, **sizes)
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        sizes = {"hidden_size": 2048, "num_hidden_layers": layers or 48, "num_attention_heads": 32}
        sizes |= {"num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
        config = Qwen3MoeConfig(vocab_size=S["vocab"], head_dim=128, **sizes)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-30b-a3b")
"""The fixed workload's Qwen2.5-0.5B shape, Qwen2.5-1.5B's and 7B's (`rl_step.SCALES`), Qwen3-0.6B's (28 layers,
width 1,024, 16 query / 8 key-value heads of 128 with head norms, tied) and Qwen3-30B-A3B's (48 layers, width 2,048,
32 query / 4 key-value heads, 128 experts of width 768, 8 per token)."""


def long_tail(decoder: StaticDecoder, rows: int, length: int) -> dict:
    """One generation of `rows` rows whose lengths spread up to `length` (the stop tokens of `rl_step.py
    --workload variable`), decoding the whole batch to its longest row and compacting the unfinished rows into
    smaller shapes (the default, `COMPACT_REMAINING`): each run once to compile and capture its shapes, then timed."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, S["vocab"], (rows, S["prompt_len"]), generator=g).cuda()
    stops = list(range(3, S["vocab"], stop_every(length)))
    record = {"rows": rows, "length": length}
    for name, remaining in (("whole_batch", 10**9), ("compacted", COMPACT_REMAINING)):
        decoder.compact_remaining = remaining
        for _ in range(2):
            torch.manual_seed(0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            _, log_probs = decoder.generate(ids, torch.ones_like(ids), length, Sampling(True), stops, pad_token_id=0)
            torch.cuda.synchronize()
        seconds, new_tokens = time.perf_counter() - start, int((log_probs != 0).sum())
        record[name] = {"s": round(seconds, 2), "new_tokens": new_tokens, "tokens_per_s": round(new_tokens / seconds)}
    return record | {"kv_cache": kv_cache_use(decoder.caches[(rows, S["prompt_len"] + length)].pages)}


def kv_cache_use(pages: KVPages) -> dict:
    """The paged KV cache of one shape: its pools' GiB and pages, the most pages its rows held at once, and the GiB
    a cache that reserved every row's whole length would take."""
    page_bytes = sum(t[0].numel() * t.element_size() for pair in pages.pools for t in pair)
    gib = 2**-30
    return {
        "pool_gib": round(pages.pages * page_bytes * gib, 2),
        "pool_pages": pages.pages,
        "most_pages_held": pages.most_held,
        "whole_length_gib": round(len(pages.held) * pages.per_row * page_bytes * gib, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="time one layer's attention and projections alone")
    parser.add_argument("--sweep", action="store_true", help="time the Triton kernels' launch settings")
    parser.add_argument("--profile", help="write one generation's kernel table per row count into this folder")
    parser.add_argument("--model", choices=MODELS, default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, help="this many decoder layers instead of the shape's own")
    parser.add_argument("--fp8", action="store_true", help="the projections in FP8 (rollout.quantization=fp8)")
    parser.add_argument("--kv-fp8", action="store_true", help="the KV cache in FP8 (rollout.kv_cache_dtype=fp8)")
    parser.add_argument(
        "--moe-loops", action="store_true", help="transformers' own experts (not fixed-shape), so no CUDA graphs"
    )
    parser.add_argument(
        "--unfused", action="store_true", help="keep the layers' own q/k/v and gate/up projections (before fusing)"
    )
    parser.add_argument(
        "--long-tail", type=int, help="also decode responses spread up to this many tokens, with and without compaction"
    )
    parser.add_argument("--floor", action="store_true", help="time decode attention at long contexts against the floor")
    parser.add_argument("--long-step", type=int, help="time one captured decode step of --rows at this context")
    parser.add_argument("--skip-generation", action="store_true", help="leave out the whole generations of --rows")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.unfused:
        fused_projections.ATTENTIONS.clear()
        fused_projections.MLPS.clear()
    if args.moe_loops:
        moe_decode.EXPERTS.clear()
    model = benchmark_model(args.model, args.layers)
    kv_dtype = torch.float8_e4m3fn if args.kv_fp8 else None
    decoder = StaticDecoder(model, compile_step=True, longest_prompt=S["prompt_len"], kv_dtype=kv_dtype)
    if args.fp8:
        FP8Projections(decoder.blocks)
    results = {"scale": args.model, "layers": model.config.num_hidden_layers, "unfused": args.unfused}
    results |= {
        "fp8": args.fp8,
        "kv_fp8": args.kv_fp8,
        "moe_loops": args.moe_loops,
        "device": torch.cuda.get_device_name(),
        "by_rows": [],
    }
    if args.floor:
        bandwidth = copy_bandwidth()
        results |= {"copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "floor": []}
        for rows, length in FLOOR_SHAPES:
            results["floor"].append(attention_floor(rows, length, bandwidth))
            print(json.dumps(results["floor"][-1]), flush=True)
    for rows in args.rows:
        record = {"rows": rows} if args.skip_generation else generation(decoder, rows, args.steps, args.profile)
        if args.long_step:
            record["long_step"] = long_step(decoder, rows, args.long_step, args.profile)
        if args.parts:
            record |= {
                "attention_us": attention_parts(rows),
                "projections_us": projection_parts(rows),
                "sampler_us": sampler_parts(rows),
            }
        if args.sweep:
            record["sweep"] = sweep(rows)
        if args.long_tail:
            record["long_tail"] = long_tail(decoder, rows, args.long_tail)
        print(json.dumps(record), flush=True)
        results["by_rows"].append(record)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
