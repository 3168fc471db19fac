"""The documentation stays true: the configuration reference is the schema's, every config key has a doc line,
every `ketch ...` command in the README and the docs parses with today's commands and keys, the README is short
and its links lead where they say, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ketch.cli import build_parser
from ketch.config import ConfigError, load_config
from ketch.config.reference import PAGE, REGENERATE, field_docs, render, schema_source, undocumented

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "benchmarks/README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")]
)
CONFIG_COMMANDS = {"train": "train", "sft": "sft", "rm": "rm", "config": "train", "doctor": "train"}
"""The commands whose overrides are config keys, and the command whose defaults they load with."""


def test_every_config_key_has_a_doc_line():
    assert undocumented(field_docs(schema_source())) == []


def test_a_key_without_a_doc_line_is_found():
    source = schema_source()
    doc = '    """Weight of the KL loss when use_kl_loss."""\n'
    assert doc in source
    assert undocumented(field_docs(source.replace(doc, ""))) == ["actor.kl_loss_coef"]


def test_the_committed_config_reference_is_current():
    assert (ROOT / PAGE).read_text() == render(), f"docs/reference/config.md is out of date; run: {REGENERATE}"


def test_the_config_reference_gives_type_default_range_doc_and_the_builtin_runs_default():
    row = next(line for line in render().splitlines() if line.startswith("| `rollout.n` |"))
    assert row == (
        "| `rollout.n` | int | `8` | `[1, inf)` | Responses sampled per prompt (GRPO/RLOO need n > 1). "
        "`ketch train` (built-in run): `16`. |"
    )
    row = next(line for line in render().splitlines() if line.startswith("| `actor.rollout_is` |"))
    assert row.startswith('| `actor.rollout_is` | "token" \\| "sequence" \\| None | `null` |  | Truncated importance')


def ketch_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, arguments after `ketch`) of every `ketch ...` command in `text`: the lines of fenced code
    blocks (continuation lines joined, comments and environment assignments dropped) and inline code spans
    (except those with a `<placeholder>`, which show what ketch prints)."""
    found, fenced, lines = [], False, text.splitlines()
    i = 0
    while i < len(lines):
        start, line = i + 1, lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and (command := re.match(r"\s*(?:[A-Z_]+=\S*\s+)*ketch\s", line)):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            found.append((start, shlex.split(line[command.end() :], comments=True)))
        else:
            spans = re.findall(r"`(ketch [^`<]+)`", line)  # a span with a <placeholder> shows output, not a command
            found += [(start, shlex.split(span)[1:]) for span in spans]
        i += 1
    return found


def check_command(argv: list[str]) -> None:
    """Parse `ketch argv` as the command line does; for the commands that take config keys, load the config with
    the same overrides (and config file, when it is one of the repository's). A bare `...` stands for the
    reader's own settings and is dropped; `ketch export` alone (a command named in prose) only has to exist."""
    argv = [a for a in argv if a != "..."]
    if not argv:
        return  # `ketch ...` in prose: any command
    parser = build_parser()
    if len(argv) == 1 or argv == ["config", "show"]:
        assert _exists(parser, argv), f"`ketch {shlex.join(argv)}` is no command"
        return
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        raise AssertionError(f"`ketch {shlex.join(argv)}` does not parse: see the usage message above") from None
    if args.command not in CONFIG_COMMANDS:
        assert args.command == "serve" or not extra, f"`ketch {args.command}` takes no {extra}"
        return
    path = args.config_path
    if path is not None and not (ROOT / path).is_file():
        assert not path.startswith("examples/"), f"{path} does not exist"
        path = None  # the reader's own file
    load_config(ROOT / path if path else None, extra, CONFIG_COMMANDS[args.command], typed=True)


def _exists(parser, command: list[str]) -> bool:
    """Whether `ketch COMMAND --help` prints a help message."""
    try:
        parser.parse_known_args([*command, "--help"])
    except SystemExit as exit:
        return exit.code == 0
    return False


COMMANDS = [(doc, line, argv) for doc in DOCS for line, argv in ketch_commands(doc.read_text())]


@pytest.mark.parametrize(("doc", "line", "argv"), COMMANDS, ids=[f"{d.relative_to(ROOT)}:{n}" for d, n, _ in COMMANDS])
def test_a_command_in_the_docs_parses_with_todays_keys(doc, line, argv):
    check_command(argv)


def test_the_commands_of_the_docs_are_found():
    found = {(doc.relative_to(ROOT).as_posix(), shlex.join(argv)) for doc, _, argv in COMMANDS}
    assert ("docs/algorithms.md", "train actor.use_kl_loss=true actor.kl_loss_coef=0.02") in found
    assert ("README.md", "train --config-path examples/gsm8k/grpo_qwen2.5_0.5b.yaml") in found
    assert len({doc for doc, _ in found}) >= 15


def test_a_renamed_key_in_a_command_fails():
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.kl_coef'"):
        check_command(["train", "actor.kl_coef=0.1"])
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["export", "runs/x/checkpoints/global_step_1"])
    with pytest.raises(AssertionError, match="does not exist"):
        check_command(["train", "--config-path", "examples/no_such.yaml"])


def test_the_readme_is_at_most_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def slug(heading: str) -> str:
    """The anchor of a Markdown heading, as GitHub and MkDocs make it for plain headings."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def section(path: Path, anchor: str) -> str:
    """The text under the heading of `path` whose anchor is `anchor`, up to the next heading of its level or
    above; empty when no heading has that anchor."""
    lines = path.read_text().splitlines()
    headings = [
        (i, len(m[1])) for i, line in enumerate(lines) if (m := re.match(r"(#+) (.*)", line)) and slug(m[2]) == anchor
    ]
    if not headings:
        return ""
    start, level = headings[0]
    end = next((j for j in range(start + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
    return "\n".join(lines[start:end])


def test_the_readmes_links_lead_to_files_and_headings_that_exist():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text()):
        path = ROOT / target[0]
        assert path.exists(), f"README.md links to {target[0]}, which does not exist"
        if target[1]:
            assert section(path, target[1]), f"{target[0]} has no heading #{target[1]}"


@pytest.mark.parametrize(
    ("link", "what"),
    [
        ("docs/algorithms.md#kl", "algorithm.kl_ctrl.kl_coef"),
        ("docs/data-and-rewards.md#your-own-reward-function", "reward.function=path/to/file.py:name"),
        ("docs/checkpoints.md#resume", "trainer.resume_mode"),
    ],
)
def test_the_readme_links_straight_to_how_to(link, what):
    assert f"]({link})" in (ROOT / "README.md").read_text()
    path, anchor = link.split("#")
    assert what in section(ROOT / path, anchor)


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make test and make docs install it)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site/reference/config.html").is_file()
