"""Roles: thin glue between the engine, the rollout and the controller."""

from ketch.workers.actor import ActorRolloutRefWorker
from ketch.workers.critic import CriticWorker
from ketch.workers.reward_model import RewardModelWorker
from ketch.workers.rollout import RolloutWorker

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "RolloutWorker"]
