"""Failed writes told apart from other errors (disk full, file too large, over a quota, read-only, I/O error),
with their cause in words and the free space, for the messages of a failed checkpoint or model export."""

from __future__ import annotations

import errno
import re
import resource
import shutil
from pathlib import Path

WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO, errno.EROFS}
_WRITE_FAILURE = re.compile(r"No space left|File too large|Disk quota|Input/output error|unexpected pos|StreamWriter")
"""A failed write is an `OSError` with one of `WRITE_ERRNOS`, or an error with one of these messages (safetensors
and DCP keep the OS's words; torch's zip writer reports a short write as `unexpected pos N vs M`)."""

_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+")


def write_error_cause(err: BaseException) -> str | None:
    """What `err`, or an error it wraps (`cause`, `__cause__`, `__context__`), says about a failed write, as
    `Type: message`; None when no error in the chain is a failed write."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).strip()
        if (isinstance(err, OSError) and err.errno in WRITE_ERRNOS) or _WRITE_FAILURE.search(text):
            if short := _SHORT_WRITE.search(text):
                return f"{_short_write_reason()}; torch's file writer stopped short: {short.group()}"
            return f"{type(err).__name__}: {text.splitlines()[-1] if text else ''}"
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return None


def _short_write_reason() -> str:
    """Why a write stopped short, which torch's writer does not say: this process's file size limit when it has
    one (`ulimit -f`), else a full disk."""
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        return f"File too large: this process may write files of at most {limit} bytes (ulimit -f)"
    return "No space left on device"


def size_text(size: int) -> str:
    """`N bytes (X.Y MiB)` for a message, in the unit that suits the size (`N bytes` alone under 1 KiB)."""
    value, unit = float(size), ""
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{size} bytes" + (f" ({value:.1f} {unit})" if unit else "")


def free_space(path: Path) -> str:
    """`N bytes (X.Y MiB) are free on <path>`, for a message."""
    return f"{size_text(shutil.disk_usage(path).free)} are free on {path}"


def directory_size(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
