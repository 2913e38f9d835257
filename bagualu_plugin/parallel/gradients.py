"""Data-parallel gradient reduction under expert parallelism (§II-B): one flat all-reduce per group
of parameters, so that every rank sums in the same order and the weights stay bitwise equal on
every replica. The demo and nanotron's launcher both reduce through `all_reduce_gradients`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import Adapter


def all_reduce_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, divide: int = 1) -> None:
    """Sum `params`' gradients over `group` (None: this rank alone) in one flat buffer, then divide.
    A missing gradient counts as zeros: every rank must give the collective the same length."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    if divide != 1:
        flat /= divide
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Data parallelism over the expert-parallel group itself (dp = ep; None: the default group):
    the replicated parameters' gradients are averaged over its ranks; a local expert's gradient
    already sums every rank's tokens routed to it (the all-to-all's backward), so it is only
    divided by the ranks: the gradient of the mean of the ranks' losses. An expert without a
    gradient keeps none (nothing is exchanged for it)."""
    size = dist.get_world_size(group)
    experts = {id(p) for layer in Adapter(model).layers if layer.moe for p in layer.experts.parameters()}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    all_reduce_gradients(replicated, group or dist.group.WORLD, size)
    all_reduce_gradients([p for p in model.parameters() if id(p) in experts and p.grad is not None], None, size)
