"""Which operator is running now. Module hooks mark where each op of docs/architecture.md begins;
an op lasts until the next one begins, so glue code between modules (residual adds, the
sigmoid scaling of Qwen2-MoE's shared expert, the loss after the LM head) belongs to the op
before it. The "bagualu" experts implementation refines the experts into fc1 / act / fc2.

Attention's core begins after its last projection, so RoPE belongs to attn_core: attn_qkv makes
q, k, v; attn_core rotates them and runs the kernel; attn_out is the output projection.

The loss begins after the LM head's forward. Under the loss runner (`runtime.head`) HF's forward
runs the LM head on no position, and the runner runs it again on the final norm's output inside
the loss function (the chunked loss does not call it: its saves are the loss's).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..costmodel.graph import OpId
from .adapter import Adapter


class OpTracker:
    """The op running now (`current`), set by hooks on the model's modules from `install` to
    `remove`. While `active` is False the hooks return at once and change nothing: a runtime
    installs them once and turns them on only for its own forwards (`PlanRuntime.forward`), so
    evaluation, `generate` or a recompute replaying after the forward see no op scope, as if the
    hooks were not there."""

    def __init__(self, adapter: Adapter, *, active: bool = True):
        self.adapter = adapter
        self.active = active
        self.current: OpId | None = None
        self.listeners: list[Callable[[OpId], None]] = []
        self._handles: list[RemovableHandle] = []
        self._experts: list[nn.Module] = []

    def enter(self, op: OpId) -> None:
        if self.active and op != self.current:
            self.current = op
            for listener in self.listeners:
                listener(op)

    def _at(self, module: nn.Module, op: OpId, when: str = "pre") -> None:
        if when == "pre":
            handle = module.register_forward_pre_hook(lambda *_: self.enter(op))
        else:
            handle = module.register_forward_hook(lambda *_: self.enter(op))
        self._handles.append(handle)

    def install(self) -> OpTracker:
        a = self.adapter
        self._at(a.decoder.embed_tokens, OpId(-1, "embed"))
        for layer in a.layers:
            i, m = layer.index, layer.module
            self._at(m.input_layernorm, OpId(i, "attn_norm"))
            self._at(m.self_attn, OpId(i, "attn_qkv"))
            self._at(a.qkv_last(layer), OpId(i, "attn_core"), "post")
            self._at(m.self_attn.o_proj, OpId(i, "attn_out"))
            self._at(m.post_attention_layernorm, OpId(i, "mlp_norm"))
            if not layer.moe:
                self._at(m.mlp, OpId(i, "dense_mlp"))
                continue
            self._at(layer.router, OpId(i, "router"))
            self._at(layer.wrapped or layer.experts, OpId(i, "expert_fc1"))  # PEFT's LoRA on them is made in fc1
            # every tracker installed on these experts (a profiler's beside a runtime's), as module hooks add up
            layer.experts._bagualu_scope = (*getattr(layer.experts, "_bagualu_scope", ()), (self, i))
            self._experts.append(layer.experts)
            for shared in layer.shared:
                self._at(shared, OpId(i, "shared_expert"))
        head = a.head_index
        self._at(a.decoder.norm, OpId(head, "final_norm"))
        self._at(a.model.lm_head, OpId(head, "lm_head"))
        self._at(a.model.lm_head, OpId(head, "loss"), "post")
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for experts in self._experts:
            scopes = tuple(scope for scope in experts._bagualu_scope if scope[0] is not self)
            if scopes:
                experts._bagualu_scope = scopes
            else:
                del experts._bagualu_scope
        self._handles.clear()
        self._experts.clear()
        self.current = None


def enter_expert_op(experts: nn.Module, name: str) -> None:
    """Called by the bagualu experts implementation at expert_fc1 / expert_act / expert_fc2."""
    for tracker, layer in getattr(experts, "_bagualu_scope", ()):
        tracker.enter(OpId(layer, name))
