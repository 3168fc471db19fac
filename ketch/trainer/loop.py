"""`TrainingLoop`: what every step of a run shares around the algorithm: logging, validation, checkpoints,
resume, recovery from failed steps, the export at the end and the run report. `PPOTrainer` (RL), `SFTTrainer`
and `RMTrainer` supply the step itself, what a checkpoint holds of their models and how their model is written.

A failed step (a worker raising, out of memory, a worker process dying, a call timing out) is logged as
an event; when the workers are still alive a checkpoint is saved first (`trainer.checkpoint_on_failure`);
then the workers are torn down, started again and resumed from the newest complete checkpoint, up to
`trainer.max_retries` times, after which the run stops with a summary of every failure. A failure that is not
retried (the driver's own, a failed export of the model) ends the run the same way: event, summary, report.
"""

from __future__ import annotations

import json
import logging
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ketch.config import to_dict
from ketch.controller.errors import WorkerDiedError, WorkerError, describe, is_out_of_memory
from ketch.disk import write_error_cause
from ketch.engine.export import ExportError
from ketch.models import stop_token_ids
from ketch.protocol import DataProto
from ketch.report import write_report
from ketch.report.summary import failure_place
from ketch.tracking import Tracker, info
from ketch.trainer.checkpoint import CheckpointManager, due, read_trainer_state
from ketch.trainer.groups import WorkerGroups
from ketch.trainer.oom_advice import out_of_memory_advice
from ketch.trainer.run_dir import owns_run_dir, removed_if_start_fails, warn_if_steps_replaced

logger = logging.getLogger("ketch")

RECOVERABLE = (WorkerError, torch.OutOfMemoryError)


class RunFailedError(RuntimeError):
    """The run failed more often than `trainer.max_retries` allows; the message lists every failure."""


class TrainingLoop:
    """The loop every trainer runs: steps, logging, validation, checkpoints, resume, recovery and the model's export.

    A subclass sets `config`, `run_dir`, `loader`, `total_steps`, `step_size` and `val_set` (None: no validation)
    in its `__init__` (a trainer that writes the actor sets `model_path` and `tokenizer` too) and implements:

    - `_build_groups() -> WorkerGroups`: start the workers and load their models (again after a failure);
    - `_trained_roles() -> dict[str, group]`: the groups a checkpoint holds, by their directory in it;
    - `_train_step(batch: DataProto, step: int) -> dict[str, float]`: one step on a batch of `loader`, its metrics;
    - `_validate(step: int) -> dict[str, float]`: the `val/...` metrics after `step` (0: before the first).

    The other methods under "for subclasses" in `loop.py` have defaults."""

    step = 0
    step_size: str
    """What one step trains on, for the start-up line: "64 samples", "128 rows"."""
    tracker_step_lines = True
    """The tracker prints the console line of a step with timings (PPO's); False: the trainer prints its own
    (`_console_line`)."""
    val_history: list[dict[str, float]]
    failures: list[dict[str, Any]]

    @owns_run_dir
    def fit(self) -> dict[str, float]:
        """Train until `total_steps`, recovering from failed steps, and export the model.

        The run directory is locked throughout; a failure that ends the run is recorded (event, summary, report)
        before it propagates.

        Returns:
            The last step's metrics.

        Raises:
            RunDirBusyError: If another run holds the run directory.
            RunFailedError: If more steps failed than `trainer.max_retries` allows.
        """
        self._open()
        try:
            while True:
                try:
                    metrics = self._run()
                    break
                except RECOVERABLE as err:
                    self._recover(err)
            model_dir = self._export()
        except RunFailedError:
            raise
        except Exception as err:
            self._record_failure(err)
            self._close_failed()
            raise
        self._finish(metrics, model_dir)
        return metrics

    def _run(self) -> dict[str, float]:
        """Steps `self.step + 1 .. total_steps`. `self.step` counts completed steps and `self.loader_state` is
        the data position after the last of them: together they are what a checkpoint records."""
        t = self.config.trainer
        metrics: dict[str, float] = {}
        if self.step < self.total_steps:
            self._warm_up()
        if self.step == 0 and t.val_before_train and self.val_set is not None:
            self.tracker.log(self._validate_and_log_samples(step=0), step=0)
        first = self.step + 1
        while self.step < self.total_steps:
            step = self.step + 1
            metrics = self._train_step(self.loader.next_batch(), step)
            validated = due(t.test_freq, step, self.total_steps) and self.val_set is not None
            if validated:
                metrics |= self._validate_and_log_samples(step)
            self.step, self.loader_state = step, self.loader.state_dict()
            self._log(metrics, step, validated)
            stop = validated and self._stop_after(metrics)
            if due(t.save_freq, step, self.total_steps) or step == self.total_steps or stop:
                self._save_checkpoint()
            if step == first:  # what the first step built (compiled graphs) lasts: no collector scans it again
                self.groups.freeze_long_lived()
            if stop:
                info(f"stopped early at step {step} of {self.total_steps}")
                break
        return metrics

    def _log(self, metrics: dict[str, float], step: int, validated: bool) -> None:
        """Record the metrics of `step` (`metrics.jsonl`, the trackers); the trainer's own console line
        (`_console_line`), when it has one, every `trainer.log_interval` steps and at each validation."""
        self.tracker.log(metrics, step)
        line = self._console_line(step, metrics)
        if line is not None and (validated or step % self.config.trainer.log_interval == 0):
            info(line, self.tracker.bar)

    def _validate_and_log_samples(self, step: int) -> dict[str, float]:
        """Validate; the responses to the first `trainer.val_samples_to_log` prompts go to `samples.jsonl`."""
        try:
            metrics = self._validate(step)
        except Exception as err:
            err.step = step  # step 0's validation fails before step 1 starts
            raise
        self.val_history.append({"step": step, **metrics})
        keep = self.config.trainer.val_samples_to_log
        self.tracker.log_samples([r for r in getattr(metrics, "samples", []) if r["prompt_id"] < keep], step)
        return metrics

    # ----------------------------------------------------------------- start, checkpoints, resume
    def _open(self) -> None:
        """Create the run directory, the tracker and the workers, and resume; a failure here stops what started
        and leaves no new run directory behind."""
        c = self.config
        with removed_if_start_fails(self.run_dir):
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                (self.run_dir / "config.json").write_text(json.dumps(to_dict(c), indent=2))
                self.checkpoints = CheckpointManager(
                    self.run_dir / "checkpoints", c.trainer.max_checkpoints_to_keep, c.trainer.checkpoint_remote_dir
                )
                self.tracker = Tracker.for_run(self.run_dir, to_dict(c), self.total_steps, self.tracker_step_lines)
                self.failures = []
                self.groups = self._build_groups()
                self._resume(self._checkpoint_to_resume())
            except BaseException:
                if getattr(self, "groups", None) is not None:
                    self.groups.shutdown()
                if getattr(self, "tracker", None) is not None:
                    self.tracker.close(failed=True)
                raise
        info(f"run directory: {self.run_dir}; steps {self.step + 1}..{self.total_steps} of {self.step_size}")

    def _checkpoint_to_resume(self) -> Path | None:
        """The checkpoint `trainer.resume_mode` names; a start from step 1 over an earlier run's steps says that it
        replaces them."""
        mode = self.config.trainer.resume_mode
        checkpoint = self.checkpoints.to_resume(mode)
        if checkpoint is None:
            why = "trainer.resume_mode=disable" if mode == "disable" else "it holds no checkpoint to resume from"
            warn_if_steps_replaced(self.run_dir, why)
        return checkpoint

    def _resume(self, checkpoint: Path | None) -> None:
        """Restore every part of the run from `checkpoint`, or start fresh when it is None."""
        if checkpoint is None:
            self.step, self.val_history, self.loader_state = 0, [], self.loader.state_dict()
            self.tracker.truncate_after(-1)
            return
        state = read_trainer_state(checkpoint)
        for name, group in self._trained_roles().items():
            group.load_checkpoint(str(checkpoint.resolve() / name))
        self.step, self.val_history = state["global_step"], state["val_history"]
        self.loader.load_state_dict(state["loader"])
        self.loader_state = self.loader.state_dict()
        self._load_extra_state(state, checkpoint)
        self.tracker.truncate_after(self.step)
        self.tracker.event("resume", step=self.step, checkpoint=str(checkpoint))
        info(f"resumed from {checkpoint} at step {self.step}")
        if self.step >= self.total_steps:
            info(
                f"this run already finished its {self.total_steps} steps; to train again, set "
                "trainer.resume_mode=disable or another trainer.experiment_name"
            )

    def _save_checkpoint(self) -> Path:
        """Checkpoint the state after the last completed step (`self.loader_state` is the data position)."""
        staging = self.checkpoints.staging_dir(self.step)
        try:
            roles = self._trained_roles()
            for name, group in roles.items():
                group.save_checkpoint(str(staging / name))
            if "actor" in roles:  # what `ketch export` writes beside the actor's weights
                (staging / "vllm_engine_config.json").write_text(json.dumps(self.engine_config(), indent=2))
            state = {
                "global_step": self.step,
                "loader": self.loader_state,
                "val_history": self.val_history,
                "world_size": self.config.world_size(torch.cuda.is_available()),
                **self._extra_state(staging),
            }
            path = self.checkpoints.commit(staging, self.step, state, to_dict(self.config))
        except BaseException as err:
            self.checkpoints.discard(staging)
            if write_error_cause(err) is not None:
                raise self.checkpoints.io_failure(self.step, err) from err
            err.step = self.step  # the failure belongs to the step being saved, not to the next one
            raise
        self.tracker.event("checkpoint", step=self.step, path=str(path))
        return path

    def engine_config(self) -> dict[str, Any]:
        """The rollout settings of this run, as `vllm serve` takes them.

        Returns:
            `tensor_parallel_size`, `max_model_len`, `dtype`, `stop_token_ids` and `gpu_memory_utilization`, as
            written to `vllm_engine_config.json`.
        """
        c, r = self.config, self.config.rollout
        dtype = (
            c.model.dtype
            if c.model.dtype != "auto"
            else ("bfloat16" if c.uses_gpu(torch.cuda.is_available()) else "float32")
        )
        return {
            "tensor_parallel_size": r.tensor_parallel_size,
            "max_model_len": r.max_model_len or c.data.max_prompt_length + c.data.max_response_length,
            "dtype": dtype,
            "stop_token_ids": stop_token_ids(self.tokenizer, self.model_path, r.stop_token_ids),
            "gpu_memory_utilization": r.gpu_memory_utilization,
        }

    # ----------------------------------------------------------------- failures
    def _recover(self, err: BaseException) -> None:
        """Record the failure, checkpoint if possible, then restart the workers from the newest checkpoint."""
        t = self.config.trainer
        failure = self._record_failure(err)
        if t.checkpoint_on_failure and not isinstance(err, WorkerDiedError):
            self._try_checkpoint_on_failure()
        if len(self.failures) > t.max_retries:
            self._close_failed()
            raise RunFailedError(self._failure_summary()) from err
        self.groups.shutdown()
        if failure["out_of_memory"]:
            time.sleep(t.oom_retry_delay)
        self.groups = self._build_groups()
        self._resume(self.checkpoints.latest())
        self.tracker.event("recovery", step=self.step, attempt=len(self.failures))
        info(f"recovered (attempt {len(self.failures)} of {t.max_retries}); continuing after step {self.step}")

    def _record_failure(self, err: BaseException) -> dict[str, Any]:
        """Log `err` with its cause and traceback (the worker's own for a worker failure) and record it as a
        `failure` event."""
        failure = {
            "step": getattr(err, "step", self.step + 1),
            "role": getattr(err, "role", "driver"),
            "rank": getattr(err, "rank", None),
            "error": err.error if type(err) is WorkerError else describe(err),  # died / timed out: the type leads
            "traceback": err.traceback if isinstance(err, WorkerError) else "".join(traceback.format_exception(err)),
            "out_of_memory": is_out_of_memory(err),
        }
        if hasattr(err, "stage"):  # a failure after the steps (the export)
            failure["stage"] = err.stage
        if failure["out_of_memory"]:
            failure["advice"] = out_of_memory_advice(getattr(err, "method", ""), self.config)
        self.failures.append(failure)
        when, who = failure_place(failure)
        where = f"{when} failed ({who}): {failure['error']}"
        if failure.get("advice"):
            where += "\n" + failure["advice"]
        if isinstance(err, WorkerError):  # the driver's own errors reach the user whole as they propagate
            where += "\n" + failure["traceback"]
        logger.error(where)
        self.tracker.event("failure", **failure)
        return failure

    def _close_failed(self) -> None:
        """End a failed run: stop the workers, mark the trackers failed, write the report."""
        self.groups.shutdown()
        self.tracker.close(failed=True)
        self._write_report()

    def _try_checkpoint_on_failure(self) -> None:
        """Checkpoint the last completed step unless it already is: a checkpoint written before the failure is
        cleaner than the models now (the failed step may have updated some of them)."""
        latest = self.checkpoints.latest()
        if self.step == 0 or (latest is not None and read_trainer_state(latest)["global_step"] == self.step):
            return  # nothing trained since the last checkpoint (or the start): a new one would stand in for progress
        try:
            path = self._save_checkpoint()
            info(f"saved a checkpoint at the failure: {path}")
        except Exception:  # the workers may be too broken to save; recovery goes on from an older one
            logger.warning("could not save a checkpoint at the failure:\n%s", traceback.format_exc())

    def _failure_summary(self) -> str:
        lines = [
            f"the run failed {len(self.failures)} time(s), more than trainer.max_retries="
            f"{self.config.trainer.max_retries} allows:"
        ]
        for f in self.failures:
            when, who = failure_place(f)
            lines.append(f"  {when}: {who}: {f['error']}")
            if f.get("advice"):
                lines.append(textwrap.fill(f["advice"], 116, initial_indent="    ", subsequent_indent="    "))
        if self.failures[-1]["traceback"]:
            lines += ["the last failure's traceback (the failure events in metrics.jsonl hold each one):"]
            lines += [textwrap.indent(self.failures[-1]["traceback"], "  ")]
        lines += [f"details: {self.run_dir / 'summary.txt'}, {self.run_dir / 'report.html'}"]
        return "\n".join(lines)

    # ----------------------------------------------------------------- the end
    def _export(self) -> Path:
        """Write the trained model as `<run dir>/model` (`_write_model`; see `write_hf_directory`: a failed write
        leaves no `model/`)."""
        model_dir = (self.run_dir / "model").resolve()
        try:
            self._write_model(model_dir)
        except WorkerError as err:
            if not isinstance(err.cause, ExportError):
                raise
            latest = self.checkpoints.latest()
            held = f"the checkpoint {latest} holds" if latest else "no checkpoint holds"
            again = f"it resumes from {latest.name} and writes the model" if latest else "it trains again from step 1"
            failed = ExportError(
                f"{err.cause}. {held} the trained model: free space (or set trainer.default_local_dir to a larger "
                f"disk), then run the same command again: {again}"
            )
            failed.step, failed.stage = self.step, "export"  # the export follows the last step
            raise failed from err
        return model_dir

    def _finish(self, metrics: dict[str, float], model_dir: Path) -> None:
        self.groups.shutdown()
        self.tracker.event("end", step=self.step, model=str(model_dir))
        self.tracker.close()
        self._write_report()
        info(self.summary(metrics))

    def _write_report(self) -> None:
        """`report.html`, plots and `summary.txt` in the run directory; a failure here only warns."""
        try:
            path = write_report(self.run_dir)
        except Exception:  # the run's outputs are complete without the report; say how to make it again
            logger.warning(
                "could not write the run report (retry: ketch report %s):\n%s", self.run_dir, traceback.format_exc()
            )
            return
        info(f"report: {path}")

    def summary(self, metrics: dict[str, float]) -> str:
        """The end-of-run summary.

        Args:
            metrics: The last step's metrics (`fit`'s result).

        Returns:
            Lines of text: first vs last validation accuracy, the last step's reward, and where the metrics,
            checkpoint and model are.
        """
        lines = [f"finished {self.step} steps; run directory {self.run_dir}"]
        if self.val_history:
            first, last = self.val_history[0], self.val_history[-1]
            for key in (k for k in last if k.endswith("acc")):
                lines.append(f"{key}: {first.get(key, float('nan')):.3f} (step {first['step']}) -> {last[key]:.3f}")
        if "critic/score/mean" in metrics:
            lines.append(f"reward (mean score) at the last step: {metrics['critic/score/mean']:.3f}")
        latest = self.checkpoints.latest()
        lines.append(f"metrics: {self.run_dir / 'metrics.jsonl'}; checkpoint: {latest}")
        lines.append(self._model_line(self.run_dir / "model"))
        return "\n".join(lines)

    # ----------------------------------------------------------------- for subclasses
    def _build_groups(self) -> WorkerGroups:
        """Start the workers and load their models (at the start and again after a failure)."""
        raise NotImplementedError

    def _trained_roles(self) -> dict[str, Any]:
        """The groups whose models and optimizers a checkpoint holds, by their directory in it (`actor`, `critic`,
        `reward_model`: the roles of `ketch export --role`)."""
        raise NotImplementedError

    def _train_step(self, batch: DataProto, step: int) -> dict[str, float]:
        """Train on `batch` (a step's rows from `loader`); returns the step's metrics."""
        raise NotImplementedError

    def _validate(self, step: int) -> dict[str, float]:
        """The validation metrics after `step` (0: before the first), `val/...`."""
        raise NotImplementedError

    def _warm_up(self) -> None:
        """Get ready for the first step to come, outside its timings (PPO's rollout); by default nothing."""

    def _write_model(self, model_dir: Path) -> None:
        """Write the trained model as a Hugging Face directory `model_dir`: by default the actor, with the run's
        rollout settings (`engine_config`)."""
        self.groups.actor_rollout.save_pretrained(str(model_dir), self.engine_config())

    def _model_line(self, model_dir: Path) -> str:
        """The summary's last line: where the model is and what it is for."""
        return f"model: {model_dir} (serve it with: ketch serve {model_dir})"

    def _console_line(self, step: int, metrics: dict[str, float]) -> str | None:
        """The trainer's own console line for the metrics of `step`; None: the tracker's (`tracker_step_lines`)."""
        return None

    def _stop_after(self, metrics: dict[str, float]) -> bool:
        """Whether training ends at the validated step of `metrics`, before `total_steps` (SFT's `stop_when`)."""
        return False

    def _extra_state(self, directory: Path) -> dict[str, Any]:
        """More driver-side state to save in `trainer_state.json` (e.g. running reward statistics); what is too large
        for it goes into files of `directory`, the checkpoint being written."""
        return {}

    def _load_extra_state(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore what `_extra_state` saved, from the whole trainer state and the `checkpoint` directory."""
