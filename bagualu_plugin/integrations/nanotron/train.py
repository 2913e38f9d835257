"""`torchrun --nproc_per_node N -m bagualu_plugin.integrations.nanotron.train --config-file X.yaml`:
train an HF MoE checkpoint with nanotron's pipeline engine, with the Provisioner in it when the
config's `bagualu:` section is enabled (`BagualuPipelineEngine`), stock nanotron otherwise.

nanotron's `DistributedTrainer` cannot run on a CPU (its import needs flash_attn, it builds the model
on CUDA, its FP32 gradient accumulator is CUDA-only), so this is a small loop of our own around
nanotron's engine, P2P and `PipelineBlock`s; that is what lets the same run go on gloo and on NCCL.

This first version:
- runs pipeline parallelism only: one process per pipeline rank, the pipeline group is the world
  (dp, tp and expert parallelism are refused: they need their groups and gradient all-reduces);
- loads the checkpoint named by nanotron's `model.init_method.path` (`ExistingCheckpointInit`)
  whole on every rank, in the checkpoint's dtype (`model.dtype` is not applied), and runs only the
  rank's blocks (`PipelineModel`); loading only a rank's layers is a later step;
- feeds synthetic tokens, seeded by `general.seed`, in [0, vocab) of the checkpoint, labels = inputs;
- steps `torch.optim.AdamW` with nanotron's `optimizer:` section (learning rate, weight decay,
  betas, eps; the learning rate stays constant) or torch's defaults without one.

`--metrics PATH`: rank 0 writes one JSON line per iteration, `{"iteration", "loss", "peak_device_bytes"}`:
the loss is the sum of the last pipeline rank's micro-batch losses (nanotron divides each by the
micro-batch count), the peaks the activation bytes each pipeline rank's Ledger saw (the Provisioner's
with the plugin, one tracking the forwards without), so stock and plugin runs compare line by line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from ...adapters.costs import model_cost
from ...config import RecipeError
from ...runtime.ledger import Ledger
from ...runtime.provisioner import apply
from .compat import import_nanotron

_nanotron_config = import_nanotron()

from nanotron.config.models_config import ExistingCheckpointInit  # noqa: E402
from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine  # noqa: E402
from nanotron.parallel.pipeline_parallel.p2p import P2P  # noqa: E402
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer  # noqa: E402

from .config import Config, recipe_for  # noqa: E402
from .engine import BagualuPipelineEngine  # noqa: E402
from .model import PipelineModel  # noqa: E402

_SOURCE = "nanotron config"


def check_supported(config: Config, world_size: int) -> None:
    """Raise `RecipeError` naming the first field this launcher cannot run yet."""
    par = config.parallelism
    problems = [
        (f"parallelism.{name}", f"{name}={value}: only pipeline parallelism is supported yet, set it to 1")
        for name, value in (("dp", par.dp), ("tp", par.tp), ("expert_parallel_size", getattr(par, "expert_parallel_size", 1)))
        if value != 1
    ]
    if par.pp != world_size:
        problems.append(("parallelism.pp", f"pp={par.pp}, but torchrun started {world_size} processes: they must be equal"))
    if not isinstance(config.model.init_method, ExistingCheckpointInit):
        problems.append(("model.init_method.path", "required: the directory of the HF checkpoint to train"))
    if config.tokens is None:
        problems.append(("tokens", "required (sequence length, micro-batches, steps), but missing"))
    if config.optimizer is not None and config.optimizer.clip_grad is not None:
        problems.append(("optimizer.clip_grad", "not supported yet (it needs the gradient norm over the pipeline ranks): set it to null"))
    enabled = config.bagualu is not None and config.bagualu.enabled
    if enabled and not isinstance(par.pp_engine, OneForwardOneBackwardPipelineEngine):
        problems.append(("parallelism.pp_engine", "bagualu.enabled runs the Provisioner inside nanotron's 1F1B engine: set it to 1f1b"))
    if problems:
        raise RecipeError(_SOURCE, problems)


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


def train(config: Config, device: torch.device, metrics: str | None) -> None:
    """Run `tokens.train_steps` iterations on this process's pipeline rank, on `device` (the group
    is initialised)."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    check_supported(config, pp)
    tokens, last = config.tokens, pp - 1
    torch.manual_seed(config.general.seed)
    model = AutoModelForCausalLM.from_pretrained(
        str(config.model.init_method.path), local_files_only=True, experts_implementation="bagualu"
    ).to(device)
    model.train()
    p2p = P2P(dist.group.WORLD, device)
    stages = PipelineModel(model, p2p)
    optimizer = _optimizer(config, model.parameters())

    prov = None
    if config.bagualu is not None and config.bagualu.enabled:
        recipe = recipe_for(config, rank)
        prov = apply(model, recipe, model_cost(model, recipe.hardware).stage(pp, rank))
        engine, ledger = BagualuPipelineEngine(prov, tokens.micro_batch_size * tokens.sequence_length, tokens.sequence_length), prov.ledger
    else:
        engine, ledger = config.parallelism.pp_engine, Ledger.for_model(model)

    data = torch.Generator().manual_seed(config.general.seed)  # the same stream on every rank
    shape, vocab, m = (tokens.micro_batch_size, tokens.sequence_length), model.config.vocab_size, tokens.batch_accumulation_per_replica
    out = open(metrics, "w") if metrics and rank == 0 else None  # noqa: SIM115 - open for the whole run
    try:
        for iteration in range(tokens.train_steps):
            ids = [torch.randint(0, vocab, shape, generator=data) for _ in range(m)]
            batch = [
                {
                    "input_ids": x.to(device) if rank == 0 else TensorPointer(0),
                    "labels": x.to(device) if rank == last else TensorPointer(last),
                }
                for x in ids
            ]
            ledger.reset_peak()
            with ledger.track() if prov is None else contextlib.nullcontext():  # the Provisioner tracks its own
                outputs = engine.train_batch_iter(model=stages, pg=p2p.pg, batch=batch, nb_microbatches=m, grad_accumulator=None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            loss = torch.zeros((), dtype=torch.float64, device=device)
            if rank == last:
                loss += sum(o["loss"].detach() for o in outputs)  # the fp32 sum, exact in float64
            dist.broadcast(loss, src=last)
            peaks = [torch.zeros((), dtype=torch.int64, device=device) for _ in range(pp)]
            dist.all_gather(peaks, torch.tensor(ledger.peak_device_bytes, dtype=torch.int64, device=device))
            if out is not None:
                line = {"iteration": iteration, "loss": loss.item(), "peak_device_bytes": [int(p) for p in peaks]}
                out.write(json.dumps(line) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
        if prov is not None:
            prov.remove()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-file", required=True, help="nanotron YAML, optionally with a bagualu: section")
    parser.add_argument("--metrics", help="rank 0 writes one JSON line per iteration here")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout: a rank that stops ends the job after it")
    args = parser.parse_args(argv)
    config = _nanotron_config.get_config_from_file(args.config_file, config_class=Config)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout_s))
    train(config, device, args.metrics)
    dist.barrier()  # every rank is done: its metrics written, its last P2P send received


if __name__ == "__main__":
    main()
    # The interpreter's teardown of torch's C++ threads aborts now and then after gloo P2P
    # ("terminate called without an active exception", about one run in ten on CPU), failing a
    # finished run; nothing is left to do, so the process ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
