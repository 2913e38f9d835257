"""The tested range the plugin warns outside of at import (`bagualu_plugin.versions`) is the one CI
installs: its oldest versions are pyproject's lower bounds (.ci/lower_bounds.py pins them for CI's
oldest-version run), its newest those of .ci/constraints-newest.txt (the README's install) and the
torch of .ci/run's newest set."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from bagualu_plugin import versions

ROOT = Path(__file__).resolve().parents[1]


def _bounds() -> dict[str, str]:
    """pyproject's lower bounds, as CI's oldest-version run pins them."""
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "lower_bounds.py")], capture_output=True, text=True, check=True)
    return dict(line.split("==") for line in done.stdout.split())


def test_the_tested_range_is_what_ci_installs():
    lower = _bounds()
    newest = dict(
        line.split("==") for line in (ROOT / ".ci" / "constraints-newest.txt").read_text().splitlines() if "==" in line
    )
    newest["torch"] = re.search(r"^newest_torch=(\S+)", (ROOT / ".ci" / "run").read_text(), re.MULTILINE)[1]  # its newest set's
    for name, (oldest, latest) in versions.TESTED.items():
        assert Version(oldest) == Version(lower[name]), name
        assert Version(latest) == Version(Version(newest[name]).base_version), name


def test_a_version_outside_the_range_is_named_with_the_range():
    assert versions.untested({"transformers": "5.25.0", "torch": "2.13.0+cpu", "trl": None}) == []
    assert versions.untested({"transformers": "5.26.0", "peft": "0.20.0", "torch": "2.10.0+cu128"}) == [
        "torch 2.10.0+cu128 (tested: 2.11.0 to 2.15.0)", "transformers 5.26.0 (tested: 5.17.0 to 5.25.0)",
        "peft 0.20.0 (tested: 0.21.0 to 0.21.2)",
    ]


def test_importing_warns_once_outside_the_range(monkeypatch):
    import warnings

    monkeypatch.setattr(versions, "untested", lambda: ["transformers 6.0.0 (tested: 5.24.0 to 5.25.0)"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_untested()
    assert [str(w.message)[:80] for w in caught] == [
        "bagualu-plugin has not been tested with transformers 6.0.0 (tested: 5.24.0 to 5.25.0)"[:80]
    ]
