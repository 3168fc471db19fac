"""Checks of combinations of keys that each look fine alone but cannot run together."""

from __future__ import annotations

from ketch.config.batch import BatchError, derive_batch_plan
from ketch.config.loader import ConfigError
from ketch.config.parallel import megatron_problems
from ketch.config.schema import KetchConfig

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def validate(config: KetchConfig) -> None:
    """Raise `ConfigError` naming the conflicting keys when `config` cannot run."""
    problems = [p for check in _CHECKS if (p := check(config))] + megatron_problems(config)
    for world in sorted({config.world_size(gpu_visible=False), config.world_size(gpu_visible=True)}):
        try:
            derive_batch_plan(config, world_size=world)
        except BatchError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def _positive_counts(c: KetchConfig) -> str | None:
    counts = {
        "data.max_prompt_length": c.data.max_prompt_length,
        "data.max_response_length": c.data.max_response_length,
        "actor.ppo_epochs": c.actor.ppo_epochs,
        "critic.ppo_epochs": c.critic.ppo_epochs,
        "trainer.total_epochs": c.trainer.total_epochs,
        "trainer.log_interval": c.trainer.log_interval,
        "trainer.n_gpus_per_node": c.trainer.n_gpus_per_node,
        "trainer.n_cpu_workers": c.trainer.n_cpu_workers,
        "trainer.nnodes": c.trainer.nnodes,
        "rollout.val.n": c.rollout.val.n,
    }
    if c.trainer.total_steps is not None:
        counts["trainer.total_steps"] = c.trainer.total_steps
    bad = [f"{k}={v}" for k, v in counts.items() if v < 1]
    return f"{', '.join(bad)} must be >= 1" if bad else None


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
    if r.temperature <= 0:
        return f"rollout.temperature={r.temperature} must be > 0 (use rollout.do_sample=false for greedy decoding)"
    if not 0 < r.top_p <= 1:
        return f"rollout.top_p={r.top_p} must be in (0, 1]"
    if r.top_k < 0:
        return f"rollout.top_k={r.top_k} must be >= 0 (0 disables top-k)"
    if r.val.n > 1 and not r.val.do_sample:
        return (
            f"rollout.val.n={r.val.n} with rollout.val.do_sample=false would give {r.val.n} identical greedy "
            "answers; set rollout.val.do_sample=true or rollout.val.n=1"
        )
    return None


def _multi_turn(c: KetchConfig) -> str | None:
    m = c.rollout.multi_turn
    if not m.enable:
        return None
    if m.max_turns < 1 or m.tool_timeout <= 0:
        return f"rollout.multi_turn.max_turns={m.max_turns} must be >= 1 and tool_timeout={m.tool_timeout} > 0"
    if not m.tools and not m.environment:
        return "rollout.multi_turn.enable=true needs rollout.multi_turn.tools (names or .py files) or .environment"
    return None


def _loggers(c: KetchConfig) -> str | None:
    unknown = [name for name in c.trainer.logger if name not in KNOWN_LOGGERS]
    if unknown:
        return f"trainer.logger has unknown entries {unknown}; choose from {list(KNOWN_LOGGERS)}"
    if c.trainer.val_samples_to_log < 0:
        return f"trainer.val_samples_to_log={c.trainer.val_samples_to_log} must be >= 0 (0 writes no samples)"
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
    if r.clip is not None and r.clip <= 0:
        return f"reward.clip={r.clip} must be > 0 (or null to disable clipping)"
    if r.model.micro_batch_size_per_device is not None and r.model.micro_batch_size_per_device < 1:
        return f"reward.model.micro_batch_size_per_device={r.model.micro_batch_size_per_device} must be >= 1 (or null)"
    return None


def _registered_algorithms(c: KetchConfig) -> str | None:
    # ketch.algorithms imports no other ketch module, so the registries can be asked at load time
    from ketch.algorithms import get_adv_estimator, get_policy_loss

    for key, lookup, name in (
        ("algorithm.adv_estimator", get_adv_estimator, c.algorithm.adv_estimator),
        ("actor.policy_loss", get_policy_loss, c.actor.policy_loss),
    ):
        try:
            lookup(name)
        except ValueError as err:
            return f"{key}={name}: {err}"
    return None


def _rollout_is(c: KetchConfig) -> str | None:
    a = c.actor
    if a.rollout_is is not None and a.recompute_old_log_prob is False:
        return "actor.rollout_is needs the training engine's old log-probs: set actor.recompute_old_log_prob=null"
    if a.rollout_is_threshold <= 0:
        return f"actor.rollout_is_threshold={a.rollout_is_threshold} must be > 0"
    return None


_CHECKS = (_positive_counts, _critic_matches_estimator, _kl_used_once, _sampling, _loggers, _backend, _reward_sources)
_CHECKS += (_registered_algorithms, _rollout_is, _multi_turn)
