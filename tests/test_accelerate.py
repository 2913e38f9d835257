"""Accelerate (`integrations.accelerate`, `Provisioner.micro_batch`, `examples/finetune_moe.py`).

- `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo) runs the example on a saved tiny
  checkpoint and a local text file, with the plugin under a capacity that forces plans and without
  it (`--no-adaptive`): the losses are equal step for step, bit for bit, and fall; the plugin keeps
  every process under the capacity the stock run exceeds; the saved model reloads. The same with
  expert parallelism over the two processes, whose losses also match the data-parallel run's, and
  with each micro-batch planned for its recorded routing (`--oracle`).
- A convergence run in the style of Liger-Kernel's mini-model tests: 30 steps in one process with
  and without the plugin, the same losses.
- Two owners of recompute, a second install and recipes that do not fit the accelerator are
  errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import yaml

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from helpers import tiny_recipe  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import bagualu_plugin as bgl  # noqa: E402
from bagualu_plugin.adapters.tiny import save_tiny, tiny_model, tiny_tokenizer  # noqa: E402
from bagualu_plugin.config import Recipe  # noqa: E402
from bagualu_plugin.derive import recipe_of  # noqa: E402
from bagualu_plugin.integrations.accelerate import prepare_model  # noqa: E402
from bagualu_plugin.parallel.launch import free_port  # noqa: E402
from bagualu_plugin.report import read_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_moe.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
SEQ, MBS, M = 32, 2, 4
TINY = {"num_hidden_layers": 4}
WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()


def _recipe(dp: int = 1, ep: int = 1, capacity: float = 0.7, **changes) -> dict:
    """The tiny model at 0.7 x its keep-all micro-batch: it has to plan."""
    recipe = tiny_recipe(
        tiny_model("qwen3_moe", **TINY), seq_len=SEQ, micro_batch_size=MBS, capacity=capacity, parallel={"dp": dp, "ep": ep},
        pipeline={"pp": 1, "micro_batches": M}, strategies={"allowed": ["recompute", "offload"]}, exclude_defaults=True, as_dict=True,
    )
    return {**recipe, **changes}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny checkpoint with its tokenizer, and a text file of 300 documents."""
    tmp = tmp_path_factory.mktemp("accelerate")
    save_tiny("qwen3_moe", tmp / "ckpt", **TINY)
    tiny_tokenizer().save_pretrained(tmp / "ckpt")
    (tmp / "corpus.txt").write_text("\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40)) for i in range(300)))
    return tmp


def _run(workdir: Path, name: str, recipe: dict, steps: int, processes: int, *flags: str) -> list[dict]:
    (workdir / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    args = ["--model", "ckpt", "--recipe", f"{name}.yaml", "--steps", str(steps), "--output-dir", name, "--data", "corpus.txt",
            "--timeout-s", "120", *flags]
    if processes == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(EXAMPLE), *args]
    # faulthandler on: a launch past its timeout has every process of it (torch elastic starts each
    # worker in a session of its own) aborted, and their Python stacks end up in the failure message
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    log = workdir / f"{name}.log"
    with log.open("w") as sink:
        launch = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
        try:
            out, _ = launch.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            family = psutil.Process(launch.pid).children(recursive=True)
            for process in family:
                with contextlib.suppress(psutil.Error):
                    process.send_signal(signal.SIGABRT)
            psutil.wait_procs(family, timeout=10)
            for process in [*family, launch]:
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    process.kill()
            launch.wait()
            pytest.fail(f"{name}: the launch ran past 300 s; its processes' stacks:\n{log.read_text()[-12000:]}")
    err = log.read_text()
    assert launch.returncode == 0, err[-4000:]
    return [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]


def _same_training(ours: list[dict], theirs: list[dict], processes: int) -> None:
    assert [s["loss"] for s in ours] == [s["loss"] for s in theirs]  # floats from JSON: bitwise
    assert ours[-1]["loss"] < ours[0]["loss"]
    capacity = ours[0]["capacity_bytes"]
    assert all(len(s["peak_device_bytes"]) == processes and max(s["peak_device_bytes"]) <= capacity for s in ours)
    assert max(max(s["peak_device_bytes"]) for s in theirs) > capacity  # without the plugin it would not fit


@pytest.fixture(scope="module")
def ddp(workdir):
    plugin = _run(workdir, "ddp", _recipe(dp=2), 6, 2, "--report-to", "tensorboard")
    stock = _run(workdir, "ddp-stock", _recipe(dp=2), 6, 2, "--no-adaptive")
    return plugin, stock


@pytest.mark.multiprocess
def test_two_processes_train_bitwise_stock_under_the_capacity(ddp, workdir):
    _same_training(*ddp, processes=2)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(workdir / "ddp" / "model", local_files_only=True)
    original = AutoModelForCausalLM.from_pretrained(workdir / "ckpt", local_files_only=True)
    assert not torch.equal(reloaded.lm_head.weight, original.lm_head.weight)  # trained, then saved
    assert (workdir / "ddp" / "memory.png").stat().st_size > 0
    runs = read_run(workdir / "ddp")  # each process's events, in the output directory
    assert list(runs) == ["rank 0", "rank 1"] and all(len(events) == 6 * M and any(e["plan"] for e in events) for events in runs.values())
    # --report-to tensorboard: accelerator.log took the plugin's figures every step (TensorBoard's own reader)
    scalars = EventAccumulator(str(workdir / "ddp" / "finetune_moe")).Reload()
    assert [e.step for e in scalars.Scalars("bagualu/peak_device_bytes")] == list(range(6))
    assert {"loss", "bagualu/capacity_bytes", "bagualu/budget_bytes", "bagualu/escalations"} <= set(scalars.Tags()["scalars"])


@pytest.mark.multiprocess
def test_expert_parallel_over_two_processes(ddp, workdir):
    """Each process holds 4 of the 8 experts; DDP leaves them alone, and their gradients are
    scaled to the mean DDP takes of the rest: the same training as data parallelism, to rounding."""
    plugin = _run(workdir, "ep", _recipe(dp=2, ep=2), 6, 2)
    stock = _run(workdir, "ep-stock", _recipe(dp=2, ep=2), 6, 2, "--no-adaptive")
    _same_training(plugin, stock, processes=2)
    # the oracle: each micro-batch planned for the routing an untimed pass recorded, on both processes at once
    oracle = _run(workdir, "ep-oracle", _recipe(dp=2, ep=2), 6, 2, "--oracle")
    _same_training(oracle, stock, processes=2)
    foreseen = read_run(workdir / "ep-oracle")["rank 0"]
    assert len(foreseen) == 6 * M and all(not e["escalations"] and not e["deferred"] for e in foreseen)  # nothing left to the gates
    for ours, data_parallel in zip(plugin, ddp[0]):
        assert ours["loss"] == pytest.approx(data_parallel["loss"], rel=1e-5)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workdir / "ep" / "model", local_files_only=True)  # gathered whole
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 8


@pytest.mark.multiprocess
def test_convergence_with_and_without_the_plugin(workdir):
    plugin = _run(workdir, "long", _recipe(), 30, 1)
    stock = _run(workdir, "long-stock", _recipe(), 30, 1, "--no-adaptive")
    _same_training(plugin, stock, processes=1)
    assert plugin[-1]["loss"] < 0.8 * plugin[0]["loss"]


def _model():
    model = tiny_model("qwen3_moe", **TINY)
    model.set_experts_implementation("bagualu")
    return model


def test_hf_gradient_checkpointing_is_refused():
    model = _model()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient_checkpointing_enable\(\).*gradient_checkpointing_disable"):
        bgl.apply(model, Recipe.from_dict(_recipe()))


def test_hf_gradient_checkpointing_enabled_after_apply_is_refused_at_the_next_iteration():
    model = _model()
    prov = bgl.apply(model, Recipe.from_dict(_recipe(capacity=2.0)))
    ids = torch.randint(0, 128, (MBS, SEQ))
    for _ in range(M):  # one optimizer step: the next micro-batch begins an iteration
        with prov.micro_batch(ids):
            model(input_ids=ids, labels=ids).loss.backward()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient_checkpointing_enable\(\).*gradient_checkpointing_disable"):
        with prov.micro_batch(ids):
            model(input_ids=ids, labels=ids).loss.backward()


def test_checkpoint_wrappers_are_refused_also_after_apply():
    """What accelerate's fsdp_activation_checkpointing installs: torch's checkpoint wrappers."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = _model()
    prov = bgl.apply(model, Recipe.from_dict(_recipe(capacity=2.0)))
    apply_activation_checkpointing(model, check_fn=lambda m: m in list(model.model.layers))
    ids = torch.randint(0, 128, (MBS, SEQ))
    with pytest.raises(ValueError, match="wrapped for activation checkpointing.*fsdp_activation_checkpointing"):
        with prov.micro_batch(ids):
            model(input_ids=ids, labels=ids).loss.backward()


def test_a_second_install_is_refused_until_removed():
    model, recipe = _model(), Recipe.from_dict(_recipe(capacity=2.0))
    prov = bgl.apply(model, recipe)
    with pytest.raises(ValueError, match="has a Provisioner installed already"):
        bgl.apply(model, recipe)
    prov.remove()
    bgl.apply(model, recipe).remove()


def test_micro_batch_counts_and_checks_its_block():
    model, ids = _model(), torch.randint(0, 128, (MBS, SEQ))
    prov = bgl.apply(model, Recipe.from_dict(_recipe(capacity=2.0)))
    for expected in [*range(M), 0]:  # the accumulation steps of one optimizer step, then the next
        with prov.micro_batch(ids) as mb:
            model(input_ids=ids, labels=ids).loss.backward()
        assert mb == expected
    with pytest.raises(ValueError, match="ran no forward inside the block"):
        with prov.micro_batch(ids):
            pass
    with pytest.raises(ValueError, match="a second forward inside one micro-batch"):
        with prov.micro_batch(ids):
            model(input_ids=ids)
            model(input_ids=ids)
    with prov.micro_batch(ids) as mb:  # still usable: a failed block abandons its optimizer step
        model(input_ids=ids, labels=ids).loss.backward()
    assert mb == 0
    prov.remove()


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (_recipe(dp=2), r"parallel\.dp=2, but Accelerate runs 1 processes"),
        (_recipe(pipeline={"pp": 2, "micro_batches": 4}), r"pipeline\.pp=2: Accelerate runs no pipeline"),
    ],
    ids=["dp", "pp"],
)
def test_recipes_that_do_not_fit_the_accelerator(recipe, message):
    with pytest.raises(ValueError, match=message):
        prepare_model(_model(), Recipe.from_dict(recipe), Accelerator(cpu=True))


RECIPES = ROOT / "recipes" / "accelerate"


@pytest.mark.parametrize("name", ["launch-ddp-1x8.yaml", "launch-ddp-2x8.yaml", "launch-fsdp2-2x8.yaml"])
def test_launch_configs_load_with_accelerate_s_own_classes(name):
    """Each launch config is what `accelerate launch --config_file` reads, and names the bagualu
    recipe it pairs with, which validates (capacity holds the static bytes and M0)."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    from bagualu_plugin.cli import main

    config = load_config_from_file(str(RECIPES / name))
    assert isinstance(config, ClusterConfig) and config.num_processes == 8 * config.num_machines
    if config.distributed_type == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2 and config.fsdp_config["fsdp_activation_checkpointing"] is False
    words = (RECIPES / name).read_text().split()
    paired = RECIPES / next(word for word in words if word.endswith(".yaml") and not word.startswith("launch"))
    assert main(["validate-recipe", str(paired)]) == 0
    recipe = bgl.load_recipe(paired)
    assert recipe.pipeline.pp == 1 and recipe.parallel.dp == config.num_processes


def test_the_tiny_recipe_is_the_tests_own():
    """It says what cannot be derived; the rest comes from the model and the two processes."""
    path, cpu = RECIPES / "tiny-qwen3-moe-2cpu.yaml", torch.device("cpu")
    derived = recipe_of(_model(), path, device=cpu, processes=2, micro_batches=1, batch=None)
    assert derived == Recipe.from_dict(_recipe(dp=2))


def test_a_quantized_checkpoint_is_refused_with_the_way_to_load_it():
    """DeepSeek-V3 ships FP8 experts, which transformers runs through its FP8 experts interface;
    the plugin needs them dequantized (FP8 quantization itself needs a GPU, so the config says it)."""
    model = _model()
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"quant_method='fp8'.*FineGrainedFP8Config\(dequantize=True\)"):
        bgl.apply(model, Recipe.from_dict(_recipe()))
    model.config.quantization_config["dequantize"] = True
    bgl.apply(model, Recipe.from_dict(_recipe())).remove()


def test_generation_after_training_runs_as_without_the_plugin():
    """Outside a training micro-batch the model is its own: `generate` gets its KV cache (a
    recompute plan once refused it), transformers' experts kernel choice for decoding (it switches
    from "grouped_mm" only when it finds that name) and the same tokens."""
    torch.manual_seed(0)
    model, ids = tiny_model("qwen3_moe", **TINY), torch.randint(0, 128, (MBS, SEQ))
    seen = []
    model.model.layers[1].mlp.experts.register_forward_pre_hook(lambda *_: seen.append(model.config._experts_implementation))

    def generate():
        seen.clear()
        with torch.no_grad():
            out = model.eval().generate(ids[:1, :8], max_new_tokens=8, do_sample=False)
        model.train()
        return out, set(seen)

    own, impl = model.get_experts_implementation(), model.config._experts_implementation
    expected, expected_seen = generate()
    prov = bgl.apply(model, Recipe.from_dict(_recipe(capacity=0.5)))
    seen.clear()
    with prov.micro_batch(ids):
        assert model.get_experts_implementation() == {k: "bagualu" for k in own}
        model(input_ids=ids, labels=ids).loss.backward()
    assert "recompute" in prov.events[-1].plan.values() and set(seen) == {"bagualu"}
    assert model.get_experts_implementation() == own and model.config.use_cache
    got, got_seen = generate()
    assert torch.equal(got, expected) and got_seen == expected_seen == {impl}
    prov.remove()
