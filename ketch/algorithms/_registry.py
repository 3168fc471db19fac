"""A name → object registry that refuses duplicates and lists its names when a lookup fails."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind (`what`, used in error messages)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"a {self._what} named {name!r} is already registered; register yours under another name")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"unknown {self._what} {name!r}; registered: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)
