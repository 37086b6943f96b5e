"""tritonlm/cli.py: the argparse tree is wired from tritonlm/commands alone, every command
module there is wired in, and the usual failures end in one line and an exit code."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tritonlm.commands
from tritonlm.cli import SUBCOMMAND_MODULES, build_parser, main


def test_subcommands_come_from_tritonlm_commands_only_and_all_of_it():
    assert all(name.startswith("tritonlm.commands.") for name in SUBCOMMAND_MODULES), SUBCOMMAND_MODULES
    modules = {f"tritonlm.commands.{m.name}" for m in pkgutil.iter_modules(tritonlm.commands.__path__)}
    assert set(SUBCOMMAND_MODULES) == modules, "a module in tritonlm/commands that cli.py does not wire in, or the reverse"
    assert all(callable(getattr(importlib.import_module(name), "add_parser", None)) for name in SUBCOMMAND_MODULES)


def test_every_subcommand_parses_its_help(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = list(sub.choices)
    assert {"serve", "serve-default", "export", "generate", "openai", "perf", "plan", "doctor", "instances"} <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: tritonlm {name}")


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    assert capsys.readouterr().out.startswith("usage: tritonlm")
