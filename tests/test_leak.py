"""A persistent Provisioner keeps nothing per micro-batch once its telemetry deque is cleared: 200
iterations at a budget no plan fits (every micro-batch's Algorithm 2 ends infeasible, in one
process) and 200 with routing spikes that reach the gates of 2 expert-parallel gloo ranks (the
gates defer and escalate), the project's live objects and the Python heap (`tracemalloc`) flat
after warm-up: a leak grows the heap in every stretch of iterations, where a one-off (a dict of
the interpreter's or of a library's, made before tracing, resized under it) grows it in one."""

import gc
import sys
import tracemalloc
import warnings

import pytest
import torch
from helpers import tiny_recipe, unmitigated_bytes

from bagualu_plugin.adapters import Adapter, tiny_model
from bagualu_plugin.adapters.gate import RoutingSkew
from bagualu_plugin.config import Recipe
from bagualu_plugin.parallel import expert_parallel
from bagualu_plugin.parallel.launch import run_ranks
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.provisioner import apply

PP, M, BATCH, SEQ = 2, 2, 1, 8
WARMUP, ITERATIONS, WINDOWS = 10, 200, 4
OBJECTS = 20  # the cached exception's leak kept ~13 objects (an Event, its GatePlan, ...) per micro-batch
HEAP = 2 << 10  # per window of ITERATIONS // WINDOWS iterations
ROUNDS = 2  # of WINDOWS windows each, every rank the same (expert-parallel ranks run in lockstep): the least counts
GREW = f"the Python heap grew by {{}} bytes or more in {WINDOWS - 1} of {WINDOWS} stretches of {ITERATIONS // WINDOWS} iterations"


def _ours() -> int:
    """Live objects of the project's own classes."""
    return sum(str(getattr(type(o), "__module__", "")).startswith("bagualu_plugin") for o in gc.get_objects())


def _growth(model, recipe: Recipe, around=None) -> tuple[int, int, int, int]:
    """Live project objects gained over ROUNDS * ITERATIONS after WARMUP and the traced heap bytes that all
    but one of their WINDOWS stretches gained at most (the second largest gain; the least of up to
    ROUNDS such rounds), the telemetry
    deque cleared each time; the forwards run and the gates that deferred or escalated."""
    prov = apply(model, recipe)
    prov.ledger.on_overrun = "record"  # an overrun is not what this measures
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(M)]
    acted = 0

    def run(iterations: int) -> None:
        nonlocal acted
        for _ in range(iterations):
            run_iteration(model, batches, prov.stage.schedule, prov, around=around)
            model.zero_grad(set_to_none=True)
            acted += sum(len(e.escalations) + len(e.deferred) for e in prov.events)
            prov.events.clear()
        gc.collect()
        sys._clear_type_cache()  # CPython's method cache holds the types it met last (bounded): not ours

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the infeasible budget's warning, once per micro-batch
        tracemalloc.start()  # before warm-up: what steady state reuses was allocated under tracing too
        run(WARMUP)
        objects = _ours()
        gains = []
        for _ in range(ROUNDS):  # a leak grows in every round; another thread's burst (xdist's reports) in one
            grew = []
            for _ in range(WINDOWS):
                heap = tracemalloc.get_traced_memory()[0]
                run(ITERATIONS // WINDOWS)
                grew.append(tracemalloc.get_traced_memory()[0] - heap)
            gains.append(sorted(grew)[-2])
        tracemalloc.stop()
    prov.remove()
    return _ours() - objects, min(gains), prov.forwards, acted


def _recipe(model, capacity: float, allowed: list[str], ep: int = 1, rank: int = 0, **changes) -> Recipe:
    """Capacity as a multiple of one unmitigated micro-batch."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, capacity=capacity, parallel={"ep": ep, "ep_rank": rank, "dp": ep},
        pipeline={"pp": PP, "rank": 0, "micro_batches": M}, strategies={"allowed": allowed, "offload": {"min_bytes": 0}}, **changes,
    )


@pytest.fixture
def one_thread():
    """A tiny model runs faster on one torch thread, and never thrashes a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_an_infeasible_budget_every_micro_batch_keeps_nothing(one_thread):
    """Offload only, M0 declared far below what offloading reaches: Algorithm 2 gives up on every
    micro-batch (the cached `InfeasibleBudget` once kept every caller's frames alive)."""
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    model.set_experts_implementation("bagualu")
    recipe = _recipe(model, 1.0, ["offload"], budget={"min_budget": int(unmitigated_bytes(model, BATCH, SEQ) // 8)})
    objects, heap, forwards, _ = _growth(model, recipe)
    assert forwards == (WARMUP + ROUNDS * ITERATIONS) * M
    assert objects <= OBJECTS, f"{objects} more live bagualu_plugin objects after {ROUNDS * ITERATIONS} iterations"
    assert heap < HEAP, GREW.format(heap)


def _spiking_rank(rank: int, size: int) -> tuple[int, int, int, int]:
    torch.set_num_threads(1)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    model.set_experts_implementation("bagualu")
    expert_parallel(model)
    recipe = _recipe(model, 2.0, ["recompute", "offload"], ep=size, rank=rank)
    adapter = Adapter(model)

    def around(step):  # micro-batch 1 of every iteration sends every pair to rank 0's experts
        return RoutingSkew(adapter, 1.0 if step.micro_batch == 1 else 0.0, ep_size=size, ep_rank=0)

    return _growth(model, recipe, around)


@pytest.mark.multiprocess
def test_spikes_at_the_gates_keep_nothing():
    hot, cold = run_ranks(_spiking_rank, 2, timeout_s=600)
    assert hot[3] >= WARMUP + ITERATIONS  # the hot rank's gates acted on every spike
    for grown, grew, _, _ in (hot, cold):
        assert grown <= OBJECTS, f"{grown} more live bagualu_plugin objects after {ROUNDS * ITERATIONS} iterations"
        assert grew < HEAP, GREW.format(grew)
