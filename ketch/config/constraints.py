"""Checks of a loaded config: each value within its range (`RANGES`), and combinations of keys that each look
fine alone but cannot run together."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from ketch.config.batch import BatchError, derive_batch_plan
from ketch.config.errors import raise_problems
from ketch.config.exact import exact_log_probs_problem, old_log_prob_key
from ketch.config.parallel import megatron_problems, rollout_problems
from ketch.config.partial import partial_rollout_problem
from ketch.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    FilterGroupsConfig,
    KetchConfig,
    KLControlConfig,
    LoraConfig,
    MegatronConfig,
    MultiTurnConfig,
    OptimConfig,
    OverlongBufferConfig,
    PartialRolloutConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TrainerConfig,
    ValSamplingConfig,
)
from ketch.registry import ADV_ESTIMATORS, POLICY_LOSSES

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")

POSITIVE, COUNT, NON_NEGATIVE, UNIT, FINITE = "(0, inf)", "[1, inf)", "[0, inf)", "[0, 1]", "(-inf, inf)"
RANGES: dict[type, dict[str, str | tuple[str, str]]] = {
    OptimConfig: {
        "lr": POSITIVE,
        "betas": ("[0, 1)", "AdamW's betas are decay rates, e.g. [0.9, 0.999]"),
        "weight_decay": NON_NEGATIVE,
        "grad_clip": (NON_NEGATIVE, "0 disables clipping"),
        "warmup_steps": NON_NEGATIVE,
        "min_lr_ratio": UNIT,
    },
    DataConfig: {
        "max_prompt_length": COUNT,
        "max_response_length": COUNT,
        "train_batch_size": COUNT,
        "val_batch_size": COUNT,
        "max_samples": COUNT,
    },
    ActorConfig: {
        "ppo_mini_batch_size": COUNT,
        "ppo_micro_batch_size_per_device": COUNT,
        "ppo_max_token_len_per_device": COUNT,
        "ppo_epochs": COUNT,
        "ulysses_sequence_parallel_size": COUNT,
        "clip_ratio_low": ("[0, 1)", "the ratio is clipped below at 1 - clip_ratio_low, which must stay > 0"),
        "clip_ratio_high": NON_NEGATIVE,
        "clip_ratio_c": ("(1, inf)", "the dual-clip bound is a multiple of the advantage, e.g. 3.0"),
        "gspo_clip_ratio_low": ("[0, 1)", "the sequence ratio is clipped below at 1 - gspo_clip_ratio_low"),
        "gspo_clip_ratio_high": NON_NEGATIVE,
        "loss_scale_factor": (COUNT, "null uses data.max_response_length"),
        "rollout_is_threshold": POSITIVE,
        "entropy_coeff": (FINITE, "a negative value penalises entropy"),
        "router_aux_loss_coef": (NON_NEGATIVE, "null uses the model config's router_aux_loss_coef"),
        "kl_loss_coef": NON_NEGATIVE,
    },
    LoraConfig: {
        "rank": (NON_NEGATIVE, "0 trains the whole model"),
        "alpha": POSITIVE,
        "dropout": "[0, 1)",
    },
    MegatronConfig: {
        "tensor_model_parallel_size": COUNT,
        "pipeline_model_parallel_size": COUNT,
        "virtual_pipeline_model_parallel_size": (COUNT, "null means one model chunk per stage"),
    },
    CriticConfig: {
        "ppo_mini_batch_size": COUNT,
        "ppo_micro_batch_size_per_device": COUNT,
        "ppo_epochs": COUNT,
        "cliprange_value": POSITIVE,
    },
    RefConfig: {"log_prob_micro_batch_size_per_device": COUNT},
    ValSamplingConfig: {"n": COUNT, "temperature": POSITIVE},
    MultiTurnConfig: {
        "max_turns": COUNT,
        "max_tokens_per_turn": (COUNT, "null lets a turn use what is left of data.max_response_length"),
        "tool_timeout": POSITIVE,
    },
    RolloutConfig: {
        "n": COUNT,
        "temperature": (POSITIVE, "use rollout.do_sample=false for greedy decoding"),
        "top_p": ("(0, 1]", "1 disables nucleus sampling"),
        "top_k": (NON_NEGATIVE, "0 disables top-k"),
        "stop_token_ids": NON_NEGATIVE,
        "log_prob_micro_batch_size_per_device": COUNT,
        "tensor_parallel_size": COUNT,
        "gpu_memory_utilization": "(0, 1]",
        "max_model_len": COUNT,
        "max_num_seqs": COUNT,
        "max_num_batched_tokens": COUNT,
        "n_workers_per_node": COUNT,
        "staleness": ("[0, 1]", "a standalone rollout runs at most one step ahead of training"),
    },
    PartialRolloutConfig: {
        "over_sample": ("[1, inf)", "a multiple of data.train_batch_size, e.g. 1.5"),
        "round_tokens": (COUNT, "null: no budget (multi-turn: max_response_length / (max_staleness + 1))"),
        "max_staleness": NON_NEGATIVE,
    },
    RewardModelConfig: {"micro_batch_size_per_device": COUNT},
    RewardConfig: {"clip": (POSITIVE, "null disables clipping")},
    OverlongBufferConfig: {"len": COUNT, "penalty_factor": NON_NEGATIVE},
    FilterGroupsConfig: {"gen_batch_size": COUNT, "max_num_gen_batches": (NON_NEGATIVE, "0 means no limit")},
    KLControlConfig: {"kl_coef": NON_NEGATIVE, "target_kl": POSITIVE, "horizon": COUNT},
    AlgorithmConfig: {
        "gamma": UNIT,
        "lam": UNIT,
        "clip_advantage": (POSITIVE, "null disables clipping"),
    },
    TrainerConfig: {
        "total_epochs": COUNT,
        "total_steps": COUNT,
        "log_interval": COUNT,
        "test_freq": (NON_NEGATIVE, "0 disables periodic validation"),
        "save_freq": (NON_NEGATIVE, "0 saves only at the end"),
        "val_samples_to_log": (NON_NEGATIVE, "0 writes no samples"),
        "max_checkpoints_to_keep": (COUNT, "null keeps all"),
        "max_retries": NON_NEGATIVE,
        "oom_retry_delay": NON_NEGATIVE,
        "seed": NON_NEGATIVE,
        "n_gpus_per_node": COUNT,
        "n_cpu_workers": COUNT,
        "nnodes": COUNT,
        "worker_timeout": (POSITIVE, "null waits forever"),
    },
}
"""The allowed values of numeric keys, per schema section, as intervals (`inf` for no bound), optionally with
a hint. A list is checked item by item; None (where a key allows it) always passes. A new numeric key gets a
line here."""


def validate(config: KetchConfig) -> None:
    """Raise `ConfigError` naming every key out of range, then the conflicting keys, when `config` cannot run."""
    raise_problems(out_of_range(config))
    problems = [p for check in _CHECKS if (p := check(config))] + megatron_problems(config) + rollout_problems(config)
    for world in sorted({config.world_size(gpu_visible=False), config.world_size(gpu_visible=True)}):
        try:
            derive_batch_plan(config, world_size=world)
        except BatchError as err:
            problems.append(str(err))
    raise_problems(problems)


def out_of_range(section: Any, prefix: str = "") -> list[str]:
    """One line per key of `section` (and its sub-sections) outside its range in `RANGES`."""
    problems = []
    ranges = RANGES.get(type(section), {})
    for f in dataclasses.fields(section):
        value, path = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += out_of_range(value, f"{path}.")
        elif f.name in ranges and value is not None:
            interval, hint = ranges[f.name] if isinstance(ranges[f.name], tuple) else (ranges[f.name], "")
            inside = _Interval.parse(interval)
            if not all(inside.holds(v) for v in (value if isinstance(value, list) else [value])):
                problems.append(f"{path}={value!r} must be {inside.describe()}" + (f" ({hint})" if hint else ""))
    return problems


@dataclasses.dataclass(frozen=True)
class _Interval:
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> _Interval:
        """`"(0, 1]"`, `"[1, inf)"`, ...: brackets include the bound, parentheses exclude it."""
        match = re.fullmatch(r"([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])", text)
        if match is None:
            raise ValueError(f"not an interval: {text!r}")
        return cls(float(match[2]), float(match[3]), match[1] == "[", match[4] == "]")

    def holds(self, value: Any) -> bool:
        """Whether `value` is a number inside (NaN never is)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def describe(self) -> str:
        low = f"{self.low:g}"
        if math.isinf(self.high):
            return f"{'>=' if self.low_closed else '>'} {low}"
        return f"in {'[' if self.low_closed else '('}{low}, {self.high:g}{']' if self.high_closed else ')'}"


def _critic_matches_estimator(c: KetchConfig) -> str | None:
    if c.algorithm.adv_estimator == "gae" and c.critic.enable is False:
        return "algorithm.adv_estimator=gae needs values, but critic.enable=false; enable the critic or pick grpo/rloo"
    if c.algorithm.adv_estimator != "gae" and c.critic.enable:
        return (
            f"critic.enable=true but algorithm.adv_estimator={c.algorithm.adv_estimator} does not use values; "
            "set algorithm.adv_estimator=gae or critic.enable=null"
        )
    return None


def _kl_used_once(c: KetchConfig) -> str | None:
    if c.algorithm.use_kl_in_reward and c.actor.recompute_old_log_prob is False:
        return "algorithm.use_kl_in_reward=true needs the old log-probs: set actor.recompute_old_log_prob=null"
    if c.algorithm.use_kl_in_reward and c.actor.use_kl_loss:
        return "algorithm.use_kl_in_reward=true and actor.use_kl_loss=true would penalise KL twice; keep one of them"
    return None


def _sampling(c: KetchConfig) -> str | None:
    r = c.rollout
    if r.val.n > 1 and not r.val.do_sample:
        return (
            f"rollout.val.n={r.val.n} with rollout.val.do_sample=false would give {r.val.n} identical greedy "
            "answers; set rollout.val.do_sample=true or rollout.val.n=1"
        )
    return None


def _multi_turn(c: KetchConfig) -> str | None:
    m = c.rollout.multi_turn
    if m.enable and not m.tools and not m.environment:
        return "rollout.multi_turn.enable=true needs rollout.multi_turn.tools (names or .py files) or .environment"
    given = _given(m, MultiTurnConfig(), skip=("enable",))
    if given and not m.enable:
        return (
            f"rollout.multi_turn.{given[0]} is set, but rollout.multi_turn.enable=false: the rollout is single-turn "
            "and never uses it; set rollout.multi_turn.enable=true (or drop it)"
        )
    return None


def _given(section: Any, default: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """`name=value` of each field of the dataclass `section` that differs from `default` (the same class with its
    defaults), as written on the command line (`[a,b]` for a list); the fields in `skip` left out."""
    given = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name not in skip and value != getattr(default, f.name):
            shown = f"[{','.join(map(str, value))}]" if isinstance(value, list | tuple) else value
            given.append(f"{f.name}={shown}")
    return given


def _betas(c: KetchConfig) -> str | None:
    optimizers = {
        "actor.optim": c.actor.optim,
        "critic.optim": c.critic.optim,
        "reward.model.optim": c.reward.model.optim,
    }
    bad = [f"{key}.betas={o.betas}" for key, o in optimizers.items() if len(o.betas) != 2]
    return f"{', '.join(bad)}: AdamW takes two betas, e.g. [0.9, 0.999]" if bad else None


def _loggers(c: KetchConfig) -> str | None:
    unknown = [name for name in c.trainer.logger if name not in KNOWN_LOGGERS]
    if unknown:
        return f"trainer.logger has unknown entries {unknown}; choose from {list(KNOWN_LOGGERS)}"
    return None


def _backend(c: KetchConfig) -> str | None:
    t = c.trainer
    if t.backend == "local" and (t.nnodes > 1 or t.ray_address is not None):
        return f"trainer.backend=local runs in one process; trainer.nnodes={t.nnodes} / trainer.ray_address need ray"
    if t.placement == "split" and not c.use_critic:
        return "trainer.placement=split puts the critic on its own pool, but this run has no critic"
    return None


def _reward_sources(c: KetchConfig) -> str | None:
    r = c.reward
    unknown = sorted(set(r.weights or {}) - {"rule", "model"})
    if unknown:
        return f"reward.weights has unknown sources {unknown}; the sources are rule and model, e.g. {{rule: 1.0}}"
    bad = {k: v for k, v in (r.weights or {}).items() if isinstance(v, bool) or not isinstance(v, int | float)}
    if bad:
        return f"reward.weights values must be numbers; got {bad}"
    weights = r.source_weights
    if not any(weights.values()):
        return "reward.weights gives every source weight 0, so nothing would be rewarded; give rule or model a weight"
    if weights["model"] and not r.model.path:
        return "reward.weights gives the reward model a weight, but reward.model.path is not set; set it or drop model"
    if (r.clip is not None or r.normalize) and not weights["model"]:
        return "reward.clip and reward.normalize act on reward-model scores, but none are used; set reward.model.path"
    return None


def _registered_algorithms(c: KetchConfig) -> str | None:
    for key, registry, name in (
        ("algorithm.adv_estimator", ADV_ESTIMATORS, c.algorithm.adv_estimator),
        ("actor.policy_loss", POLICY_LOSSES, c.actor.policy_loss),
    ):
        try:
            registry.check(name)
        except ValueError as err:
            return f"{key}={name}: {err}"
    return None


def _standalone_rollout(c: KetchConfig) -> str | None:
    r = c.rollout
    if r.placement == "standalone" and c.trainer.backend == "local":
        return "rollout.placement=standalone gives the rollout processes of its own, which needs trainer.backend=ray"
    if r.staleness and r.placement != "standalone":
        return (
            f"rollout.staleness={r.staleness} generates while the actor trains, which needs processes of its own: "
            "set rollout.placement=standalone"
        )
    if r.staleness and c.algorithm.filter_groups.enable:
        return (
            "algorithm.filter_groups draws more prompts while a batch is generated, which rollout.staleness=1 would "
            "do a step ahead of the data position a checkpoint records; set rollout.staleness=0 with it"
        )
    return None


def _free_memory(c: KetchConfig) -> str | None:
    r = c.rollout
    if r.free_memory_while_training and (r.name != "hf" or r.placement != "hybrid"):
        return (
            "rollout.free_memory_while_training frees the memory of an hf rollout that shares the actor's GPUs "
            f"(rollout.name=hf, rollout.placement=hybrid), not of rollout.name={r.name} with rollout.placement="
            f"{r.placement}: vLLM frees its own memory between generations, and a standalone rollout trains nothing "
            "beside it; leave it unset"
        )
    return None


def _sequence_parallel(c: KetchConfig) -> str | None:
    """Ulysses sequence parallelism: FSDP roles, packed forwards, and a size that divides the processes."""
    size = c.actor.ulysses_sequence_parallel_size
    if size == 1:
        return None
    key = f"actor.ulysses_sequence_parallel_size={size}"
    roles = ["actor"] + (["critic"] if c.use_critic else [])
    if any(getattr(c, name).strategy == "megatron" for name in roles):
        return f"{key} splits the FSDP engine's micro-batches; Megatron roles use their own sequence_parallel"
    packed = c.model.use_remove_padding
    if packed is False or (packed is None and c.trainer.device == "cpu"):
        return f"{key} splits the packed row of a micro-batch: set model.use_remove_padding=true"
    for gpu_visible in (False, True):
        processes = c.num_processes(gpu_visible)
        if c.uses_gpu(gpu_visible) == gpu_visible and processes % size:
            return _indivisible(c, key, size, gpu_visible)
    return None


def _indivisible(c: KetchConfig, key: str, size: int, gpu: bool) -> str:
    """Why `key` does not divide the worker processes of a machine with (`gpu`) or without GPUs; with
    `trainer.device=auto`, where it divides the other device's processes, the device to pin."""
    keys = {True: ("trainer.n_gpus_per_node", "GPU", "cuda"), False: ("trainer.n_cpu_workers", "CPU", "cpu")}
    count = keys[gpu][0]
    processes = c.num_processes(gpu)
    where = " that trainer.device=auto starts " + ("where a GPU is visible" if gpu else "on a machine without GPUs")
    problem = f"{key} does not divide the {processes} worker processes (trainer.nnodes x {count})"
    if c.trainer.device != "auto" or c.num_processes(not gpu) % size:
        return problem
    other_count, other_kind, other_device = keys[not gpu]
    return (
        f"{problem}{where}; set trainer.device={other_device} to use the {c.num_processes(not gpu)} {other_kind} "
        f"workers of {other_count}, or {count} to a multiple of {size}"
    )


def _rollout_is(c: KetchConfig) -> str | None:
    a = c.actor
    if a.rollout_is is not None and a.recompute_old_log_prob is False:
        return "actor.rollout_is needs the training engine's old log-probs: set actor.recompute_old_log_prob=null"
    if c.old_log_prob_from_rollout and (a.rollout_is is not None or a.recompute_old_log_prob):
        given = "actor.rollout_is" if a.rollout_is is not None else "actor.recompute_old_log_prob=true"
        return f"{old_log_prob_key(c)} skips the training engine's old log-probs, which {given} needs"
    return None


def _quantization(c: KetchConfig) -> str | None:
    r = c.rollout
    rounded = {"rollout.quantization=fp8": "weights", "rollout.kv_cache_dtype=fp8": "keys and values"}
    asked = [key for key, on in zip(rounded, (r.quantization == "fp8", r.kv_cache_dtype == "fp8"), strict=True) if on]
    if asked and c.actor.rollout_is is None:
        return (
            f"{asked[0]} samples with FP8-rounded {rounded[asked[0]]}, whose log-probs differ from the trained "
            "model's; truncated importance sampling against the rollout's log-probs corrects it: set "
            "actor.rollout_is=token"
        )
    if r.kv_cache_dtype == "fp8" and r.name == "hf" and r.hf_decoding == "generate":
        return (
            "rollout.kv_cache_dtype=fp8 is the static decoder's cache, and rollout.hf_decoding=generate decodes with "
            "transformers' own: set rollout.hf_decoding=static (or auto, on GPUs) or rollout.kv_cache_dtype=auto"
        )
    return None


def _dapo(c: KetchConfig) -> str | None:
    f, o = c.algorithm.filter_groups, c.reward.overlong_buffer
    if f.enable and (c.rollout.n < 2 or not c.rollout.do_sample):
        return (
            f"algorithm.filter_groups.enable=true keeps only groups whose samples differ, but with rollout.n="
            f"{c.rollout.n} and rollout.do_sample={str(c.rollout.do_sample).lower()} they never can, so no batch "
            "would ever fill; set rollout.n >= 2 and rollout.do_sample=true"
        )
    rounds, prompts = f.max_num_gen_batches, f.round_size(c.data.train_batch_size)
    if f.enable and rounds and rounds * prompts < c.data.train_batch_size:
        return (
            f"algorithm.filter_groups: max_num_gen_batches={rounds} rounds of gen_batch_size={prompts} prompts "
            f"generate fewer groups than the data.train_batch_size={c.data.train_batch_size} informative ones a "
            "batch needs even if none is dropped; raise algorithm.filter_groups.max_num_gen_batches (0 = no limit) "
            "or algorithm.filter_groups.gen_batch_size"
        )
    if o.enable and o.len > c.data.max_response_length:
        return f"reward.overlong_buffer.len={o.len} must be <= data.max_response_length={c.data.max_response_length}"
    if c.algorithm.overlong_filtering and c.rollout.ignore_eos:
        return (
            "algorithm.overlong_filtering=true leaves cut-off responses out of the actor's loss, and with rollout."
            "ignore_eos=true every response is cut off, so the actor would never learn; set one of them to false"
        )
    return None


def _router_replay(c: KetchConfig) -> str | None:
    a, r, key = c.actor, c.rollout, f"actor.router_replay={c.actor.router_replay}"
    if a.router_replay == "off":
        return None
    refused = {
        "rollout.name=vllm": r.name == "vllm",
        "actor.strategy=megatron": a.strategy == "megatron",
        "actor.ulysses_sequence_parallel_size > 1": a.ulysses_sequence_parallel_size > 1,
        "rollout.multi_turn.enable=true": r.multi_turn.enable,
        "rollout.partial.enable=true": r.partial.enable,
        "algorithm.filter_groups.enable=true": c.algorithm.filter_groups.enable,
    }
    given = [name for name, on in refused.items() if on]
    if given:
        return (
            f"{key} replays the experts the hf rollout records on single-turn rollouts, trained on the FSDP engine "
            f"without sequence parallelism; not with {given[0]}: set actor.router_replay=off or drop it"
        )
    if a.router_replay == "old" and c.old_log_prob_from_rollout:
        return f"{key} replays the old-log-prob pass's experts, which {old_log_prob_key(c)} skips"
    return None


def _lora(c: KetchConfig) -> str | None:
    roles = {"actor": c.actor} | ({"critic": c.critic} if c.use_critic else {})
    refused = [name for name, role in roles.items() if role.lora.enabled and role.strategy == "megatron"]
    if refused:
        name = refused[0]
        return (
            f"{name}.lora trains adapters on the FSDP engine; the Megatron engine ({name}.strategy=megatron) trains "
            f"full weights only: set {name}.strategy=fsdp or {name}.lora.rank=0"
        )
    sections = {"actor.lora": c.actor.lora, "critic.lora": c.critic.lora, "reward.model.lora": c.reward.model.lora}
    empty = [key for key, lora in sections.items() if not lora.target_modules]
    if empty:
        return f"{empty[0]}.target_modules is empty; give all-linear or names of linear layers, e.g. [q_proj, v_proj]"
    for key, lora in sections.items():
        given = _given(lora, LoraConfig(), skip=("rank", "adapter_path"))
        if given and not lora.enabled:
            return (
                f"{key}.{given[0]} is set, but {key}.rank=0: LoRA is off and every weight trains; set {key}.rank "
                f"(e.g. 16) to train adapters, or drop {key}.{given[0].split('=')[0]}"
            )
    return None


_CHECKS = (_betas, _critic_matches_estimator, _kl_used_once, _sampling, _loggers, _backend, _reward_sources)
_CHECKS += (_registered_algorithms, _rollout_is, _dapo, _multi_turn, _standalone_rollout, _free_memory, _lora)
_CHECKS += (_sequence_parallel, partial_rollout_problem, _router_replay, _quantization, exact_log_probs_problem)
