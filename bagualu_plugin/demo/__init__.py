"""The spike demo (`bagualu demo`): adaptive provisioning against static policies on one real model
(paper §II-B, §VI-C), on CPU with a simulated device capacity.

A tiny GLM-4-MoE trains under real expert parallelism, `parallel.ep` gloo processes, each also
pipeline rank `pipeline.rank` of a 1F1B pipeline whose other stages are not run. Routing follows
the recipe's spikes, all skewed onto rank `parallel.ep_rank`, the hot rank, whose memory the
demo reports. One concept a module:

- `policies`: the five policies and one policy's training run on a rank (`PolicyRun`), with
  what it records (`PolicyResult`, `TimelineEntry`);
- `model`: the model, recipe, cost model, stage and batches of one rank, and the training step
  every policy shares;
- `collectives`: what every rank must agree on so that none is left in a collective alone;
- `job`: the processes (`run_demo`, one `demo_rank` each).

The table and JSON rows of a run are `report.summary` and `report.summary_table`.
"""

from .job import run_demo
from .policies import POLICIES, PolicyResult

__all__ = ["POLICIES", "PolicyResult", "run_demo"]
