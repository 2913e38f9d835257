"""What the weights, gradients and optimizer state of a live model take on its device, measured
rather than computed from bytes per parameter (`budget.non_activation_bytes: auto` under the
Provisioner): Algorithm 1's M_used starts there (paper §V-A).

The optimizer's state appears at its first step, so every `torch.optim` step is watched (torch's
global step hook): when an optimizer over this model's parameters holds more or less state than
before, the owner is told to re-base its budgets. On CUDA the caching allocator is read instead of
counting tensors: it also holds what no parameter owns (buffers of the launcher, the batch)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .ledger import Ledger, _storage


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (tied and viewed ones once)."""
    seen: dict[object, int] = {}
    for tensor in tensors:
        found = _storage(tensor)
        if found is not None:
            seen[found[0]] = found[1]
    return sum(seen.values())


class StaticMemory:
    """The non-activation bytes of `model` on `ledger`'s device."""

    def __init__(self, model: nn.Module, ledger: Ledger):
        self._model, self._ledger = model, ledger
        self._mine = {id(p) for p in model.parameters()}
        self._state: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._on_change: Callable[[], None] | None = None
        self._handle = None

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call `on_change()` after every optimizer step that changed the state an optimizer holds
        for the model's parameters (the first step makes it)."""
        self._on_change = on_change
        self._handle = register_optimizer_step_post_hook(self._stepped)

    def measure(self) -> int:
        """Weights and buffers, a gradient for every trainable parameter (allocated or about to be:
        the first backward makes them, `zero_grad` may free them), and the optimizer state."""
        params = list(self._model.parameters())
        missing = storage_bytes(p for p in params if p.requires_grad and p.grad is None)
        if self._ledger.device.type == "cuda":
            return torch.cuda.memory_allocated(self._ledger.device) - self._ledger.live_device_bytes + missing
        grads = storage_bytes(p.grad for p in params if p.grad is not None)
        return storage_bytes([*params, *self._model.buffers()]) + grads + missing + sum(self._state.values())

    def _stepped(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        ours = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self._mine]
        if not ours:
            return
        held = storage_bytes(t for p in ours for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor))
        if self._state.get(optimizer) != held:
            self._state[optimizer] = held
            self._on_change()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
