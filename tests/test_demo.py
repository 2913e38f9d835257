"""The spike demo's policies on the built-in demo recipe (short runs; numbers live in benchmarks)."""

import pytest
import torch

from bagualu_plugin import load_recipe
from bagualu_plugin.demo import PolicyRun, demo_cost, demo_stage, pretrained, run_demo, run_policy
from bagualu_plugin.spikes import imbalance_schedule


def spiky(**spikes):
    recipe = load_recipe("demo")
    return recipe.model_copy(update={"spikes": recipe.spikes.model_copy(update=spikes)})


def test_adaptive_survives_spikes_that_crash_the_unmitigated_policy():
    recipe = spiky(spike_probability=1.0, spike_max_imbalance=2.6, normal_max_imbalance=1.2)
    adaptive, none = run_demo(recipe, steps=2, policies=["adaptive", "none"])
    assert adaptive.ooms == 0 and adaptive.steps_completed == 2
    assert adaptive.peak_device_bytes <= recipe.hardware.capacity_bytes
    assert all(e.peak <= recipe.hardware.capacity_bytes for e in adaptive.timeline)
    forwards = [e for e in adaptive.timeline if e.kind == "F"]
    assert len(forwards) == 2 * recipe.pipeline.micro_batches == adaptive.forwards
    assert all(e.live <= e.ceiling for e in forwards)  # each forward stays within its budget
    assert none.ooms >= 1  # then it restarts with full recompute, as the paper's baselines do
    assert none.steps_completed == 2 - none.ooms
    assert [e for e in none.timeline if e.oom][0].peak > recipe.hardware.capacity_bytes


def test_restart_is_charged_and_policies_are_checked():
    recipe = spiky(spike_probability=1.0, restart_iterations=0)
    free = run_policy("none", recipe, steps=2)
    charged = run_policy("none", spiky(spike_probability=1.0, restart_iterations=1000), steps=2)
    assert free.ooms == charged.ooms >= 1
    assert charged.seconds > free.seconds + 100 * (free.seconds / 2)
    with pytest.raises(ValueError, match="policies must be"):
        run_demo(recipe, 1, ["adaptive", "greedy"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_demo(recipe, 0)


def test_every_policy_trains_its_own_identical_copy():
    """Each policy's model starts as the same copy; an iteration ends with an optimizer step,
    except one that ran out of memory (its restart resumes from the last step)."""
    recipe = spiky(spike_probability=1.0)
    stage = demo_stage(recipe, demo_cost(recipe))
    schedule = imbalance_schedule(recipe.spikes, 2, recipe.pipeline.micro_batches, stage.cost.moe_layers)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, recipe.model.vocab_size, (2, recipe.batch.seq_len), generator=g) for _ in range(8)]
    start = pretrained(stage, batches)
    runs = [PolicyRun(p, stage, schedule, batches, start) for p in ("adaptive", "none")]
    adaptive, none = ([p.detach().clone() for p in run.model.parameters()] for run in runs)
    assert all(torch.equal(a, b) for a, b in zip(adaptive, none))
    try:
        for it in range(2):
            for run in runs:
                before, ooms = [p.detach().clone() for p in run.model.parameters()], run.result.ooms
                run.iteration(it)
                stepped = [not torch.equal(a, b) for a, b in zip(before, run.model.parameters())]
                assert sum(stepped) > len(stepped) // 2 if run.result.ooms == ooms else not any(stepped)
    finally:
        results = [run.close() for run in runs]
    assert results[0].ooms == 0 and results[1].ooms >= 1
