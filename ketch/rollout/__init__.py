"""Rollout engines: the `Rollout` interface and its backends (`hf`; `vllm` on request)."""

from ketch.rollout import hf  # noqa: F401  (registers the backend)
from ketch.rollout.base import (
    Rollout,
    build_rollout,
    get_rollout_class,
    register_rollout,
    response_mask_from_stops,
)

__all__ = [
    "Rollout",
    "build_rollout",
    "get_rollout_class",
    "register_rollout",
    "response_mask_from_stops",
]
