"""Tracker backends of `trainer.logger`: TensorBoard, Weights & Biases and MLflow.

Each library is imported only when its backend is chosen; a missing one raises `TrackerError` naming the
`pip install 'ketch[<extra>]'` that adds it. Nothing here needs the network unless the user's settings ask
for it: TensorBoard writes event files, wandb honours `WANDB_MODE` (offline writes into the run directory for
a later `wandb sync`), MLflow writes a file store under the run directory unless `MLFLOW_TRACKING_URI` is set.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The library each optional `trainer.logger` entry needs; the pip extra has the entry's name."""


class TrackerError(ValueError):
    """A chosen tracker cannot start (its library is missing, or it refused to open a run)."""


def install_hint(logger: str) -> str:
    """How to get the library of `logger`."""
    return f"pip install 'ketch[{logger}]'"


def _import(module: str, logger: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise TrackerError(
            f"trainer.logger includes {logger!r}, but its library cannot be imported ({err}); install it with "
            f"{install_hint(logger)}, or remove {logger} from trainer.logger"
        ) from None


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def truncate_after(self, step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardBackend:
    """Scalars as TensorBoard event files in `<run_dir>/tensorboard` (`tensorboard --logdir <run_dir>`)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict[str, Any]):
        self.summary_writer = _import("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.log_dir = run_dir / "tensorboard"
        self.writer = None
        self.purge_step: int | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            self.writer = self.summary_writer(log_dir=str(self.log_dir), purge_step=self.purge_step)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """The next events written hide those of earlier writers at steps after `step` (a resumed run)."""
        self.close(failed=False)
        self.purge_step = step + 1

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbBackend:
    """A Weights & Biases run named `experiment` in `project`, with the config, written under the run directory.

    The mode comes from the user's environment (`WANDB_MODE=offline` needs no account or network)."""

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict[str, Any]):
        wandb = _import("wandb", "wandb")
        try:
            self.run = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir))
        except Exception as err:  # wandb raises its own error classes, e.g. UsageError without an API key
            raise TrackerError(
                f"wandb could not start a run ({type(err).__name__}: {err}); log in with `wandb login`, or set "
                f"WANDB_MODE=offline to write the run under {run_dir / 'wandb'} and upload it later with `wandb sync`"
            ) from err

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def truncate_after(self, step: int) -> None:
        """wandb keeps a run's steps increasing; steps logged again after a recovery are dropped by wandb."""

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflowBackend:
    """An MLflow run named `experiment` in the experiment `project`, with the flattened config as params.

    Without `MLFLOW_TRACKING_URI`, the store is the directory `<run_dir>/mlruns` (`mlflow ui --backend-store-uri
    <run_dir>/mlruns`); MLflow 3 asks file stores to opt in with `MLFLOW_ALLOW_FILE_STORE`, which is set here
    unless the user set it."""

    PARAM_CHARS = 6000  # MLflow's limit on a parameter value
    BATCH = 100  # MLflow's limit on parameters per request

    def __init__(self, run_dir: Path, project: str, experiment: str, config: dict[str, Any]):
        tracking = _import("mlflow.tracking", "mlflow")
        self.entities = _import("mlflow.entities", "mlflow")
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        try:
            self.client = tracking.MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(project)
            experiment_id = found.experiment_id if found else self.client.create_experiment(project)
            self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        except Exception as err:  # MlflowException, or the HTTP errors of a tracking server
            raise TrackerError(f"mlflow could not start a run at {uri} ({type(err).__name__}: {err})") from err
        params = [self.entities.Param(k, str(v)[: self.PARAM_CHARS]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + self.BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self.entities.Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def truncate_after(self, step: int) -> None:
        """MLflow keeps every value; steps logged again after a recovery appear twice in its history."""

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def mlflow_key(key: str) -> str:
    """`key` with the characters MLflow refuses in metric names replaced by `_` (`val/x/pass@4` -> `val/x/pass_4`)."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: {"actor": {"optim": {"lr": 1}}} -> {"actor.optim.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


BACKENDS = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MLflowBackend}
