"""Real expert parallelism (`bgl.expert_parallel`): tokens exchanged between gloo processes on CPU.

Against one process running the full model on the rank's batch: the loss and the non-expert
gradients of each rank, and each local expert's gradient against the sum over ranks of the full
model's gradient for that expert. Not bitwise: CPU matmul rounds a row differently depending on
how many rows it multiplies at once (one row against several already differs), and an expert
multiplies the rows of all ranks at once. Tolerance 1e-5 relative (loss, and the norm of each
gradient's error over its norm); measured over 2 and 4 ranks at most 1.0e-7 for the loss, 8.5e-7
for the non-expert gradients, 2.0e-7 for the expert gradients.

Every group has a collective timeout (60 to 120 s) and every launch a deadline (`parallel.launch`).
The checks that succeed on 2 ranks share one launch (`helpers.run_jobs`, the `two_ranks` fixture):
each rank's spawn and imports cost seconds, more than several of the checks themselves.
"""

import time

import pytest
import torch
from helpers import collectives, plan_step, relative_error, run_jobs, tiny_recipe

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, Adapter, tiny_model
from bagualu_plugin.adapters.costs import model_cost
from bagualu_plugin.adapters.gate import GateMonitor, RoutingSkew
from bagualu_plugin.config import Recipe
from bagualu_plugin.costmodel import OpId
from bagualu_plugin.costmodel.graph import COLLECTIVE_OPS, EXPERT_OPS
from bagualu_plugin.parallel import expert_parallel
from bagualu_plugin.parallel.launch import RankError, run_ranks
from bagualu_plugin.runtime.driver import run_iteration
from bagualu_plugin.runtime.plan_runtime import PlanRuntime
from bagualu_plugin.runtime.profiler import measure_micro_batch

FAMS = sorted(FAMILIES)
BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
TOL = 1e-5

pytestmark = pytest.mark.multiprocess  # every test runs gloo ranks (`run_ranks`)


def _model(family: str, ep: bool = True, **overrides):
    model = tiny_model(family, **overrides)
    model.set_experts_implementation("bagualu")
    if ep:
        expert_parallel(model)
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + rank))


def _step(model, ids, plan=None):
    """Loss, gradients by name and saved bytes of one step (labels a copy of `ids`)."""
    return plan_step(model, ids, plan or {}, named=True)


def _skew(model, fraction: float, layers=None):
    """Every rank routes `fraction` of each layer's pairs (of `layers`; None: all) to rank 0's experts."""
    return RoutingSkew(Adapter(model), fraction, ep_size=torch.distributed.get_world_size(), ep_rank=0, layers=layers)


def _against_one_process(rank: int, size: int, families: list[str], fraction: float) -> dict:
    ids, out = _batch(rank), {}
    for family in families:
        reference, model = _model(family, ep=False), _model(family)
        with _skew(reference, fraction):
            loss0, grads0, _ = _step(reference, ids)
        with _skew(model, fraction), GateMonitor(model) as monitor:
            loss, grads, _ = _step(model, ids)
        received = monitor.local_pairs()
        local = Adapter(model).expert_group.local
        expert, other = 0.0, 0.0
        for name, g in grads.items():
            g0 = grads0[name]
            if g.shape != g0.shape:  # a sharded expert parameter: every rank's tokens reached it
                torch.distributed.all_reduce(g0)
                expert = max(expert, relative_error(g, g0[local.start : local.stop], floor=1e-30))
            else:
                other = max(other, relative_error(g, g0, floor=1e-30))
        sharded = sum(p.numel() for layer in Adapter(model).layers if layer.moe for p in layer.experts.parameters())
        full = sum(p.numel() for layer in Adapter(reference).layers if layer.moe for p in layer.experts.parameters())
        out[family] = dict(loss=abs(loss - loss0).item() / loss0.item(), expert=expert, other=other,
                           received=received, sharded=sharded, full=full, missing=sorted(set(grads0) - set(grads)))
    return out


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """Every check below that succeeds on 2 ranks, in one launch: each job's results in rank order."""
    return run_jobs(2, {
        "balanced": (_against_one_process, FAMS, 0.0),
        "without tokens": (_against_one_process, ["glm4_moe", "gpt_oss"], 1.0),
        "ledger": (_ledger_and_plans, FAMS),
        "bad input": (_bad_input,),
        "gate": (_gate,),
        "adaptive": (_adaptive_training,),
        "profiled": (_profiled, ["gpt_oss", "qwen2_moe"]),
        "floor": (_floor,),
        "split": (_split_collective,),
    }, timeout_s=120)


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_match_one_process_on_their_batch(size, request):
    if size == 2:
        results = request.getfixturevalue("two_ranks")["balanced"]
    else:
        results = run_ranks(_against_one_process, size, FAMS, 0.0, timeout_s=60)
    for family in FAMS:
        per_rank = [r[family] for r in results]
        for r in per_rank:
            assert r["loss"] < TOL and r["other"] < TOL and r["expert"] < TOL, (family, r)
            assert r["sharded"] * size == r["full"] and not r["missing"]
        # every routed pair of every rank was received by exactly one rank
        for layer in per_rank[0]["received"]:
            assert sum(r["received"][layer] for r in per_rank) == size * TOKENS * 2


def test_experts_and_ranks_without_tokens(two_ranks):
    """Every pair routed to rank 0's experts: rank 1 receives nothing, its experts no gradient."""
    results = two_ranks["without tokens"]
    for family in ("glm4_moe", "gpt_oss"):
        hot, cold = results[0][family], results[1][family]
        for r in (hot, cold):
            assert r["loss"] < TOL and r["other"] < TOL and r["expert"] < TOL, (family, r)
        assert set(cold["received"].values()) == {0}
        assert set(hot["received"].values()) == {2 * TOKENS * 2}


def _ledger_and_plans(rank: int, size: int, families: list[str]) -> dict:
    """Ledger bytes against the cost model at this rank's real local pairs, under several plans,
    balanced and skewed; and a plan that recomputes on rank 0 only."""
    ids, out = _batch(rank), {}
    for family in families:
        model = _model(family)
        adapter, cm = Adapter(model), model_cost(model)
        moe = [layer.index for layer in adapter.layers if layer.moe]
        plans = {
            "keep": {},
            "experts recomputed": {OpId(i, n): "recompute" for i in moe for n in EXPERT_OPS},
            "fc1 recomputed, fc2 offloaded": {**{OpId(i, "expert_fc1"): "recompute" for i in moe},
                                               **{OpId(i, "expert_fc2"): "offload" for i in moe}},
            "full recompute": cm.full_recompute(),
            # the same on every rank, so a region may hold the all-to-alls
            "experts recomputed with their all-to-alls": {OpId(i, n): "recompute" for i in moe for n in COLLECTIVE_OPS},
            "full recompute with the all-to-alls": cm.full_recompute(collective=True),
        }
        checks = {}
        for fraction in (0.0, 0.75):
            for name, plan in plans.items():
                with _skew(model, fraction), GateMonitor(model) as monitor:
                    _, _, saved = _step(model, ids, plan)
                pairs = monitor.local_pairs()
                predicted = cm.activation_bytes(TOKENS, [pairs[i] for i in moe], SEQ, plan)
                # the skew hook hands the experts a rewritten index (even at 0), which dispatch keeps
                # besides the router's own, unless the router recomputes
                predicted += 8 * TOKENS * 2 * sum(plan.get(OpId(i, "router")) != "recompute" for i in moe)
                checks[(fraction, name)] = (saved, predicted, sum(pairs.values()))
        # plans that differ per rank: rank 0 recomputes its experts and attention, the others keep
        mixed = plans["experts recomputed"] | {OpId(i, "attn_core"): "recompute" for i in moe} if rank == 0 else {}
        loss_keep, grads_keep, _ = _step(model, ids)
        loss_mixed, grads_mixed, _ = _step(model, ids, mixed)
        bitwise = torch.equal(loss_keep, loss_mixed) and all(torch.equal(grads_keep[n], g) for n, g in grads_mixed.items())
        errors = {}
        for name, plan in (("moe block", {OpId(moe[0], n): "recompute" for n in ("router", "dispatch", "combine")}),
                           ("dispatch alone", {OpId(moe[0], "dispatch"): "recompute"})):
            runtime = PlanRuntime(model)
            try:
                runtime.set_plan(plan)
            except ValueError as error:
                errors[name] = str(error)
        out[family] = dict(checks=checks, bitwise=bitwise, errors=errors, ops=[op.name for op in bgl.list_ops(model) if op.layer == moe[0]])
    return out


def test_ledger_matches_cost_model_and_plans_may_differ_per_rank(two_ranks):
    results = two_ranks["ledger"]
    for family in FAMS:
        hot, cold = results[0][family], results[1][family]
        for r in (hot, cold):
            for key, (saved, predicted, _) in r["checks"].items():
                assert saved == predicted, (family, key)
            assert r["bitwise"], family
            assert set(r["errors"]) == {"moe block", "dispatch alone"}
            assert all("expert parallelism" in e for e in r["errors"].values())
            assert r["ops"].index("router") < r["ops"].index("dispatch") < r["ops"].index("expert_fc1")
            assert r["ops"].index("expert_fc2") < r["ops"].index("combine")
        # the skew raises the hot rank's pairs and bytes, and lowers the other's
        for name in ("keep", "fc1 recomputed, fc2 offloaded"):
            assert hot["checks"][(0.75, name)][2] > hot["checks"][(0.0, name)][2]
            assert hot["checks"][(0.75, name)][0] > hot["checks"][(0.0, name)][0]
            assert cold["checks"][(0.75, name)][0] < cold["checks"][(0.0, name)][0]


def _bad_input(rank: int, size: int) -> list[str]:
    errors = []
    for make in (lambda: _model("qwen3_moe", num_experts=7), lambda: expert_parallel(tiny_model("qwen3_moe"))):
        try:
            make()
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_bad_input_names_what_is_expected(two_ranks):
    errors = two_ranks["bad input"][0]
    assert "has 2 ranks, which does not divide num_experts=7" in errors[0]
    assert "experts_implementation='bagualu'" in errors[1]


def _fails_on_rank_1(rank: int, size: int) -> None:
    if rank == 1:
        raise torch.OutOfMemoryError("simulated out of memory on rank 1")
    torch.distributed.barrier()  # rank 0 waits for a rank that never comes


def test_one_rank_failing_stops_the_job():
    with pytest.raises(RankError, match="rank 1 failed: OutOfMemoryError"):
        run_ranks(_fails_on_rank_1, 2, timeout_s=30)


def _sleeps(rank: int, size: int) -> None:
    time.sleep(120)


def test_a_launch_past_its_deadline_fails():
    """`deadline_s` bounds the whole launch (`helpers.run_jobs` lengthens it, the collectives'
    timeout kept): a rank still running then ends the job."""
    with pytest.raises(ValueError, match="deadline_s must be > 0, got 0"):
        run_ranks(_sleeps, 1, deadline_s=0)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within 5 s"):
        run_ranks(_sleeps, 1, timeout_s=60, deadline_s=5)
    assert time.monotonic() - start < 60


def _recipe(model, ep: int, ep_rank: int, pp: int = 1, micro_batches: int = 3) -> Recipe:
    """Expert-parallel rank `ep_rank` of `ep`, pipeline rank 0 of `pp`, at the CPU preset's capacity."""
    return tiny_recipe(
        model, seq_len=SEQ, micro_batch_size=BATCH, parallel={"ep": ep, "ep_rank": ep_rank, "dp": ep},
        pipeline={"pp": pp, "rank": 0, "micro_batches": micro_batches},
        # fp8 is lossy; tensors of a tiny model are all below the default offload minimum
        strategies={"offload": {"min_bytes": 0}},
    )


def _gate(rank: int, size: int) -> dict:
    """The adaptive system on each rank of 2, as pipeline rank 0 of 4 (1F1B, 6 micro-batches):
    micro-batches 1 (warmup) and 4 (steady) route every pair of layer 2 to rank 0's experts."""
    model = _model("glm4_moe", num_hidden_layers=4)
    cm = model_cost(model)  # analytic: its times, unlike measured ones, never change the plans
    recipe = _recipe(model, size, rank, pp=4, micro_batches=6)
    capacity = int(2.5 * cm.activation_bytes(TOKENS, seq_len=SEQ))  # rank 0 of 4 holds 4 micro-batches at its peak
    # plans leave the gates nothing for spikes (spike_max = the normal band), so the gates must act
    spikes = recipe.spikes.model_copy(update={"spike_max_imbalance": recipe.spikes.normal_max_imbalance})
    recipe = recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"capacity_bytes": capacity}), "spikes": spikes})
    prov = bgl.apply(model, recipe, cm)
    spiking = (1, 4)
    try:
        # the spiking micro-batches skew in their forward (and their backward's recompute); the
        # others run the same (no-op) hook, so they save the same tensors
        spike = lambda step: _skew(model, 1.0 if step.micro_batch in spiking else 0.0, [2])  # noqa: E731
        run_iteration(model, [_batch(rank + 10 * i) for i in range(6)], prov.stage.schedule, prov, around=spike)
        events = {e.micro_batch: e for e in prov.events}
        planned = TOKENS * 2 * recipe.spikes.normal_max_imbalance
        return dict(
            escalated={mb: {x.layer: x.local_pairs for x in e.escalations} for mb, e in events.items()},
            deferred={mb: {x.layer: x.local_pairs for x in e.deferred} for mb, e in events.items()},
            budget={mb: (e.actual, e.budget) for mb, e in events.items()},
            others=[(x.local_pairs > planned and x.overrun > 0) for e in events.values() for x in e.escalations + e.deferred
                    if not (e.micro_batch in spiking and x.layer == 2)],
            peak=prov.ledger.peak_device_bytes,
            capacity=capacity,
        )
    finally:
        prov.remove()


def test_only_the_hot_rank_s_gate_defers_and_escalates(two_ranks):
    """Rank 0 receives both ranks' pairs of layer 2 (2x its balanced share): in warmup the later
    warmup micro-batches give up what the spike needs, in steady its experts recompute. Rank 1
    receives none of them: its gate does nothing for layer 2."""
    hot, cold = two_ranks["gate"]
    assert hot["deferred"][1].get(2) == 2 * TOKENS * 2 and 2 not in hot["escalated"][1]
    assert hot["escalated"][4].get(2) == 2 * TOKENS * 2
    assert hot["budget"][4][0] <= hot["budget"][4][1]
    for mb in (1, 4):
        assert 2 not in cold["escalated"][mb] and 2 not in cold["deferred"][mb]
    for r in (hot, cold):
        assert all(r["others"])  # random-init routing is skewed too: any other decision really overran
        assert r["peak"] <= r["capacity"]


def _train(model, batches, schedule, provisioner, steps: int) -> list:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for it in range(steps):
        spike = lambda step: _skew(model, 1.0 if (it, step.micro_batch) in {(1, 4), (2, 1)} else 0.0, [2])  # noqa: E731, B023
        losses.append(run_iteration(model, batches, schedule, provisioner, around=spike))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _adaptive_training(rank: int, size: int) -> dict:
    """Three AdamW steps of the adaptive system against plain expert-parallel training of an
    identical model, with recompute and offload allowed, then offload alone (the gate still
    escalates by recomputing the spiking layer's experts)."""
    out = {}
    batches = [_batch(rank + 10 * i) for i in range(6)]
    for allowed, factor in ((("recompute", "offload"), 1.6), (("offload",), 2.0)):
        model, plain = _model("glm4_moe", num_hidden_layers=4), _model("glm4_moe", num_hidden_layers=4)
        cm = bgl.profile(model, [32, 64, 128], repeats=1)
        recipe = _recipe(model, size, rank, pp=4, micro_batches=6)
        capacity = int(factor * cm.activation_bytes(TOKENS, seq_len=SEQ))
        recipe = recipe.model_copy(update={
            "hardware": recipe.hardware.model_copy(update={"capacity_bytes": capacity}),
            "strategies": recipe.strategies.model_copy(update={"allowed": list(allowed)}),
        })
        prov = bgl.apply(model, recipe, cm)
        try:
            adaptive = _train(model, batches, prov.stage.schedule, prov, 3)
            events = list(prov.events)
        finally:
            prov.remove()
        reference = _train(plain, batches, prov.stage.schedule, None, 3)
        out[allowed] = dict(
            bitwise=all(torch.equal(a, b) for it_a, it_b in zip(adaptive, reference) for a, b in zip(it_a, it_b))
            and all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())),
            trained=adaptive[0][0] != adaptive[-1][0],
            strategies=sorted({s for e in events for s in e.plan.values()}),
            mitigated=all(e.plan for e in events),
            escalated=any(x.layer == 2 for e in events for x in e.escalations),
            peak=prov.ledger.peak_device_bytes <= capacity,
        )
    return out


def test_adaptive_training_is_bitwise_plain_expert_parallel_training(two_ranks):
    for r in two_ranks["adaptive"]:
        for allowed, x in r.items():
            assert x["bitwise"] and x["trained"] and x["mitigated"] and x["peak"], (allowed, x)
            assert x["strategies"] and set(x["strategies"]) <= set(allowed)
        assert r[("recompute", "offload")]["escalated"] or r[("offload",)]["escalated"]


def _floor(rank: int, size: int) -> dict:
    """One iteration of the adaptive system at a capacity where the experts' own escalation does
    not fit some micro-batches (recompute and offload only, as pipeline rank 0 of 4: 4 micro-batches
    in flight), micro-batch 1 routing every pair of layer 2 to rank 0's experts, against plain
    expert-parallel training of an identical model."""
    model, plain = _model("glm4_moe", num_hidden_layers=4), _model("glm4_moe", num_hidden_layers=4)
    cm = bgl.profile(model, [32, 64, 128], repeats=1)
    model.zero_grad(set_to_none=True)
    recipe = _recipe(model, size, rank, pp=4, micro_batches=6)
    capacity = int(1.0 * cm.activation_bytes(TOKENS, seq_len=SEQ))
    recipe = recipe.model_copy(update={
        "hardware": recipe.hardware.model_copy(update={"capacity_bytes": capacity}),
        "strategies": recipe.strategies.model_copy(update={"allowed": ["recompute", "offload"]}),
    })
    batches = [_batch(rank + 10 * i) for i in range(6)]
    prov = bgl.apply(model, recipe, cm)
    try:
        spike = lambda m: lambda step: _skew(m, 1.0 if step.micro_batch == 1 else 0.0, [2])  # noqa: E731
        with collectives() as issued:
            losses = run_iteration(model, batches, prov.stage.schedule, prov, around=spike(model))
        events = sorted(prov.events, key=lambda e: e.micro_batch)
    finally:
        prov.remove()
    reference = run_iteration(plain, batches, prov.stage.schedule, None, around=spike(plain))
    return dict(
        bitwise=all(torch.equal(a, b) for a, b in zip(losses, reference))
        and all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()) if q.grad is not None),
        collective={(e.micro_batch, x.layer): x.overrun > 0 for e in events for x in e.escalations if x.collective},
        alone={(e.micro_batch, x.layer) for e in events for x in e.escalations if not x.collective},
        plans=[e.plan for e in events],
        peak=prov.ledger.peak_device_bytes,
        capacity=prov.stage.capacity,
        collectives=issued,
    )


def _floor_holds_on_every_rank(ranks: list[dict]) -> None:
    """Every rank recomputes the same layers with their all-to-alls, asked for by at least one
    rank each and joined by some that did not ask; the rest of their plans are their own. Every
    rank issued the same collectives in the same order, the replayed all-to-alls among them."""
    together = [set(r["collective"]) for r in ranks]
    assert together[0] and all(t == together[0] for t in together), together
    for where in together[0]:
        assert any(r["collective"][where] for r in ranks), where  # some rank asked
    assert any(not asked for r in ranks for asked in r["collective"].values())  # and some joined
    assert len({frozenset(r["alone"]) for r in ranks}) > 1 or any(r["plans"] != ranks[0]["plans"] for r in ranks)
    for r in ranks:
        assert r["bitwise"] and r["peak"] <= r["capacity"], r
        assert r["collectives"] == ranks[0]["collectives"]
    # per MoE layer and micro-batch: the gate's agreement (one all-reduce), 3 all-to-alls forward
    # (the counts, the rows out and back) and 2 in backward; each collective replay adds 2
    issued = ranks[0]["collectives"]
    assert issued.count("all_to_all_single") >= 5 * issued.count("all_reduce") + 2 * len(together[0])


def test_the_floor_runs_on_every_rank_and_is_bitwise(two_ranks):
    """The collective escalation (paper §V-A's MoE block recomputed whole) over 2 ranks."""
    _floor_holds_on_every_rank(two_ranks["floor"])


def test_the_floor_runs_on_four_ranks():
    _floor_holds_on_every_rank(run_ranks(_floor, 4, timeout_s=120))


def _split_collective(rank: int, size: int) -> dict:
    """A fixed plan that recomputes a whole MoE layer (its all-to-alls with it) on rank 0 only is
    refused at `apply_plan` on every rank, before any forward; the same plan on every rank runs
    and is bitwise the plain step."""
    model, ids = _model("deepseek_v3"), _batch(rank)
    adapter = Adapter(model)
    layer = next(part.index for part in adapter.layers if part.moe)
    whole = {op: "recompute" for op in bgl.list_ops(model) if op.layer == layer}
    try:
        _step(model, ids, whole if rank == 0 else {})
        refused = None
    except ValueError as error:
        refused = str(error)
    loss, grads, _ = _step(model, ids)
    loss_whole, grads_whole, _ = _step(model, ids, whole)
    bitwise = torch.equal(loss, loss_whole) and all(torch.equal(grads[n], g) for n, g in grads_whole.items())
    return dict(refused=refused, bitwise=bitwise, layer=layer)


@pytest.mark.parametrize("size", [2, 4])
def test_a_collective_region_on_some_ranks_only_is_refused(size, request):
    ranks = request.getfixturevalue("two_ranks")["split"] if size == 2 else run_ranks(_split_collective, 4, timeout_s=60)
    for r in ranks:
        assert r["refused"] is not None and r["bitwise"], r
        assert f"layer {r['layer']} (dispatch, expert_fc1, expert_act, expert_fc2, combine) on rank(s) [0] only" in r["refused"]
    assert len({r["refused"] for r in ranks}) == 1  # every rank says the same


def _profiled(rank: int, size: int, families: list[str]) -> dict:
    """`bgl.profile` on every rank at once, then micro-batches at skews it never ran."""
    out = {}
    for family in families:
        model = _model(family)
        cm = bgl.profile(model, [32, 64, 128], repeats=1)
        moe = cm.moe_layers
        escalated = {OpId(i, n): "recompute" for i in moe for n in EXPERT_OPS}
        checks = []
        ids = _batch(rank)
        for skew in (0.2, 0.9):
            saved, routed, _ = measure_micro_batch(model, ids, skew=skew, repeats=0)
            pairs = [routed[i] for i in moe]
            with _skew(model, skew), GateMonitor(model) as monitor:
                _, _, kept = _step(model, ids, escalated)
            recomputed = cm.activation_bytes(TOKENS, [monitor.local_pairs()[i] for i in moe], SEQ, escalated)
            checks.append((saved, cm.activation_bytes(TOKENS, pairs, SEQ), kept, recomputed, sum(pairs)))
        out[family] = dict(checks=checks, pairs_per_token=cm.pairs_per_token)
    return out


def test_profile_under_expert_parallelism_predicts_unseen_skews(two_ranks):
    families = ["gpt_oss", "qwen2_moe"]
    hot, cold = two_ranks["profiled"]
    for family in families:
        for r in (hot, cold):
            assert r[family]["pairs_per_token"] == 2  # each rank's experts receive T * top_k balanced
            for saved, predicted, kept, recomputed, _ in r[family]["checks"]:
                assert saved == predicted and kept == recomputed, family
        assert hot[family]["checks"][1][4] > hot[family]["checks"][0][4] > cold[family]["checks"][0][4]  # the skew moved pairs


def test_recipe_must_name_the_group():
    with pytest.raises(RankError, match="parallel.ep=1, parallel.ep_rank=0, but the model is expert-parallel over 2 ranks"):
        run_ranks(_wrong_recipe, 2, timeout_s=60)
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="parallel.ep=2, parallel.ep_rank=1, but the model is not expert-parallel"):
        bgl.apply(model, _recipe(model, 2, 1))


def _wrong_recipe(rank: int, size: int) -> None:
    model = _model("qwen3_moe")
    bgl.apply(model, _recipe(model, 1, 0))
