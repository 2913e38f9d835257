"""Which operator is running now. Module hooks mark where each op of DESIGN.md section 4 begins;
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
    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.current: OpId | None = None
        self.listeners: list[Callable[[OpId], None]] = []
        self._handles: list[RemovableHandle] = []
        self._experts: list[nn.Module] = []

    def enter(self, op: OpId) -> None:
        if op != self.current:
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
            layer.experts._bagualu_scope = (self, i)
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
            del experts._bagualu_scope
        self._handles.clear()
        self._experts.clear()
        self.current = None


def enter_expert_op(experts: nn.Module, name: str) -> None:
    """Called by the bagualu experts implementation at expert_fc1 / expert_act / expert_fc2."""
    scope = getattr(experts, "_bagualu_scope", None)
    if scope is not None:
        tracker, layer = scope
        tracker.enter(OpId(layer, name))
