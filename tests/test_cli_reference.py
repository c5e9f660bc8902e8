"""The command reference is the parsers' own (docs/CLI.md), and every benchmark takes exactly
the options its code reads: `memspec bench X --help` lists only X's."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from memspec.launch import cli
from memspec.launch.clidoc import render

ROOT = Path(__file__).resolve().parent.parent
MODULES = {"eval": "evaluation", "gate": "gate_sweep", "heads": "heads_ab", "json": "structured"}


def test_docs_cli_md_is_generated_from_the_parsers():
    assert (ROOT / "docs" / "CLI.md").read_text() == render(), \
        "regenerate it: python3 -m memspec.launch.clidoc > docs/CLI.md"


def _action_parser(name: str) -> argparse.ArgumentParser:
    bench = next(a for a in cli.build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _read_attrs(module: str) -> set[str]:
    """`args.X` read anywhere in the bench module (getattr with a default is tolerant)."""
    tree = ast.parse((ROOT / "bench" / f"{module}.py").read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "args"}


@pytest.mark.parametrize("action", list(cli.BENCH_ACTIONS))
def test_each_benchmark_takes_the_options_its_code_reads_and_no_others(action):
    p = _action_parser(action)
    ns = p.parse_args([])
    missing = _read_attrs(MODULES.get(action, action)) - set(vars(ns))
    assert not missing, f"bench {action} reads {missing} but its parser has no such option"
    own = {a.dest for a in p._actions if a.option_strings and a.dest not in ("help", "debug")}
    assert own == set(cli.BENCH_ACTIONS[action][1])
    text = p.format_help()
    others = set(cli.BENCH_OPTIONS) - own
    for opt in others:
        assert f"--{opt.replace('_', '-')} " not in text, f"bench {action} --help lists {opt}"


def test_bench_alone_or_with_options_only_is_bench_eval():
    p = cli.build_parser()
    assert p.parse_args(cli._bench_default(["bench"])).what == "eval"
    args = p.parse_args(cli._bench_default(["bench", "--json", "x.json"]))
    assert (args.what, args.json) == ("eval", "x.json")
    args = p.parse_args(cli._bench_default(["--debug", "bench", "engine", "--prompts", "2"]))
    assert (args.what, args.prompts, args.debug) == ("engine", 2, True)


def test_an_option_of_another_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "messages", "--kills", "3"])
    assert "unrecognized arguments: --kills" in capsys.readouterr().err
