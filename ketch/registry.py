"""A name → entry registry that refuses duplicates and lists its names when a lookup fails, and the two whose names a
config chooses: the advantage estimators (`algorithm.adv_estimator`) and the policy losses (`actor.policy_loss`).

They live below both `ketch.config`, which checks a config's names against them at load, and `ketch.algorithms`,
which fills them (its built-ins when imported, users' entries through `register_adv_estimator` and
`register_policy_loss`). Each declares the names of its built-ins, so that a config loaded before `ketch.algorithms`
is imported is checked against them too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind (`what`, used in error messages); `builtins` names the entries that
    `ketch.algorithms` adds when it is imported."""

    def __init__(self, what: str, builtins: Iterable[str] = ()) -> None:
        self._what = what
        self.builtins = frozenset(builtins)
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"a {self._what} named {name!r} is already registered; register yours under another name")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(self._unknown(name))
        return self._entries[name]

    def check(self, name: str) -> None:
        """Raise `get`'s ValueError when `name` is neither registered nor built in."""
        if name not in self._entries and name not in self.builtins:
            raise ValueError(self._unknown(name))

    def names(self) -> list[str]:
        return sorted(self.builtins | self._entries.keys())

    def _unknown(self, name: str) -> str:
        return f"unknown {self._what} {name!r}; registered: {', '.join(self.names())}"


ADV_ESTIMATORS: Registry[Any] = Registry(
    "advantage estimator", ("gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo")
)
"""`AdvEstimator`s by name (`ketch.algorithms.estimators`)."""
POLICY_LOSSES: Registry[Any] = Registry("policy loss (actor.policy_loss)", ("cispo", "gspo", "gspo_token", "vanilla"))
"""Policy-loss functions by name (`ketch.algorithms.policy_losses`)."""
