"""Import nanotron on PyPI 0.4 as well as on its main branch.

PyPI nanotron 0.4 cannot be imported at all: `nanotron.config` -> `utils_config` -> the pipeline
engine -> `nanotron.logging`, which imports `LoggingArgs` from the half-initialised
`nanotron.config.config` (fixed upstream the day after the release). `nanotron.logging` uses
`LoggingArgs` only as a type annotation, so it is imported once with a placeholder module standing
in for `nanotron.config.config`; the real config is imported next and `nanotron.logging.LoggingArgs`
pointed at the real class, so nothing of the placeholder survives. Where the plain import works
(nanotron main), nothing is patched.

nanotron main's `nanotron.config` needs flash_attn (`models_config` imports its attention), which
has no CPU build; its pipeline engine, P2P, blocks and `ParallelContext` do not. `import_pipeline`
makes those importable without the config where the plain import works, so the engine and the
pipeline model run on nanotron main's engine too; the config and the launcher need the config.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


def _require() -> None:
    if importlib.util.find_spec("nanotron") is None:
        raise ImportError("the nanotron integration needs nanotron: pip install 'bagualu-plugin[nanotron]'")


def import_pipeline() -> None:
    """nanotron's pipeline engine (with P2P, blocks, tensor pointers, `ParallelContext`) imported:
    plainly where that works (nanotron main), else through `import_nanotron` (PyPI 0.4's cycle)."""
    _require()
    try:
        importlib.import_module("nanotron.parallel.pipeline_parallel.engine")
    except ImportError as exc:
        if "circular import" not in str(exc):
            raise
        import_nanotron()


def import_nanotron() -> types.ModuleType:
    """`nanotron.config`, imported; an ImportError naming the extra when nanotron is missing."""
    _require()
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
