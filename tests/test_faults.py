"""A rank that fails mid-iteration ends the whole job, in every launcher: `parallel.launch.run_ranks`,
the nanotron launcher under torchrun and `examples/finetune_moe.py` under `accelerate launch`.
Rank 1 raises, or is killed with SIGKILL, at its third MoE gate (tests/fault_rank.py: between a
layer's routing and its dispatch, while the other rank waits in a collective). Every launch must
end within its collective timeout, exit non-zero (`run_ranks`: raise) and name rank 1 and its error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from fault_rank import inject

import bagualu_plugin as bgl
from bagualu_plugin.adapters import save_tiny
from bagualu_plugin.demo.model import rank_batches, rank_model, rank_recipe, train_step
from bagualu_plugin.parallel.launch import RankError, free_port, run_ranks
from bagualu_plugin.runtime.driver import run_iteration

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
FAULT = Path(__file__).with_name("fault_rank.py")
BIN = Path(sys.executable).parent
TIMEOUT_S = 120  # every launch's collective timeout: each must end sooner, its imports included
ERRORS = {"raise": r"RuntimeError: injected fault at gate 3 \(layer \d+\) on rank 1", "kill": r"Signal 9 \(SIGKILL\)"}


def _training(rank: int, size: int, how: str) -> None:
    """The demo's model and recipe over `size` expert-parallel ranks, three iterations."""
    recipe = bgl.load_recipe("demo")
    recipe = rank_recipe(recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"ep": size, "dp": size})}), rank)
    if rank == 1:
        inject(rank, 3, how)
    model = rank_model(recipe.model)
    prov = bgl.apply(model, recipe)
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        for _ in range(3):
            run_iteration(model, rank_batches(recipe, rank), prov.stage.schedule, prov)
            train_step(model, optimizer)
    finally:
        prov.remove()


@pytest.mark.parametrize("how", ["raise", "kill", "segv"])
def test_run_ranks(how):
    """A rank's error, its death, or its crash with the Python stacks it left (where it was)."""
    expected = {
        "raise": "rank 1 failed: " + ERRORS["raise"],
        "kill": r"rank 1 exited with code -9 \(SIGKILL\) before reporting",
        "segv": r"rank 1 exited with code -11 \(SIGSEGV\) before reporting\nFatal Python error: Segmentation fault(.|\n)*in failing",
    }
    start = time.monotonic()
    with pytest.raises(RankError, match=expected[how]):
        run_ranks(_training, 2, how, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S


def _failures(stderr: str) -> dict[int, str]:
    """torchrun's failure summary (torch.distributed.elastic's ChildFailedError), by rank: each
    failure's block, with the rank's error when it wrote one (`@record`) or its signal."""
    blocks = re.split(r"\n\[\d+\]:\n", stderr)[1:]
    return {int(m.group(1)): block for block in blocks if (m := re.search(r"rank\s+: (\d+) \(local_rank: \d+\)", block))}


def _launch(cmd: list[str], cwd: Path, how: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 120)  # + the imports
    assert done.returncode != 0, done.stdout[-2000:]
    failures = _failures(done.stderr)
    assert 1 in failures and re.search(ERRORS[how], failures[1]), done.stderr[-6000:]
    assert time.monotonic() - start < TIMEOUT_S


def _fault(how: str) -> list[str]:
    return [str(FAULT), "--rank", "1", "--gate", "3", "--how", how, "--"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from nanotron_configs import TINY

    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("faults") / "ckpt", **TINY)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_the_nanotron_launcher(how, checkpoint, tmp_path):
    pytest.importorskip("nanotron")
    from nanotron_configs import bagualu_section, train_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(train_config(checkpoint, bagualu_section(2), pp=2, train_steps=3)))
    _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *_fault(how),
             "-m", "bagualu_plugin.integrations.nanotron.train", "--config-file", str(path), "--timeout-s", str(TIMEOUT_S)], tmp_path, how)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_accelerate_launch(how, checkpoint, tmp_path):
    pytest.importorskip("accelerate")
    _launch([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
             "--dynamo_backend", "no", "--main_process_port", str(free_port()), *_fault(how), str(ROOT / "examples" / "finetune_moe.py"),
             "--model", str(checkpoint), "--capacity", "1GiB", "--steps", "3", "--output-dir", "out", "--timeout-s", str(TIMEOUT_S)],
            tmp_path, how)
