"""One code path for every HF MoE family: find the decoder layers, their MoE blocks, routers,
experts and shared experts, and name their operators (docs/architecture.md). The attribute names
that differ come from the family's traits (`bagualu_plugin.families`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..costmodel.graph import COMM_OPS, EMBED_OPS, HEAD_OPS, LAYER_OPS, OpId
from ..families import FAMILIES

GROUP_ATTR = "_bagualu_expert_group"  # on an experts module: its `parallel.expert.ExpertGroup`
GATE_ATTR = "_bagualu_gate"  # on an expert-parallel experts module: gate(received (E/ep,), pairs), called at dispatch


class UnsupportedModelError(ValueError):
    """The model is not a supported HF MoE causal LM."""


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under torch.compile, PEFT and DDP/FSDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif type(model).__name__.startswith("Peft") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "FullyShardedDataParallel":
            model = model.module
        else:
            return model


@dataclass(frozen=True)
class Layer:
    """One decoder layer and, if it is an MoE layer, the parts of its MoE block."""

    index: int
    module: nn.Module
    router: nn.Module | None
    experts: nn.Module | None  # the module the experts implementation runs on
    shared: tuple[nn.Module, ...]
    wrapped: nn.Module | None = None  # the MoE block's experts where PEFT's LoRA wraps them (target_parameters)

    @property
    def moe(self) -> bool:
        return self.experts is not None

    @property
    def expert_parallel(self) -> bool:
        """Whether the routed experts are sharded over a process group (`bgl.expert_parallel`)."""
        return getattr(self.experts, GROUP_ATTR, None) is not None


class Adapter:
    """A supported model, taken apart into layers and operators."""

    def __init__(self, model: nn.Module):
        self.model = unwrap(model)
        config = getattr(self.model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} ({type(self.model).__name__}); "
                f"supported: {', '.join(sorted(FAMILIES))}"
            )
        self.family = FAMILIES[model_type]
        self.config = config
        decoder = getattr(self.model, "model", None)
        if decoder is None or not hasattr(decoder, "layers") or not hasattr(self.model, "lm_head"):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} is not a causal LM with .model.layers and .lm_head; "
                "load it with AutoModelForCausalLM"
            )
        self.decoder = decoder
        self.layers = [self._layer(i, layer) for i, layer in enumerate(decoder.layers)]
        if not any(layer.moe for layer in self.layers):
            raise UnsupportedModelError(f"{model_type} model has no MoE layer")

    def _layer(self, index: int, layer: nn.Module) -> Layer:
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            return Layer(index, layer, None, None, ())
        router = getattr(mlp, self.family.router, None)
        if router is None:
            raise UnsupportedModelError(
                f"layer {index}: MoE block {type(mlp).__name__} has no router attribute {self.family.router!r}"
            )
        shared = tuple(getattr(mlp, name) for name in self.family.shared)
        if hasattr(mlp.experts, "get_base_layer"):  # PEFT's ParamWrappers (target_parameters) around the experts
            return Layer(index, layer, router, mlp.experts.get_base_layer(), shared, mlp.experts)
        return Layer(index, layer, router, mlp.experts, shared)

    @property
    def top_k(self) -> int:
        return self.config.num_experts_per_tok

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer, over the whole expert-parallel group."""
        return getattr(self.config, self.family.num_experts_field)

    @property
    def expert_group(self):
        """The `parallel.expert.ExpertGroup` the routed experts are sharded over; None without EP."""
        return next((getattr(layer.experts, GROUP_ATTR) for layer in self.layers if layer.moe and layer.expert_parallel), None)

    @property
    def weight(self) -> torch.Tensor:
        """The model's first parameter: the dtype and device it computes in, as its cost model and
        the messages about it read them (the meta device's for another pipeline stage's)."""
        return next(self.model.parameters())

    @property
    def head_index(self) -> int:
        """Block index of the final norm, LM head and loss (one past the last decoder layer)."""
        return len(self.layers)

    def qkv_last(self, layer: Layer) -> nn.Module:
        """The projection after which attention's core (RoPE and the attention kernel) begins."""
        attn = layer.module.self_attn
        for name in self.family.qkv_last:
            if hasattr(attn, name):
                return getattr(attn, name)
        raise UnsupportedModelError(f"layer {layer.index}: attention has none of {self.family.qkv_last}")

    def layer_ops(self, layer: Layer) -> list[str]:
        if not layer.moe:
            return [n for n in LAYER_OPS if n.startswith(("attn_", "mlp_")) or n == "dense_mlp"]
        drop = {"dense_mlp"} | (set() if layer.shared else {"shared_expert"}) | (set() if layer.expert_parallel else set(COMM_OPS))
        return [n for n in LAYER_OPS if n not in drop]

    def ops(self) -> list[OpId]:
        """Every operator of the model, block by block (docs/architecture.md names)."""
        ops = [OpId(-1, n) for n in EMBED_OPS]
        for layer in self.layers:
            ops += [OpId(layer.index, n) for n in self.layer_ops(layer)]
        return ops + [OpId(self.head_index, n) for n in HEAD_OPS]


def shared_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a decoder layer receives besides its hidden states (RoPE tables, masks): every
    layer gets the same ones, so mitigating them in one layer saves nothing."""
    rest = [*args[1:], *(v for k, v in kwargs.items() if k != "hidden_states")]
    return [t for t in tree_leaves(rest) if isinstance(t, torch.Tensor)]


def list_ops(model: nn.Module) -> list[OpId]:
    """`bgl.list_ops`: the operators of a supported HF MoE model."""
    return Adapter(model).ops()


_replays = 0  # recompute regions replaying now (`runtime.replay`), maybe ahead of backward


@contextmanager
def replaying() -> Iterator[None]:
    """Inside: a recompute region replays, in backward or ahead of it (paper §V-B)."""
    global _replays
    _replays += 1
    try:
        yield
    finally:
        _replays -= 1


def is_inside_backward() -> bool:
    """True while autograd's engine runs or a recompute region replays ahead of it (`replaying`):
    decisions taken at the gate must not be taken again then (docs/architecture.md), and a module
    a region replays runs plainly."""
    return _replays > 0 or torch._C._current_graph_task_id() != -1
