"""What several test files share: the recipe of a tiny model, one loss-and-gradients step under a
plan, the relative error of gradients, several ranks' jobs in one launch, the collectives a
rank issues, and the Trainer example launched as a user launches it (also for
benchmarks/gpu_check.py, which puts this folder on sys.path). Tests import it as `from helpers
import ...` (tests/ is on sys.path: pytest puts a rootdir-less test folder there, and
tests/conftest.py makes sure; the ranks of `parallel.launch.run_ranks` take the parent's sys.path)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.distributed as dist

from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import ModelDims
from bagualu_plugin.costmodel.mitigation import MitigationOptions
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.runtime.plan_runtime import apply_plan


def unmitigated_bytes(model, micro_batch_size: int, seq_len: int, stage: tuple[int, int] | None = None) -> int:
    """What one micro-batch of `micro_batch_size` sequences of `seq_len` keeps with nothing
    mitigated, by the analytic cost model of `model` (of pipeline stage `stage` = (pp, rank) when
    given, else of the whole model)."""
    cost = model_cost(model)
    if stage is not None:
        cost = cost.stage(*stage)
    return cost.activation_bytes(micro_batch_size * seq_len, seq_len=seq_len)


def tiny_recipe(
    model,
    *,
    seq_len: int,
    micro_batch_size: int,
    capacity: float | None = None,
    capacity_bytes: int | None = None,
    stage: tuple[int, int] | None = None,
    pipeline: dict | None = None,
    parallel: dict | None = None,
    strategies: dict | None = None,
    budget: dict | None = None,
    telemetry: str | None = None,
    batch_section: bool = True,
    exclude_defaults: bool = False,
    as_dict: bool = False,
    **sections,
) -> Recipe | dict:
    """The recipe of (tiny) `model` on the CPU preset: its dimensions (FP32, SDPA), the batch
    section, no non-activation bytes (`budget` updates that section, e.g. `min_budget`).

    capacity: a multiple of one unmitigated micro-batch (`unmitigated_bytes`, of `stage` when
    given); capacity_bytes: in bytes; neither: the preset's. pipeline, parallel, strategies: those
    sections as given (left out when None); telemetry: the events' path. batch_section=False leaves
    out the batch section (nanotron's `bagualu:` section takes it from nanotron's own); exclude_defaults:
    the model section without its defaults (its empty tuples do not survive YAML); `sections`:
    further top-level keys, last. A `Recipe`, or with as_dict the dict it is made from."""
    if capacity is not None and capacity_bytes is not None:
        raise TypeError("give capacity (a multiple of one micro-batch) or capacity_bytes, not both")
    hardware: dict = {"preset": "cpu"}
    if capacity is not None:
        hardware["capacity_bytes"] = int(capacity * unmitigated_bytes(model, micro_batch_size, seq_len, stage))
    elif capacity_bytes is not None:
        hardware["capacity_bytes"] = capacity_bytes
    dims = ModelDims.from_hf_config(model.config, dtype="fp32", attention="sdpa")
    data = {"hardware": hardware, "model": dims.model_dump(exclude_defaults=exclude_defaults)}
    optional = {"parallel": parallel, "pipeline": pipeline}
    data |= {name: section for name, section in optional.items() if section is not None}
    if batch_section:
        data["batch"] = {"seq_len": seq_len, "micro_batch_size": micro_batch_size}
    data["budget"] = {"non_activation_bytes": 0, **(budget or {})}
    if strategies is not None:
        data["strategies"] = strategies
    if telemetry is not None:
        data["telemetry"] = {"path": telemetry}
    data |= sections
    return data if as_dict else Recipe.from_dict(data)


def plan_step(
    model,
    ids: torch.Tensor,
    plan: Mapping | None = None,
    *,
    labels: torch.Tensor | None = None,
    options: MitigationOptions = MitigationOptions(),
    seed: int | None = None,
    backward: bool = True,
    grads: str = "present",
    named: bool = False,
    output: bool = False,
    autocast: torch.dtype | None = None,
) -> tuple:
    """One forward (and backward) of `model` on `ids` from cleared gradients: the detached loss,
    the gradients and the device bytes the Ledger counted at the end of forward.

    plan: installed with `apply_plan` (and `options`) for the forward; `{}` mitigates nothing but
    still counts; None runs the bare model (the bytes are None). labels: default a copy of `ids`,
    as data collators make them (a region recomputing the loss holds its own). seed: set before
    the forward (the same dropout masks every time). backward=False: no backward, no gradients.
    Gradients (copies), in parameter order, a list or with `named` a dict by parameter name: of
    every parameter that has one ("present"), that requires grad ("trainable": one without a
    gradient fails), or of every parameter ("all", None where it has none). With `output`, the
    model's output is returned last as well. autocast: the forward (not the backward) under
    CPU autocast to that dtype."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    labels = ids.clone() if labels is None else labels

    def forward():
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(input_ids=ids, labels=labels)
        return out if output else out.loss  # only what the caller keeps outlives the forward

    if plan is None:
        result, saved = forward(), None
    else:
        with apply_plan(model, plan, options=options) as ledger:
            result = forward()
            saved = ledger.live_device_bytes
    loss = result.loss if output else result
    if backward:
        loss.backward()
    chosen = {"present": lambda p: p.grad is not None, "trainable": lambda p: p.requires_grad, "all": lambda p: True}[grads]

    def copy(name, p):
        if p.grad is None and grads == "trainable":
            raise AssertionError(f"{name} requires grad but got no gradient")
        return None if p.grad is None else p.grad.clone()

    got = [(n, copy(n, p)) for n, p in model.named_parameters() if backward and chosen(p)]
    got = dict(got) if named else [g for _, g in got]
    return (loss.detach(), got, saved, result) if output else (loss.detach(), got, saved)


def relative_error(values, reference, floor: float = 0.0) -> float:
    """The relative L2 error |values - reference| / |reference|, in FP32: of one tensor (the
    reference's norm clamped at `floor`, e.g. 1e-30 where both may be zero), or of a sequence of
    tensors taken together as one vector."""
    if isinstance(values, torch.Tensor):
        return ((values - reference).float().norm() / reference.float().norm().clamp_min(floor)).item()
    num = sum(((g - r).float().norm() ** 2).item() for g, r in zip(values, reference))
    return (num / sum((r.float().norm() ** 2).item() for r in reference)) ** 0.5


def origin_of(rank: int, size: int, name: str) -> str:
    """Where a rank finds the module `name` (a file), as `run_ranks` runs it."""
    import importlib.util

    return importlib.util.find_spec(name).origin


def _jobs(rank: int, size: int, jobs: list[tuple[str, Callable, tuple]]) -> dict:
    start = torch.get_rng_state()
    out = {}
    for name, fn, args in jobs:
        torch.set_rng_state(start)  # each job from the state a launch of its own starts with
        out[name] = fn(rank, size, *args)
    return out


def run_jobs(size: int, jobs: Mapping[str, tuple], *, timeout_s: float, threads: int | None = None) -> dict[str, list]:
    """Several `run_ranks` workers in one launch of `size` ranks, one after the other in each rank:
    `jobs` maps a name to `(fn, *args)`, `fn(rank, size, *args)` as `run_ranks` calls it. Each
    job's results by name, in rank order, as `run_ranks(fn, size, *args)` returns them. A launch
    costs every rank its start and the test module's imports, and the group's set-up, so checks
    that need the same ranks share one. Collectives time out after `timeout_s` (a deadlock fails
    as fast as in a launch of its own); the launch's deadline is each job's own (`timeout_s` + 60 s) added up. A
    job that raises fails the launch, so one expected to fail runs in a launch of its own."""
    listed = [(name, job[0], tuple(job[1:])) for name, job in jobs.items()]
    ranks = run_ranks(_jobs, size, listed, timeout_s=timeout_s, threads=threads, deadline_s=len(listed) * (timeout_s + 60))
    return {name: [r[name] for r in ranks] for name in jobs}


@contextmanager
def collectives(names: tuple[str, ...] = ("all_reduce", "all_to_all_single")) -> Iterator[list[str]]:
    """The collectives this rank issues inside the block (torch.distributed's, those the plugin's
    expert parallelism calls: the gates' agreement and the rows' all-to-alls, forward, backward and
    replays), by name, in order. Under expert parallelism every rank must issue the same sequence."""
    issued: list[str] = []
    originals = {name: getattr(dist, name) for name in names}

    def recording(name: str, collective: Callable) -> Callable:
        def call(*args, **kwargs):
            issued.append(name)
            return collective(*args, **kwargs)

        return call

    for name, collective in originals.items():
        setattr(dist, name, recording(name, collective))
    try:
        yield issued
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


ROOT = Path(__file__).resolve().parents[1]
# by module: found wherever pip put accelerate, also where its scripts are not beside the interpreter (pip --target)
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def launched_env() -> dict[str, str]:
    """A launched process's environment: the source tree importable first, one torch thread per process."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run_launch(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`cmd`, a launcher (`accelerate launch`, `torchrun`), in a session of its own, its output
    captured. Past `timeout_s` the whole session is killed, the ranks it started with it (killing
    the launcher alone leaves them running), and `TimeoutExpired` raised."""
    with subprocess.Popen(cmd, env=launched_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launch:
        try:
            out, err = launch.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(launch)
            launch.communicate()
            raise
    return subprocess.CompletedProcess(cmd, launch.returncode, out, err)


def kill_session(process: subprocess.Popen) -> None:
    """Kill `process`'s session (started with `start_new_session=True`), whatever is left of it."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def accelerate_config(folder: Path, processes: int, zero: Mapping | None = None) -> Path:
    """The file `accelerate launch --config_file` reads: `processes` processes on this machine
    under accelerate's FSDP2 plugin (no `zero`), or its DeepSpeed plugin with `zero` as the JSON
    config's `zero_optimization`, written beside it (`deepspeed_config`: accelerate's plugin takes
    a reduce bucket size only there). `use_cpu: False` on CPU too: DeepSpeed's CPU accelerator
    runs it over gloo."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    if zero is None:
        name, engine = "fsdp2", {"distributed_type": "FSDP", "mixed_precision": "no", "fsdp_config": {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": False, "fsdp_activation_checkpointing": False}}
    else:
        name = f"zero{zero['stage']}"
        engine = {"distributed_type": "DEEPSPEED",
                  "deepspeed_config": {"deepspeed_config_file": str(deepspeed_config(folder, zero)), "zero3_init_flag": False}}
    config = folder / f"{name}-{processes}.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": processes,
                                      "machine_rank": 0, "main_training_function": "main", "use_cpu": False, **engine}))
    return config


def deepspeed_config(folder: Path, zero: Mapping, **fields) -> Path:
    """DeepSpeed's JSON config with `zero` as its `zero_optimization` and `fields` beside it, the
    batch sizes "auto" (the Trainer fills them in; the precision is none, FP32), written in
    `folder`: for the Trainer's own `deepspeed` argument or accelerate's plugin (`accelerate_config`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"zero{zero['stage']}.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "zero_optimization": {**zero, "stage3_gather_16bit_weights_on_model_save": True}, **fields,
    }))
    return path


def launch_example(launcher: Path | Sequence[str], out: Path, *flags: str, timeout_s: float = 300) -> tuple[list, dict, dict]:
    """examples/sft_moe.py under `launcher` (`run_launch`): `accelerate launch --config_file` of
    that file (a Path), or the command given (torchrun's). Its log records' losses, the plugin's
    figures over the run (each one's largest, misses summed) and the tensors it saved, by file. A
    failed launch raises with the end of its stderr."""
    from safetensors.torch import load_file

    from bagualu_plugin.parallel.launch import free_port

    if isinstance(launcher, Path):
        launcher = [*ACCELERATE_LAUNCH, "--config_file", str(launcher), "--main_process_port", str(free_port())]
    done = run_launch([*launcher, str(ROOT / "examples" / "sft_moe.py"), "--output-dir", str(out), *flags], timeout_s)
    assert done.returncode == 0, f"python {' '.join(launcher[1:3])} exited {done.returncode}:\n{done.stderr[-4000:]}"
    records = json.loads((out / "log_history.json").read_text())
    figures: dict = {}
    for record in records:
        for name, value in record.items():
            if name.startswith("bagualu/"):
                figures[name] = figures.get(name, 0) + value if name.endswith("misses") else max(figures.get(name, value), value)
    saved = {f.name: load_file(f) for f in sorted((out / "model").glob("*.safetensors"))}
    return [r.get("loss") for r in records], figures, saved
