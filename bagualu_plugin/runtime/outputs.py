"""What a forward returned, as the plugin reads it where the forward ends: the autograd nodes of its
outputs, through which its backward is awaited, and whether torch.compile made them (refused)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

COMPILED = "CompiledFunctionBackward"  # the autograd node of a graph torch.compile made (AOTAutograd's)
UNCOMPILED = (
    "bagualu: the model's training forward ran under torch.compile, whose graphs take in the plugin's op scopes and "
    "recompute regions and save what their own partitioner chooses, not what the plan says: train the model "
    "uncompiled with the plugin, or compile it without the plugin"
)


def compiled(output) -> bool:
    """Whether torch.compile made the graph of a forward that returned `output`: it is refused at
    the forward's end (`UNCOMPILED`), before any replay, wherever the plugin finds that end (the
    model's hook, `micro_batch()`, the 1F1B driver)."""
    return any(type(fn).__name__ == COMPILED for fn in grad_fns(output))


def grad_fns(output) -> list:
    """The distinct autograd nodes of the tensors a forward returned (a ModelOutput's fields)."""
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else [output]
    nodes = {}
    for value in values:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            nodes[id(value.grad_fn)] = value.grad_fn
    return list(nodes.values())
