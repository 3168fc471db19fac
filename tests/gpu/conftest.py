"""GPU-only tests: skipped, with the reason, where torch sees fewer GPUs than a test needs (the CPU suite)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    """A random 2-layer Qwen2 on the GPU in float32, head size 64 (the decode kernel's), vocabulary of 512."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).cuda().eval()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): the test needs n CUDA GPUs")
