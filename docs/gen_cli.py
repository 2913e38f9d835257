"""Writes reference/cli.md at build time from the `bagualu` argparse parser (mkdocs-gen-files):
one section per subcommand with its `--help`, so a new subcommand appears without editing docs."""

import argparse
import os

import mkdocs_gen_files

from bagualu_plugin.cli import _parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal's width: fixed, for a stable page
parser = _parser()
lines = [
    "# CLI reference",
    "",
    "Generated at build time from `bagualu_plugin.cli._parser()` (`docs/gen_cli.py`): each section is the",
    "command's own `--help`. Every error a command finds reads `bagualu <command>: error: <message>` on",
    "stderr with exit status 2.",
    "",
    "```text",
    parser.format_help().rstrip(),
    "```",
    "",
]
for name, sub in _subcommands(parser).items():
    lines += [f"## `bagualu {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]

with mkdocs_gen_files.open("reference/cli.md", "w") as f:
    f.write("\n".join(lines))
mkdocs_gen_files.set_edit_path("reference/cli.md", "gen_cli.py")
