"""HF Trainer and TRL (`integrations.transformers.BagualuCallback`): TRL's real `SFTTrainer` and HF's
`Trainer` fine-tune saved tiny checkpoints of GLM-4-MoE, DeepSeek-V3 and Qwen3-MoE on a
`datasets.Dataset` with gradient accumulation, under a capacity that forces plans: per-step losses
and final weights bitwise those of the same run without the callback, the peak at or under the
capacity while the unplanned run's is above it, every micro-batch's Ledger equal to the cost
model of its kind, the plugin's figures in `log_history`. The same with PEFT LoRA; and under
`accelerate launch --num_processes 2` through `examples/sft_moe.py`: every combination of
{SFTTrainer, Trainer} x {DDP, expert parallelism over the two processes} x {full, LoRA}. Training
arguments that would make a second owner of recompute are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402
from helpers import ACCELERATE_LAUNCH, ROOT, kill_session, launched_env, run_launch  # noqa: E402
from peft import LoraConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

from bagualu_plugin import cli  # noqa: E402
from bagualu_plugin.adapters.costs import model_cost  # noqa: E402
from bagualu_plugin.adapters.tiny import save_tiny, tiny_tokenizer  # noqa: E402
from bagualu_plugin.costmodel import ForwardKind  # noqa: E402
from bagualu_plugin.costmodel.plan import Plan  # noqa: E402
from bagualu_plugin.integrations.transformers import BagualuCallback, UnplannedCallback  # noqa: E402
from bagualu_plugin.parallel.launch import free_port  # noqa: E402
from bagualu_plugin.report import read_run  # noqa: E402

FAMILIES = ("glm4_moe", "deepseek_v3", "qwen3_moe")
M, BATCH, LENGTH, STEPS = 4, 2, 40, 2
EXACT = {"allowed": ["recompute", "offload"]}  # fp8 is lossy by design
WORDS = "the quick brown fox jumps over a lazy dog while experts route tokens across ranks".split()
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(4 + i % 9)) for i in range(64)]  # uneven lengths
LORA = {"glm4_moe": ["q_proj", "v_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"], "qwen3_moe": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trainer")
    for family in FAMILIES:
        save_tiny(family, root / family, num_hidden_layers=4)
        tiny_tokenizer().save_pretrained(root / family)
    (root / "corpus.txt").write_text("\n".join(TEXTS))
    return {**{f: root / f for f in FAMILIES}, "corpus": root / "corpus.txt"}


FP32 = {"bf16": False}  # no mixed precision (SFTConfig's default is bf16=True)


def _fine_tune(checkpoints, family: str, kind: str, callback, lora: bool = False, dtype=torch.float32, precision: dict | None = FP32):
    """The model loaded in `dtype`; `precision`: the trainer's mixed-precision arguments (None:
    its config's defaults, SFTConfig's bf16=True)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoints[family], local_files_only=True, dtype=dtype)
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # HF's language-modelling collator pads with it (TRL does so itself)
    common = dict(
        output_dir=str(checkpoints["corpus"].parent / "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=M,
        max_steps=STEPS, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        gradient_checkpointing=False, disable_tqdm=True, **(precision or {}),
    )
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=LORA[family]) if lora else None
    dataset = Dataset.from_dict({"text": TEXTS})
    if kind == "sft":
        trainer = SFTTrainer(model=model, args=SFTConfig(max_length=LENGTH, **common), train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft, callbacks=[callback])
    else:
        tokenized = dataset.map(lambda row: tokenizer(row["text"], truncation=True, max_length=LENGTH), remove_columns=["text"])
        if peft is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft)
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=tokenized, processing_class=tokenizer,
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=[callback])
    trainer.train()
    losses = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    return losses, [p.detach().clone() for p in trainer.model.parameters()], trainer


def _compare(checkpoints, family: str, kind: str, lora: bool = False, dtype=torch.float32, precision: dict | None = FP32):
    """The run without the plugin (measured), then with it under 0.7 x the largest step's
    activations beyond the static bytes: the same training bit for bit, under the capacity the
    other exceeds, every micro-batch keeping what the cost model of its kind predicts."""
    unplanned = UnplannedCallback()
    stock = _fine_tune(checkpoints, family, kind, unplanned, lora, dtype, precision)
    static = unplanned.static_bytes[-1]  # with the optimizer's state
    capacity = static + int(0.7 * (max(unplanned.peaks[1:]) - static))
    callback = BagualuCallback({"hardware": {"capacity_bytes": capacity}, "strategies": EXACT})
    ours = _fine_tune(checkpoints, family, kind, callback, lora, dtype, precision)
    assert ours[0] == stock[0] and len(ours[0]) == STEPS  # per-step losses, bitwise
    assert all(torch.equal(a, b) for a, b in zip(ours[1], stock[1]))  # final weights, bitwise
    prov = callback.provisioner
    assert prov.peak_device_bytes <= capacity < max(unplanned.peaks[1:])  # the run without the plugin would not fit
    events = list(prov.events)
    assert len(events) == STEPS * M and any(e.plan for e in events) and not prov.awaits_backward()
    records = [r for r in ours[2].state.log_history if "loss" in r]
    assert all(r["bagualu/capacity_bytes"] == capacity and r["bagualu/micro_batches"] == M for r in records)
    assert records[-1]["bagualu/peak_device_bytes"] == prov.peak_device_bytes and records[-1]["bagualu/mitigated_ops"] > 0
    assert all(r["bagualu/cost_model_misses"] == 0 and r["bagualu/spilled_bytes"] == 0 for r in records)  # kept what was planned
    assert [r["bagualu/unplanned_peak_device_bytes"] for r in stock[2].state.log_history if "loss" in r] == unplanned.peaks
    model = ours[2].model
    costs = {}
    assert {e.kind["fused_head"] for e in events} == {kind == "sft"}  # TRL's head
    assert next(iter(prov.decider.costs)).fused_head == (kind == "sft")  # the floor checked at train begin is its kind's
    assert {e.kind["masked"] for e in events} == {False, True}  # padded micro-batches and others
    for e in events:  # micro-batches of every length the collator made
        key = tuple(e.kind.items())
        costs[key] = costs.get(key) or model_cost(model, kind=ForwardKind(**e.kind))
        assert e.actual == costs[key].activation_bytes(e.tokens, seq_len=e.seq_len, plan=Plan(e.plan))
    return callback, ours[2]


@pytest.mark.parametrize("kind", ["sft", "hf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tuning_is_bitwise_under_a_capacity_that_forces_plans(checkpoints, family, kind):
    callback, trainer = _compare(checkpoints, family, kind)
    assert trainer.model.config._experts_implementation != "bagualu"  # outside a training forward the model runs its own
    assert not hasattr(trainer.model, "_bagualu_provisioner")  # removed at train end, its events kept


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_is_bitwise_and_the_ledger_is_the_cost_model(checkpoints, family):
    callback, trainer = _compare(checkpoints, family, "sft", lora=True)
    assert callback.provisioner.recipe.model.lora is not None


def test_trl_defaults_bf16_model_under_bf16_autocast(checkpoints):
    """What TRL users run: a bfloat16 checkpoint and SFTConfig's bf16=True (autocast)."""
    _compare(checkpoints, "qwen3_moe", "sft", dtype=torch.bfloat16, precision={"bf16": True})


@pytest.mark.parametrize(("family", "kind", "lora", "precision"), [
    ("glm4_moe", "sft", False, None),  # SFTConfig's defaults: bf16 autocast over the FP32 weights as saved
    ("deepseek_v3", "sft", True, None),
    ("qwen3_moe", "hf", False, {"bf16": True}),  # HF's Trainer asked for mixed precision
    ("glm4_moe", "hf", True, {"bf16": True}),
])
def test_mixed_precision_over_fp32_weights_is_exact(checkpoints, family, kind, lora, precision):
    """Standard mixed precision: autocast over FP32 master weights. Every linear, matmul and
    attention keeps copies of its operands (the weights' too) in BF16: each micro-batch is planned
    and measured as such a kind, with no miss and no spill, the training bitwise."""
    callback, _ = _compare(checkpoints, family, kind, lora, precision=precision)
    assert {e.kind["autocast"] for e in callback.provisioner.events} == {"bf16"}


@pytest.mark.parametrize("added", [False, True], ids=["given-to-the-trainer", "added-after-its-init"])
def test_the_figures_reach_tensorboard_and_the_run_its_picture(checkpoints, tmp_path, added):
    """The Trainer calls its report_to integrations before the callbacks it is given: the callback
    logs first wherever it was put, so TensorBoard's event files (read back with TensorBoard's own
    reader) hold every `bagualu/*` figure of every step. The telemetry is in the output directory,
    and `bagualu report` draws it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], local_files_only=True)
    args = SFTConfig(
        output_dir=str(tmp_path), max_length=LENGTH, per_device_train_batch_size=BATCH, gradient_accumulation_steps=M,
        max_steps=STEPS, logging_steps=1, report_to=["tensorboard"], save_strategy="no", use_cpu=True,
        gradient_checkpointing=False, disable_tqdm=True, bf16=False,
    )
    callback = BagualuCallback({"hardware": {"capacity_bytes": "1GiB"}})
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tiny_tokenizer(),
                         callbacks=None if added else [callback])
    if added:
        trainer.add_callback(callback)
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    figures = sorted(k for k in steps[-1] if k.startswith("bagualu/"))
    assert len(steps) == STEPS and "bagualu/escalations" in figures
    (logdir,) = (tmp_path / "runs").iterdir()
    scalars = EventAccumulator(str(logdir)).Reload()
    assert set(f"train/{k}" for k in figures) <= set(scalars.Tags()["scalars"])
    for k in ("bagualu/peak_device_bytes", "bagualu/micro_batches", "bagualu/planner_ms"):  # the run's summary record too
        logged = [r[k] for r in trainer.state.log_history if k in r]
        assert [e.value for e in scalars.Scalars(f"train/{k}")] == pytest.approx(logged, rel=1e-6) and len(logged) >= STEPS
    runs = read_run(tmp_path)
    assert list(runs) == ["run"] and len(runs["run"]) == STEPS * M
    assert cli.main(["report", str(tmp_path)]) == 0 and (tmp_path / "bagualu-report.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argument", "value"),
    [("gradient_checkpointing", True), ("activation_offloading", True), ("use_liger_kernel", True), ("torch_compile", True)],
)
def test_a_second_owner_is_refused_at_train_begin(checkpoints, argument, value):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3_moe"], local_files_only=True)
    args = SFTConfig(output_dir=str(checkpoints["corpus"].parent / "refused"), use_cpu=True, report_to=[], max_steps=1,
                     **{"gradient_checkpointing": False, argument: value})
    callback = BagualuCallback({"hardware": {"capacity_bytes": "1GiB"}})
    if argument == "use_liger_kernel":  # Liger is not installed here: the callback refuses it before Trainer gets that far
        with pytest.raises(ValueError, match=rf"BagualuCallback: {argument}=True: .*; pass {argument}=False"):
            callback.on_train_begin(args, None, None, model=model)
        return
    with pytest.raises(ValueError, match=rf"BagualuCallback: {argument}=True: .*; pass {argument}=False"):  # at the Trainer's init
        SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tiny_tokenizer(),
                   callbacks=[callback])
    if argument == "activation_offloading":  # TRL's own offloading needs an accelerator to start
        return
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tiny_tokenizer())
    trainer.add_callback(callback)  # added later, it has missed the init: train begin refuses it
    with pytest.raises(ValueError, match=rf"BagualuCallback: {argument}=True: .*; pass {argument}=False"):
        trainer.train()


def _accelerate_launch(script: Path, *args: str) -> subprocess.CompletedProcess:
    """`script` under `accelerate launch` on 2 CPU processes, killed past 300 s with its ranks."""
    return run_launch([*ACCELERATE_LAUNCH, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                       "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(script), *args], 300)


def _launch(checkpoints, family: str, name: str, *flags: str) -> Path:
    out = checkpoints["corpus"].parent / name
    done = _accelerate_launch(
        ROOT / "examples" / "sft_moe.py", "--model", str(checkpoints[family]), "--data", str(checkpoints["corpus"]),
        "--output-dir", str(out), "--steps", str(STEPS), "--accumulation", str(M), "--batch-size", str(BATCH),
        "--max-length", str(LENGTH), *flags,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


# {SFTTrainer, Trainer} x {DDP, expert parallelism} x {full, LoRA}, the families in rotation; on the oldest
# versions CI runs the two not marked slow (each trainer, parallelism and fine-tuning once), on the newest all eight
GRID = [
    ("sft", False, False, "qwen3_moe"), ("sft", False, True, "glm4_moe"), ("sft", True, False, "deepseek_v3"),
    ("sft", True, True, "qwen3_moe"), ("hf", False, False, "deepseek_v3"), ("hf", False, True, "qwen3_moe"),
    ("hf", True, False, "glm4_moe"), ("hf", True, True, "deepseek_v3"),
]
KEPT = {("sft", True, True, "qwen3_moe"), ("hf", False, False, "deepseek_v3")}
SHARE = 0.93  # the capacity: this share of what the same run needs without the plugin


def _flags(trainer: str, ep: bool, lora: bool) -> tuple[str, ...]:
    return ("--trainer", trainer, *(("--ep",) if ep else ()), *(("--lora",) if lora else ()))


@pytest.fixture(scope="module")
def planned(checkpoints):
    """A grid row's two launches (the stock run, then the plugin at SHARE of its unplanned peak),
    each launched once in this module: (stock output, plugin output, capacity)."""
    done = {}

    def launches(trainer: str, ep: bool, lora: bool, family: str) -> tuple[Path, Path, int]:
        key = (trainer, ep, lora, family)
        if key not in done:
            name, flags = f"launch-{family}-{trainer}-{'ep' if ep else 'ddp'}{'-lora' if lora else ''}", _flags(trainer, ep, lora)
            stock = _launch(checkpoints, family, f"{name}-stock", "--no-plugin", *flags)
            theirs = json.loads((stock / "log_history.json").read_text())
            capacity = int(SHARE * max(r["bagualu/unplanned_peak_device_bytes"] for r in theirs if "loss" in r))
            done[key] = stock, _launch(checkpoints, family, name, "--capacity", str(capacity), *flags), capacity
        return done[key]

    return launches


@pytest.mark.multiprocess
@pytest.mark.parametrize(("trainer", "ep", "lora", "family"), [
    pytest.param(*row, marks=() if row in KEPT else pytest.mark.slow,
                 id=f"{row[0]}-{'ep' if row[1] else 'ddp'}-{'lora' if row[2] else 'full'}-{row[3]}")
    for row in GRID
])
def test_two_processes_under_accelerate_launch(planned, trainer, ep, lora, family):
    """Every combination once over 2 gloo processes: the run without the plugin first, then the
    plugin at 93% of what that run needed (static bytes included), so plans must act. Losses and
    saved weights bitwise, the peak at or under the capacity. Expert parallelism with LoRA: the
    frozen experts take no gradient hook (it crashed at the Trainer's init)."""
    stock, ours, capacity = planned(trainer, ep, lora, family)
    records, theirs = (json.loads((d / "log_history.json").read_text()) for d in (ours, stock))
    assert [r.get("loss") for r in records] == [r.get("loss") for r in theirs]
    mine, other = (load_file(d / "model" / "model.safetensors") for d in (ours, stock))
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
    steps = [r for r in records if "loss" in r]
    assert all(r["bagualu/peak_device_bytes"] <= capacity for r in steps) and max(r["bagualu/mitigated_ops"] for r in steps) > 0
    runs = read_run(ours)  # each process's telemetry, in the output directory by default
    assert list(runs) == ["rank 0", "rank 1"] and all(len(events) == STEPS * M for events in runs.values())
    assert all(any(e["plan"] and sum(e["mitigated"].values()) > 0 for e in events) for events in runs.values())
    assert cli.main(["report", str(ours)]) == 0 and (ours / "bagualu-report.png").stat().st_size > 0


@pytest.mark.multiprocess
@pytest.mark.slow  # torch's rendezvous, the same torch in every CI run
def test_two_nodes_train_as_one(checkpoints, planned):
    """Two `torchrun` agents on this machine, as a cluster launches them (`--nnodes 2`, node ranks
    0 and 1, one process each, c10d rendezvous on 127.0.0.1): each process derives dp 2 and its
    expert-parallel rank from its global rank (both have local rank 0), and SFTTrainer with the
    experts over the two nodes trains bitwise as the same grid row on one node under `accelerate
    launch` (its launch shared with the grid's test) at the same capacity."""
    row = ("sft", True, False, "deepseek_v3")
    _, one, capacity = planned(*row)
    out, port = checkpoints["corpus"].parent / "two-nodes", free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"two-nodes-{port}",
             "--rdzv_conf", "timeout=60",
             str(ROOT / "examples" / "sft_moe.py"), "--model", str(checkpoints[row[-1]]), "--data", str(checkpoints["corpus"]),
             "--output-dir", str(out), "--steps", str(STEPS), "--accumulation", str(M), "--batch-size", str(BATCH),
             "--max-length", str(LENGTH), "--capacity", str(capacity), *_flags(*row[:3])],
            env=launched_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        errors = [agent.communicate(timeout=300)[1] for agent in agents]
    finally:
        for agent in agents:  # each agent with the process it started
            kill_session(agent)
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(e[-3000:] for e in errors)
    for rank in (0, 1):
        parallel = json.loads((out / f"recipe-rank{rank}.json").read_text())["parallel"]
        assert (parallel["dp"], parallel["ep"], parallel["ep_rank"]) == (2, 2, rank)
    records, theirs = (json.loads((d / "log_history.json").read_text()) for d in (out, one))
    assert [r.get("loss") for r in records] == [r.get("loss") for r in theirs]
    mine, other = (load_file(d / "model" / "model.safetensors") for d in (out, one))
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)


USER_SCRIPT = """
import os, sys, time
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from bagualu_plugin.integrations.transformers import BagualuCallback

model_dir, corpus, out, ep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **({"experts_implementation": "bagualu"} if ep > 1 else {}))
tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
dataset = Dataset.from_dict({"text": open(corpus).read().splitlines()})
args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, max_length=40,
                 gradient_checkpointing=False, use_cpu=True, report_to=[], save_strategy="no", bf16=False)
recipe = {"hardware": {"capacity_bytes": 8_000_000}, **({"parallel": {"ep": ep}} if ep > 1 else {})}
SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[BagualuCallback(recipe)]).train()
with open(f"{out}/trained-{os.environ['RANK']}", "w") as f:  # a file per process: their stdout lines interleave
    f.write(repr(time.time()))
"""
ABORT = "terminate called without an active exception"  # torch's gloo teardown at exit: benchmarks/gloo_exit.py


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.slow, id="ddp"), pytest.param(2, id="expert-parallel")])
def test_a_users_script_ends_by_itself(checkpoints, ep):
    """A user's SFTTrainer script with the callback, no `os._exit` and no barrier of ours, under
    `accelerate launch` on 2 processes: it exits within 30 s of training's end. The one failure
    allowed is torch's own abort at the interpreter's exit, which the same job without the plugin
    or the Trainer shows too (`benchmarks/gloo_exit.py`); never a hang."""
    script, out = checkpoints["corpus"].parent / "user_sft.py", checkpoints["corpus"].parent / f"user-{ep}"
    script.write_text(USER_SCRIPT)
    done = _accelerate_launch(script, str(checkpoints["qwen3_moe"]), str(checkpoints["corpus"]), str(out), str(ep))
    ended = time.time()
    trained = [float(path.read_text()) for path in sorted(out.glob("trained-*"))]
    assert len(trained) == 2, done.stderr[-3000:]
    assert ended - max(trained) < 30
    assert done.returncode == 0 or ABORT in done.stderr, done.stderr[-3000:]
