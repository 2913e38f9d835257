"""`torchrun --nproc_per_node N -m bagualu_plugin.integrations.nanotron.train --config-file X.yaml`:
train an HF MoE checkpoint with nanotron's pipeline engine, with the Provisioner in it when the
config's `bagualu:` section is enabled (`BagualuPipelineEngine`), stock nanotron otherwise.
Multi-node: `torchrun --nnodes N --node_rank R --nproc_per_node 8 --rdzv_backend c10d
--rdzv_endpoint HOST:PORT -m ...`, the same command on every node.

What runs on a CPU, over gloo, and why:
- nanotron's `ParallelContext` makes the groups (world = ep x pp x dp x tp, its layout); the one
  patch is `set_device`, a no-op without CUDA (`context.CPUParallelContext`);
- nanotron's `P2P`, `PipelineBlock`, `TensorPointer` and `OneForwardOneBackwardPipelineEngine`
  run unchanged (they take the device and the group they are given); with `bagualu.dual_batch`
  the steady points run fused (`engine.DualBatchPipelineEngine`: the executor runs the stage's
  pieces, nanotron's `P2P` moves activations and gradients);
- nanotron's `DistributedTrainer` does not: its import needs flash_attn, it builds the model on
  CUDA and its FP32 gradient accumulator is CUDA-only. This module is the small loop in its place.

The loop:
- each rank loads only its pipeline stage's weights (and, under expert parallelism, only its
  experts) from the HF checkpoint at nanotron's `model.init_method.path`, in the checkpoint's
  dtype (`model.dtype` is not applied); the rest of the model stays on the meta device;
- feeds each of the ep x dp data replicas its own micro-batches (`data.micro_batches`): synthetic
  tokens seeded by `general.seed`, or a local dataset named by nanotron's data section;
- after nanotron's engine ran the micro-batches: tied embeddings' gradients summed between the
  first and last pipeline rank; dense gradients averaged over the ep x dp replicas, expert
  gradients (each already summed over the expert-parallel ranks by the all-to-all's backward)
  summed over dp and divided by the same count; then `torch.optim.AdamW` steps with nanotron's
  `optimizer:` section (learning rate, weight decay, betas, eps; constant learning rate);
- `bagualu.spikes` (expert parallelism only): every rank skews each micro-batch's routing onto
  expert-parallel rank 0's experts as the section's seeded schedule says (`spikes.imbalance_schedule`).

`bagualu.manual_gc` (on by default, also with the section disabled): the garbage collector is
frozen after set-up and collects at each iteration's end on every rank at once
(`collector.ManualCollector`), so no rank's collection stalls the others mid-iteration.

`bagualu.metrics_path`: rank 0 writes one JSON line per iteration, `{"iteration", "loss",
"peak_device_bytes"}`: the loss is the mean over data replicas of the sum of the last pipeline
rank's micro-batch losses (nanotron divides each by the micro-batch count), the peaks the
activation bytes each rank's Ledger saw (the Provisioner's with the plugin, one tracking the
forwards without), in world-rank order, so stock and plugin runs compare line by line. Each rank
logs its `bagualu/*` figures every iteration through nanotron's logger (`LoggerWriter`; the
config's `logging:` section sets its levels), and writes its Provisioner's events to
`bagualu-telemetry.rank<world rank>.jsonl` beside the checkpoints (`checkpoints.checkpoints_path`;
`bagualu.telemetry.path` names another file, its rank put before the suffix the same way;
`bagualu report DIR` draws them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ...adapters import Adapter
from ...adapters.costs import model_cost
from ...adapters.gate import RoutingSkew
from ...collector import ManualCollector
from ...config import RecipeError, Spikes
from ...costmodel.pipeline import stage_layers
from ...parallel.checkpoint import expert_shards, load_pretrained
from ...parallel.gradients import all_reduce_gradients
from ...parallel.launch import end_process
from ...runtime.ledger import Ledger
from ...runtime.provisioner import apply
from ...spikes import imbalance_schedule, skew_fraction
from .compat import import_nanotron

_nanotron_config = import_nanotron()

from nanotron.config.models_config import ExistingCheckpointInit  # noqa: E402
from nanotron.logging import LoggerWriter, LogItem, set_ranks_logging_level  # noqa: E402
from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine  # noqa: E402
from nanotron.parallel.pipeline_parallel.p2p import P2P  # noqa: E402
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer  # noqa: E402

from .config import Config, recipe_for  # noqa: E402
from .context import EXPERT_PARALLEL, expert_group, parallel_context, rank_matrix  # noqa: E402
from .data import micro_batches  # noqa: E402
from .engine import BagualuPipelineEngine, DualBatchPipelineEngine  # noqa: E402
from .model import PipelineModel, stage_state  # noqa: E402

_SOURCE = "nanotron config"
HOT_RANK = 0  # the expert-parallel rank spikes route onto


def check_supported(config: Config, world_size: int) -> None:
    """Raise `RecipeError` naming the first fields this launcher cannot run."""
    par, ep = config.parallelism, getattr(config.parallelism, "expert_parallel_size", 1)
    problems = []
    for name in ("tp", "context_parallel_size"):  # main has context parallelism
        if getattr(par, name, 1) != 1:
            problems.append((f"parallelism.{name}", f"{name}={getattr(par, name)}: not supported, set it to 1"))
    if ep > 1 and not EXPERT_PARALLEL:
        msg = "this nanotron's ParallelContext cannot lay out expert parallelism (nanotron main): use nanotron 0.4 or set it to 1"
        problems.append(("parallelism.expert_parallel_size", msg))
    if ep * par.pp * par.dp * par.tp != world_size:
        msg = f"expert_parallel_size x pp x dp x tp = {ep * par.pp * par.dp * par.tp}, but torchrun started {world_size} processes"
        problems.append(("parallelism", f"{msg}: they must be equal"))
    if not isinstance(config.model.init_method, ExistingCheckpointInit):
        problems.append(("model.init_method.path", "required: the directory of the HF checkpoint to train"))
    if config.tokens is None:
        problems.append(("tokens", "required (sequence length, micro-batches, steps), but missing"))
    if config.optimizer is not None and config.optimizer.clip_grad is not None:
        problems.append(("optimizer.clip_grad", "not supported (it needs the gradient norm over all ranks): set it to null"))
    if config.optimizer is not None and config.optimizer.zero_stage != 0:
        problems.append(("optimizer.zero_stage", f"zero_stage={config.optimizer.zero_stage}: only 0 is supported"))
    enabled = config.bagualu is not None and config.bagualu.enabled
    if enabled and not isinstance(par.pp_engine, OneForwardOneBackwardPipelineEngine):
        problems.append(("parallelism.pp_engine", "bagualu.enabled runs the Provisioner inside nanotron's 1F1B engine: set it to 1f1b"))
    spikes = _spikes(config)
    if spikes is not None and spikes.enabled and ep < 2:
        msg = "routing spikes move pairs between expert-parallel ranks: they need expert_parallel_size >= 2"
        problems.append(("bagualu.spikes.enabled", msg))
    if problems:
        raise RecipeError(_SOURCE, problems)


def _spikes(config: Config) -> Spikes | None:
    """The spike schedule's section: the recipe's when the plugin is enabled, else an inline one
    (so that a stock run sees the same routing)."""
    args = config.bagualu
    if args is None:
        return None
    if args.enabled:
        return recipe_for(config, 0).spikes
    return Spikes.model_validate(args.spikes) if args.spikes is not None else None


def _optimizer(config: Config, params) -> torch.optim.Optimizer:
    args = config.optimizer
    if args is None:
        return torch.optim.AdamW(params)
    return torch.optim.AdamW(
        params,
        lr=args.learning_rate_scheduler.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )


class _GradientSync:
    """The gradient reductions nanotron's trainer would do, for the ranks this one shares weights
    with. Every rank makes every group, in one order (`new_group` is collective)."""

    def __init__(self, pc, model: nn.Module, stages: PipelineModel, timeout: timedelta):
        ranks, rank = rank_matrix(pc), dist.get_rank()  # [ep, pp, dp, tp]
        ep, pp, dp, tp = ranks.shape
        self.replicas = ep * dp

        def mine(groups) -> dist.ProcessGroup | None:
            found = None
            for members in groups:
                group = dist.new_group([int(r) for r in members], timeout=timeout)
                if rank in members:
                    found = group
            return found

        ends = [ranks[e, [0, pp - 1], d, t] for e in range(ep) for d in range(dp) for t in range(tp)]
        self.tied = mine(ends) if pp > 1 and stages.tied else None
        self.replica = mine([ranks[:, p, :, t].reshape(-1) for p in range(pp) for t in range(tp)]) if self.replicas > 1 else None
        self.dp = pc.dp_pg if dp > 1 else None
        experts = set(expert_shards(model))
        held = [(name, p) for name, p in model.named_parameters() if not p.is_meta]
        self.tied_params = stages.tied_parameters()
        self.dense = [p for name, p in held if name not in experts]
        self.experts = [p for name, p in held if name in experts]

    def __call__(self) -> None:
        if self.tied is not None and self.tied_params:
            all_reduce_gradients(self.tied_params, self.tied)
        if self.replica is not None:
            all_reduce_gradients(self.dense, self.replica, self.replicas)
            all_reduce_gradients(self.experts, self.dp, self.replicas)


def _install_spikes(spikes: Spikes, model: nn.Module, layers: range, ep: int, iterations: int, micro_batches: int):
    """Skew every forward's routing in this stage's `layers` as the seeded schedule says (the same
    on every rank); returns what to call before each forward (once per micro-batch on every rank:
    a forward pre-hook on nanotron's stages, or the fused engine's `on_forward`)."""
    adapter = Adapter(model)
    moe = [layer.index for layer in adapter.layers if layer.moe]
    local = [i for i in moe if i in layers]
    schedule = imbalance_schedule(spikes, iterations, micro_batches, moe)
    skews = {i: RoutingSkew(adapter, 0.0, ep, HOT_RANK, layers=[i]).install() for i in local}
    forwards = iter(range(iterations * micro_batches))

    def next_forward(*_):
        n = next(forwards)
        for layer, skew in skews.items():
            skew.fraction = skew_fraction(min(schedule[n // micro_batches][n % micro_batches][layer], ep), ep)

    return next_forward


def train(config: Config, device: torch.device, timeout: timedelta) -> None:
    """Run `tokens.train_steps` iterations on this process's ranks, on `device` (the default group
    is initialised, `config` passed `check_supported`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    par, tokens = config.parallelism, config.tokens
    ep = getattr(par, "expert_parallel_size", 1)
    pc = parallel_context(par.tp, par.pp, par.dp, ep)
    if config.logging is not None:
        set_ranks_logging_level(pc, config.logging)
    ep_pg = expert_group(pc)
    pp_rank, ep_rank, dp_rank = dist.get_rank(pc.pp_pg), dist.get_rank(ep_pg), dist.get_rank(pc.dp_pg)
    last, m = par.pp - 1, tokens.batch_accumulation_per_replica
    torch.manual_seed(config.general.seed)
    model = load_pretrained(
        config.model.init_method.path, expert_group=ep_pg if ep > 1 else None, keep=stage_state(par.pp, pp_rank)
    )
    p2p = P2P(pc.pp_pg, device)
    stages = PipelineModel(model, p2p).to(device)
    sync = _GradientSync(pc, model, stages, timeout)
    optimizer = _optimizer(config, [p for p in model.parameters() if not p.is_meta])

    spikes, next_forward = _spikes(config), None
    if spikes is not None and spikes.enabled:
        next_forward = _install_spikes(spikes, model, stage_layers(len(Adapter(model).layers), par.pp, pp_rank), ep, tokens.train_steps, m)
    prov = None
    if config.bagualu is not None and config.bagualu.enabled:
        recipe = recipe_for(config, pp_rank, ep_rank)
        if config.checkpoints is not None:  # the run's events beside its checkpoints
            recipe = recipe.with_output_dir(config.checkpoints.checkpoints_path)
        prov = apply(model, recipe, model_cost(model, recipe.hardware).stage(par.pp, pp_rank))
        sizes = (tokens.micro_batch_size * tokens.sequence_length, tokens.sequence_length)
        if recipe.pipeline.dual_batch:
            engine = DualBatchPipelineEngine(prov, *sizes, on_forward=next_forward)
            next_forward = None  # the engine calls it
        else:
            engine = BagualuPipelineEngine(prov, *sizes)
        ledger = prov.ledger
    else:
        engine, ledger = par.pp_engine, Ledger.for_model(model)
    if next_forward is not None:
        stages.register_forward_pre_hook(next_forward)

    batches = micro_batches(config, config.model.init_method.path, model.config.vocab_size, ep_rank * par.dp + dp_rank, sync.replicas)
    writer = LoggerWriter(global_step=tokens.train_steps)  # nanotron's own log line, "iteration: i / n | ..."
    metrics = config.bagualu.metrics_path if config.bagualu is not None else None
    out = None
    if metrics and rank == 0:
        Path(metrics).parent.mkdir(parents=True, exist_ok=True)
        out = open(metrics, "w")  # noqa: SIM115 - open for the whole run
    try:
        with ManualCollector(config.bagualu is None or config.bagualu.manual_gc) as collector:
            for iteration in range(tokens.train_steps):
                batch = [
                    {
                        "input_ids": x.to(device) if pp_rank == 0 else TensorPointer(0),
                        "labels": x.to(device) if pp_rank == last else TensorPointer(last),
                    }
                    for x in next(batches)
                ]
                ledger.reset_peak()
                with ledger.track() if prov is None else contextlib.nullcontext():  # the Provisioner tracks its own
                    outputs = engine.train_batch_iter(model=stages, pg=pc.pp_pg, batch=batch, nb_microbatches=m, grad_accumulator=None)
                sync()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

                loss = torch.zeros((), dtype=torch.float64, device=device)
                if pp_rank == last:
                    loss += sum(o["loss"].detach() for o in outputs)  # the fp32 sum, exact in float64
                dist.all_reduce(loss)
                peaks = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(world)]
                dist.all_gather(peaks, torch.tensor(ledger.peak_device_bytes, dtype=torch.int64, device=device))
                if out is not None:
                    line = {"iteration": iteration, "loss": loss.item() / sync.replicas, "peak_device_bytes": [int(p) for p in peaks]}
                    out.write(json.dumps(line) + "\n")
                    out.flush()
                if prov is not None:
                    figures = [LogItem(k, v, "human_format" if k.endswith("bytes") else None) for k, v in prov.figures().items()]
                    writer.add_scalars_from_list(figures, iteration + 1)
                collector.step()
    finally:
        if out is not None:
            out.close()
        if prov is not None:
            prov.remove()


@record  # a rank's error, with its traceback, in torchrun's summary of the failed job
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", required=True, help="nanotron YAML, optionally with a bagualu: section")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout: a rank that stops ends the job after it")
    args = parser.parse_args(argv)
    try:  # every check of the config, before any process group or model
        config = _nanotron_config.get_config_from_file(args.config_file, config_class=Config)
        check_supported(config, int(os.environ.get("WORLD_SIZE", 1)))
    except RecipeError as exc:
        raise SystemExit(f"{args.config_file}: {exc}") from None
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    train(config, device, timeout)
    dist.barrier()  # every rank is done: its metrics written, its last P2P send received


if __name__ == "__main__":
    main()
    end_process()  # main returned past its barrier; its objects are freed, the process group is not
