"""The user cache directory, where built-in data and the warmed-up built-in model are kept."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KETCH_CACHE_DIR`, else `$XDG_CACHE_HOME/ketch`, else `~/.cache/ketch` (created on demand)."""
    root = os.environ.get("KETCH_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ketch"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
