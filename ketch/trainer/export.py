"""`ketch export CHECKPOINT_DIR OUT_DIR`: a saved step as a Hugging Face directory, merged on the CPU."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from transformers import AutoConfig

from ketch.engine.checkpoint import HF_DIR
from ketch.engine.export import load_checkpoint_state, write_hf_directory
from ketch.models import load_tokenizer
from ketch.trainer.checkpoint import read_trainer_state

logger = logging.getLogger("ketch")

ROLES = ("actor", "critic", "reward_model")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, role: str = "actor") -> Path:
    """Merge the FSDP shards of `role` in `checkpoint` (a `.../checkpoints/global_step_N` directory) on the
    CPU and write them with the config, tokenizer, generation config and vLLM engine settings of the run."""
    checkpoint = Path(checkpoint)
    read_trainer_state(checkpoint)  # a half-written checkpoint fails here with a clear message
    part = checkpoint / role
    if role not in ROLES or not part.is_dir():
        present = [r for r in ROLES if (checkpoint / r).is_dir()]
        raise FileNotFoundError(f"{checkpoint} has no {role!r} part; it has {present}")
    hf_config = AutoConfig.from_pretrained(part / HF_DIR)
    state = load_checkpoint_state(part)
    if role == "critic":
        return write_hf_directory(state, hf_config, out_dir)
    if role == "reward_model":
        return write_hf_directory(state, hf_config, out_dir, load_tokenizer(str(part / HF_DIR)))
    engine_config = json.loads((checkpoint / "vllm_engine_config.json").read_text())
    tokenizer = load_tokenizer(str(part / HF_DIR))
    out = write_hf_directory(state, hf_config, out_dir, tokenizer, engine_config["stop_token_ids"], engine_config)
    shutil.copy(checkpoint / "config.json", out / "ketch_config.json")
    logger.info("exported %s of %s to %s", role, checkpoint, out)
    return out
