"""`PathPlanner` (planner/path.py): Algorithm 2 of paper §V-A served for every shape from a few
paths computed on forms of the shape, checked against the greedy from scratch at each shape
(`plan_micro_batch`), against the greedy as this project computed it before
(tests/reference_greedy.py: the no-worse rule), and by the work each decision costs, counted."""

import gc
import math
import random
import traceback
import tracemalloc
import weakref
from dataclasses import dataclass

import pytest
import reference_greedy
import torch

import bagualu_plugin as bgl
from bagualu_plugin.adapters import FAMILIES, tiny_config, tiny_model
from bagualu_plugin.config import load_recipe
from bagualu_plugin.costmodel import CostModel, Forward, MitigationOptions
from bagualu_plugin.planner import InfeasibleBudget, PathPlanner, plan_micro_batch
from bagualu_plugin.planner import decider as decider_module
from bagualu_plugin.planner import path as path_module
from bagualu_plugin.planner.decider import Band, Decider, Foresight
from bagualu_plugin.stage import Stage

STRATEGY_SETS = {"all": ("recompute", "offload", "fp8"), "recompute": ("recompute",), "offload": ("offload",), "fp8": ("fp8",)}
PRESETS = {"glm-423b-a30b": 1, "glm-319b-a30b": 1, "glm-783b-a35b": 1}  # recipe -> a model chunk of its rank
# the smallest tiny model of each family: one decoder layer, an MoE one
ONE_MOE_LAYER = {"first_k_dense_replace": 0, "mlp_only_layers": []}
NORMAL, SPIKE = 1.2, 2.6  # the recipes' routing band and spike maximum (spikes.*_max_imbalance)


@dataclass(frozen=True)
class Case:
    """One cost model as a planner sees it: its micro-batch shape and the planner's quanta."""

    name: str
    cm: CostModel
    tokens: int
    seq_len: int
    options: MitigationOptions
    budget_quantum: int
    routed_quantum: int
    allowed: tuple[str, ...]


def _stage_case(name: str, stage: Stage) -> Case:
    balanced = stage.tokens * stage.cost.pairs_per_token
    quanta = max(1, stage.min_budget // 16), max(1, int(balanced) // 16)  # the Decider's buckets
    allowed = tuple(stage.recipe.strategies.allowed)
    return Case(name, stage.cost, stage.tokens, stage.recipe.batch.seq_len, stage.options, *quanta, allowed)


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models profile faster on one thread than on cores shared with others
    try:
        profiled = {}
        for family in FAMILIES:
            config = tiny_config(family)  # which dense-layer field the family reads
            dense = {k: v for k, v in ONE_MOE_LAYER.items() if hasattr(config, k)}
            profiled[family] = bgl.profile(tiny_model(family, num_hidden_layers=1, **dense), [8, 12, 16], repeats=1)
    finally:
        torch.set_num_threads(threads)
    out = [Case(f, cm, 64, 16, MitigationOptions(), 256, 8, STRATEGY_SETS["all"]) for f, cm in profiled.items()]
    out += [_stage_case(name, Stage.of(load_recipe(name)).chunk(chunk)) for name, chunk in PRESETS.items()]
    return out


def _qwen3(pp: int, micro_batches: int = 8) -> Stage:
    """Stage 0 of Qwen3-30B-A3B (the built-in recipe's dimensions: 48 layers, 128 experts, top-8) over `pp` stages."""
    recipe = load_recipe("qwen3_moe")
    return Stage.of(recipe.model_copy(update={"pipeline": recipe.pipeline.model_copy(update={"pp": pp, "micro_batches": micro_batches})}))


def _outcome(plan, *args):
    try:
        return "plan", plan(*args)
    except InfeasibleBudget as exc:
        return "infeasible", exc.best, str(exc)


def _same(got, want) -> bool:
    """The same outcome, plan and bytes; the times to floating-point rounding (a form sums in its own order)."""
    (kind, a, *_), (kind_b, b, *_) = got, want
    return (
        kind == kind_b and a.plan == b.plan and a.steps == b.steps
        and (a.activation_bytes, a.room_bytes) == (b.activation_bytes, b.room_bytes)
        and math.isclose(a.forward_extra_s, b.forward_extra_s, rel_tol=1e-9, abs_tol=1e-15)
        and math.isclose(a.backward_extra_s, b.backward_extra_s, rel_tol=1e-9, abs_tol=1e-15)
    )


def _shapes(case: Case, rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(tokens, seq_len) as a collator pads them: 1 to 4 sequences of a length up to the case's."""
    lengths = {case.seq_len, max(1, case.seq_len // 2)} | {rng.randint(1, case.seq_len) for _ in range(n)}
    return sorted({(b * length, length) for length in lengths for b in (1, rng.randint(1, 4))})[:n]


def _routings(case: Case, tokens: int, rng: random.Random) -> list[list[float]]:
    """Local routed pairs per MoE layer: the normal band's top and a spike on every layer, and one that differs per layer."""
    balanced, n = tokens * case.cm.pairs_per_token, len(case.cm.moe_layers)
    return [[balanced * NORMAL] * n, [balanced * SPIKE] * n, [balanced * (1.0 if i % 2 else 1.9) for i in range(n)]]


def _budgets(case: Case, key, strategies: tuple[str, ...], rng: random.Random, n: int) -> list[float]:
    """From 0 (below every plan) to above the unmitigated need."""
    tokens, seq_len, pairs = key
    top = case.cm.footprint(Forward(tokens, seq_len, pairs), None, case.options).needed_bytes
    return [0.0, 1.1 * top] + [rng.uniform(0.05 * top, top) for _ in range(n)]


@pytest.fixture(scope="module")
def grid(cases):
    """Every (model, strategy set): one PathPlanner asked a churn of shapes (budget x routing x
    shape, shuffled), and `plan_micro_batch` from scratch at each rounded budget and routing."""
    rng = random.Random(2)
    records, planners = [], []
    for case in cases:
        for label, strategies in STRATEGY_SETS.items():
            if not set(strategies) <= set(case.allowed):
                continue
            planner = PathPlanner(case.cm, case.budget_quantum, case.routed_quantum, strategies, case.options)
            asks = []
            for tokens, seq_len in _shapes(case, rng, 12 if label == "all" else 6):
                routings = _routings(case, tokens, rng)
                for routed in routings if label == "all" else routings[:1]:
                    key = planner.key(tokens, routed, seq_len)
                    asks += [(key, budget) for budget in _budgets(case, key, strategies, rng, 3)]
            rng.shuffle(asks)
            for key, budget in asks:
                tokens, seq_len, pairs = key
                floor = int(budget // case.budget_quantum) * case.budget_quantum
                got = _outcome(planner.answer, key, budget)
                want = _outcome(plan_micro_batch, case.cm, floor, tokens, pairs, seq_len, strategies, case.options)
                records.append((f"{case.name} {label} {tokens}x{seq_len} budget {floor} routed {pairs[:2]}", case, strategies, key, floor,
                                got, want))
            planners.append((f"{case.name} {label}", planner, len({key for key, _ in asks})))
    return records, planners


def test_every_shape_is_served_the_greedys_plan_from_scratch(grid):
    records, planners = grid
    assert len(records) >= 1500
    mismatches = [label for label, *_, got, want in records if not _same(got, want)]
    assert not mismatches, f"{len(mismatches)} of {len(records)} differ, e.g. {mismatches[:3]}"
    assert {got[0] for *_, got, _ in records} == {"plan", "infeasible"}
    for label, planner, shapes in planners:
        assert planner.answers == sum(r[0].startswith(label + " ") for r in records)
        assert planner.paths < shapes, label  # far fewer paths than the shapes and routings they serve


def test_no_plan_is_worse_than_the_greedy_before_it_served_every_shape(grid):
    """The greedy before (tests/reference_greedy.py) chose between candidates of equal bytes and
    time by the rounding of its whole-plan sums; the planner chooses the first in program order.
    So a plan may name other layers, never more bytes (it fits wherever that one fitted) nor more
    mitigation time, on the same grid as the exact comparison (the one-layer models and the
    preset chunks: the greedy before priced every trial on the whole plan)."""
    differ = 0
    for label, case, strategies, key, floor, got, _ in grid[0]:
        tokens, seq_len, pairs = key
        kind, plan, cost = reference_greedy.plan_micro_batch(case.cm, floor, tokens, pairs, seq_len, strategies, case.options)
        decision = got[1]
        assert got[0] == kind, label
        assert decision.activation_bytes + decision.room_bytes == cost.needed_bytes, label
        before, now = cost.forward_extra_s + cost.backward_extra_s, decision.forward_extra_s + decision.backward_extra_s
        assert now <= before * (1 + 1e-9) + 1e-15, label
        differ += decision.plan != plan
    assert differ < len(grid[0]) / 10  # the noise decides rarely: most plans are the same


def test_a_path_prices_each_kind_of_layer_once_whatever_the_depth():
    """Counted work, not time: a whole path of Qwen3-30B-A3B at 4096 tokens over 12, 24 and 48
    layers evaluates about as many block footprints (one per kind of block and plan it meets,
    the decoder layers being one kind) and records about as many comparisons; only its steps
    grow with the layers (one per layer and mitigation)."""
    counts = {}
    for pp in (4, 2, 1):
        stage = _qwen3(pp)
        planner = PathPlanner(stage.cost, 1, 1, tuple(stage.recipe.strategies.allowed), stage.options)
        with pytest.raises(InfeasibleBudget):
            planner.plan(0, 4096, None, 4096)  # the whole path, to its end
        (path,) = planner._forms
        counts[pp] = (len(stage.cost.layers), planner.footprints, path.tape.recorded, planner.steps_computed)
    shallow, deep = counts[4], counts[1]
    assert deep[0] == 4 * shallow[0] and deep[3] >= 3.5 * shallow[3]  # four times the layers, as many more steps
    assert deep[1] <= 1.25 * shallow[1] and deep[2] <= 1.5 * shallow[2], counts  # not four times the footprints or comparisons


def _stream(decider: Decider, stage: Stage, rng: random.Random, forwards: int, spikes: float = 0.029):
    """`forwards` micro-batches as TRL's collator pads them (the recipe's number of texts, of
    log-normal length up to its sequence length), their gates in the normal band or a spike:
    each one's decisions."""
    cm, m, texts = stage.cost, stage.recipe.pipeline.micro_batches, stage.recipe.batch.micro_batch_size
    for k in range(forwards):
        if k % m == 0:
            decider.start_iteration()
        length = max(min(stage.recipe.batch.seq_len, round(rng.lognormvariate(math.log(512), 1.0))) for _ in range(texts))
        f = decider.begin(k % m, texts * length, length)
        spike = rng.random() < spikes
        for layer in cm.moe_layers:
            decider.at_gate(f, layer, f.balanced * (rng.uniform(1.2, SPIKE) if spike else rng.uniform(0.9, NORMAL)))
        kept = cm.footprint(Forward(texts * length, length, list(f.routed.values())), f.plan, stage.options)
        decider.end(f, round(kept.device_bytes + kept.room_bytes))
        yield f


def test_a_stream_of_new_shapes_is_decided_by_lookups(monkeypatch):
    """Counted work under churn: 600 micro-batches of Qwen3-30B-A3B's whole depth on one stage
    (most of them planned), nearly every one a shape not seen before. After the first micro-batch (which computes its path whole),
    nearly none evaluates a block footprint or makes a path; each gate's costs are read off forms."""
    stage = _qwen3(1, micro_batches=4)
    priced, pricing = [], path_module.gate_costs
    monkeypatch.setattr(path_module, "gate_costs", lambda *a, **k: priced.append(a[3:5]) or pricing(*a, **k))
    decider = Decider(stage)
    planner = decider.planner(None)
    work, shapes, planned = [], set(), 0
    for f in _stream(decider, stage, random.Random(3), 600):
        work.append((planner.footprints, planner.paths))
        shapes.add(f.gates.decision.plan.key and (f.budget, tuple(f.routed.values())))
        planned += bool(f.plan)
    new_work = sum(1 for before, after in zip(work, work[1:]) if after != before)
    assert planned > 300 and planner.paths <= path_module.FORM_PATHS
    assert new_work <= 12, work[:20]  # micro-batches after the first that priced anything
    assert len(priced) <= 2, priced  # each gate's costs read off forms, not priced at the shape


def test_ten_thousand_shapes_leave_the_caches_where_a_hundred_left_them():
    """The paths, the bands of recent shapes, the plans each path has handed out, the shapes'
    variables each tape keeps and the footprints memoised on them have fixed caps: 10,000
    micro-batches of distinct shapes (and budgets) from one stream hold no more memory than 100 did."""
    stage = _qwen3(4, micro_batches=4)
    decider = Decider(stage)
    rng = random.Random(0)
    cm = stage.cost
    shapes = iter(rng.sample(range(256, 16_384), 10_300))  # a new shape every time

    def run(n: int) -> None:
        for k in range(n):
            if k % 4 == 0:
                decider.start_iteration()
            tokens = next(shapes)
            f = decider.begin(k % 4, tokens, tokens)
            for layer in cm.moe_layers[:2]:
                decider.at_gate(f, layer, f.balanced * rng.uniform(0.9, NORMAL))
            decider.end(f, int(decider.budgets.budget(k % 4) * rng.uniform(0.3, 1.0)))

    run(100)
    tracemalloc.start()
    try:
        run(100)
        gc.collect()
        settled, _ = tracemalloc.get_traced_memory()
        run(10_000)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    planner = decider.planner(None)
    assert len(decider._bands) <= decider_module.BANDS_KEPT and len(planner._forms) <= path_module.FORM_PATHS
    assert all(len(p._plans) <= path_module.PLANS_KEPT and len(p.tape._points) <= 8 for p in planner._forms)
    assert after - settled < 1 << 20, (settled, after)  # under a MiB more after 10,000 shapes


def test_infeasible_budgets_raise_a_new_exception_that_keeps_no_caller_alive(cases):
    """A kept exception re-raised chains every raiser's frames onto its traceback, and with them
    the callers' locals: each infeasible answer is a new exception, gone with its handler."""
    case = next(c for c in cases if c.name == "glm-319b-a30b")
    planner = PathPlanner(case.cm, strategies=("offload",), options=case.options)

    class Local:
        pass

    def caller() -> tuple[int, weakref.ref, weakref.ref]:
        local = Local()
        try:
            planner.plan(0, case.tokens, seq_len=case.seq_len)
        except InfeasibleBudget as exc:
            assert exc.best.steps == planner.steps_computed > 0
            return len(traceback.extract_tb(exc.__traceback__)), weakref.ref(exc), weakref.ref(local)
        raise AssertionError("no offload plan keeps 0 bytes")

    depths = set()
    for _ in range(10):
        depth, exc, local = caller()
        assert exc() is None and local() is None  # neither the exception nor the caller's local outlives the call
        depths.add(depth)
    assert len(depths) == 1  # the traceback does not grow from call to call
    assert planner.answers == 10 and planner.paths == 1


def test_bad_queries_name_what_is_wrong_and_leave_no_path(cases):
    case = next(c for c in cases if c.name == "gpt_oss")  # it keeps per-sequence tensors: seq_len is required
    planner = PathPlanner(case.cm, 1, 1, options=case.options)
    with pytest.raises(ValueError, match="quanta"):
        PathPlanner(case.cm, routed_quantum=0)
    with pytest.raises(ValueError, match="strategies: unknown"):
        PathPlanner(case.cm, strategies=("zip",))
    with pytest.raises(ValueError, match="seq_len is required"):
        planner.plan(1e9, case.tokens)
    with pytest.raises(ValueError, match="routed has 3 entries"):
        planner.plan(1e9, case.tokens, [1.0, 2.0, 3.0], case.seq_len)
    assert planner.paths == 0


def test_a_foreseen_routing_is_planned_as_the_greedy_from_scratch(cases):
    """The oracle's plan (`Foresight`: the routing known before the forward) is Algorithm 2's for
    that routing at the budget, from scratch, and its gates leave no room for a spike: at the
    routing known every gate fits; where no plan fits, the most Algorithm 2 can save."""
    rng = random.Random(5)
    for case in cases:
        band = Band(PathPlanner(case.cm, case.budget_quantum, case.routed_quantum, case.allowed, case.options), case.tokens,
                    case.seq_len, NORMAL, SPIKE)
        for routed in _routings(case, case.tokens, rng):
            pairs = tuple(math.ceil(r / case.routed_quantum) * case.routed_quantum for r in routed)
            foresight = Foresight(band, dict(zip(case.cm.moe_layers, routed)))
            top = case.cm.footprint(Forward(case.tokens, case.seq_len, pairs), None, case.options).needed_bytes
            for budget in [0.0, 1.1 * top] + [rng.uniform(0.3 * top, top) for _ in range(4)]:
                floor = int(budget // case.budget_quantum) * case.budget_quantum
                want = _outcome(plan_micro_batch, case.cm, floor, case.tokens, pairs, case.seq_len, case.allowed, case.options)
                gates, slack = foresight.plan(budget)
                assert _same(("plan" if want[0] == "plan" else "infeasible", gates.decision), want), f"{case.name} {floor} {pairs}"
                assert slack == budget - want[1].activation_bytes - want[1].room_bytes
                assert gates.need == 0 and gates.planned == dict(zip(case.cm.moe_layers, map(float, pairs)))
                if want[0] == "plan":
                    for layer, x in zip(case.cm.moe_layers, routed):
                        assert gates.at_gate(layer, x, slack, 0.0).action == "fits"
    with pytest.raises(ValueError, match=r"routed: no local routed pairs for MoE layers \[\d+"):
        Foresight(band, {})


def test_gates_read_off_forms_are_the_gates_priced_at_the_shape(cases):
    """Each served plan's gates (`PathPlanner.gates`: per MoE layer what a pair more keeps, what
    escalating frees) are the ones `gate_costs` prices at the shape, for shapes the path was not
    computed at."""
    from bagualu_plugin.planner.gate import gate_costs

    rng = random.Random(9)
    for case in cases:
        planner = PathPlanner(case.cm, case.budget_quantum, case.routed_quantum, case.allowed, case.options)
        for tokens, seq_len in _shapes(case, rng, 6):
            key = planner.key(tokens, [tokens * case.cm.pairs_per_token * NORMAL] * len(case.cm.moe_layers), seq_len)
            for budget in _budgets(case, key, case.allowed, rng, 2):
                served = planner.find(key, budget)
                gates = planner.gates(served, float(key[2][0]), float(key[2][0]) * 2)
                want = gate_costs(case.cm, served.decision.plan, tokens, seq_len, float(key[2][0]), case.options)
                assert set(gates.costs) == set(want)
                for layer, cost in gates.costs.items():
                    for a, b in zip(cost, want[layer]):
                        assert (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)), case.name


def test_gates_credit_fewer_pairs_against_the_routing_their_plan_was_made_for(cases):
    """Routing is rounded up to the quantum (never truncated first), and each gate of a plan measures
    the pairs that arrive against its own layer's planned pairs: where the micro-batch is over its
    budget, pairs below plan fit only by what they really give back. Seed 7 of the exactness sweep
    ran 929 bytes over when a gate credited 28.8 planned pairs on a plan made for 28."""
    case = cases[0]
    planner = PathPlanner(case.cm, case.budget_quantum, 1, case.allowed, case.options)
    assert planner.key(case.tokens, [28.8, 28.0], case.seq_len)[2] == (29, 28)
    band = Band(planner, case.tokens, case.seq_len, NORMAL, SPIKE)
    assert band.planned == planner.key(case.tokens, [band.balanced * NORMAL], case.seq_len)[2][0] >= band.balanced * NORMAL
    layers = case.cm.moe_layers
    routed = {layer: band.balanced * (0.5 + i) for i, layer in enumerate(layers)}
    gates, _ = Foresight(band, routed).plan(1e15)
    assert gates.planned == {layer: float(math.ceil(x)) for layer, x in routed.items()}
    for layer, planned in gates.planned.items():
        per_pair = gates.costs[layer].per_pair
        short = -per_pair / 2  # half a pair's bytes over budget already: one pair fewer gives it back
        assert gates.at_gate(layer, planned - 1, short, 0.0).action == "fits"
        assert gates.at_gate(layer, planned, short, 0.0).action != "fits"
