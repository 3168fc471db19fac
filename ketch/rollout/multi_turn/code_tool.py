"""The `python` tool: run a snippet in a fresh Python subprocess with a time limit, a memory limit and no
network, and return what it printed."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile

from ketch.rollout.multi_turn.tools import tool

TIME_LIMIT_S = 5.0
MEMORY_LIMIT_BYTES = 512 * 2**20
MAX_OUTPUT_CHARS = 2000

_NO_NETWORK = """
import socket
def _blocked(*args, **kwargs):
    raise OSError("network access is disabled in the python tool")
socket.socket.connect = socket.socket.connect_ex = socket.socket.sendto = _blocked
socket.create_connection = socket.getaddrinfo = _blocked
del socket, _blocked
"""
"""Prepended to the snippet: no socket can connect or resolve a name (and on Linux, `unshare -rn` below removes
the network altogether where the kernel lets unprivileged users do so)."""


@tool(name="python")
def run_python(code: str) -> str:
    """Run Python code and return its standard output (and the error, if it fails). Use print() to show results.

    Args:
        code: a complete Python program.
    """
    with tempfile.TemporaryDirectory(prefix="ketch-python-") as workdir:
        try:
            done = subprocess.run(
                _command(),
                input=_NO_NETWORK + code,
                capture_output=True,
                text=True,
                timeout=TIME_LIMIT_S,
                cwd=workdir,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "HOME": workdir},
                preexec_fn=_limit_resources,
            )
        except subprocess.TimeoutExpired:
            return f"error: the program ran longer than {TIME_LIMIT_S:g} s and was stopped"
    output = done.stdout
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        output += f"error: {lines[-1] if lines else f'exit status {done.returncode}'}"
    return output[-MAX_OUTPUT_CHARS:] or "(no output; print() what you want to see)"


def _command() -> list[str]:
    """`python -I -` (isolated: no user site, no environment variables read), in a namespace without
    network when `unshare -rn` works here."""
    python = [sys.executable, "-I", "-"]
    return ["unshare", "-rn", *python] if _can_unshare() else python


def _can_unshare() -> bool:
    if not hasattr(_can_unshare, "result"):
        try:
            check = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=5)
            _can_unshare.result = check.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _can_unshare.result = False
    return _can_unshare.result


def _limit_resources() -> None:
    """In the child before exec: cap its address space and CPU time, give it its own process group."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    cpu = int(TIME_LIMIT_S) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    os.setsid()
