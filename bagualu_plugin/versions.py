"""The versions of the libraries the plugin patches or prices that CI tests: the oldest (the lower
bounds pyproject.toml declares, installed by CI's oldest-version job) and the newest (CI's install
of what the registries serve, recorded in `.ci/constraints-newest.txt`). The adapters and the
analytic cost models follow one transformers release's modules; outside this range they may not,
so importing the plugin says so once, naming the package, its version and the range tested
(the cost model's run-time check, `runtime.calibration`, then shows what differs)."""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "2.15.0"),
    "transformers": ("5.17.0", "5.25.0"),
    "trl": ("1.16.0", "1.16.0"),
    "peft": ("0.21.0", "0.21.2"),
    "accelerate": ("1.10.1", "1.16.0"),
    "nanotron": ("0.4", "0.4"),
}


def untested(installed: dict[str, str | None] | None = None) -> list[str]:
    """The installed packages of `TESTED` outside their tested range, each named with its version
    and the range (`installed`: name -> version, None where absent; default: this environment's)."""
    if installed is None:
        installed = {name: _installed(name) for name in TESTED}
    out = []
    for name, (oldest, newest) in TESTED.items():
        found = installed.get(name)
        if found is not None and not Version(oldest) <= Version(Version(found).base_version) <= Version(newest):
            out.append(f"{name} {found} (tested: {oldest} to {newest})")
    return out


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def warn_untested() -> None:
    outside = untested()
    if outside:
        warnings.warn(
            f"bagualu-plugin has not been tested with {', '.join(outside)}: its adapters and cost models follow the "
            "modules of the tested releases; the cost model's run-time check reports what differs",
            RuntimeWarning, stacklevel=3,
        )
