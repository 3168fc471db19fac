"""The user cache directory, where built-in data, the warmed-up built-in model and torch.compile's caches are
kept."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_FIX = "set KETCH_CACHE_DIR to a folder you can write (ketch keeps built-in data, models and compiled code there)"


def cache_root() -> Path:
    """`$KETCH_CACHE_DIR`, else `$XDG_CACHE_HOME/ketch`, else `~/.cache/ketch` (not created)."""
    root = os.environ.get("KETCH_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ketch"
    return Path(root)


def cache_dir() -> Path:
    """`cache_root()`, created on demand."""
    path = cache_root()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or error
        raise OSError(f"cannot create the ketch cache directory {path} ({reason}); {CACHE_FIX}") from error
    return path


def use_compile_cache() -> str:
    """Keep torch.compile's caches (FX graphs, AOTAutograd graphs, autotuning) under the ketch cache directory,
    so that a later run reuses them (`$TORCHINDUCTOR_CACHE_DIR` wins when set to another directory than torch's
    default, which torch itself writes there on first use, e.g. when transformers is imported); returns the
    directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
