"""Shared test setup. The helpers the test files share live in tests/helpers.py (`from helpers
import ...`); the markers are registered in pyproject.toml:

- `multiprocess`: the test starts processes (gloo ranks through `parallel.launch.run_ranks`,
  torchrun, `accelerate launch`, a python subprocess). `pytest -m "not multiprocess"` is the fast,
  in-process tier; CI runs everything.
- `gpu`: the test needs a CUDA device; without one it is skipped.

One torch thread per process: the models here are tiny, and on CPU cores shared with other jobs
torch's intra-op threads cost far more than they save (a LoRA test took 14 s on one thread, 43 to
190 s on two, on 2 busy cores). OMP_NUM_THREADS (set to 1 unless given) also reaches the
processes the tests start (torchrun's and `accelerate launch`'s workers, python subprocesses);
`parallel.launch.run_ranks` sets its ranks' own count (`threads`)."""

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))

# pytest's default (prepend) import mode already puts this folder, which has no __init__.py, on
# sys.path when it imports this file; so that `from helpers import ...` (and nanotron_configs)
# also resolve under --import-mode=append/importlib, put it there ourselves.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Each test starts from the process state it would have alone, in a directory of its own
    (where a Provisioner given no output directory writes its telemetry). transformers'
    TrainingArguments write accelerate's settings into os.environ, and accelerate keeps its first
    state for the whole process: one test's `torch_compile=True` would make every later
    `accelerator.prepare` in that worker compile its model."""
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
