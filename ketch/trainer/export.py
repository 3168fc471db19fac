"""`ketch export CHECKPOINT_DIR OUT_DIR`: a saved step as a Hugging Face directory, merged on the CPU (a role
that trained LoRA adapters: its adapters merged into the base model they were trained on)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from transformers import AutoConfig

from ketch.engine.checkpoint import HF_DIR
from ketch.engine.export import ExportError, load_checkpoint_state, write_hf_directory
from ketch.engine.lora import ADAPTER_CONFIG, merged_state
from ketch.models import load_causal_lm, load_critic, load_reward_model, load_tokenizer
from ketch.trainer.checkpoint import read_trainer_state

logger = logging.getLogger("ketch")

ROLES = ("actor", "critic", "reward_model")
BASE_LOADERS = {"actor": load_causal_lm, "critic": load_critic, "reward_model": load_reward_model}


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, role: str = "actor") -> Path:
    """Merge the FSDP shards of `role` in `checkpoint` (a `.../checkpoints/global_step_N` directory) on the
    CPU and write them with the config, tokenizer, generation config and vLLM engine settings of the run. A write
    that fails (a full disk) raises `ExportError` saying what to do."""
    try:
        return _export(Path(checkpoint), out_dir, role)
    except ExportError as err:
        raise ExportError(
            f"{err}. The checkpoint {checkpoint} is unchanged: free space, or give `ketch export` an out_dir on a "
            "larger disk, then run it again"
        ) from err


def _export(checkpoint: Path, out_dir: str | Path, role: str) -> Path:
    read_trainer_state(checkpoint)  # a half-written checkpoint fails here with a clear message
    part = checkpoint / role
    if role not in ROLES or not part.is_dir():
        present = [r for r in ROLES if (checkpoint / r).is_dir()]
        raise FileNotFoundError(f"{checkpoint} has no {role!r} part; it has {present}")
    hf_config = AutoConfig.from_pretrained(part / HF_DIR)
    state = load_checkpoint_state(part)
    if (part / HF_DIR / ADAPTER_CONFIG).is_file():
        state = _merged_into_base(part / HF_DIR, role, state)
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


def _merged_into_base(directory: Path, role: str, adapters: dict) -> dict:
    """The state of `role`'s base model (named in `directory/adapter_config.json`) with the checkpoint's adapters
    (and a head trained with them) merged in."""
    base = json.loads((directory / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    return merged_state(BASE_LOADERS[role](base), directory, adapters)
