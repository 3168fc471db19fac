"""`ketch train | sft | rm | export | convert-gguf | doctor | report | serve | config show`: parse, build, call.
No logic lives here."""

from __future__ import annotations

import argparse
import logging
import sys

from ketch.config import BatchError, ConfigError, load_config, to_yaml

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, BatchError)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that describe bad input: printed as one clear message, without a traceback."""
    from ketch.algorithms import NonFiniteError
    from ketch.controller.errors import WorkerError
    from ketch.data import DatasetError
    from ketch.engine.export import ExportError
    from ketch.models import ModelLoadError
    from ketch.rewards import RewardError, RewardFunctionError, UnknownDataSourceError
    from ketch.rollout.multi_turn import ToolError
    from ketch.rollout.vllm_adapter import VLLMUnavailableError
    from ketch.tracking import TrackerError
    from ketch.trainer.checkpoint import CheckpointError
    from ketch.trainer.loop import RunFailedError
    from ketch.trainer.mismatch_guard import RolloutMismatchError
    from ketch.trainer.preflight import StartupError
    from ketch.trainer.run_lock import RunDirBusyError

    data_errors = (DatasetError, ModelLoadError, RewardError, RewardFunctionError, UnknownDataSourceError, ToolError)
    run_errors = (NonFiniteError, WorkerError, RunFailedError, TrackerError, VLLMUnavailableError, FileNotFoundError)
    run_errors += (CheckpointError, ExportError, StartupError, RunDirBusyError, RolloutMismatchError)
    return (*USER_ERRORS, *data_errors, *run_errors)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ketch",
        description="RL post-training for language models. Overrides: key.path=value or --key.path value.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "PPO/GRPO training; with no arguments, the built-in arithmetic task on a tiny model"),
        ("sft", "supervised fine-tuning on prompt/response pairs"),
        ("rm", "reward-model training on prompt/chosen/rejected pairs (Bradley-Terry)"),
    ):
        sub = commands.add_parser(name, help=help_text, allow_abbrev=False)
        sub.add_argument("--config-path", help="YAML file with config sections (data, model, actor, ...)")
    export = commands.add_parser("export", help="write a saved step as a Hugging Face directory", allow_abbrev=False)
    export.add_argument("checkpoint", help="a checkpoint directory: <run dir>/checkpoints/global_step_N")
    export.add_argument("out_dir", help="where to write the model directory")
    export.add_argument("--role", choices=["actor", "critic", "reward_model"], default="actor")
    convert = commands.add_parser(
        "convert-gguf", help="write a GGUF model file as a Hugging Face directory", allow_abbrev=False
    )
    convert.add_argument("gguf_file", help="a .gguf model file (dequantized on conversion)")
    convert.add_argument("out_dir", help="where to write the model directory")
    convert.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    doctor = commands.add_parser("doctor", help="check the environment (and a config) before a run", allow_abbrev=False)
    doctor.add_argument("--config-path", help="YAML file with config sections; overrides may follow")
    report = commands.add_parser("report", help="write report.html, plots and summary.txt of a run", allow_abbrev=False)
    report.add_argument("run_dir", help="a run directory: trainer.default_local_dir/trainer.experiment_name")
    serve = commands.add_parser("serve", help="serve an exported model with vLLM's OpenAI server", allow_abbrev=False)
    serve.add_argument("model_dir", help="a directory written by ketch export (or <run dir>/model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    config = commands.add_parser("config", help="inspect the configuration", allow_abbrev=False)
    show = config.add_subparsers(dest="action", required=True).add_parser(
        "show", help="print the config that ketch train runs with the same arguments"
    )
    show.add_argument("--config-path", help="YAML file with config sections")
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (test runners and notebooks swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    logging.getLogger("ketch").setLevel(logging.INFO)
    try:
        if args.command == "serve":
            from ketch.serve import serve

            serve(args.model_dir, args.host, args.port, overrides)
            return 0
        if args.command == "export":
            from ketch.trainer.export import export_checkpoint

            print(export_checkpoint(args.checkpoint, args.out_dir, args.role))
            return 0
        if args.command == "convert-gguf":
            from ketch.models.gguf import convert_gguf
            from ketch.models.pretrained import DTYPES

            print(convert_gguf(args.gguf_file, args.out_dir, DTYPES[args.dtype]))
            return 0
        if args.command == "doctor":
            from ketch.doctor import doctor

            return doctor(args.config_path, overrides)
        if args.command == "report":
            from ketch.report import write_report

            path = write_report(args.run_dir)
            print((path.parent / "summary.txt").read_text(), end="")
            print(f"report: {path}")
            return 0
        # `ketch config show` prints the configuration that `ketch train` with the same arguments runs.
        command = "train" if args.command == "config" else args.command
        config = load_config(args.config_path, overrides, command, typed=True)
        if args.command == "config":
            print(to_yaml(config), end="")
        elif args.command == "train":
            from ketch.trainer.ppo import PPOTrainer

            PPOTrainer(config).fit()
        elif args.command == "sft":
            from ketch.trainer.builtin import resolve_model_path
            from ketch.trainer.sft import SFTTrainer

            SFTTrainer(config, resolve_model_path).fit()
        elif args.command == "rm":
            from ketch.trainer.rm import RMTrainer

            RMTrainer(config).fit()
    except _user_errors() as err:
        print(f"ketch {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
