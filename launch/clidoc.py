"""docs/CLI.md from the command line's own parsers, so the reference cannot drift from the
code: `python3 -m memspec.launch.clidoc > docs/CLI.md` (tests/test_cli.py checks it)."""

from __future__ import annotations

import argparse

from memspec.launch.cli import build_parser

HEAD = """# memspec command reference

Generated from the parsers (`python3 -m memspec.launch.clidoc > docs/CLI.md`); every
command also answers `--help`. `memspec bench` with no action runs `memspec bench eval`.
Every error prints one line (`memspec: error: ...`); `--debug` (anywhere) adds the
traceback of an unexpected one.
"""


def _commands(p: argparse.ArgumentParser, path: list[str]
              ) -> list[tuple[list[str], str, argparse.ArgumentParser]]:
    """(command words, help, parser) of every runnable command, in the parsers' order."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            out = []
            for name, child in action.choices.items():
                sub = _commands(child, [*path, name])
                out.extend(sub or [([*path, name], helps.get(name, ""), child)])
            return out
    return []


def _flag(a: argparse.Action) -> str:
    flags = ", ".join(a.option_strings) if a.option_strings else a.dest.upper()
    if a.option_strings and a.nargs != 0:
        flags += f" {a.metavar or a.dest.upper()}"
    return flags


def render() -> str:
    out = [HEAD]
    for words, help_, p in _commands(build_parser(), ["memspec"]):
        out.append(f"\n## `{' '.join(words)}`\n")
        if help_:
            out.append(f"\n{help_[0].upper()}{help_[1:]}.\n" if not help_.endswith(".")
                       else f"\n{help_}\n")
        rows = [a for a in p._actions if not isinstance(a, argparse._HelpAction)
                and a.help is not argparse.SUPPRESS and a.dest != "debug"]
        if not rows:
            continue
        out.append("\n| argument | default | what it does |\n|---|---|---|\n")
        for a in rows:
            hidden = a.default is None or a.default is False or a.default == argparse.SUPPRESS
            default = "" if hidden or not a.option_strings else f"`{a.default}`"
            choices = f" (one of {', '.join(map(str, a.choices))})" if a.choices else ""
            text = (a.help or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{_flag(a)}` | {default} | {text}{choices} |\n")
    return "".join(out)


if __name__ == "__main__":
    print(render(), end="")
