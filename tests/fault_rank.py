"""Run a launcher's entry point with one rank made to fail mid-iteration, for tests/test_faults.py:

    torchrun --standalone --nproc_per_node 2 tests/fault_rank.py --rank 1 --gate 3 --how raise \\
        -- -m bagualu_plugin.integrations.nanotron.train --config-file X.yaml
    accelerate launch --multi_gpu --num_processes 2 tests/fault_rank.py --rank 1 --gate 3 --how kill \\
        -- examples/finetune_moe.py --model CKPT ...

On the process whose RANK is --rank, the --gate-th MoE gate its Provisioner handles (counted from
1, over the whole run) raises `RuntimeError("injected fault ...")` or sends the process SIGKILL (or SIGSEGV):
between a layer's routing and its dispatch, while the other ranks wait in a collective (the
pipeline's P2P, the experts' all-to-all, DDP's gradient all-reduce). Every other rank, and this
one until then, runs the entry point unchanged, as `__main__`."""

import argparse
import itertools
import os
import runpy
import signal
import sys

from bagualu_plugin.runtime.provisioner import Provisioner


def inject(rank: int, gate: int, how: str) -> None:
    """Make this process (rank `rank`) fail at the `gate`-th MoE gate its Provisioners handle
    (from 1): raise RuntimeError (`how="raise"`), or SIGKILL itself (`how="kill"`) or SIGSEGV
    (`how="segv"`, a crash)."""
    gates, on_gate = itertools.count(1), Provisioner._on_gate

    def failing(self, layer, *rest):
        n = next(gates)
        if n == gate:
            if how in ("kill", "segv"):
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSEGV)
            raise RuntimeError(f"injected fault at gate {n} (layer {layer}) on rank {rank}")
        return on_gate(self, layer, *rest)

    Provisioner._on_gate = failing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True, help="the RANK that fails")
    parser.add_argument("--gate", type=int, required=True, help="fail at this rank's n-th MoE gate (from 1)")
    parser.add_argument("--how", choices=("raise", "kill", "segv"), required=True)
    argv = sys.argv[1:]
    if "--" not in argv:
        parser.error("expected -- then the entry point: -m MODULE ARGS... or SCRIPT ARGS...")
    split = argv.index("--")
    args, target = parser.parse_args(argv[:split]), argv[split + 1 :]
    if int(os.environ["RANK"]) == args.rank:
        inject(args.rank, args.gate, args.how)
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
