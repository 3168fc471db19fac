"""Triton kernels on the CPU: a script run by Triton's interpreter in a fresh process (the interpreter is chosen when
Triton is imported), its result read back as the JSON it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def interpreted(script: str, *args: str, timeout: int = 600) -> Any:
    """What `script` (run by `python -c` with `args` and `TRITON_INTERPRET=1`) prints as JSON on its last line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
