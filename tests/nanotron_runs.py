"""Several runs of the nanotron launcher in one torchrun launch, for tests/test_nanotron_train.py:

    torchrun --standalone --nproc_per_node N tests/nanotron_runs.py --timeout-s 60 --run-timeout-s 300 A.yaml B.yaml ...

calls the launcher's own `main(["--config-file", X, "--timeout-s", T])` for each config in turn,
as `torchrun -m bagualu_plugin.integrations.nanotron.train --config-file X` does for one. Starting
N processes that import torch, transformers and nanotron costs more than a tiny run, so runs on
the same number of processes share them: the process group that the first run's `main`
initialises serves the later ones (each run makes its own nanotron groups in it, with the same
collective timeout). Each run must end within --run-timeout-s: then SIGALRM, left at its default
action (which a blocked collective cannot hold off), ends the process, and torchrun the job."""

import argparse
import signal

import torch.distributed as dist

from bagualu_plugin.integrations.nanotron import train as launcher
from bagualu_plugin.parallel.launch import end_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", required=True, help="each run's collective timeout (the launcher's --timeout-s)")
    parser.add_argument("--run-timeout-s", type=int, required=True, help="how long each run may take")
    parser.add_argument("configs", nargs="+", help="nanotron YAML files, run in this order")
    args = parser.parse_args()
    init = dist.init_process_group

    def once(*a, **kw) -> None:  # the launcher's main initialises the group for each run
        if not dist.is_initialized():
            init(*a, **kw)

    dist.init_process_group = once
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    for config in args.configs:
        signal.alarm(args.run_timeout_s)
        launcher.main(["--config-file", config, "--timeout-s", args.timeout_s])
        signal.alarm(0)


if __name__ == "__main__":
    main()
    end_process()  # as the launcher's own __main__ does
