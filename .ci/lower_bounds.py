"""Print pip constraints that pin every dependency of the package and its `test` extra to the lower
bound pyproject.toml declares (`name>=X` -> `name==X`): CI installs them to check that the oldest
versions the project claims to support really pass. Linters are not pinned (their rules, not
the package, change with their version)."""

import re
import sys
from pathlib import Path

import tomllib

UNPINNED = {"ruff"}

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+).*", requirement)
    if match is None:
        sys.exit(f"{requirement!r}: every dependency needs a lower bound (name>=version) that CI can install")
    if match[1] not in UNPINNED:
        print(f"{match[1]}=={match[2]}")
