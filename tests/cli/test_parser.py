"""The command line as a whole (`agentzip_blk.cli.build_parser()`, which the man page and
shell completion are generated from): every option has help, every subcommand a description
and an example, and --config / --run-dir work after the subcommand as well as before it."""

from __future__ import annotations

import argparse

import pytest

from agentzip_blk.cli import build_parser, helptext

from .clirun import one_error_line, run

PARSER = build_parser()
LEAVES = [(path, sub) for path, sub, _ in helptext.walk(PARSER)
          if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)]


def test_every_option_has_help_and_every_subcommand_a_description_and_example():
    missing = []
    for path, sub, _ in [((), PARSER, None), *helptext.walk(PARSER)]:
        name = " ".join(path) or "(top level)"
        for action in sub._actions:
            if not action.help:
                missing.append(f"{name}: {'/'.join(action.option_strings) or action.dest}: no help")
        if path and not sub.description:
            missing.append(f"{name}: no description")
        if path and "example" not in (sub.epilog or ""):
            missing.append(f"{name}: no example")
        if path and f"agentzip-blk {path[0]}" not in (sub.epilog or ""):
            missing.append(f"{name}: the example does not run the command")
    assert not missing, "\n".join(missing)
    assert len(LEAVES) >= 18  # every command was walked, the nested ones too


def _required(sub: argparse.ArgumentParser) -> list[str]:
    """Placeholder values for what a subcommand requires, so it parses."""
    argv: list[str] = []
    def value(action):
        if action.choices:
            return str(list(action.choices)[0])
        return "1" if action.type in (int, float) else "x"
    for group in sub._mutually_exclusive_groups:
        if group.required:
            action = group._group_actions[0]
            argv += [action.option_strings[0], value(action)]
    for action in sub._actions:
        if action.required and action.option_strings:
            argv += [action.option_strings[0], value(action)]
        elif not action.option_strings and action.nargs is None:
            argv.append(value(action))
    return argv


@pytest.mark.parametrize("path, sub", LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_global_options_before_or_after_the_subcommand(path, sub):
    rest = _required(sub)
    after = PARSER.parse_args([*path, *rest, "--config", "/c/after.yaml", "--run-dir", "/r"])
    assert (after.config, after.run_dir) == ("/c/after.yaml", "/r")
    before = PARSER.parse_args(["--config", "/c/before.yaml", *path, *rest])
    assert (before.config, before.run_dir) == ("/c/before.yaml", None)  # kept, not reset
    both = PARSER.parse_args(["--config", "/c/before.yaml", *path, *rest, "--config", "/c/b.yaml"])
    assert both.config == "/c/b.yaml"  # the later one wins
    assert PARSER.parse_args([*path, *rest, "--progress"]).progress is True
    assert PARSER.parse_args([*path, *rest]).progress is False


@pytest.mark.slow
def test_up_config_after_the_subcommand_is_read(tmp_path):
    # `up --config X` was refused by the parser; now X is read, and a bad X is its error
    bad = tmp_path / "c.yaml"
    bad.write_text("pool:\n  max_size: 1K\n")
    res = run("up", "--config", bad, "--run-dir", tmp_path / "run")
    assert res.returncode == 2
    assert one_error_line(res.stderr).startswith(f"{bad}: pool.max_size")
    res = run("status", "--json", "--run-dir", tmp_path / "run")
    assert res.returncode == 3  # nothing was attached


@pytest.mark.slow
def test_commands_read_the_config_named_after_them(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("compression:\n  level: 4\n")
    res = run("config", "show", "--config", good, "-o", "KEY,VALUE", "--raw", "-n")
    assert res.returncode == 0, res.stderr
    assert ["compression.level", "4"] in [line.split() for line in res.stdout.splitlines()]
    res = run("scope", "list", "--json", "--config", good, "--run-dir", tmp_path / "run")
    assert res.returncode == 0 and f'"config": "{good}"' in res.stdout
