"""Sharded checkpoints of a `TrainEngine` with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer state into one directory, plus a small
per-rank file (`extra_rank{r}.pt`: learning-rate schedule, RNG states and whatever the worker adds) and,
on rank 0, `manifest.json` (world size and parameter layout) and `hf/` (the Hugging Face config and
tokenizer, so that the checkpoint exports on its own). DCP reshards on load, so a checkpoint can
be resumed with another world size; the per-rank RNG states then cannot be, which is said in a warning. A model
that trains LoRA adapters saves those (and a head trained with them), not its frozen base.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ketch.engine.engine import TrainEngine

logger = logging.getLogger("ketch.engine")

HF_DIR = "hf"
"""Subdirectory of an engine checkpoint holding the Hugging Face config and tokenizer."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_engine(
    engine: TrainEngine | Any, directory: Path, extra: dict[str, Any] | None = None, hf_config=None, tokenizer=None
) -> None:
    """Write the engine's sharded model/optimizer state, its lr schedule and `extra` (every rank calls);
    rank 0 adds `hf_config` and `tokenizer`, when given, under `HF_DIR`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rank, world = _rank_world()
    if not isinstance(engine, TrainEngine):  # the Megatron engine writes its own per-rank files and manifest
        engine.save_checkpoint(directory, extra or {})
    else:
        dcp.save(_state(engine), checkpoint_id=str(directory))
        scheduler = engine.scheduler.state_dict() if engine.scheduler is not None else None
        torch.save({"scheduler": scheduler, "rng": rng_state(), **(extra or {})}, directory / f"extra_rank{rank}.pt")
    if rank == 0:
        if isinstance(engine, TrainEngine):
            layout = {name: list(p.shape) for name, p in engine.module.named_parameters()}
            manifest = {"format": "torch.distributed.checkpoint", "world_size": world, "parameters": layout}
            (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for part in (hf_config, tokenizer):
            if part is not None:
                part.save_pretrained(directory / HF_DIR)


def load_engine(engine: TrainEngine | Any, directory: Path) -> dict[str, Any]:
    """Load what `save_engine` wrote, resharding when the world size differs; returns the extra entries.
    RNG states are restored only when the world size is the same (they belong to ranks)."""
    directory = Path(directory)
    if not isinstance(engine, TrainEngine):
        return engine.load_checkpoint(directory)
    rank, world = _rank_world()
    manifest = json.loads((directory / "manifest.json").read_text())
    state = _state(engine)
    dcp.load(state, checkpoint_id=str(directory))
    optimizers = [engine.optimizer] if engine.optimizer is not None else []
    whole = StateDictOptions(strict=all(p.requires_grad for p in engine.module.parameters()))  # else adapters only
    model, optim = state["model"], state.get("optim", {})
    set_state_dict(engine.module, optimizers, model_state_dict=model, optim_state_dict=optim, options=whole)
    extra = torch.load(directory / f"extra_rank{rank % manifest['world_size']}.pt", weights_only=False)
    if engine.scheduler is not None and extra["scheduler"] is not None:
        engine.scheduler.load_state_dict(extra["scheduler"])
    if manifest["world_size"] == world:
        set_rng_state(extra["rng"])
    else:
        logger.warning(
            "checkpoint %s was written by %d ranks and is loaded by %d: weights, optimizer and lr schedule are "
            "resharded and restored, the per-rank RNG states are not (sampling will differ from an unbroken run)",
            directory,
            manifest["world_size"],
            world,
        )
    return extra


def _state(engine: TrainEngine) -> dict[str, Any]:
    """What a checkpoint holds: the model state (of a trained engine, its trained parameters only: a model that
    trains adapters leaves out its frozen base) and the optimizer's."""
    optimizers = [engine.optimizer] if engine.optimizer is not None else []
    model, optim = get_state_dict(engine.module, optimizers)
    if not optimizers:
        return {"model": model}
    trained = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {"model": {name: t for name, t in model.items() if name in trained}, "optim": optim}


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
