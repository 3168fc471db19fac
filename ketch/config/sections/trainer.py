"""The `trainer` section: steps, validation, checkpoints, resume, retries, trackers, devices and processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "ketch"
    """Project name used by trackers."""
    experiment_name: str = "arithmetic-grpo"
    """Run name; the run directory is default_local_dir/experiment_name."""
    default_local_dir: str = "runs"
    """Where run directories (metrics, checkpoints, exports) are written."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_steps: int | None = 100
    """Stop after this many steps (overrides total_epochs when set)."""
    log_interval: int = 10
    """Print one summary line every this many steps."""
    test_freq: int = 25
    """Validate every this many steps (and at the end); 0 disables periodic validation."""
    val_before_train: bool = True
    """Validate once before the first step."""
    val_samples_to_log: int = 4
    """Validation prompts whose responses (all rollout.val.n of them) are written to `<run dir>/samples.jsonl` with
    their scores at every validation; 0 writes none."""
    save_freq: int = 0
    """Save a checkpoint every this many steps (and at the end); 0 = only at the end."""
    max_checkpoints_to_keep: int | None = None
    """Keep only this many newest checkpoints (older ones are deleted); None keeps all."""
    checkpoint_remote_dir: str | None = None
    """An fsspec URL (s3://..., gs://..., file://...) that receives a copy of every saved checkpoint."""
    resume_mode: str = "auto"
    """`auto`: continue from the newest complete checkpoint of the run directory (else start fresh);
    `disable`: start fresh; or the path of a checkpoint directory (`.../checkpoints/global_step_N`)."""
    max_retries: int = 0
    """Failed steps (a worker raising, out of memory, a worker process dying) recovered from per run."""
    oom_retry_delay: float = 10.0
    """Seconds to wait after an out-of-memory failure before restarting the workers."""
    checkpoint_on_failure: bool = True
    """On a failed step, save a checkpoint first when the workers are still alive."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Trackers: any of console, jsonl (always on), tensorboard (`<run dir>/tensorboard`), wandb (honours WANDB_MODE;
    files under the run dir), mlflow (MLFLOW_TRACKING_URI, else a file store `<run dir>/mlruns`). The last three
    need their extra: pip install 'ketch[tensorboard]' (or wandb, mlflow)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers; auto = cuda when available."""
    seed: int = 1
    """Seed of data order, sampling and initialisation."""
    n_gpus_per_node: int = 1
    """GPUs per node used by the workers (when the workers run on GPUs)."""
    n_cpu_workers: int = 1
    """Worker processes per node when the workers run on CPUs (FSDP over gloo when > 1)."""
    nnodes: int = 1
    """Nodes used by the workers."""
    backend: Literal["auto", "local", "ray"] = "auto"
    """Where workers run: in this process (local), in Ray actors (ray); auto = ray when more than one
    worker process, more than one node, a standalone rollout or a trainer.ray_address is asked for."""
    placement: Literal["colocate", "split"] = "colocate"
    """Ray: all roles of a rank in one process per device (colocate), or the critic on a pool of its own (split)."""
    ray_address: str | None = None
    """Ray cluster to join: None starts a local Ray instance; `auto` or HOST:PORT joins a running cluster."""
    worker_timeout: float | None = 3600.0
    """Seconds a worker call may take before the run stops with an error naming the rank; None waits forever."""
