"""What `rollout.partial` resolves to: the prompts in flight, the tokens of a round, the checks of the combination,
and the line `ketch doctor` shows for it."""

from __future__ import annotations

import math

from ketch.config.exact import old_log_prob_key
from ketch.config.schema import KetchConfig


def in_flight_prompts(config: KetchConfig) -> int:
    """Prompts generated for at once in a step: `rollout.partial.over_sample` x `data.train_batch_size`, rounded up."""
    return math.ceil(config.rollout.partial.over_sample * config.data.train_batch_size)


def round_tokens(config: KetchConfig) -> int:
    """Tokens an unfinished trajectory generates per round at most (`rollout.partial.round_tokens`); multi-turn:
    tokens it samples, over its turns. None is no budget (`data.max_response_length`: the round ends when enough
    prompts are finished), but for multi-turn rollouts, whose rounds do not stop early: `data.max_response_length /
    (max_staleness + 1)`, rounded up."""
    p, length = config.rollout.partial, config.data.max_response_length
    if p.round_tokens:
        return p.round_tokens
    return -(-length // (p.max_staleness + 1)) if config.rollout.multi_turn.enable else length


def partial_rollout_problem(config: KetchConfig) -> str | None:
    """Why `rollout.partial.enable=true` cannot run with the rest of `config`, or None."""
    c, p = config, config.rollout.partial
    if not p.enable:
        return None
    refused = {
        "algorithm.filter_groups.enable=true": c.algorithm.filter_groups.enable,
        "rollout.staleness=1": c.rollout.staleness > 0,
        "algorithm.adv_estimator=remax": c.algorithm.adv_estimator == "remax",
    }
    given = [key for key, on in refused.items() if on]
    if given:
        return (
            f"rollout.partial.enable=true does not support {given[0]} yet; set rollout.partial.enable=false or drop "
            f"{given[0]}"
        )
    if c.actor.rollout_is is None:
        also = f" and {old_log_prob_key(c).replace('true', 'false')}" if c.old_log_prob_from_rollout else ""
        return (
            "rollout.partial.enable=true trains on tokens sampled under older weights, which truncated importance "
            f"sampling against the rollout's log-probs corrects: set actor.rollout_is=token{also}"
        )
    if (p.max_staleness + 1) * round_tokens(c) < c.data.max_response_length:
        return (
            f"rollout.partial: a trajectory gets at most (max_staleness + 1) x round_tokens = {p.max_staleness + 1} x "
            f"{round_tokens(c)} tokens before it is dropped as stale, fewer than data.max_response_length="
            f"{c.data.max_response_length}, so long responses could never finish; raise rollout.partial.round_tokens "
            "or rollout.partial.max_staleness (or set round_tokens=null: no budget)"
        )
    return None


def describe_partial_rollouts(config: KetchConfig) -> str:
    """The `ketch doctor` row's text: whether partial rollouts are on and what bounds them."""
    c, p = config, config.rollout.partial
    if not p.enable:
        return "off: every step generates its prompts' responses to the end (rollout.partial.enable=false)"
    a = c.actor
    if c.rollout.multi_turn.enable:
        rounds = (
            f"rounds of up to {round_tokens(c)} sampled tokens a trajectory (over its turns; a cut turn goes on at "
            "the next round)"
        )
    else:
        ended = f"ended once {c.data.train_batch_size} prompts are finished"
        budget = f"rounds of up to {p.round_tokens} tokens a trajectory" if p.round_tokens else "one round a step"
        rounds = f"{budget} ({ended})"
    return (
        f"on: {in_flight_prompts(c)} prompts in flight for {c.data.train_batch_size} a step (over_sample "
        f"{p.over_sample:g}), {rounds}, a trajectory spans at most "
        f"{p.max_staleness + 1} steps (max_staleness {p.max_staleness}); its older tokens weighted by truncated "
        f"importance sampling (actor.rollout_is={a.rollout_is}, at most {a.rollout_is_threshold:g})"
    )
