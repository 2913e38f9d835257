"""Import nanotron on PyPI 0.4 as well as on its main branch.

PyPI nanotron 0.4 cannot be imported at all: `nanotron.config` -> `utils_config` -> the pipeline
engine -> `nanotron.logging`, which imports `LoggingArgs` from the half-initialised
`nanotron.config.config` (fixed upstream the day after the release). `nanotron.logging` uses
`LoggingArgs` only as a type annotation, so it is imported once with a placeholder module standing
in for `nanotron.config.config`; the real config is imported next and `nanotron.logging.LoggingArgs`
pointed at the real class, so nothing of the placeholder survives. Where the plain import works
(nanotron main), nothing is patched.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def import_nanotron() -> types.ModuleType:
    """`nanotron.config`, imported; an ImportError naming the extra when nanotron is missing."""
    if importlib.util.find_spec("nanotron") is None:
        raise ImportError("the nanotron integration needs nanotron: pip install 'bagualu-plugin[nanotron]'")
    try:
        return importlib.import_module("nanotron.config")
    except ImportError as exc:
        if "LoggingArgs" not in str(exc):
            raise
    # The failed import removed every module of the cycle from sys.modules: this starts clean.
    placeholder = types.ModuleType("nanotron.config.config")
    placeholder.LoggingArgs = type("LoggingArgs", (), {})
    sys.modules["nanotron.config.config"] = placeholder
    try:
        logging = importlib.import_module("nanotron.logging")
    finally:
        del sys.modules["nanotron.config.config"]
    config = importlib.import_module("nanotron.config")
    logging.LoggingArgs = config.LoggingArgs
    return config
