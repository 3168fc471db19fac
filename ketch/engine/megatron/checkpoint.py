"""Merge a Megatron engine checkpoint (`megatron_rank{r}.pt` per rank) into HF weights on the CPU, for
`ketch export`: data-parallel rank 0's chunks hold every weight once."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from ketch.engine.checkpoint import HF_DIR
from ketch.engine.megatron.grid import RankGrid
from ketch.engine.megatron.weights import ModelShape, Parallel, megatron_to_hf


def load_megatron_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """HF-named weights of the checkpoint in `directory` (its `manifest.json` names the grid, `hf/` the model)."""
    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    hf_config = AutoConfig.from_pretrained(directory / HF_DIR)
    critic = any(name.endswith("ForTokenClassification") for name in hf_config.architectures or [])
    parallel = Parallel(manifest["tp"], manifest["pp"], manifest["vpp"])
    chunks = {}
    for rank in range(manifest["world_size"]):
        grid = RankGrid(rank, manifest["world_size"], parallel.tp, parallel.pp)
        if grid.dp_rank == 0:
            path = directory / f"megatron_rank{rank}.pt"
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)["chunks"]
            chunks |= {(grid.pp_rank, vp, grid.tp_rank): state for vp, state in enumerate(saved)}
    return megatron_to_hf(chunks, ModelShape.from_hf(hf_config, value_head=critic), parallel)
