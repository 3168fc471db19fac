"""GPU-only tests: skipped, with the reason, where torch sees fewer GPUs than a test needs (the CPU suite)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_models import tiny_decoder

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Collection hooks see every item of the session, so only this folder's tests are marked."""
    gpus = torch.cuda.device_count()
    for item in items:
        if HERE not in Path(item.path).parents:
            continue
        needed = item.get_closest_marker("gpus")
        count = needed.args[0] if needed else 1
        if gpus < count:
            item.add_marker(pytest.mark.skip(reason=f"needs {count} CUDA GPU(s), torch sees {gpus}"))


@pytest.fixture
def tiny_qwen2() -> torch.nn.Module:
    return tiny_decoder("qwen2")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs")
