"""The spike demo's policies on real expert-parallel ranks (short runs; numbers live in benchmarks).

`run_demo` starts `parallel.ep` = 4 processes, which import, profile and pretrain before the first
iteration (about half a minute on 2 cores), so one run serves several tests; the tests of the
collective OOM run the demo's pieces in their own ranks with the analytic cost model instead of
a profile. Every launch has a deadline (`parallel.launch.run_ranks`): a rank left out of step
fails the test instead of hanging it."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bagualu_plugin import load_recipe
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.demo import run_demo
from bagualu_plugin.demo.model import demo_stage, rank_batches, rank_model, rank_recipe
from bagualu_plugin.demo.policies import PolicyRun
from bagualu_plugin.parallel.gradients import average_gradients
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.spikes import imbalance_schedule

RESTART_ITERATIONS = 1000  # so that the charge stands out of any timing noise


def spiky(**spikes):
    recipe = load_recipe("demo")
    return recipe.model_copy(update={"spikes": recipe.spikes.model_copy(update=spikes)})


@pytest.fixture(scope="module")
def every_iteration_spikes():
    recipe = spiky(spike_probability=1.0, spike_max_imbalance=2.6, normal_max_imbalance=1.2, restart_iterations=RESTART_ITERATIONS)
    return recipe, run_demo(recipe, steps=2, policies=["adaptive", "none", "oracle"], timeout_s=300)


@pytest.mark.multiprocess
def test_adaptive_survives_spikes_that_crash_the_unmitigated_policy(every_iteration_spikes):
    recipe, (adaptive, none, _) = every_iteration_spikes
    capacity, ep, pipe = recipe.hardware.capacity_bytes, recipe.parallel.ep, recipe.pipeline
    assert adaptive.ooms == 0 and adaptive.steps_completed == 2
    assert adaptive.peak_device_bytes <= capacity
    assert all(e.peak <= capacity for e in adaptive.timeline)
    forwards = [e for e in adaptive.timeline if e.kind == "F"]
    assert len(forwards) == 2 * pipe.micro_batches == adaptive.forwards
    assert all(e.live <= e.ceiling for e in forwards)  # each forward stays within its budget
    assert max(adaptive.rank_peak_device_bytes) <= capacity and len(adaptive.rank_peak_device_bytes) == ep
    # the job's tokens: every rank's
    assert adaptive.tokens == 2 * pipe.micro_batches * recipe.batch.tokens * ep
    assert none.ooms >= 1  # then it restarts with full recompute, as the paper's baselines do
    assert none.steps_completed == 2 - none.ooms
    oom = [e for e in none.timeline if e.oom][0]
    assert oom.peak > capacity and oom.oom_ranks == (recipe.parallel.ep_rank,) and oom.kind == "F"
    # the spikes target the reported rank: the others keep less
    assert none.rank_peak_device_bytes[recipe.parallel.ep_rank] == max(none.rank_peak_device_bytes)


@pytest.mark.multiprocess
def test_the_oracle_plans_each_spike_knowing_it(every_iteration_spikes):
    """Each micro-batch planned for the routing its first pass recorded, on every rank at once:
    no OOM, every forward within its budget, and the first pass untimed."""
    recipe, (adaptive, _, oracle) = every_iteration_spikes
    capacity = recipe.hardware.capacity_bytes
    assert oracle.ooms == 0 and oracle.steps_completed == 2 and oracle.tokens == adaptive.tokens
    assert oracle.peak_device_bytes <= capacity and max(oracle.rank_peak_device_bytes) <= capacity
    forwards = [e for e in oracle.timeline if e.kind == "F"]
    assert len(forwards) == oracle.forwards == 2 * recipe.pipeline.micro_batches
    assert all(e.live <= e.ceiling for e in forwards)
    assert [e.spike for e in forwards] == [e.spike for e in adaptive.timeline if e.kind == "F"]


RECORDED = Path(__file__).parent / "data" / "demo-every-iteration-spikes-2.json"


def _fixed(result) -> dict:
    """What the seeds fix in a policy's result: steps, OOMs (where, on which ranks), forwards,
    tokens and each step's spike. Its bytes are not: every rank profiles its cost model, and
    Algorithm 2 breaks ties between equal reductions by the time they add, so a plan follows the
    op times the machine's load gave the profile."""
    timeline = [[e.iteration, e.micro_batch, e.kind, e.spike, e.oom, list(e.oom_ranks)] for e in result.timeline]
    return {"policy": result.policy, "steps_completed": result.steps_completed, "ooms": result.ooms,
            "forwards": result.forwards, "tokens": result.tokens, "timeline": timeline}


@pytest.mark.multiprocess
def test_fixed_seeds_give_the_recorded_run(every_iteration_spikes):
    """The run as recorded before the decisions were made fast (the same policies, the same steps)."""
    _, results = every_iteration_spikes
    assert [_fixed(r) for r in results[:2]] == json.loads(RECORDED.read_text())


@pytest.mark.multiprocess
def test_restart_is_charged_once_for_the_job(every_iteration_spikes):
    _, (adaptive, none, _) = every_iteration_spikes
    for r in (adaptive, none):
        assert len(r.iteration_s) == r.steps_completed
        assert r.seconds == pytest.approx(sum(r.iteration_s) + r.restart_s)
    assert adaptive.restart_s == 0
    # one OOM, charged as RESTART_ITERATIONS iterations (of the failed one's time, at least a few forwards)
    assert none.ooms == 1 and none.restart_s > 50 * sum(none.iteration_s)


def test_policies_and_capacity_are_checked_before_starting_ranks():
    recipe = spiky(spike_probability=1.0)
    with pytest.raises(ValueError, match="policies must be"):
        run_demo(recipe, 1, ["adaptive", "greedy"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        run_demo(recipe, 0)
    small = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"capacity_bytes": 2_000_000})})
    with pytest.raises(ValueError, match=r"cannot hold static memory 0 plus 4 in-flight micro-batches .* M0 = "):
        run_demo(small, 1)
    one = recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"ep": 1, "dp": 1})})
    with pytest.raises(ValueError, match="parallel.ep >= 2"):
        run_demo(one, 1)


def _params(run: PolicyRun) -> list[torch.Tensor]:
    return [p.detach().clone() for p in run.model.parameters()]


def _averaged(rank: int, size: int) -> bool:
    """`average_gradients` of gradients rank + 1 everywhere: replicated ones become the mean over
    ranks, a local expert's (already a sum over the ranks' tokens) is divided by the ranks."""
    model = rank_model(load_recipe("demo").model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    average_gradients(model)
    mean = sum(range(1, size + 1)) / size
    return all(torch.all(p.grad == ((rank + 1) / size if ".mlp.experts." in n else mean)).item() for n, p in model.named_parameters())


def _oom_on_one_rank(rank: int, size: int, short: int) -> dict:
    """Policies adaptive and none, 2 iterations, no spikes; in iteration 0 rank `short`'s Ledgers
    have room for 2.5 micro-batches only, so that rank (and no other) overruns in the third
    forward. Analytic cost model (no profile), no pretraining."""
    recipe = load_recipe("demo")
    recipe = recipe.model_copy(update={"spikes": recipe.spikes.model_copy(update={"spike_probability": 0.0})})
    mine = rank_recipe(recipe, rank)
    model = rank_model(recipe.model)
    stage = demo_stage(mine, model_cost(model))
    schedule = imbalance_schedule(recipe.spikes, 2, recipe.pipeline.micro_batches, stage.cost.moe_layers)
    batches = rank_batches(recipe, rank)
    runs = [PolicyRun(p, stage, schedule, batches, model.state_dict(), hot=0) for p in ("adaptive", "none")]
    identical = all(torch.equal(a, b) for a, b in zip(*(_params(run) for run in runs)))
    limit = int(2.5 * stage.micro_batch(1.0).activation_bytes)
    if rank == short:
        for run in runs:
            run.runner.ledger.capacity_bytes = limit
    stepped = {run.result.policy: [] for run in runs}
    try:
        for it in range(2):
            for run in runs:
                before, ooms = _params(run), run.result.ooms
                run.iteration(it)
                changed = [not torch.equal(a, b) for a, b in zip(before, run.model.parameters())]
                stepped[run.result.policy].append((run.result.ooms > ooms, sum(changed), len(changed)))
    finally:
        results = [run.close() for run in runs]
    # data parallelism keeps the replicated weights equal on every rank
    replicated = torch.cat([p.detach().reshape(-1) for n, p in runs[0].model.named_parameters() if ".mlp.experts." not in n])
    gathered = [torch.empty_like(replicated) for _ in range(size)]
    dist.all_gather(gathered, replicated)
    same = all(torch.equal(g, replicated) for g in gathered)
    return dict(limit=limit, identical=identical, averaged=_averaged(rank, size), stepped=stepped, results=results, same_across_ranks=same)


@pytest.mark.multiprocess
def test_an_oom_on_one_rank_stops_every_rank_at_the_same_step():
    """Also: every policy's model starts as the same copy, an iteration ends with an optimizer
    step except one that ran out of memory (its restart resumes from the last step), and data
    parallelism keeps the replicated weights equal on every rank."""
    short = 2  # not the hot rank: its Ledger alone is short of memory
    ranks = run_ranks(_oom_on_one_rank, 4, short, timeout_s=120, threads=1)
    for rank, r in enumerate(ranks):
        assert r["identical"] and r["same_across_ranks"] and r["averaged"]
        for result in r["results"]:
            assert result.ooms == 1 and result.steps_completed == 1, (rank, result.policy)
            first = [e for e in result.timeline if e.iteration == 0]
            assert [(e.kind, e.micro_batch) for e in first] == [("F", 0), ("F", 1), ("F", 2)]  # stopped together
            assert first[-1].oom and first[-1].oom_ranks == (short,) and not any(e.oom for e in first[:-1])
            if rank == short:
                assert first[-1].peak > r["limit"]  # what it needed: the step ran to its end
            assert [e.kind for e in result.timeline if e.iteration == 1] == ["F"] * 4 + ["B"] * 4  # full recompute then
        for policy, steps in r["stepped"].items():
            (oom0, changed0, _), (oom1, changed1, total) = steps
            assert oom0 and changed0 == 0  # the failed iteration's gradients are dropped: no step
            assert not oom1 and changed1 > total // 2, (rank, policy)  # an optimizer step on every rank
