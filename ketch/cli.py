"""`ketch train | sft | config show`: parse, build, call. No logic lives here."""

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
    from ketch.models import ModelLoadError
    from ketch.rewards import RewardError, RewardFunctionError, UnknownDataSourceError
    from ketch.trainer.loop import RunFailedError

    data_errors = (DatasetError, ModelLoadError, RewardError, RewardFunctionError, UnknownDataSourceError)
    return (*USER_ERRORS, *data_errors, NonFiniteError, WorkerError, RunFailedError, FileNotFoundError)


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
    ):
        sub = commands.add_parser(name, help=help_text, allow_abbrev=False)
        sub.add_argument("--config-path", help="YAML file with config sections (data, model, actor, ...)")
    export = commands.add_parser("export", help="write a saved step as a Hugging Face directory", allow_abbrev=False)
    export.add_argument("checkpoint", help="a checkpoint directory: <run dir>/checkpoints/global_step_N")
    export.add_argument("out_dir", help="where to write the model directory")
    export.add_argument("--role", choices=["actor", "critic"], default="actor")
    config = commands.add_parser("config", help="inspect the configuration", allow_abbrev=False)
    show = config.add_subparsers(dest="action", required=True).add_parser("show", help="print the resolved config")
    show.add_argument("--config-path", help="YAML file with config sections")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    logging.basicConfig(format="[%(levelname)s] %(message)s", level=logging.WARNING, force=True)
    logging.getLogger("ketch").setLevel(logging.INFO)
    try:
        if args.command == "export":
            from ketch.trainer.export import export_checkpoint

            print(export_checkpoint(args.checkpoint, args.out_dir, args.role))
            return 0
        config = load_config(args.config_path, overrides)
        if args.command == "config":
            print(to_yaml(config), end="")
        elif args.command == "train":
            from ketch.trainer.ppo import PPOTrainer

            PPOTrainer(config).fit()
        elif args.command == "sft":
            from ketch.trainer.sft import SFTTrainer

            SFTTrainer(config).fit()
    except _user_errors() as err:
        print(f"ketch {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
