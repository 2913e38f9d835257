"""`CostModel`: (Δt_f, Δt_b, Δm) of every operator of a model on one device (paper §IV).

The model is a list of blocks (embedding -1, decoder layers 0..L-1, LM head L), each an operator
graph whose costs are linear in the micro-batch load. It answers the questions the planner asks:
how many bytes does a micro-batch keep for backward, under which plan, at what time cost, and what
does one (operator, strategy) change buy. It is pure arithmetic, built analytically from model
dimensions (`from_config`) or fitted to a real model by the profiler, and saved as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

from ..hardware import HardwareSpec, preset
from . import analytic
from .dims import ModelDims, Parallel
from .forward import Forward, Routed
from .graph import BlockGraph, OpId, OpSpec, TensorSpec
from .linear import LinearForm, Load
from .mitigation import MITIGATIONS, Footprint, MitigationOptions, device_bytes_by_op, footprint, holding_regions, memoised
from .pipeline import MicroBatchCost, stage_layers
from .plan import Plan

FORMAT = "bagualu-costmodel/1"


@dataclass(frozen=True)
class OpCost:
    """One row of the per-operator table: times, and the saved bytes charged to the op."""

    op: OpId
    forward_s: float
    backward_s: float
    saved_bytes: float


@dataclass(frozen=True)
class MitigationCost:
    """What applying one strategy to one op changes, relative to a base plan (§IV-B)."""

    op: OpId | tuple[OpId, ...]
    strategy: str
    bytes_saved: float
    forward_s: float  # added to the forward micro-batch
    backward_s: float  # added to the backward micro-batch

    @property
    def bandwidth(self) -> float:
        """Mitigation bandwidth: bytes saved per second of added time."""
        added = self.forward_s + self.backward_s
        return self.bytes_saved / added if added > 0 else float("inf")


@memoised
def holds_arguments(block: BlockGraph, plan: Mapping[str, str]) -> bool:
    """Whether the block's recompute regions take the layer's arguments (attention, whole or in
    part, or the whole layer runs under a checkpoint that holds them)."""
    return any("attn_core" in region.ops for region in holding_regions(block, plan))


class CostModel:
    def __init__(
        self,
        blocks: Mapping[int, BlockGraph],
        hardware: HardwareSpec,
        pairs_per_token: float,
        name: str = "",
        source: str = "analytic",
    ):
        if not blocks:
            raise ValueError("a CostModel needs at least one block")
        # equal blocks (the decoder layers of one kind) are one object: what is computed per block
        # (its footprint under a plan, `mitigation.footprint`) is computed once for all of them
        alike: dict[BlockGraph, BlockGraph] = {}
        self.blocks = {i: alike.setdefault(b, b) for i, b in sorted(blocks.items())}
        self.hardware = hardware
        self.pairs_per_token = pairs_per_token  # local routed pairs per token under balanced routing
        self.name = name
        self.source = source

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_config(
        cls,
        dims: ModelDims,
        hardware: HardwareSpec | str = "h100",
        parallel: Parallel = Parallel(),
        name: str = "",
    ) -> CostModel:
        """Analytic costs from model dimensions on `hardware`, as one device of `parallel` sees them."""
        hw = preset(hardware) if isinstance(hardware, str) else hardware
        if dims.num_experts % parallel.ep:
            raise ValueError(f"parallel.ep ({parallel.ep}) must divide num_experts ({dims.num_experts})")
        if dims.num_attention_heads % parallel.tp:
            raise ValueError(f"parallel.tp ({parallel.tp}) must divide num_attention_heads ({dims.num_attention_heads})")
        return cls(analytic.blocks(dims, parallel, hw), hw, dims.top_k / parallel.tp, name=name or dims.family)

    # queries ---------------------------------------------------------------------------------
    @cached_property
    def layers(self) -> list[int]:
        """Decoder layers in this model (or stage)."""
        return [i for i, b in self.blocks.items() if b.kind in ("moe", "dense")]

    @cached_property
    def moe_layers(self) -> list[int]:
        return [i for i, b in self.blocks.items() if b.kind == "moe"]

    def ops(self) -> list[OpId]:
        return [OpId(i, op.name) for i, b in self.blocks.items() for op in b.ops]

    @cached_property
    def per_sequence_tensors(self) -> list[str]:
        """The tensors whose size depends on how the tokens split into sequences (`linear.PER_SEQUENCE`):
        where there are any, every query needs `seq_len`."""
        return [
            f"{i}.{t.name} ({', '.join(t.elements.per_sequence_terms)})"
            for i, block in self.blocks.items()
            for t in block.tensors
            if t.elements.per_sequence_terms
        ]

    def layer_load(self, tokens: int, routed: float | None = None, seq_len: int | None = None) -> Load:
        """The load of an MoE layer with `routed` local pairs (`loads`' for one)."""
        self._check_seq_len(tokens, seq_len)
        return Load.of(tokens, routed, seq_len, self.pairs_per_token)

    def loads(self, forward: Forward) -> dict[int, Load]:
        """The load of each block under `forward` (its routed pairs one per MoE layer of this
        model, or one number for all; its `seq_len` where the model keeps per-sequence tensors)."""
        if not isinstance(forward, Forward):
            raise TypeError(f"forward: expected a costmodel.Forward(tokens, seq_len, routed, kind), got {forward!r:.80}")
        tokens, routed, seq_len = forward.tokens, forward.routed, forward.seq_len
        self._check_seq_len(tokens, seq_len)
        moe = self.moe_layers
        if routed is None or isinstance(routed, (int, float)):
            per_layer = dict.fromkeys(moe, routed)
        else:
            routed = list(routed)
            if len(routed) != len(moe):
                raise ValueError(f"routed has {len(routed)} entries, expected one per MoE layer ({len(moe)}: {moe})")
            per_layer = dict(zip(moe, routed))
        alike: dict[object, Load] = {}  # one load per routing: alike blocks get one object
        for pairs in (*per_layer.values(), 0):
            if pairs not in alike:
                alike[pairs] = Load.of(tokens, pairs, seq_len, self.pairs_per_token)
        return {i: alike[per_layer.get(i, 0)] for i in self.blocks}

    def _check_seq_len(self, tokens: int, seq_len: int | None) -> None:
        if seq_len is None and self.per_sequence_tensors:
            shown = ", ".join(self.per_sequence_tensors[:3]) + (", ..." if len(self.per_sequence_tensors) > 3 else "")
            raise ValueError(
                f"seq_len is required: {self.name or 'this model'} keeps tensors that grow with the sequences of a "
                f"micro-batch ({shown}), so {tokens} tokens as one sequence is not {tokens} tokens as several; "
                "pass the tokens per sequence"
            )

    def _split(self, plan: Mapping[OpId, str] | None) -> dict[int, dict[str, str]]:
        """{block: {op name: strategy}} of `plan`, every block present (grouped by the plan itself
        where it is a `Plan`, once)."""
        blocks = (plan if isinstance(plan, Plan) else Plan(plan)).blocks()
        unknown = set(blocks) - set(self.blocks)
        if unknown:
            raise KeyError(f"plan names layers {sorted(unknown)}, but this model has blocks {list(self.blocks)}")
        return {i: dict(blocks.get(i, ())) for i in self.blocks}

    def footprint(
        self, forward: Forward, plan: Mapping[OpId, str] | None = None, options: MitigationOptions = MitigationOptions()
    ) -> Footprint:
        """The bytes `forward` keeps under `plan` and the time its mitigations add (`mitigation.footprint`)."""
        return self.footprint_at(self.loads(forward), plan, options)

    def footprint_at(
        self, loads: Mapping[int, Load], plan: Mapping[OpId, str] | None = None, options: MitigationOptions = MitigationOptions()
    ) -> Footprint:
        """`footprint` at each block's load (`loads`: numbers, or forms of the shape: `costmodel.symbolic`)."""
        plans = self._split(plan)
        alike: dict[tuple, list[int]] = {}  # the blocks of one graph, load and plan: priced once
        for i, block in self.blocks.items():
            alike.setdefault((id(block), frozenset(plans[i].items()), loads[i]), []).append(i)
        total, holding = Footprint(), set()
        for layers in alike.values():
            block, ops = self.blocks[layers[0]], plans[layers[0]]
            total += footprint(block, ops, loads[layers[0]], self.hardware, options).repeated(len(layers))
            if holds_arguments(block, ops):
                holding.update(layers)
        return total + Footprint(device_bytes=self.argument_bytes(loads, holding))

    def holds_arguments(self, plan: Mapping[OpId, str] | None) -> bool:
        """Whether some block's recompute regions under `plan` hold the decoder layers' arguments
        (`holds_arguments`): then whatever tensors the layers receive stay until backward."""
        plans = self._split(plan)
        return any(holds_arguments(block, plans[i]) for i, block in self.blocks.items())

    def device_bytes_by_op(
        self, forward: Forward, plan: Mapping[OpId, str] | None = None, options: MitigationOptions = MitigationOptions()
    ) -> dict[OpId, float]:
        """`footprint`'s device bytes per op, charged as the Ledger charges them (`mitigation.
        device_bytes_by_op`); the layer arguments that recompute regions hold (position ids,
        masks), to the op that made them. Per block the sums are what the Ledger counts; within
        a block a storage two ops save may be charged to either."""
        loads, plans = self.loads(forward), self._split(plan)
        holding = {i for i, block in self.blocks.items() if holds_arguments(block, plans[i])}
        out: dict[OpId, float] = {}
        for i, block in self.blocks.items():
            for name, nbytes in device_bytes_by_op(block, plans[i], loads[i], options).items():
                out[OpId(i, name)] = nbytes
            for t in block.tensors:
                if set(t.held_by) & holding:
                    out[OpId(i, t.producer)] = out.get(OpId(i, t.producer), 0.0) + t.bytes(loads[i])
        return out

    def with_saved(self, op: OpId, bytes_per_token: float, kept: bool = False) -> CostModel:
        """This cost model, with `op` saving `bytes_per_token` more per token than its graph says
        (what the Ledger measured it keep beyond: `runtime.calibration`), as one more tensor it
        makes and saves: recomputing or offloading the op takes those bytes away too, unless
        `kept` (measured while the op was mitigated: what saves them is outside its regions)."""
        block = self.blocks[op.layer]
        block.op(op.name)  # a KeyError naming the op where the block has none
        extra = TensorSpec(
            f"{op.name}.measured{len(block.tensors)}", op.name, (op.name,), LinearForm(per_token=bytes_per_token), 1, shared=kept,
        )
        blocks = {**self.blocks, op.layer: replace(block, tensors=(*block.tensors, extra))}
        return CostModel(blocks, self.hardware, self.pairs_per_token, self.name, self.source)

    def argument_bytes(self, loads: Mapping[int, Load], holding: set[int]) -> float:
        """Bytes of the layer arguments (position ids, masks) that the recompute regions of the
        layers in `holding` keep alive."""
        return sum((t.bytes(loads[i]) for i, t in self._arguments if set(t.held_by) & holding), 0.0)

    @cached_property
    def _arguments(self) -> list[tuple[int, TensorSpec]]:
        """The layer arguments nothing saves, which recompute regions may hold (`TensorSpec.held_by`), by block."""
        return [(i, t) for i, block in self.blocks.items() for t in block.tensors if t.held_by]

    def activation_bytes(
        self,
        tokens: int,
        routed: Routed = None,
        seq_len: int | None = None,
        plan: Mapping[OpId, str] | None = None,
        options: MitigationOptions = MitigationOptions(),
    ) -> int:
        """Bytes the autograd graph holds on the device at the end of one forward micro-batch of
        `tokens` tokens (`Forward`'s fields, as plain numbers: the question users ask)."""
        return round(self.footprint(Forward(tokens, seq_len, routed), plan, options).device_bytes)

    def micro_batch(
        self, forward: Forward, plan: Mapping[OpId, str] | None = None, options: MitigationOptions = MitigationOptions()
    ) -> MicroBatchCost:
        """The micro-batch triangle: summed op times plus mitigation overhead, and device bytes."""
        loads = self.loads(forward)
        fp = self.footprint_at(loads, plan, options)
        fwd = sum(op.forward_s.at(loads[i]) for i, b in self.blocks.items() for op in b.ops)
        bwd = sum(op.backward_s.at(loads[i]) for i, b in self.blocks.items() for op in b.ops)
        return MicroBatchCost(fwd + fp.forward_extra_s, bwd + fp.backward_extra_s, fp.device_bytes)

    def op_costs(self, forward: Forward) -> list[OpCost]:
        """Per-operator (Δt_f, Δt_b, Δm) with nothing mitigated; Δm sums to `activation_bytes`."""
        loads, rows = self.loads(forward), []
        for i, block in self.blocks.items():
            charged = dict.fromkeys(block.op_names, 0.0)
            for t in block.path_tensors():
                owner = block.owner(t)
                if owner is not None:
                    charged[owner] += t.bytes(loads[i])
            for op in block.ops:
                rows.append(OpCost(OpId(i, op.name), op.forward_s.at(loads[i]), op.backward_s.at(loads[i]), charged[op.name]))
        return rows

    def mitigation_cost(
        self,
        op: OpId | Sequence[OpId],
        strategy: str,
        forward: Forward,
        base: Mapping[OpId, str] | None = None,
        options: MitigationOptions = MitigationOptions(),
    ) -> MitigationCost:
        """Bytes saved and time added by setting `op` (or several ops of one block, e.g. a
        recompute unit) to `strategy` on top of `base` (default: everything kept)."""
        ops = [op] if isinstance(op, OpId) else list(op)
        layers = {o.layer for o in ops}
        if len(layers) != 1 or not layers <= set(self.blocks):
            raise KeyError(f"ops {[str(o) for o in ops]} must name one block of this model ({list(self.blocks)})")
        (layer,) = layers
        block = self.blocks[layer]
        for o in ops:
            block.op(o.name)
        load = self.loads(forward)[layer]
        plans = self._split(base)[layer]
        before = footprint(block, plans, load, self.hardware, options)
        after = footprint(block, {**plans, **{o.name: strategy for o in ops}}, load, self.hardware, options)
        return MitigationCost(
            ops[0] if len(ops) == 1 else tuple(ops),
            strategy,
            before.device_bytes - after.device_bytes,
            after.forward_extra_s - before.forward_extra_s,
            after.backward_extra_s - before.backward_extra_s,
        )

    def mitigated(
        self, forward: Forward, plan: Mapping[OpId, str] | None = None, options: MitigationOptions = MitigationOptions()
    ) -> dict[str, float]:
        """The device bytes `plan` takes off the micro-batch, per strategy: each block's
        strategies applied one after another (recompute, offload, fp8), each credited with what
        it took off beyond the ones before; the layer arguments recompute regions hold are
        recompute's cost. Sums to what nothing mitigated keeps minus what `plan` keeps; only the
        blocks the plan touches are priced (it runs once per micro-batch, for its telemetry)."""
        out = dict.fromkeys(MITIGATIONS, 0.0)
        plans = {i: p for i, p in self._split(plan).items() if p}
        if not plans:
            return out
        loads = self.loads(forward)
        for i, block_plan in plans.items():
            kept, applied = footprint(self.blocks[i], {}, loads[i], self.hardware, options).device_bytes, {}
            for strategy in MITIGATIONS:
                step = {name: s for name, s in block_plan.items() if s == strategy}
                if step:
                    applied |= step
                    now = footprint(self.blocks[i], applied, loads[i], self.hardware, options).device_bytes
                    out[strategy] += kept - now
                    kept = now
        holding = {i for i, p in plans.items() if holds_arguments(self.blocks[i], p)}
        out["recompute"] -= self.argument_bytes(loads, holding)
        return out

    def recompute_unit(self, op: OpId) -> list[OpId]:
        """The smallest run of ops that can be recomputed together with `op` (None of it if none);
        an op of a span is recomputed alone."""
        return [OpId(op.layer, name) for name in self.blocks[op.layer].recompute_unit(op.name)]

    def full_recompute(self, collective: bool = False) -> dict[OpId, str]:
        """Every op that can be recomputed, recomputed: a decoder layer then keeps only its input
        (the paper's M0 plan), the head its input, the final norm's output and the labels.
        Under expert parallelism one rank alone cannot recompute the all-to-alls, so its routed
        experts hold the rows dispatch received; `collective`: with every MoE layer's collective
        unit too (`graph.collective_unit`), which holds nothing per routed pair: a static policy
        the same on every rank, and the floor the gates reach together (M0)."""
        return {
            OpId(i, name): "recompute"
            for i, b in self.blocks.items()
            for name in dict.fromkeys(n for unit in (*b.recompute_units, *b.spans, *(b.collective,) * collective) for n in unit)
        }

    # pipeline stages and static memory ---------------------------------------------------------
    def stage(self, pp: int, rank: int, vp: int = 1, chunks: Sequence[int] | None = None) -> CostModel:
        """The blocks that rank `rank` of a `pp`-stage pipeline holds: an equal share of the
        decoder layers, the embedding on the first stage, the LM head on the last. With `vp`
        model chunks per rank (interleaved 1F1B), those of `chunks` (default: all the rank's);
        the embedding belongs to chunk 0 of rank 0, the head to chunk vp - 1 of the last rank. A
        block set without the embedding makes the RoPE tables and position ids of its layers
        itself (`BlockGraph.positions`)."""
        chunks = range(vp) if chunks is None else chunks
        layers = self.layers
        keep = {layers[i] for c in chunks for i in stage_layers(len(layers), pp, rank, vp, c)}
        first, last = rank == 0 and 0 in chunks, rank == pp - 1 and vp - 1 in chunks
        keep |= {i for i, b in self.blocks.items() if (b.kind == "embed" and first) or (b.kind == "head" and last)}
        blocks = {i: b if i in keep else b.positions() for i, b in self.blocks.items() if i in keep or b.kind == "embed"}
        part = f"stage {rank}/{pp}" if vp == 1 else f"stage {rank}/{pp} chunks {','.join(map(str, chunks))}/{vp}"
        return CostModel(blocks, self.hardware, self.pairs_per_token, f"{self.name} {part}", self.source)

    def parameter_counts(self, trainable: bool = False) -> tuple[int, int]:
        """(dense, expert) parameters held on this device; `trainable`: those that train (not
        LoRA's frozen base), which alone have gradients and optimizer state."""
        dense = sum(b.dense_params - trainable * b.frozen_params[0] for b in self.blocks.values())
        return dense, sum(b.expert_params - trainable * b.frozen_params[1] for b in self.blocks.values())

    def static_bytes(
        self,
        weight_bytes: float,
        grad_bytes: float,
        optimizer_bytes: float,
        dense_shards: int = 1,
        expert_shards: int = 1,
        shard_gradients: bool = False,
    ) -> int:
        """Non-activation memory: weights of every local parameter, gradients of every trainable
        one, their optimizer state sharded over the replicas of each parameter (data parallel for
        dense, dp*tp/ep for experts), and the gradients too where `shard_gradients` (ZeRO-2)."""
        dense, expert = self.parameter_counts(trainable=True)
        dense_grad, expert_grad = (grad_bytes / dense_shards, grad_bytes / expert_shards) if shard_gradients else (grad_bytes,) * 2
        trained = dense * (dense_grad + optimizer_bytes / dense_shards) + expert * (expert_grad + optimizer_bytes / expert_shards)
        return round(sum(self.parameter_counts()) * weight_bytes + trained)

    def fsdp_static_bytes(
        self, weight_bytes: float, grad_bytes: float, optimizer_bytes: float, shards: int, gathered: int = 2,
        shard_bytes: float | None = None,
    ) -> int:
        """Non-activation memory under full shard (FSDP2, ZeRO-3): every local parameter's weights
        (`shard_bytes` per parameter, default `weight_bytes`; 0 with the shards in host memory) and
        every trainable one's gradients and optimizer state divided over `shards`, plus the largest
        decoder layer's weights whole, `gathered` times (the one running and the one prefetched).
        Recompute adds no all-gather
        under FSDP2 (measured in tests/test_fsdp.py, units of decoder layers or finer): a region
        replays modules whose unit backward gathers anyway, at most earlier, so the mitigation
        rooflines price it with none, and its gathered weights are the layer counted here."""
        params, trainable = sum(self.parameter_counts()), sum(self.parameter_counts(trainable=True))
        layer = max((self.blocks[i].dense_params + self.blocks[i].expert_params for i in self.layers), default=0)
        sharded = params * (weight_bytes if shard_bytes is None else shard_bytes) + trainable * (grad_bytes + optimizer_bytes)
        return round(sharded / shards + gathered * layer * weight_bytes)

    # persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "source": self.source,
            "pairs_per_token": self.pairs_per_token,
            "hardware": self.hardware.model_dump(),
            "blocks": [
                {
                    "index": i,
                    "kind": b.kind,
                    "dense_params": b.dense_params,
                    "expert_params": b.expert_params,
                    "frozen_params": list(b.frozen_params),
                    "units": [list(u) for u in b.units],
                    "spans": [list(s) for s in b.spans],
                    "transient": b.transient.to_dict(),
                    "ops": [
                        {"name": o.name, "inputs": list(o.inputs), "forward_s": o.forward_s.to_dict(), "backward_s": o.backward_s.to_dict()}
                        for o in b.ops
                    ],
                    "tensors": [
                        {**asdict(t), "savers": list(t.savers), "held_by": list(t.held_by), "elements": t.elements.to_dict()}
                        for t in b.tensors
                    ],
                }
                for i, b in self.blocks.items()
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a cost model file: format is {data.get('format')!r}, expected {FORMAT!r}")
        blocks = {}
        for b in data["blocks"]:
            ops = tuple(
                OpSpec(o["name"], tuple(o["inputs"]), LinearForm.from_dict(o["forward_s"]), LinearForm.from_dict(o["backward_s"]))
                for o in b["ops"]
            )
            tensors = tuple(
                TensorSpec(
                    **{**t, "savers": tuple(t["savers"]), "held_by": tuple(t["held_by"]), "elements": LinearForm.from_dict(t["elements"])}
                )
                for t in b["tensors"]
            )
            units = tuple(tuple(u) for u in b["units"])
            spans = tuple(tuple(s) for s in b.get("spans", ()))  # files saved before spans existed have none
            frozen = tuple(b.get("frozen_params", (0, 0)))  # nor frozen parameters before LoRA
            transient = LinearForm.from_dict(b.get("transient", {}))  # nor a moment's saves before they were priced
            blocks[b["index"]] = BlockGraph(b["kind"], ops, tensors, b["dense_params"], b["expert_params"], units, spans, frozen, transient)
        hw = HardwareSpec.model_validate(data["hardware"], strict=False)
        return cls(blocks, hw, data["pairs_per_token"], data["name"], data["source"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()))
