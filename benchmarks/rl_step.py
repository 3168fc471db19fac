"""Time one RL step of ketch on the fixed GPU workload of the GPU-performance issue, stage by stage.

Workload (`--scale full`): a Qwen2.5-0.5B-shaped model with random weights in bf16, GRPO without KL or
critic, 16 prompts x 8 samples per step, prompts of 128 tokens, responses of exactly 256 tokens
(`ignore_eos`), one epoch, one mini-batch, AdamW lr 1e-6, update micro-batches of up to 49,152 tokens (one
per GPU). `--variant ppo` runs the same with a critic, GAE and a KL penalty to a reference policy.
`--scale small` is a scaled-down copy that runs on a CPU; `--scale 1.5b`, `3b` and `7b` are Qwen2.5's larger shapes
(their random weights drawn in bf16 on the GPU), with update micro-batches sized for one H200; `--scale 30b-a3b`
is Qwen3-30B-A3B's mixture of experts (`--layers 24` halves it, for a disk that does not hold 61 GB).
`--workload variable` lets responses stop: one token id in `stop_every` is a stop token (about one stop
per `stop_every` sampled tokens on a random model: lengths spread geometrically, a long tail up to the limit, as a
reasoning model's do) and the reward pays for stopping early; `stop_every` is `STOP_EVERY`, or a quarter of the
response length for longer ones (a mean of about a quarter, 2% of the responses at the limit).
`--response-length N` sets the responses' length (the limit, for `variable`), e.g. 8192 to 32768 for long
reasoning responses: with `--prompts 16 --n 4` and `--set model.gradient_checkpointing=true` on one H200
(docs/benchmarks.md, "Long responses on one H200").
`--lora-rank 64` trains LoRA adapters of that rank on every linear layer (`actor.lora`, and `critic.lora` with
`--variant ppo`) instead of the whole model, the base kept in the rollout's dtype; the reference is then the actor
with its adapters off, and the update's MFU counts 4 x parameters x tokens (forward and the activations' gradients;
the frozen weights take none).

    PYTHONPATH=. python3 benchmarks/rl_step.py --variant grpo --warmup 2 --steps 5 --out results/x.json

Prints per-stage seconds (median over the timed steps) and writes them as JSON with: tokens/s (the real
prompt + response tokens of each step's batch per step time), decode tokens/s (the real response tokens
per generation time), the actor update's MFU against the peak of every GPU that ran, and each worker's
peak GPU memory (read from the worker processes, so also under Ray); and the first step's time, its stages and
its ratio to a warm step (`first_step_over_warm_step`: the compile wait; run the command twice to see it with
the compiler caches of the first run, `benchmarks/device/compile_wait.sh`), beside the seconds before it
(`setup_s`: the trainer's construction and start, then the rollout's warm-up).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.autograd import DeviceType
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ketch.config import load_config
from ketch.trainer import ppo
from ketch.trainer.ppo import PPOTrainer

FIXED_WORKLOAD = {"prompts": 16, "n": 8, "prompt_len": 128, "response_len": 256}
"""The GPU workload of every Qwen2.5 shape: 16 prompts x 8 samples, prompts of 128 tokens, responses of 256."""
SCALES = {
    "full": {
        **FIXED_WORKLOAD,
        "vocab": 151936,
        "hidden": 896,
        "intermediate": 4864,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "micro": 32,
        "max_tokens": 49152,
        "tied": True,
    },
    "small": {
        "vocab": 2048,
        "hidden": 128,
        "intermediate": 512,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "prompts": 4,
        "n": 4,
        "prompt_len": 16,
        "response_len": 16,
        "micro": 16,
        "max_tokens": 512,
        "tied": True,
    },
    "1.5b": {  # Qwen2.5-1.5B's shape, the fixed workload: one H200 with token-budget micro-batches
        **FIXED_WORKLOAD,
        "vocab": 151936,
        "hidden": 1536,
        "intermediate": 8960,
        "layers": 28,
        "heads": 12,
        "kv_heads": 2,
        "micro": 32,
        "max_tokens": 16384,
        "tied": True,
    },
    "3b": {  # Qwen2.5-3B's shape, the fixed workload
        **FIXED_WORKLOAD,
        "vocab": 151936,
        "hidden": 2048,
        "intermediate": 11008,
        "layers": 36,
        "heads": 16,
        "kv_heads": 2,
        "micro": 16,
        "max_tokens": 8192,
        "tied": True,
    },
    "7b": {  # Qwen2.5-7B's shape: for Megatron TP=2 beside FSDP2 on two GPUs (with model.gradient_checkpointing)
        **FIXED_WORKLOAD,
        "vocab": 152064,
        "hidden": 3584,
        "intermediate": 18944,
        "layers": 28,
        "heads": 28,
        "kv_heads": 4,
        "micro": 16,
        "max_tokens": 16384,
        "tied": False,
    },
    "30b-a3b": {  # Qwen3-30B-A3B's shape (128 experts of width 768, 8 a token): LoRA and routing replay on one H200
        **FIXED_WORKLOAD,
        "vocab": 151936,
        "hidden": 2048,
        "intermediate": 6144,
        "layers": 48,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "experts": 128,
        "top_k": 8,
        "expert_intermediate": 768,
        "micro": 16,
        "max_tokens": 16384,
        "tied": False,
    },
}
PEAK_BF16_FLOPS = {"cuda": 989e12}
"""Dense bf16 peak of an H200 (the figure TRL's 26.7% MFU on this workload refers to)."""
STOP_EVERY = 128
"""`--workload variable`: token ids 3, 3 + STOP_EVERY, ... stop a response."""
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "wait_gen", "step")
"""`wait_gen`: with a standalone rollout at `rollout.staleness=1`, how long the weight hand-off waited for the next
step's generation, which ran (with its scoring) during the step instead of in it."""


SPECIAL = ("<pad>", "<eos>", "<unk>")


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ids 0-2 are pad/eos/unk, id i >= 3 is the word `w{i}` (special tokens must not
    be prefixes of words, or the tokenizer splits words at them)."""
    words = {token: i for i, token in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_workload(root: Path, s: dict, steps: int, device: str = "cpu") -> tuple[Path, Path]:
    """The random bf16 model of scale `s` (`random_model`) with its tokenizer, and `steps` batches of prompts
    under `root`; returns the model directory and the prompts' Parquet file."""
    tokenizer = word_tokenizer(s["vocab"])
    positions = max(4096, s["prompt_len"] + s["response_len"])
    config = qwen2_config(
        s, max_position_embeddings=positions, tie_word_embeddings=s["tied"], pad_token_id=0, eos_token_id=1
    )
    random_model(config, matmul_parameters(s), device).save_pretrained(root / "model")
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers (or this process's engines) get the GPU memory back
    # A directory of its own: next to a Qwen2 config.json, AutoTokenizer would rebuild it as a Qwen2 (BPE) one.
    tokenizer.save_pretrained(root / "tokenizer")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, s["vocab"], (s["prompts"] * steps, s["prompt_len"]), generator=g)
    rows = [{"prompt": " ".join(f"w{i}" for i in row), "data_source": "bench", "answer": ""} for row in ids.tolist()]
    pq.write_table(pa.Table.from_pylist(rows), root / "prompts.parquet")
    return root / "model", root / "prompts.parquet"


def qwen2_config(s: dict, **extra) -> Qwen2Config:
    """The Qwen2 architecture of scale `s` (vocabulary, widths, layers, heads); `extra` sets the other fields. A
    scale with `experts` is Qwen3-MoE's instead: `experts` of width `expert_intermediate`, `top_k` a token, in every
    layer."""
    sizes = {"vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["intermediate"]}
    sizes |= {"num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"]}
    if "experts" not in s:
        return Qwen2Config(**sizes, **extra)
    experts = {"num_experts": s["experts"], "num_experts_per_tok": s["top_k"]}
    experts |= {"moe_intermediate_size": s["expert_intermediate"], "head_dim": s["head_dim"]}
    return Qwen3MoeConfig(**sizes, **experts, **extra)


def join_process_group(rank: int, world: int, port: int, device: str) -> torch.device:
    """Join a process group of `world` processes spawned on this machine as `rank` (gloo for CPU tensors, NCCL
    for GPU ones); returns this rank's device (its own GPU on `device="cuda"`)."""
    cuda = device == "cuda"
    here = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(here)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    return here


def random_model(config: Qwen2Config, parameters: int, device: str) -> Qwen2ForCausalLM:
    """Random weights in bf16: below a billion `parameters` drawn in float32 on the CPU (the weights the recorded
    results used), larger models directly in bf16 on `device` (a 7B model in float32 on the CPU takes 30 GB and
    minutes to draw)."""
    torch.manual_seed(0)
    if parameters < 1e9:
        return Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def overrides(s: dict, model: Path, data: Path, args, steps: int, out: Path) -> list[str]:
    variant, device = args.variant, args.device
    reward = "score" if args.workload == "fixed" else "score_short"
    common = [
        f"model.path={model}",
        f"model.tokenizer_path={model.with_name('tokenizer')}",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        "data.shuffle=false",
        f"data.max_prompt_length={s['prompt_len']}",
        f"data.max_response_length={s['response_len']}",
        f"data.train_batch_size={s['prompts']}",
        f"rollout.n={s['n']}",
        *workload_overrides(args.workload, s["vocab"], s["response_len"]),
        "model.dtype=bfloat16" if device == "cuda" else "model.dtype=float32",
        f"trainer.device={device}",
        "actor.optim.lr=1e-6",
        f"actor.ppo_mini_batch_size={s['prompts']}",
        "actor.ppo_epochs=1",
        f"actor.ppo_micro_batch_size_per_device={s['micro']}",
        "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_device={s['max_tokens']}",
        f"critic.ppo_micro_batch_size_per_device={s['micro']}",
        f"rollout.log_prob_micro_batch_size_per_device={s['micro'] * 2}",
        f"ref.log_prob_micro_batch_size_per_device={s['micro'] * 2}",
        f"reward.function={Path(__file__).with_name('bench_reward.py')}:{reward}",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        f"trainer.total_steps={steps}",
        f"trainer.default_local_dir={out}",
    ]
    if args.lora_rank:
        common += [f"actor.lora.rank={args.lora_rank}", "actor.optim.lr=1e-5"]
        common += [f"critic.lora.rank={args.lora_rank}"] if variant == "ppo" else []
    if variant == "ppo":
        return [*common, "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "critic.optim.lr=1e-5"]
    return [*common, "algorithm.adv_estimator=grpo"]


def workload_overrides(workload: str, vocab: int, response_len: int = 256) -> list[str]:
    """`fixed`: every response runs to the full length; `variable`: one id in `stop_every(response_len)` stops a
    response."""
    if workload == "fixed":
        return ["rollout.ignore_eos=true"]
    stops = ",".join(str(i) for i in range(3, vocab, stop_every(response_len)))
    return ["rollout.ignore_eos=false", f"rollout.stop_token_ids=[{stops}]"]


def stop_every(response_len: int) -> int:
    """One stop token id in this many: STOP_EVERY, or a quarter of a longer response length (a mean response of
    about a quarter of the limit on a random model, geometric: e^-4 = 2% reach the limit)."""
    return max(STOP_EVERY, response_len // 4)


def run(args) -> dict:
    s = SCALES[args.scale] | {
        key: value
        for key, value in (
            ("prompts", args.prompts),
            ("n", args.n),
            ("response_len", args.response_length),
            ("layers", args.layers),
        )
        if value
    }
    root = Path(tempfile.mkdtemp(prefix="ketch-rl-step-"))
    total = args.warmup + args.steps
    model, data = build_workload(root, s, total, args.device)
    config = load_config(overrides=overrides(s, model, data, args, total, root) + args.set)
    start = time.perf_counter()
    trainer = PPOTrainer(config)
    trainer._open()
    opened = time.perf_counter()
    trainer._warm_up()  # as `TrainingLoop._run` does before its first step
    warmed = time.perf_counter()
    records, collector = [], GarbageCollectorTime()
    for step in range(1, total + 1 + bool(args.profile)):  # a profiled step comes after the timed ones
        first = args.profile_first_step if step == 1 else None
        with profiled_stage(args.profile if step > total else None, args.profile_stage), host_profiled(first):
            collector.seconds = 0.0
            records.append(trainer._train_step(trainer.loader.next_batch(), step))
        stages = ", ".join(f"{k}={records[-1][f'timing_s/{k}']:.3f}" for k in STAGES if f"timing_s/{k}" in records[-1])
        print(f"step {step}: {stages}, in the driver's garbage collector {collector.seconds:.3f}", flush=True)
        if step == 1:
            trainer.groups.freeze_long_lived()  # as `TrainingLoop._run` does after its first step
            print(f"compilation in the first step:\n{torch._dynamo.utils.compile_times(repr='str')}", flush=True)
    memory = worker_memory(trainer.groups)
    rows = config.data.train_batch_size * config.rollout.n
    trainer.groups.shutdown()
    result = summarize(records[args.warmup : total], s, args, rows, config)
    result["device"] = _device_name(args.device)
    result["first_step_s"] = records[0]["timing_s/step"]
    result["first_step_seconds"] = {k: records[0][f"timing_s/{k}"] for k in STAGES if f"timing_s/{k}" in records[0]}
    result["first_step_over_warm_step"] = result["first_step_s"] / result["step_s"]
    result["setup_s"] = {"open": opened - start, "warm_up": warmed - opened}
    result["workers_peak_memory"] = memory
    if args.device == "cuda":
        result["peak_gpu_memory_gib"] = max(m["allocated_gib"] for m in memory)
    return result


@contextmanager
def profiled_stage(out: str | None, stage: str):
    """Profile the enclosed step (`stage` "step") or only one of its stages (as the trainer times them)."""
    if out is None or stage == "step":
        with profiled(out):
            yield
        return
    timed = ppo._timed

    @contextmanager
    def timed_and_profiled(timings: dict, name: str):
        with profiled(out if name == stage else None), timed(timings, name):
            yield

    ppo._timed = timed_and_profiled
    try:
        yield
    finally:
        ppo._timed = timed


@contextmanager
def profiled(out: str | None):
    """Profile the enclosed step with torch.profiler (CPU and CUDA) and write to `out` its busiest operators and
    kernels (also by input shape), the call paths of its copies and the GPU's idle gaps; only what runs in this
    process is seen (the one-GPU run without Ray)."""
    if out is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        yield
    averages = prof.key_averages()
    tables = [averages.table(sort_by=key, row_limit=40) for key in ("self_cuda_time_total", "self_cpu_time_total")]
    tables.append(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=30))
    tables.append(_copy_stacks(prof.events()))
    tables.append(_device_idle(prof.events()))
    tables.append(json.dumps({k: dict(v) for k, v in torch._dynamo.utils.counters.items()}, indent=1, default=str))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n\n".join(tables))


def _copy_stacks(events, top: int = 15, depth: int = 10) -> str:
    """The `top` call paths (the nearest `depth` enclosing Python functions and operators) whose tensor copies
    took the most device time."""
    paths = defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.name == "aten::copy_":
            chain = tuple(_enclosing(event.cpu_parent, depth))
            paths[chain][0] += event.self_device_time_total / 1e3
            paths[chain][1] += 1
    ranked = sorted(paths.items(), key=lambda item: -item[1][0])[:top]
    return "\n".join(f"copy_: {ms:.2f} ms device, {n} calls\n  " + "\n  ".join(c) for c, (ms, n) in ranked)


def _device_idle(events, min_us: float = 50.0, top: int = 15, depth: int = 6) -> str:
    """How long the GPU sat idle between its first and last kernel, and what the host was doing (the innermost
    operators and Python functions on the CPU) in the `top` longest gaps over `min_us`."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:
        return "no device activity"
    gaps, busy, (start, end) = [], 0.0, kernels[0]
    for k_start, k_end in kernels[1:]:
        if k_start > end:
            busy += end - start
            gaps.append((k_start - end, end))
            start = k_start
        end = max(end, k_end)
    busy += end - start
    span = end - kernels[0][0]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    lines = [f"device busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms ({busy / span:.1%}); idle gaps:"]
    for length, at in sorted((g for g in gaps if g[0] >= min_us), reverse=True)[:top]:
        middle = at + length / 2
        inner = max(
            (e for e in host if e.time_range.start <= middle <= e.time_range.end),
            key=lambda e: e.time_range.start,
            default=None,
        )
        lines.append(
            f"{length:8.0f} us at +{(at - kernels[0][0]) / 1e3:.1f} ms  " + " < ".join(_enclosing(inner, depth))
        )
    return "\n".join(lines)


def _enclosing(event, depth: int) -> list[str]:
    """The names of `event` (None: none) and of the operators and Python functions around it, innermost first."""
    names = []
    while event is not None and len(names) < depth:
        names.append(event.name)
        event = event.cpu_parent
    return names


@contextmanager
def host_profiled(out: str | None):
    """Profile the enclosed step's Python (cProfile: the host side, so first-use work such as dynamo's tracing,
    cache loads, lazy library set-up and imports shows by function) and write its functions by cumulative and
    by own time to `out`; only what runs in this process is seen (the one-GPU run without Ray)."""
    if out is None:
        yield
        return
    profile = cProfile.Profile()
    with profile:
        yield
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(120)
    stats.sort_stats("tottime").print_stats(60)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text.getvalue())


def worker_memory(groups) -> list[dict]:
    """Each worker process's peak GPU memory, per role and rank (colocated roles share a process, so the
    actor's figure covers them)."""
    found = []
    for role in ("actor_rollout", "critic", "reward_model", "rollout"):
        group = getattr(groups, role)
        if group is not None:
            found += [{"role": role, "rank": rank, **m} for rank, m in enumerate(group.peak_device_memory())]
    return found


class GarbageCollectorTime:
    """Seconds this process spends in Python's garbage collector (`seconds`, reset by the caller)."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def summarize(records: list[dict], s: dict, args, rows: int, config) -> dict:
    """Medians over `records` (the timed steps' metrics) of the stage times and of the throughputs computed
    from each step's real tokens: `rows` sequences per step. The update's MFU is per GPU of the actor;
    `devices` counts a standalone rollout's too. `overhead` is the step less its stages: the hybrid weight
    hand-off is part of the update, a standalone one a stage of its own, and a generation started ahead
    (`rollout.staleness=1`) none of the step's."""
    gpu = args.device == "cuda"
    standalone = config.rollout.placement == "standalone"
    median = {
        k: statistics.median(r[f"timing_s/{k}"] for r in records) for k in STAGES if f"timing_s/{k}" in records[0]
    }
    median["weight_sync"] = statistics.median(r["timing_s/weight_sync"] for r in records)
    outside = (
        {"step"}
        | ({"gen", "reward"} if config.rollout.staleness else set())
        | (set() if standalone else {"weight_sync"})
    )
    median["overhead"] = median["step"] - sum(v for k, v in median.items() if k not in outside)
    train_devices = config.num_processes(gpu)
    devices = train_devices + (config.rollout_processes(gpu) if standalone else 0)
    tokens = [r["perf/total_num_tokens"] for r in records]
    new_tokens = [r["response_length/mean"] * rows for r in records]
    params = matmul_parameters(s)
    result = {
        "variant": args.variant,
        "workload": args.workload,
        "scale": args.scale,
        "response_length": s["response_len"],
        "devices": devices,
        "overrides": args.set,
        "lora_rank": args.lora_rank,
        "memory_cap_gib": args.memory_cap_gib,
        "steps_timed": len(records),
        "sequences_per_step": rows,
        "tokens_per_step": statistics.median(tokens),
        "response_tokens_per_step": statistics.median(new_tokens),
        "seconds": median,
        "step_s": median["step"],
        "tokens_per_s": _median_rate(tokens, records, "step"),
        "decode_tokens_per_s": _median_rate(new_tokens, records, "gen"),
        "parameters": params,
        "step_s_each": [r["timing_s/step"] for r in records],
    }
    partial = sorted(k for k in records[0] if k.startswith("partial/"))
    if partial:  # rollout.partial: the trajectories carried, their staleness, the tokens dropped, per timed step
        result["partial"] = {k: [r[k] for r in records] for k in partial}
    mismatch = sorted(k for k in records[0] if k.startswith("training/rollout_probs_diff"))
    if mismatch:  # the rollout's log-probs against the training forward's, per timed step
        result["mismatch"] = {k: [r[k] for r in records] for k in mismatch}
    if args.device == "cuda":
        flops = [(4 if args.lora_rank else 6) * params * t for t in tokens]
        result["update_mfu"] = _median_rate(flops, records, "update_actor") / (PEAK_BF16_FLOPS["cuda"] * train_devices)
    return result


def _median_rate(amounts: list[float], records: list[dict], stage: str) -> float:
    """The median over steps of amount / that step's seconds in `stage`."""
    return statistics.median(a / r[f"timing_s/{stage}"] for a, r in zip(amounts, records, strict=True))


def matmul_parameters(s: dict) -> int:
    """Parameters of scale `s` that take part in a token's matmuls: the layers (of a mixture of experts, the router
    and the `top_k` experts a token runs through) and one vocabulary projection (an untied input embedding is a
    lookup, so `6 x parameters x tokens` counts the FLOPs either way)."""
    head_dim = s.get("head_dim", s["hidden"] // s["heads"])
    attention = 2 * s["hidden"] * head_dim * (s["heads"] + s["kv_heads"])
    if "experts" in s:
        mlp = s["hidden"] * (s["experts"] + 3 * s["top_k"] * s["expert_intermediate"])
    else:
        mlp = 3 * s["hidden"] * s["intermediate"]
    return s["layers"] * (attention + mlp) + s["vocab"] * s["hidden"]


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    parser.add_argument(
        "--prompts", type=int, help="prompts per step (and per mini-batch), e.g. 32 on two GPUs for weak scaling"
    )
    parser.add_argument("--n", type=int, help="samples per prompt (default: the scale's, 8)")
    parser.add_argument("--layers", type=int, help="this many decoder layers instead of the scale's own")
    parser.add_argument("--response-length", type=int, help="tokens per response (the limit with --workload variable)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: every weight)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--set", nargs="*", default=[], help="extra config overrides, e.g. rollout.hf_decoding=generate"
    )
    parser.add_argument(
        "--profile", help="profile one more step after the timed ones; write its torch.profiler tables to this file"
    )
    parser.add_argument(
        "--profile-stage",
        default="step",
        choices=["step", *(k for k in STAGES if k not in ("step", "wait_gen"))],
        help="profile only this stage of the step",
    )
    parser.add_argument(
        "--profile-first-step", help="profile the first step's Python with cProfile; write its busiest functions here"
    )
    parser.add_argument(
        "--memory-cap-gib",
        type=float,
        help="let this process allocate at most this much GPU memory, e.g. 79.6 for an 80 GB GPU's share; the "
        "one-process (local) run's worker only",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total)
    start = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
