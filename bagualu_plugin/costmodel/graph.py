"""The operator graph of one block (an MoE or dense decoder layer, the embedding, the LM head).

An operator (paper §IV-A) has a forward and a backward time. Memory belongs to tensors, not to
operators: each `TensorSpec` is one storage, made by one producer and saved for backward by zero
or more operators (its savers). Two savers of one storage hold one copy; that is why mitigation
must be judged per tensor, and where the conflicts of §V-A (one source tensor, consumers with
different precision or placement) come from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .linear import LinearForm, Load

LAYER_OPS = (
    "attn_norm",
    "attn_qkv",
    "attn_core",
    "attn_out",
    "mlp_norm",
    "router",
    "dispatch",
    "expert_fc1",
    "expert_act",
    "expert_fc2",
    "combine",
    "shared_expert",
    "dense_mlp",
)
EMBED_OPS = ("embed",)
HEAD_OPS = ("final_norm", "lm_head", "loss")
INPUT = "input"  # producer of a block's input: the previous block's output
BlockKind = Literal["embed", "dense", "moe", "head"]


ATTENTION_OPS = ("attn_qkv", "attn_core", "attn_out")
MOE_OPS = ("router", "dispatch", "expert_fc1", "expert_act", "expert_fc2", "combine", "shared_expert")
EXPERT_OPS = ("expert_fc1", "expert_act", "expert_fc2")
COMM_OPS = ("dispatch", "combine")  # expert parallelism's all-to-alls: in no unit one rank recomputes alone
COLLECTIVE_OPS = ("dispatch", *EXPERT_OPS, "combine")  # the routed experts with their all-to-alls
LOSS_OPS = ("lm_head", "loss")  # the head's loss runner replays both: HF's lm_head, then the model's loss


def standard_units(kind: str, ops: tuple[str, ...], shared_alone: bool = True) -> tuple[tuple[str, ...], ...]:
    """What a runtime can recompute in HF models by replaying exactly one module or function
    (checkpoint regions): the whole decoder layer, its MoE block or dense MLP, attention as a
    whole, the routed experts as a whole (what the gate escalates: the region holds the router's
    outputs only, nothing per routed pair), and each op that is a module or function of its own. The shared expert is alone only
    where the family has no glue around it (Qwen2-MoE scales it by a sigmoid gate in the MoE
    block's forward). Ops inside a span are recomputed alone through the span. The head's loss
    runs inside HF's CausalLM forward, so the runtime's loss runner (`runtime.head`) replays the
    LM head and the model's own loss function together.

    Under expert parallelism no unit holds dispatch or combine: their collectives run on every
    rank at once, and a recompute in one rank's backward would wait for ranks that never join
    (`parallel.expert`). The whole layer and the MoE block are then no units, and the routed
    experts' unit is the local computation between the two."""
    if kind == "embed":
        return (("embed",),)
    if kind == "head":
        return (("final_norm",), ("lm_head",), LOSS_OPS)
    alone = {"attn_norm", "mlp_norm", "router", "expert_fc1", "expert_act", "expert_fc2", "dense_mlp"}
    if shared_alone:
        alone.add("shared_expert")
    units = [ops, *(tuple(o for o in ops if o in group) for group in (ATTENTION_OPS, MOE_OPS, EXPERT_OPS))]
    units += [(o,) for o in ops if o in alone]
    return tuple(dict.fromkeys(u for u in units if u and not set(u) & set(COMM_OPS)))


def collective_unit(ops: tuple[str, ...]) -> tuple[str, ...]:
    """Under expert parallelism, the routed experts with their dispatch and combine (`COLLECTIVE_OPS`):
    a region whose replay runs the all-to-alls again, so every rank of the expert-parallel group
    must recompute it in the same micro-batch (a static plan the same on every rank, or the gate's
    collective escalation, which every rank agrees on: `planner.gate`). It holds the MoE block's
    input and the router's outputs only, nothing per routed pair, so no spike can grow it. () for
    a block that does not dispatch."""
    return tuple(o for o in ops if o in COLLECTIVE_OPS) if "dispatch" in ops else ()


def standard_spans(kind: str, ops: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Op runs that one HF module's forward makes (the attention module, the MoE block), within
    which any subset of ops can be recomputed: no module or function of HF code computes exactly
    attn_qkv, attn_core or attn_out (RoPE and the kernel sit inside the attention forward), nor
    Qwen2-MoE's gated shared expert, and re-implementing those forwards per family would copy HF
    code that changes with every release. So the runtime replays the span's module and drops only
    the subset's saves: the region holds the span's inputs, as recomputing the whole span does.
    The loss alone is recomputed so too, through the head's loss runner. Under expert parallelism
    the MoE block is no span: replaying it would run dispatch and combine again."""
    if kind == "head":
        return (LOSS_OPS,)
    if kind not in ("dense", "moe"):
        return ()
    spans = (tuple(o for o in ops if o in ATTENTION_OPS), tuple(o for o in ops if o in MOE_OPS))
    return tuple(s for s in spans if s and not set(s) & set(COMM_OPS))


@dataclass(frozen=True, order=True)
class OpId:
    """One operator of the model: block index (-1 embedding, num_layers the head) and op name."""

    layer: int
    name: str

    def __str__(self) -> str:
        return f"{self.layer}.{self.name}"

    @classmethod
    def parse(cls, text: str) -> OpId:
        layer, _, name = text.partition(".")
        return cls(int(layer), name)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    producer: str
    savers: tuple[str, ...]
    elements: LinearForm
    dtype_bytes: int
    floating: bool = True  # integer tensors (routing indices) cannot be stored in FP8
    shared: bool = False  # handed to every layer (RoPE tables): kept as it is, whatever the plan
    held_by: tuple[int, ...] = ()  # a layer argument nothing saves (position ids, masks): held only
    # by recompute regions of these layers that take it (attention, the whole layer)
    chunked: bool | None = None  # the head's loss path it belongs to: True only with the chunked
    # loss (`MitigationOptions.loss_chunk_tokens`), False only without; None both

    def bytes(self, load: Load) -> float:
        return self.elements.at(load) * self.dtype_bytes


@dataclass(frozen=True)
class OpSpec:
    name: str
    inputs: tuple[str, ...]
    forward_s: LinearForm
    backward_s: LinearForm


@dataclass(frozen=True)
class BlockGraph:
    kind: BlockKind
    ops: tuple[OpSpec, ...]
    tensors: tuple[TensorSpec, ...]
    dense_params: int = 0  # parameters on this device, replicated over data parallel
    expert_params: int = 0  # parameters of this device's experts, replicated over dp * tp / ep
    units: tuple[tuple[str, ...], ...] = ()  # recompute units; () = the whole block or any op alone
    spans: tuple[tuple[str, ...], ...] = ()  # op runs recomputed in part by replaying them whole
    frozen_params: tuple[int, int] = (0, 0)  # (dense, expert) of those that do not train (LoRA's frozen
    # base): weights without gradients or optimizer state
    transient: LinearForm = LinearForm()  # bytes saved for a moment in the block's forward and freed
    # before it ends (the load-balancing loss's top-k indices): room, never kept, whatever the plan

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate op names in {self.kind} block: {names}")
        tensors = {t.name for t in self.tensors}
        if len(tensors) != len(self.tensors):
            raise ValueError(f"duplicate tensor names in {self.kind} block")
        for t in self.tensors:
            unknown = {t.producer, *t.savers} - {*names, INPUT}
            if unknown:
                raise ValueError(f"tensor {t.name!r} names unknown ops {sorted(unknown)}")
        for op in self.ops:
            if set(op.inputs) - tensors:
                raise ValueError(f"op {op.name!r} reads unknown tensors {sorted(set(op.inputs) - tensors)}")
        for unit in (*self.units, *self.spans):
            if set(unit) - set(names):
                raise ValueError(f"recompute unit or span {unit} names ops this {self.kind} block lacks")

    def positions(self) -> BlockGraph:
        """The embedding block as a later pipeline stage has it: no token ids and no weights, only
        what the stage computes again for its own layers (RoPE tables, position ids, masks)."""
        if self.kind != "embed":
            raise ValueError(f"positions() is the embedding block's, not a {self.kind} block's")
        ops = tuple(replace(op, inputs=()) for op in self.ops)
        return replace(self, ops=ops, tensors=tuple(t for t in self.tensors if t.producer != INPUT), dense_params=0)

    @property
    def recompute_units(self) -> tuple[tuple[str, ...], ...]:
        """Op runs one rank can replay in backward on its own, largest first."""
        units = self.units or (self.op_names, *((name,) for name in self.op_names))
        return tuple(sorted(units, key=len, reverse=True))

    def recompute_unit(self, name: str) -> tuple[str, ...]:
        """The smallest run of ops recomputed together with op `name` (() if none can be); an op
        of a span is recomputed alone, through the span."""
        if any(name in span for span in self.spans):
            return (name,)
        units = [u for u in self.recompute_units if name in u]
        return min(units, key=len) if units else ()

    @property
    def collective(self) -> tuple[str, ...]:
        """The unit every rank of the expert-parallel group recomputes together (`collective_unit`)."""
        return collective_unit(self.op_names)

    def op(self, name: str) -> OpSpec:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op {name!r} in a {self.kind} block; it has {[o.name for o in self.ops]}")

    def path_tensors(self, chunked: bool = False) -> tuple[TensorSpec, ...]:
        """The tensors of one path of the head's loss: HF's, or the chunked one."""
        return tuple(t for t in self.tensors if t.chunked in (None, chunked))

    @property
    def op_names(self) -> tuple[str, ...]:
        return tuple(op.name for op in self.ops)

    def owner(self, tensor: TensorSpec) -> str | None:
        """The op a saved tensor's bytes are charged to in per-op tables: its producer, or for
        the block input its first saver. None for a tensor nothing saves."""
        if not tensor.savers:
            return None
        return tensor.producer if tensor.producer != INPUT else tensor.savers[0]
