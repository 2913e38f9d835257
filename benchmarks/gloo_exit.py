"""How a finished two-process gloo job ends, without the plugin or any Trainer: `torchrun` starts 2
processes that train a `Linear` under DistributedDataParallel for 4 steps and then end one of three
ways, each run `--runs` times:

- `return`: the script returns, as a user's script does (the interpreter tears the process group down);
- `destroy`: `torch.distributed.destroy_process_group()` first, as torch's documentation advises;
- `end_process`: a barrier, then `os._exit(0)` (`bagualu_plugin.parallel.launch.end_process`, what
  the examples do): nothing is torn down.

Prints per way the runs that exited 0, aborted (a non-zero exit: torch's C++ threads call
`std::terminate` at the interpreter's exit) or hung past `--timeout` seconds.

    python benchmarks/gloo_exit.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from bagualu_plugin.parallel.launch import free_port
from bagualu_plugin.report import table

SCRIPT = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
elif sys.argv[1] == "end_process":
    from bagualu_plugin.parallel.launch import end_process
    end_process(dist.barrier)
"""
WAYS = ("return", "destroy", "end_process")


def run(script: Path, way: str, timeout: float) -> str:
    """One launch: "exited 0", "aborted" or "hung"."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(script), way]
    try:
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hung"
    return "exited 0" if done.returncode == 0 else "aborted"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="launches per way of ending")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds after which a launch counts as hung")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp_linear.py"
        script.write_text(SCRIPT)
        counts = {way: {"exited 0": 0, "aborted": 0, "hung": 0} for way in WAYS}
        for i in tqdm(range(args.runs * len(WAYS)), desc="launches"):
            way = WAYS[i % len(WAYS)]  # taking turns: the machine's load falls on every way alike
            counts[way][run(script, way, args.timeout)] += 1
    print(table(["ending", "exited 0", "aborted", "hung"], [[way, *c.values()] for way, c in counts.items()]))


if __name__ == "__main__":
    main()
